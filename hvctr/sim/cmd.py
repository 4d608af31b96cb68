"""``hvctr simulate``: W ranks of ``hvctr train`` in one process, to measure quality at many ranks.

    hvctr simulate --ranks 64 --config run.toml --data.train_dir=data/criteo --train.run_dir=runs/sim64

Each simulated rank is a thread running the unmodified runtime: a ``Trainer`` over a
``ThreadComm`` (hvctr.sim.comm), with its own working shard and its own share of the data
(rank r reads the data shards s with s % W == r), the dense merger, the sparse owner merge,
Adam's state handling, checkpoints and the final evaluation. The ranks run strictly in turn,
so the result is that of ``mpirun -np W ... hvctr train`` with the same configuration: bit
for bit, when OpenMPI's allreduce is pinned to its ring algorithm (``--reduce-order ring``,
the default; tests/e2e/test_simulate.py holds it to that at W = 2 and 3). It differs only
in speed: one rank computes at a time, with every core of the machine.

What the simulation changes, none of which changes a result (docs/training.md, "Many ranks on one machine"):
``data.prefetch`` is off (prefetch on and off give bit-equal models), ``storage.cpu_cache_bytes``
is capped by ``--cache-bytes`` (the cache changes speed, never values), and nothing is bound to
cpus or NUMA nodes (``topology.bind`` off). Torch's thread count does change the bits of the
dense model's matmuls, in real jobs too: the one rank that computes uses ``--threads``, else
``train.threads``, else every cpu. An unbound mpirun rank uses its share of the node's cpus
(cpus / ranks on the node), so a simulation that must equal a real run bit for bit runs both
with ``--train.threads=1`` (or the same value).

The run directory is a ``hvctr train`` run directory of W ranks: ``config.toml`` (what ran),
``logs/rank-NNNNN.log``, ``metrics.jsonl``, ``checkpoints/`` (``hvctr export`` reads it;
``mpirun -np W hvctr eval`` too), ``shards/``, and ``summary.json`` with the validation AUC,
logloss, NE and COPC and a ``simulate`` section (ranks, wall time, peak RSS). The last line on
stdout is that summary's headline as one JSON object.

Memory. The process (python, torch, h5py) takes about 0.5 GB; every simulated rank adds,
for the whole run:
- its store: the CPU cache (``storage.cpu_cache_bytes``, capped at ``--cache-bytes``,
  16 MB by default), the admission sketch when ``storage.admit_after`` > 1
  (8 x ``storage.admit_sketch_slots`` bytes: lower the slots for large W), and its working
  shard, a file on disk (``storage.rows_per_rank`` rows reserved: size it for the table's
  share of one of W ranks; the pages it maps are file-backed, reclaimable, yet counted in RSS);
- its model replica: dense parameters, their gradients, Adam's m and v (16 bytes per
  parameter: 5.6 MB for the 26 x 16, 512-256-1 DNN);
- its open data shards (h5py handles and chunk caches: a few MB);
and, while a window is in flight (every rank holds one at each merge, where the ranks wait for
each other), the window: k x B x 476 bytes of batches (label, 13 dense floats, 26 keys, 26
int64 positions), its working set of U rows of ``4 x (3 x (dim + 1) + 1)`` bytes (U, the
window's distinct keys, is about 3.4 x k x B for Criteo-like data at k = 8) and, during the
sparse push, the messages to and from the owners (about 2 x U rows). The dense allreduce
holds 2 x W copies of the dense payload for a moment.
Measured (peak RSS, VmHWM, of the whole process at W = 64, 2 cores): dim 8, MLP 32-16,
B = 256, k = 4: 1.39 GB (1.09 GB with ``--cache-bytes 2e6``), 7 s for 10 steps per rank;
dim 16, MLP 512-256, B = 1024, windows of 2 batches: 2.77 GB, 13 s for 2 steps per rank.
Estimated, not measured: at B = 4096, k = 8, dim 16 a rank's window in flight is about 110 MB,
so W = 64 needs about 8 GB; lower ``data.batch_size_per_rank`` (or k) to fit larger W in less.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

from hvctr.config import Config, load_config, write_toml
from hvctr.formats import safefile
from hvctr.log import RankFormatter, _LogFile, get_logger
from hvctr.distributed.world import AgreedError, group_errors, raise_agreed
from hvctr.train.stop import StopRequest

log = get_logger(__name__)

EXIT_REQUEUE = 75
DEFAULT_CACHE_BYTES = 16_000_000


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ranks", type=int, required=True, metavar="W", help="number of simulated ranks")
    p.add_argument("--config", help="TOML file (see slurm/configs/); --section.key=value flags override it")
    p.add_argument("--resume", action="store_true",
                   help="continue from the newest complete checkpoint of the run directory (as hvctr train)")
    p.add_argument("--init-from", metavar="RUN_OR_CHECKPOINT", help="start from another run's model (as hvctr train)")
    p.add_argument("--cache-bytes", type=float, default=DEFAULT_CACHE_BYTES, metavar="BYTES",
                   help=f"cap of each simulated rank's storage.cpu_cache_bytes (default {DEFAULT_CACHE_BYTES:,}; "
                        f"0: the config's); the cache changes speed, never results")
    p.add_argument("--threads", type=int, default=0,
                   help="torch threads of the one rank that computes at a time (default: train.threads, "
                        "else every cpu this process may use)")
    p.add_argument("--reduce-order", choices=("ring", "rank"), default="ring",
                   help="float summation order of dense allreduces: ring (OpenMPI's ring allreduce over "
                        "Horovod's fusion buffer, default) or rank (ascending rank)")


def simulated_config(cfg: Config, cache_bytes: int) -> Config:
    """What a simulated rank runs with: prefetch off, the cache capped, no binding."""
    storage = cfg.storage
    if cache_bytes > 0 and storage.cpu_cache_bytes > cache_bytes:
        storage = dataclasses.replace(storage, cpu_cache_bytes=int(cache_bytes))
    return dataclasses.replace(cfg, storage=storage, data=dataclasses.replace(cfg.data, prefetch=False),
                               topology=dataclasses.replace(cfg.topology, bind=False))


def node_grouping(size: int, ranks_per_virtual_node: int) -> list[list[int]]:
    """One node (one machine), or virtual nodes of ``ranks_per_virtual_node`` consecutive ranks."""
    if ranks_per_virtual_node > 0:
        return [list(range(a, min(a + ranks_per_virtual_node, size))) for a in range(0, size, ranks_per_virtual_node)]
    return [list(range(size))]


def preflight(cfg: Config, size: int, resume: bool, init_from: str | None) -> Config:
    """hvctr train's input checks, for every simulated rank; one AgreedError for all. Returns
    the config as checked (storage.rows_per_rank = 0 sized from the data)."""
    from hvctr.train.preflight import check_inputs

    errors: list[str | None] = []
    checked, sizing = cfg, ""
    for rank in range(size):
        try:
            checked, sizing = check_inputs(cfg, rank, size, resume, init_from)
            errors.append(None)
        except ValueError as e:
            errors.append(str(e))
    raise_agreed(group_errors(errors), 0, size)
    if sizing:
        log.info(sizing)
    return checked


# --- logging: every line names its simulated rank ------------------------------------------

class _Formatter(RankFormatter):
    """hvctr.log's line, naming the simulated rank whose thread logged it ("sim": the driver)."""

    def __init__(self, world, width: int) -> None:
        super().__init__(0, width)
        self.world, self.width = world, width

    def tag(self, record: logging.LogRecord) -> str:
        rank = self.world.rank_of_thread(record.thread)
        return "sim" if rank is None else f"r{rank:<{self.width}d}"


