"""Checks of a job's inputs, on every rank, before Horovod starts and before any collective.

A bad input must stop the job before training, be reported once, and leave no rank waiting:

    cfg = preflight(args.config, overrides, resume=args.resume)   # raises AgreedError

Every rank runs the same checks (none of them communicates), then the ranks meet once to
agree on the errors (hvctr.distributed.world): rank 0 prints each distinct message once, naming the
ranks that hit it, and every rank exits with status 2. What is checked here:

- the configuration (unknown keys, wrong types, values out of range: hvctr.config);
- the world size against the config (virtual nodes must divide it);
- the hardware map: every NUMA node it names exists on this machine (when binding);
- the data: the manifest, this rank's train and validation shard files (present, HDF5, of
  the shapes the manifest records), at least one full batch on this rank;
- the checkpoint directory (without --init-from): a fresh run finds none there; a resumed run
  finds its newest checkpoint written by as many ranks as it has (resharding is a step of
  its own);
- the shard's size (``size_shard``): ``storage.rows_per_rank = 0`` becomes a number from the
  data manifest's distinct-key estimate and the rank count, with headroom; a run whose table
  would fill the shard (explicit or sized) stops here, naming the size to use.

Reading every data shard against its checksums costs a full pass over the data: the trainer
does that once Horovod is up (an error there is one rank's, and that rank reports it).
"""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path

from hvctr import memcg
from hvctr.config import Config, MergeMode, PushBehind, load_config
from hvctr.config.resolve import size_batch
from hvctr.distributed.world import check_collectively, world_rank, world_size
from hvctr.topo.bind import launcher_local_size
from hvctr.rundir import IDENTITY_NAME, RunLock, check_resume_identity, read_identity, run_identity

SHARD_HEADROOM = 1.25  # sized shards hold the estimate's fullest rank x this (sketch error, bucket skew)
MIN_SIZED_ROWS = 1 << 12


@dataclasses.dataclass
class Checked:
    """What the preflight hands to the job: the config, the run directory's lock (rank 0 of
    hvctr train and eval), the identity to write at this first start (None on a resume of a
    run that has one), warnings for the log once logging is set up, and what size_shard
    decided (``sizing``: a line for the log, "" when nothing was sized)."""

    cfg: Config
    lock: RunLock | None = None
    identity: dict | None = None
    notes: list[str] = dataclasses.field(default_factory=list)
    sizing: str = ""


def preflight(config_path: str | None, overrides: list[str], resume: bool, init_from: str | None = None,
              eval_only: bool = False, run_dir: str | Path | None = None, command: str = "hvctr train") -> Checked:
    """The job's config once every rank agrees its inputs are usable; AgreedError otherwise.

    ``eval_only``: no training data needed; ``run_dir``: where the checkpoints are when it is
    not the config's train.run_dir (hvctr eval of a moved run directory). Rank 0 takes the run
    directory's lock first (hvctr.rundir): a second job on it stops here, at once. A
    training run's identity is checked on --resume, before anything is written.
    """
    rank, size = world_rank(), world_size()
    held: list[RunLock] = []

    def check() -> Checked:
        cfg = load_config(config_path, overrides)
        directory = Path(run_dir or cfg.train.run_dir)
        if rank == 0:
            held.append(RunLock(directory, command).acquire())
        cfg, sizing = check_inputs(cfg, rank, size, resume, init_from, eval_only, run_dir)
        identity, notes = (None, []) if eval_only else check_identity(cfg, directory, size, resume, init_from)
        notes += check_directories(cfg, rank, size, directory)  # after the identity: a refused resume creates nothing
        cfg, memory = fit_memory(cfg)
        notes += memory
        if held and held[0].stale:
            notes.insert(0, held[0].stale)
        return Checked(cfg, held[0] if held else None, identity, notes, sizing)

    try:
        # comm: mpi4py allgather of every rank's first error (before Horovod starts)
        return check_collectively(check, size)
    except BaseException:
        for lock in held:
            lock.release()
        raise


