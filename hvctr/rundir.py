"""What a run directory holds about the job that owns it: its lock and its identity.

    <run_dir>/hvctr.lock      flock held by rank 0 for the job's life: host, pid, start time
    <run_dir>/identity.json   written at the run's first start: what a resume must match

One job per run directory. Two jobs on one directory would write each other's checkpoints and
working shards; so rank 0 takes an exclusive ``flock`` on ``hvctr.lock`` in the preflight,
before Horovod starts, and keeps it until the process ends (the kernel drops it when the
process dies, however it dies). A second job fails at once, naming the holder's host and pid
from the file. A lock file that still names a holder when the lock is free was left by a job
that never released it (killed, or its node lost): reported as stale and taken over. flock
works across the nodes of NFS (v4, and v3 with lockd) and Lustre mounted with ``flock``; on a
file system without it, flock fails and the error says so (the lock's core: hvctr.formats.dirlock,
which data_prep's --out lock shares). At every checkpoint rank 0 checks that the lock file it holds is
still there (``check_in_place``): a run directory deleted or moved mid-run stops the job.

A resume continues the run its checkpoints were written by. ``identity.json`` records, at the
first start: the resolved config, the digest of the training data (its data_prep manifest's
shard records: files, rows, dataset checksums), the world size and the kernel path. A resume
compares: a key of MUST_MATCH that differs (the model, the data, the batch, k, the seeds)
refuses with every difference listed, before anything in the run directory is written; any
other difference (learning rates, log cadence, epochs, cache sizes) is listed as changed.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hvctr.formats.dirlock import DirLock
from hvctr.formats.textfile import read_text

if TYPE_CHECKING:
    from hvctr.config import Config

LOCK_NAME = "hvctr.lock"
IDENTITY_NAME = "identity.json"


def usable_dir(path: str | Path, what: str) -> Path:
    """The nearest existing directory of ``path`` (itself, or the parent it would be created
    in), once a real write there worked (a temporary file, removed: it tells root the truth
    too); else a ValueError naming ``what`` (where the path came from, its config key) and the
    path: a file in its way, no permission, a read-only file system. Creates nothing."""
    p = Path(path).absolute()
    anc = p
    while not anc.exists() and anc != anc.parent:
        anc = anc.parent
    if not anc.is_dir():
        where = f"{p} is a file" if anc == p else f"{anc} is a file"
        raise ValueError(f"{what}: cannot use {p} as a directory: {where}, not a directory")
    try:
        fd, name = tempfile.mkstemp(prefix=".hvctr-probe-", dir=anc)
        os.close(fd)
        os.unlink(name)
    except OSError as e:
        raise ValueError(f"{what}: cannot {'write' if anc == p else 'create'} {p}: {e.strerror or e}"
                         + ("" if anc == p else f" (in {anc})")) from None
    return anc


class RunLock(DirLock):
    """An exclusive flock on ``<run_dir>/hvctr.lock``: ``RunLock(run_dir).acquire()``, held
    until ``release()`` or the end of the process (hvctr.formats.dirlock, shared with
    data_prep). ``stale``: the note on a stale lock taken over ("" when there was none)."""

    def __init__(self, run_dir: str | Path, command: str = "hvctr train") -> None:
        super().__init__(run_dir, LOCK_NAME, command, key="config key 'train.run_dir'", option="train.run_dir",
                         kind="run directory")
        self.run_dir = self.directory

    def acquire(self) -> "RunLock":
        """ValueError naming the holder when another job holds the run directory, or naming the
        path when the directory cannot hold a lock file."""
        usable_dir(self.run_dir, "config key 'train.run_dir'")
        super().acquire()
        return self

    def check_in_place(self) -> None:
        """ValueError naming the run directory when it is no longer the one this lock was taken
        in: deleted (``rm -rf``), moved, or replaced by another directory of that name, or the
        lock file itself removed or replaced. Whatever the job writes there then is lost (files
        of a deleted directory) or lands in a directory without its lock. Two stats and an fstat:
        called at every checkpoint (hvctr.checkpoint.manager's ``guard``). A no-op unless held."""
        if not self.in_place():
            raise ValueError(f"{self.run_dir}: the run directory was deleted, moved or replaced while this job "
                             f"ran ({self.path}, the lock this job holds, is no longer there): stopped, nothing "
                             f"more written; what the job wrote there since is lost with it: restore the "
                             f"directory and run again with --resume, or start a new train.run_dir")


# --- where the working shards go -------------------------------------------------------

SCRATCH_VARS = ("SLURM_TMPDIR", "TMPDIR")  # node-local scratch, in the order tried


def _same_file_system(a: Path, b: Path) -> bool:
    """Whether ``a`` and ``b`` (or their nearest existing parents) sit on one file system."""
    def dev(p: Path) -> int:
        p = p.absolute()
        while not p.exists() and p != p.parent:
            p = p.parent
        return p.stat().st_dev

    try:
        return dev(a) == dev(b)
    except OSError:
        return False


def working_shard_place(cfg: Config, run_dir: Path, ssd_dir: str = "", env=None) -> tuple[Path, str, bool]:
    """(directory, where it came from, whether it is scratch removed at exit) of a rank's
    working shard, first that applies:

    1. ``storage.shard_dir`` (kept);
    2. the SSD the hardware map gives the rank (placement's ssd_dir, on its NUMA node): scratch;
    3. node-local scratch: ``$SLURM_TMPDIR``, then ``$TMPDIR``, the first that is set, is a
       directory and is not on the run directory's file system (a scratch directory there is
       the shared file system again): scratch;
    4. ``<run_dir>/shards`` (kept).

    Scratch directories are named after the run (its name and a hash of its path: two runs
    never share one, and a requeued start finds the same name)."""
    env = os.environ if env is None else env
    if cfg.storage.shard_dir:
        return Path(cfg.storage.shard_dir), "storage.shard_dir", False
    tag = f"{run_dir.name}-{hashlib.sha256(str(run_dir.resolve()).encode()).hexdigest()[:10]}"
    if ssd_dir:
        return Path(ssd_dir) / "hvctr-shards" / tag, "the hardware map's SSD", True
    for var in SCRATCH_VARS:
        scratch = env.get(var, "")
        if scratch and os.path.isdir(scratch) and not _same_file_system(Path(scratch), run_dir):
            return Path(scratch) / "hvctr-shards" / tag, f"${var} (node-local scratch)", True
    return run_dir / "shards", "the run directory", False


def working_shard_dir(cfg: Config, run_dir: Path, ssd_dir: str = "", env=None) -> Path:
    """Where a rank's working shard goes (``working_shard_place``)."""
    return working_shard_place(cfg, run_dir, ssd_dir, env)[0]


def private_scratch_dir(path: str | Path) -> Path:
    """Creates ``<scratch>/hvctr-shards/<run tag>`` for this user alone, refusing what someone
    else planted there.

    Scratch directories ($TMPDIR, a node's SSD) are often world-writable and the run tag is
    predictable, so another user could put a symbolic link or a directory of theirs there and
    have the shard written through it. ``hvctr-shards`` is shared by the node's users, like
    /tmp: sticky (mode 1777), owned by this user or root, never a symbolic link. The run's own
    directory is mode 0700, owned by this user and not a symbolic link, else a ValueError
    naming it: nobody else can then create or replace a file inside it (the shard's temporary
    file included)."""
    mine = Path(path)
    shared = mine.parent
    uid = os.getuid()
    shared.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.mkdir(shared, 0o777)
        os.chmod(shared, 0o1777)  # the umask took bits away: set them as meant
    except FileExistsError:
        pass
    _check_dir(shared, lambda st: st.st_uid in (uid, 0) and (not st.st_mode & 0o002 or st.st_mode & stat.S_ISVTX),
               "owned by this user or root, and sticky where others may write to it")
    try:
        os.mkdir(mine, 0o700)
    except FileExistsError:
        pass
    _check_dir(mine, lambda st: st.st_uid == uid and not st.st_mode & 0o022,
               f"owned by this user (uid {uid}) and writable by no one else")
    return mine


def _check_dir(path: Path, ok, what: str) -> None:
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        raise ValueError(f"{path} is a symbolic link (to {os.readlink(path)}), not a directory: hvctr does not "
                         f"write working shards through it; remove it, or set storage.shard_dir")
    if not stat.S_ISDIR(st.st_mode) or not ok(st):
        raise ValueError(f"{path} is not a safe scratch directory (uid {st.st_uid}, mode {stat.filemode(st.st_mode)}): "
                         f"it must be a directory {what}; remove it, or set storage.shard_dir")


# --- identity ----------------------------------------------------------------------------

# What a resume must keep: the model and its state's shapes, the data and the position in it
# (batch size, k, world size: the saved "epoch e, batch b" means nothing on other data or
# another batch), the seeds every row and dense parameter was initialised from, and the
# admission and TTL rules whose state the checkpoint carries. Everything else may change and
# is listed (learning rates, the merge rules' tuning, log and checkpoint cadence, epochs,
# caches, placement, timeouts). The world size is checked against the newest checkpoint
# (hvctr reshard may change it), the kernel path only warned about (hvctr.checkpoint.format).
MUST_MATCH = frozenset({
    "model.arch", "model.hidden", "model.num_dense", "model.num_fields", "model.bottom_mlp", "model.cross_layers",
    "model.cross_rank", "model.pooling",
    "storage.dim", "storage.seed", "storage.init_scale", "storage.admit_after", "storage.admit_sketch_slots",
    "storage.ttl_passes",
    "merge.mode", "merge.every_k_steps", "merge.k_warmup_steps",
    "data.batch_size_per_rank",
    "train.seed", "train.sparse_optimizer",
    "data.digest",
})


def data_digest(train_dir: str) -> dict[str, Any]:
    """The training data's identity: sha256 over its data_prep manifest's train shard records
    (file names, rows, the sha256 of every dataset), independent of where the data lives and of
    when data_prep ran; with the shard count and the directory (which may move)."""
    from hvctr.data.reader import load_manifest

    shards = load_manifest(train_dir)["shards"]["train"]
    body = json.dumps(shards, sort_keys=True, separators=(",", ":")).encode()
    return {"digest": hashlib.sha256(body).hexdigest(), "shards": len(shards),
            "train_dir": str(Path(train_dir).resolve())}


def run_identity(cfg: Config, world_size: int) -> dict[str, Any]:
    """What identity.json records for a run started now with ``cfg`` on ``world_size`` ranks."""
    import hvctr
    from hvctr.config import to_dict
    from hvctr.kernels import native

    try:
        kernels = native.kernel_path()
    except native.NativeKernelsError as e:  # missing or damaged: a user error, found before Horovod
        raise ValueError(str(e)) from None
    return {"format_version": 1, "hvctr": hvctr.__version__, "config": to_dict(cfg),
            "data": data_digest(cfg.data.train_dir), "world_size": world_size, "kernels": kernels}


def _flat(identity: dict[str, Any]) -> dict[str, Any]:
    flat = {f"{s}.{k}": v for s, body in identity.get("config", {}).items() for k, v in body.items()}
    data = identity.get("data", {})
    flat["data.digest"] = data.get("digest")
    flat["data.shards"] = data.get("shards")
    flat["data.train_dir"] = data.get("train_dir")  # the digest decides; a moved directory is a change
    flat["world_size"] = identity.get("world_size")
    flat["kernels"] = identity.get("kernels")
    return flat


def compare_identity(saved: dict[str, Any], now: dict[str, Any]) -> tuple[list[str], list[str]]:
    """(differences that refuse a resume, differences listed as changed), one line each:
    ``key: saved -> now``. A key the saved identity lacks (added to hvctr since) is a change."""
    old, new = _flat(saved), _flat(now)
    refuse, changed = [], []
    for key in sorted(new):
        if key in old and old[key] == new[key]:
            continue
        was = old.get(key, "<not recorded>")
        if key == "data.digest":
            line = (f"data: the training data differ (manifest digest {str(was)[:12]} -> {str(new[key])[:12]}; "
                    f"{old.get('data.shards')} -> {new.get('data.shards')} shards; "
                    f"{old.get('data.train_dir')} -> {new.get('data.train_dir')})")
        else:
            line = f"{key}: {was!r} -> {new[key]!r}"
        (refuse if key in MUST_MATCH and key in old else changed).append(line)
    if any(line.startswith("data:") for line in refuse):
        changed = [c for c in changed if not c.startswith(("data.shards", "data.train_dir"))]
    return refuse, changed


def read_identity(run_dir: str | Path) -> dict[str, Any] | None:
    """The run's identity.json, None when there is none (a run from before it, or resharded into
    a new directory); ValueError naming the file when it is damaged."""
    path = Path(run_dir) / IDENTITY_NAME
    if not os.path.lexists(path):
        return None
    text = read_text(path, "run identity")  # a ValueError naming it: unreadable, not UTF-8
    try:
        identity = json.loads(text)
    except ValueError as e:
        raise ValueError(f"{path} is not JSON ({e}): damaged; it records what a resume must match "
                         f"(move it away to resume without that check)") from None
    if not isinstance(identity, dict):
        raise ValueError(f"{path} is not a run identity: damaged")
    return identity


def check_resume_identity(run_dir: str | Path, now: dict[str, Any]) -> list[str]:
    """On a resume: ValueError listing every difference of MUST_MATCH from the run's identity;
    else the lines of what changed (empty: nothing, or no identity to compare with)."""
    saved = read_identity(run_dir)
    if saved is None:
        return []
    refuse, changed = compare_identity(saved, now)
    if refuse:
        path = Path(run_dir) / IDENTITY_NAME
        raise ValueError(f"--resume: this run differs from the run its checkpoints were written by ({path}) in "
                         f"what a resume must keep:\n  " + "\n  ".join(refuse) +
                         "\nresume with the run's values (its config.toml), or start a new train.run_dir "
                         "(--init-from " + str(run_dir) + " starts from its model)")
    return changed


def write_json(path: str | Path, obj: Any, what: str = "") -> None:
    """``obj`` as JSON at ``path``, under a temporary name, then renamed: never half-written; a
    failed write leaves nothing of it and is a ValueError naming ``what`` and the path."""
    from hvctr.formats import safefile  # a fresh temporary file: never through a planted link

    path = Path(path)
    try:
        safefile.write_text(path, json.dumps(obj, indent=1, sort_keys=True))
    except OSError as e:
        raise ValueError(f"cannot write {what + ' ' if what else ''}{path}: {e.strerror or e}") from None


def write_identity(run_dir: str | Path, identity: dict[str, Any]) -> None:
    """identity.json, never half-written."""
    write_json(Path(run_dir) / IDENTITY_NAME, identity, "the run identity")