class _ConsoleFilter(logging.Filter):
    """Rank 0 and the simulation itself print everything, other ranks warnings and errors."""

    def __init__(self, world, all_ranks: bool) -> None:
        super().__init__()
        self.world, self.all_ranks = world, all_ranks

    def filter(self, record: logging.LogRecord) -> bool:
        rank = self.world.rank_of_thread(record.thread)
        return rank in (None, 0) or self.all_ranks or record.levelno >= logging.WARNING


class _RankFilter(logging.Filter):
    def __init__(self, world, rank: int) -> None:
        super().__init__()
        self.world, self.rank = world, rank

    def filter(self, record: logging.LogRecord) -> bool:
        return self.world.rank_of_thread(record.thread) in (self.rank, None)


def _setup_logging(world, run_dir: Path, all_ranks: bool) -> list[logging.Handler]:
    root = logging.getLogger("hvctr")
    for h in list(root.handlers):
        root.removeHandler(h)
        h.close()
    root.setLevel(logging.INFO)
    root.propagate = False
    fmt = _Formatter(world, len(str(max(world.size - 1, 0))))
    console = logging.StreamHandler(sys.stdout)
    console.setFormatter(fmt)
    console.addFilter(_ConsoleFilter(world, all_ranks))
    handlers: list[logging.Handler] = [console]
    for r in range(world.size):
        fh = _LogFile(run_dir / "logs" / f"rank-{r:05d}.log", safefile.open_append)  # a planted link: refused
        fh.setFormatter(fmt)
        fh.addFilter(_RankFilter(world, r))
        handlers.append(fh)
    for h in handlers:
        root.addHandler(h)
    return handlers