def check_identity(cfg: Config, run_dir: Path, size: int, resume: bool,
                   init_from: str | None = None) -> tuple[dict | None, list[str]]:
    """(the identity to write at this start or None, lines of what changed since the first start).

    Without checkpoints this is a first start (or a start over after one that never wrote
    one): its identity is written. With them (a resume: a fresh start on checkpoints is
    refused before this), the run's identity.json must match in MUST_MATCH, a ValueError listing
    every difference; other differences are listed. With --init-from on other data than the
    run's, the trainer decides (a new pass of a day chain).
    """
    from hvctr.checkpoint.format import read_manifests

    now = run_identity(cfg, size)
    directory = Path(cfg.checkpoint.dir or run_dir / "checkpoints")
    if not (directory.is_dir() and read_manifests(directory)):
        return now, []
    saved = read_identity(run_dir)
    if saved is None:
        return now, [f"{run_dir / IDENTITY_NAME}: none (a run from before it was recorded, or a resharded "
                     f"checkpoint): recorded from this start, checked on the next resume"]
    if init_from and saved.get("data", {}).get("digest") != now["data"]["digest"]:
        return None, []
    changed = check_resume_identity(run_dir, now)
    return None, ([f"changed since the run's first start ({run_dir / IDENTITY_NAME}):"] +
                  ["  " + c for c in changed] if changed else [])


def check_inputs(cfg: Config, rank: int, size: int, resume: bool, init_from: str | None = None,
                 eval_only: bool = False, run_dir: str | Path | None = None) -> tuple[Config, str]:
    """(the config as checked, size_shard's note): a ValueError for the first input this rank
    cannot use; no communication."""
    per_node = cfg.topology.ranks_per_virtual_node
    if per_node and size % per_node:
        raise ValueError(f"config key 'topology.ranks_per_virtual_node': {per_node} does not divide "
                         f"the world size {size}")
    if cfg.topology.hwmap not in ("", "auto") and cfg.topology.bind:
        from hvctr.topo.bind import check_map_matches_machine
        from hvctr.topo.hwmap import load_map

        try:
            hwmap = load_map(cfg.topology.hwmap)
        except ValueError as e:
            raise ValueError(f"config key 'topology.hwmap': {e}") from None
        check_map_matches_machine(hwmap)
    cfg = size_batch(cfg, size)
    _check_data(cfg, rank, size, eval_only)
    if init_from is None:  # --init-from chooses between two checkpoint directories: the trainer decides
        _check_checkpoints(cfg, Path(run_dir or cfg.train.run_dir), size, resume)
    return size_shard(cfg, size, init_from, check=not eval_only)


def first_checkpoint_bytes(cfg: Config, size: int) -> tuple[int, int]:
    """(certain, at most) bytes of one rank's file of the run's first checkpoint. Certain: the
    dense parameters with Adam's two moments. At most: with the rows of a base, as key, row and
    pass: those of the fullest rank (the data manifest's distinct-key estimate dealt over the
    ranks, at most the shard's capacity), and no more than the keys its samples carry before
    the first checkpoint (checkpoint.every_windows, or train.max_steps, steps x batch x fields)."""
    from hvctr.formats import RowLayout
    from hvctr.plan.model import dense_params, rows_per_rank
    from hvctr.data.manifest import keys_per_row
    from hvctr.data.reader import load_manifest

    rows = cfg.storage.rows_per_rank
    try:
        distinct = int(load_manifest(cfg.data.train_dir)["totals"]["distinct_keys_estimate_total"])
        rows = min(rows, rows_per_rank(distinct, size))
    except (ValueError, KeyError, TypeError):
        pass
    k = 1 if cfg.merge.mode.value == "sync" else cfg.merge.every_k_steps
    steps = [n for n in (cfg.checkpoint.every_windows * k, cfg.train.max_steps) if n > 0]
    if steps:
        per_row = keys_per_row(cfg.data.train_dir, cfg.model.num_fields)
        rows = min(rows, int(min(steps) * cfg.data.batch_size_per_rank * per_row))
    dense = 3 * 4 * dense_params(cfg.model, cfg.storage.dim)
    return dense, dense + rows * (8 + RowLayout(cfg.storage.dim, cfg.train.sparse_optimizer).row_bytes + 4)


def check_directories(cfg: Config, rank: int, size: int, run_dir: Path, env=None) -> list[str]:
    """The directories the job writes, before Horovod starts: ValueError naming the directory
    and the config key it came from when one cannot be created or written, or when its file
    system lacks the space the job certainly takes there. Rank 0: the run directory and the
    checkpoint directory (the first checkpoint: every rank's dense state certainly, its rows
    at most: first_checkpoint_bytes); every rank: its working-shard directory (the shard,
    reserved whole at creation, for each of the node's ranks). Needs on one file system add
    up. Returns warnings: a file system with room for the certain part, not for the most
    (the checkpoint's own write then fails cleanly, keeping the previous one). The hardware
    map's SSD directory is known only after placement: the trainer checks it.
    """
    from hvctr.plan.model import shard_bytes
    from hvctr.rundir import usable_dir, working_shard_place

    env = os.environ if env is None else env
    ckpt_key = "config key 'checkpoint.dir'" if cfg.checkpoint.dir else "config key 'train.run_dir' (its checkpoints/)"
    ckpt_dir = Path(cfg.checkpoint.dir or run_dir / "checkpoints")
    shard_dir, source, _ = working_shard_place(cfg, run_dir, env=env)
    shard_key = "config key 'storage.shard_dir'" + ("" if cfg.storage.shard_dir else f" (empty: working shards in {source})")
    local_ranks = launcher_local_size(env)[0] or 1
    shard = local_ranks * shard_bytes(cfg.storage.rows_per_rank, cfg.storage.dim, cfg.storage.max_load_factor,
                                      cfg.train.sparse_optimizer)["total"]
    places = [(shard_dir, shard_key, shard, shard,
               f"{local_ranks} working shard(s) of {cfg.storage.rows_per_rank:,} rows (storage.rows_per_rank)")]
    if rank == 0:
        dense, most = first_checkpoint_bytes(cfg, size)
        places = [(run_dir, "config key 'train.run_dir'", 0, 0, ""),
                  (ckpt_dir, ckpt_key, size * dense, size * most, f"the first checkpoint ({size} rank file(s))")] + places
    needs: dict[int, list] = {}
    for path, key, certain, most, what in places:
        existing = usable_dir(path, key)
        entry = needs.setdefault(existing.stat().st_dev, [existing, 0, 0, []])
        entry[1] += certain
        entry[2] += most
        if most:
            entry[3].append(f"{what}: {certain / 2**20:,.1f} MiB"
                            + (f" to {most / 2**20:,.1f} MiB" if most > certain else "") + f" in {path}")
    warnings = []
    for path, certain, most, whats in needs.values():
        st = os.statvfs(path)
        free = st.f_bavail * st.f_frsize
        said = f"{free / 2**20:,.1f} MiB free, {{}} MiB needed ({'; '.join(whats)})"
        if free < certain:
            raise ValueError(f"not enough free space on the file system of {path}: " + said.format(f"{certain / 2**20:,.1f}")
                             + "; free space there, or set train.run_dir, checkpoint.dir or storage.shard_dir elsewhere")
        if free < most:
            warnings.append(f"the file system of {path} may run out of space at the first checkpoint: "
                            + said.format(f"up to {most / 2**20:,.1f}"))
    return warnings