def peak_rss_bytes() -> int:
    """This process's peak resident set (ru_maxrss: KiB on Linux, the same figure as VmHWM)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# --- the run -------------------------------------------------------------------------------

def simulate(cfg: Config, size: int, resume: bool = False, init_from: str | None = None, threads: int = 0,
             reduce_order: str = "ring", stop: StopRequest | None = None) -> tuple[dict[str, Any], bool]:
    """Trains ``size`` simulated ranks with ``cfg`` (already made by simulated_config and
    checked); returns (rank 0's summary with the evaluation, whether a stop was requested)."""
    import torch

    from hvctr.determinism import deterministic_torch
    from hvctr.sim.comm import ThreadComm, ThreadWorld
    from hvctr.train.trainer import Trainer

    run_dir = Path(cfg.train.run_dir)
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    world = ThreadWorld(size, node_grouping(size, cfg.topology.ranks_per_virtual_node), reduce_order)
    handlers = _setup_logging(world, run_dir, cfg.metrics.all_ranks)
    threads = threads or cfg.train.threads or len(os.sched_getaffinity(0))
    deterministic_torch()
    device = torch.device(_device(cfg))
    write_toml(cfg, run_dir / "config.toml")
    stop = stop or StopRequest()
    summaries: dict[int, dict[str, Any]] = {}
    preempted: dict[int, bool] = {}

    def rank_main(rank: int) -> None:
        exc: BaseException | None = None
        try:
            world.enter(rank)
            torch.set_num_threads(threads)  # per thread: OpenMP's thread count is a per-thread setting
            trainer = Trainer(cfg, ThreadComm(world, rank), device, run_dir, resume=resume, init_from=init_from,
                              stop=stop)
            summary = trainer.train_and_evaluate()
            summaries[rank], preempted[rank] = summary, trainer.preempted
        except BaseException as e:  # reported by the main thread, naming this rank
            exc = e
        finally:
            world.finish(rank, exc)

    log.info(f"hvctr simulate: {size} simulated ranks in one process, in turn, {threads} torch threads each; "
             f"run dir {run_dir}, device {device}, cache {cfg.storage.cpu_cache_bytes:,} bytes per rank, "
             f"dense sums in {reduce_order} order")
    t0 = time.perf_counter()
    workers = [threading.Thread(target=rank_main, args=(r,), name=f"hvctr-sim-r{r}", daemon=True)
               for r in range(size)]
    for w in workers:
        w.start()
    try:
        for w in workers:
            while w.is_alive():
                w.join(0.2)  # short waits: the main thread takes the signals (StopRequest)
    except KeyboardInterrupt as e:
        world.abort(e)
        for w in workers:
            w.join(30)
        raise
    finally:
        for h in handlers[1:]:
            h.flush()
    wall = time.perf_counter() - t0
    if world.error is not None:
        rank, exc = world.error
        if isinstance(exc, AgreedError):  # every rank hit it: one message for the job
            raise AgreedError(str(exc), report=True) from exc
        if isinstance(exc, ValueError):
            raise ValueError(f"simulated rank {rank}: {exc}") from exc
        tb = "".join(traceback.format_exception(exc))
        log.error(f"simulated rank {rank} failed:\n{tb}")
        raise RuntimeError(f"simulated rank {rank} failed: {exc.__class__.__name__}: {exc}") from exc
    summary = summaries[0]
    summary["simulate"] = {"ranks": size, "threads": threads, "reduce_order": reduce_order,
                           "cache_bytes_per_rank": cfg.storage.cpu_cache_bytes, "wall_s": round(wall, 3),
                           "peak_rss_bytes": peak_rss_bytes()}
    return summary, any(preempted.values())


def _device(cfg: Config) -> str:
    import torch

    want = cfg.train.device.value
    if want == "cuda" and not torch.cuda.is_available():
        raise ValueError("config key 'train.device': cuda asked for, but CUDA is not available on this node")
    return "cuda:0" if want == "cuda" or (want == "auto" and torch.cuda.is_available()) else "cpu"


def run(args: argparse.Namespace, overrides: list[str]) -> int:
    from hvctr.rundir import write_json
    from hvctr.train.cmd import format_summary

    stop = StopRequest().install()
    if args.ranks < 1:
        raise ValueError(f"--ranks must be >= 1, got {args.ranks}")
    cfg = simulated_config(load_config(args.config, overrides), int(args.cache_bytes))
    cfg = preflight(cfg, args.ranks, args.resume, args.init_from)
    summary, stopped = simulate(cfg, args.ranks, resume=args.resume, init_from=args.init_from, threads=args.threads,
                                reduce_order=args.reduce_order, stop=stop)
    run_dir = Path(cfg.train.run_dir)
    write_json(run_dir / "summary.json", summary, "the run summary")
    log.info(format_summary(summary))
    sim, ev = summary["simulate"], summary.get("eval", {})
    line = {"ranks": args.ranks, "run_dir": str(run_dir), "auc": ev.get("auc"), "logloss": ev.get("logloss"),
            "ne": ev.get("ne"), "copc": ev.get("copc"), "steps": summary["steps"], "samples": summary["samples"],
            "mode": cfg.merge.mode.value, "every_k_steps": cfg.merge.every_k_steps, "wall_s": sim["wall_s"],
            "peak_rss_bytes": sim["peak_rss_bytes"], "preempted": stopped}
    print(json.dumps(line), flush=True)
    if stopped:
        log.warning(f"stopped by a signal after a checkpoint; resume with --resume (exit {EXIT_REQUEUE})")
        return EXIT_REQUEUE
    return 0