def _prior_rows(init_from: str) -> int:
    """Rows of the fullest rank of the model --init-from starts from, at most (the sum of its
    checkpoint chain's per-rank row counts: a delta's rows may repeat the base's); 0 unknown."""
    from hvctr.checkpoint.format import locate, read_manifests

    try:
        directory, seq = locate(init_from)
    except ValueError:
        return 0  # the trainer names the problem
    manifests = {m["seq"]: m for m in read_manifests(directory)}
    newest = manifests.get(seq) if seq is not None else next(iter(manifests.values()), None)
    if newest is None:
        return 0
    per_rank = [0] * int(newest["world_size"])
    for s in newest.get("chain", [newest["seq"]]):
        for r, f in enumerate(manifests.get(s, {}).get("files", [])):
            per_rank[r] += int(f.get("rows", 0))
    return max(per_rank, default=0)


def size_shard(cfg: Config, size: int, init_from: str | None = None, check: bool = True) -> tuple[Config, str]:
    """(``cfg`` with ``storage.rows_per_rank`` decided, a line for the log saying how it was
    sized or "" when it was not), and the check that the table fits.

    Needed rows (the fullest rank): the data manifest's ``distinct_keys_estimate_total`` dealt
    over the ranks as the buckets are (hvctr.plan.model.rows_per_rank, what ``hvctr plan
    --data`` reports), plus, with --init-from, the rows of the model it starts from. A 0 becomes
    needed x SHARD_HEADROOM; the index then has rows / storage.max_load_factor slots, as for
    any capacity. With ``check``, a capacity below the need is a ValueError naming the size
    to use, unless keys are admitted late (storage.admit_after > 1) or the run stops early
    (train.max_steps), when not every key reaches the table.
    """
    from hvctr.plan.model import rows_per_rank as fullest_rank_rows
    from hvctr.data.reader import load_manifest

    s = cfg.storage
    note = ""
    try:
        distinct = int(load_manifest(cfg.data.train_dir)["totals"]["distinct_keys_estimate_total"])
    except (ValueError, KeyError, TypeError):
        distinct = -1  # an older manifest without the estimate
    if distinct < 0:
        if s.rows_per_rank == 0:
            raise ValueError(f"config key 'storage.rows_per_rank' is 0 (size from the data), but "
                             f"{cfg.data.train_dir}/manifest.json has no totals.distinct_keys_estimate_total: "
                             f"set storage.rows_per_rank (hvctr plan --data {cfg.data.train_dir} sizes it)")
        return cfg, note
    prior = _prior_rows(init_from) if init_from else 0
    need = fullest_rank_rows(distinct, size) + prior
    sized = max(MIN_SIZED_ROWS, math.ceil(need * SHARD_HEADROOM))
    src = (f"{distinct:,} distinct keys (the data manifest's estimate) over {size} rank(s): {need - prior:,} on "
           f"the fullest" + (f", + {prior:,} rows of the --init-from model" if prior else ""))
    if s.rows_per_rank == 0:
        cfg = dataclasses.replace(cfg, storage=dataclasses.replace(s, rows_per_rank=sized))
        note = (f"shard size: storage.rows_per_rank = {sized:,} (0: sized from the data; {src}; "
                f"x {SHARD_HEADROOM} headroom; index slots at storage.max_load_factor {s.max_load_factor})")
    capacity = cfg.storage.rows_per_rank
    partial = s.admit_after > 1 or cfg.train.max_steps > 0
    if check and not partial and need > capacity:
        raise ValueError(f"config key 'storage.rows_per_rank': {capacity:,} rows per rank, but the table needs "
                         f"about {need:,} on the fullest rank ({src}): it would fill up in training; "
                         f"set storage.rows_per_rank = {sized} (or 0 to size it from the data)")
    return cfg, note


def _check_data(cfg: Config, rank: int, size: int, eval_only: bool) -> None:
    from hvctr.data.reader import ShardReader

    d = cfg.data
    if not d.train_dir:
        raise ValueError("config key 'data.train_dir' is empty: point it at a data_prep output directory")
    if not eval_only:
        with ShardReader(d.train_dir, "train", rank, size, d.batch_size_per_rank) as reader:
            if reader.num_batches == 0:
                raise ValueError(f"{d.train_dir}: rank {rank}'s train shards hold {reader.rows} rows, fewer than "
                                 f"one batch (data.batch_size_per_rank = {d.batch_size_per_rank}); lower it or add data")
    # Evaluation comes at the end of training: a missing validation shard must not wait for it.
    with ShardReader(d.valid_dir or d.train_dir, "valid", rank, size, d.batch_size_per_rank):
        pass


def _check_checkpoints(cfg: Config, run_dir: Path, size: int, resume: bool) -> None:
    from hvctr.checkpoint.format import read_manifests

    directory = Path(cfg.checkpoint.dir or run_dir / "checkpoints")
    manifests = read_manifests(directory) if directory.is_dir() else []
    if manifests and not resume:
        raise ValueError(f"{directory} already holds checkpoints: pass --resume to continue that run, "
                         f"or choose a new train.run_dir")
    if manifests and manifests[0]["world_size"] != size:
        m = manifests[0]
        raise ValueError(f"{directory}: checkpoint {m['seq']} was written by {m['world_size']} ranks, this run has "
                         f"{size}: resume with {m['world_size']} ranks, or reshard the checkpoint to {size} first "
                         f"(hvctr reshard --checkpoint {directory} --world-size {size} --out NEW_RUN_DIR/checkpoints)")


def available_memory(meminfo: str = "/proc/meminfo", cgroup: str | None = None) -> tuple[int, str]:
    """(bytes this process can still allocate, where the figure comes from): the node's
    MemAvailable, or less where the process's cgroup (a Slurm job's --mem) leaves less."""
    avail, source = -1, ""
    try:
        for line in open(meminfo):
            if line.startswith("MemAvailable:"):
                avail, source = int(line.split()[1]) * 1024, f"MemAvailable in {meminfo}"
    except (OSError, ValueError, IndexError):
        pass
    if cgroup is None:
        found = memcg.group_dir()
        group = memcg.read_group(*found) if found else None
    else:
        group = memcg.read_group(cgroup) if cgroup else None
    left = group.available if group is not None else None
    if left is not None and (avail < 0 or left < avail):
        name = "memory.limit_in_bytes" if group.version == 1 else "memory.max"
        avail, source = left, (f"the memory cgroup's limit {group.path}/{name} less what it holds that "
                               f"cannot be reclaimed (page cache counts against it)")
    return avail, source


RANK_BASE_MEMORY = 320 << 20  # a rank's own memory before its window: torch, the model, buffers
WINDOW_ROW_COPIES = 12  # copies of a window's rows a rank holds at once (pull and push messages, owner side, grads)


def rank_memory_beside_cache(cfg: Config) -> int:
    """About what a rank needs beside storage.cpu_cache_bytes: RANK_BASE_MEMORY plus its window's
    rows (k batches, about half their keys unique, at most storage.max_working_set_rows) in
    WINDOW_ROW_COPIES copies (two more with storage.pull_ahead: the next window's rows, pulled
    while this one trains, as holder and owner; one more with storage.push_behind: the rows a
    push leaves behind), the shard's recent positions (a quarter of the cache's bytes:
    hvctr.storage.shard.RecentPositions) and the owner's positions of its window's rows, kept
    from the pull to the push (8 bytes a row, the next window's too with pull_ahead). Measured: 1.2-1.6 GiB a rank at k = 8, batch 4096, 26
    fields, dim 16 (BENCHMARKS.md, "A table larger than memory"); this gives 1.36 GiB and the
    positions."""
    from hvctr.formats import RowLayout
    from hvctr.storage.shard import RECENT_POSITION_BYTES, recent_positions_for

    from hvctr.data.manifest import keys_per_row

    per_row = keys_per_row(cfg.data.train_dir, cfg.model.num_fields) if cfg.data.train_dir else cfg.model.num_fields
    rows = min(cfg.storage.max_working_set_rows,
               int(cfg.merge.every_k_steps * cfg.data.batch_size_per_rank * per_row) // 2)
    recent = recent_positions_for(cfg.storage.cpu_cache_bytes) * RECENT_POSITION_BYTES
    ahead = cfg.storage.pull_ahead and cfg.data.prefetch
    copies = WINDOW_ROW_COPIES + (2 if ahead else 0)  # the next window's, both sides
    if ahead and cfg.storage.push_behind is not PushBehind.OFF and cfg.merge.mode is MergeMode.KSTEP:
        copies += 1  # the rows a push left behind, until the prefetch thread sends them
    placed = 8 * rows * (2 if ahead else 1)
    return (RANK_BASE_MEMORY + copies * RowLayout(cfg.storage.dim, cfg.train.sparse_optimizer).row_bytes * rows
            + recent + placed)


def fit_memory(cfg: Config, env=None, meminfo: str = "/proc/meminfo", cgroup: str | None = None) -> tuple[Config, list[str]]:
    """check_memory, and storage.pull_ahead turned off where the memory is short of what a rank
    needs with it (it holds the next window's rows beside this one's): (the config to run, notes).
    Seen: 2 ranks in a 1.2 GiB v1 cgroup with a 32 MiB cache, batch 2048, k = 4 ran without it
    and were OOM-killed at step 20 with it (BENCHMARKS.md, "Training against TorchRec")."""
    notes = check_memory(cfg, env, meminfo, cgroup)
    if notes and cfg.storage.pull_ahead and cfg.data.prefetch:
        cfg = dataclasses.replace(cfg, storage=dataclasses.replace(cfg.storage, pull_ahead=False))
        notes = check_memory(cfg, env, meminfo, cgroup) + [
            "storage.pull_ahead is off for this run: it holds the next window's rows beside this one's "
            "(two more working-set copies a rank), and the memory this job may use is short of what a rank needs "
            "with them (hvctr.train.preflight.rank_memory_beside_cache)"]
    return cfg, notes


def check_memory(cfg: Config, env=None, meminfo: str = "/proc/meminfo", cgroup: str | None = None) -> list[str]:
    """ValueError naming storage.cpu_cache_bytes when the CPU caches of the node's ranks
    (each allocates its budget at start) exceed the memory available to them. Returns a warning
    where a memory cgroup's limit leaves a rank less than rank_memory_beside_cache() beside its
    cache (its processes, not the table, would be OOM-killed: the shard's page cache is clean
    and reclaimable)."""
    env = os.environ if env is None else env
    local_ranks = launcher_local_size(env)[0] or 1
    need = local_ranks * cfg.storage.cpu_cache_bytes
    avail, source = available_memory(meminfo, cgroup)
    if avail >= 0 and need > avail:
        per_rank = max(avail // max(local_ranks, 1) * 3 // 4, 0)
        raise ValueError(f"config key 'storage.cpu_cache_bytes': {cfg.storage.cpu_cache_bytes:,} bytes per rank x "
                         f"{local_ranks} rank(s) on this node = {need / 2**30:,.2f} GiB, but only "
                         f"{avail / 2**30:,.2f} GiB are available ({source}); set it to at most about "
                         f"{per_rank:,} (3/4 of the available memory over the node's ranks)")
    beside = rank_memory_beside_cache(cfg)
    if avail >= 0 and "cgroup" in source and avail - need < local_ranks * beside:
        left = (avail - need) / local_ranks
        return [f"memory: {source.split(' less ')[0]} leaves {left / 2**20:,.0f} MiB per rank beside "
                f"storage.cpu_cache_bytes ({local_ranks} rank(s) on this node); a rank needs about "
                f"{beside >> 20:,} MiB of its own (torch, a window of merge.every_k_steps batches): it may be "
                f"OOM-killed. "
                f"Give the job more memory (--mem) or lower storage.cpu_cache_bytes"]
    return []
