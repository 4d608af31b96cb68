"""``hvctr train`` and ``hvctr eval``: the jobs users launch under mpirun or srun.

    mpirun -np 2 --bind-to none python -m mpi4py -m hvctr train --config run.toml --merge.every_k_steps=8

Set-up order matters: the preflight (config and inputs checked on every rank, errors agreed
and reported once, before Horovod starts: hvctr.train.preflight; it also sizes the shard),
CUBLAS_WORKSPACE_CONFIG (before CUDA initialises), Horovod, placement (affinity, memory policy,
threads: before CUDA and before any large allocation), then the trainer.

Determinism: ``torch.use_deterministic_algorithms(True)`` on every run (hvctr.determinism, which also
turns torch's NaN fill of fresh tensors off). On CUDA, cuBLAS is then
deterministic only with a fixed workspace: ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` (set here when
unset, before any CUDA call; ``:16:8`` also works, with less memory and some speed lost),
else the first matmul raises. Its cost: 8 workspaces of 4 MiB per GPU, and no
non-deterministic (atomics-based) kernels. Exit codes: 0 done, 2 bad config or input,
75 (EX_TEMPFAIL) stopped by a signal after a checkpoint: the batch script requeues the job.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hvctr.config import Config, write_toml
from hvctr.log import get_logger, setup_logging
from hvctr.distributed.world import set_error_gate
from hvctr.train.preflight import Checked, preflight
from hvctr.train.stop import StopRequest

if TYPE_CHECKING:
    import torch

    from hvctr.distributed.protocol import Comm

log = get_logger(__name__)

EXIT_REQUEUE = 75
CUBLAS_WORKSPACE = ":4096:8"  # what cuBLAS needs for deterministic results (CUDA >= 10.2)


def cuda_determinism_env(env=None) -> str:
    """Sets CUBLAS_WORKSPACE_CONFIG (when unset) before CUDA initialises; returns a warning or ""."""
    env = os.environ if env is None else env
    value = env.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    if value not in (":4096:8", ":16:8"):
        return (f"CUBLAS_WORKSPACE_CONFIG={value}: cuBLAS is deterministic only with :4096:8 or :16:8; "
                f"on a GPU torch.use_deterministic_algorithms(True) will raise")
    return ""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="TOML file (see slurm/configs/); --section.key=value flags override it")
    p.add_argument("--resume", action="store_true",
                   help="continue from the newest complete checkpoint of the run directory (starts fresh if none)")
    p.add_argument("--init-from", metavar="RUN_OR_CHECKPOINT",
                   help="start from another run's model (a run directory, its checkpoint directory or one "
                        "ckpt-NNNNNN): a new pass over data.train_dir with the optimiser state, admission "
                        "counts and TTL clock carried over. With --resume, a checkpoint of this run on the "
                        "same data wins (a requeued day job)")


def add_eval_arguments(p: argparse.ArgumentParser) -> None:  # hvctr eval (hvctr/train/eval_cmd.py)
    p.add_argument("--run-dir", required=True, help="a run directory written by hvctr train")
    p.add_argument("--split", default="valid", choices=("valid", "train"),
                   help="which split of the run's data to evaluate (default valid; the result goes to eval-<split>.json)")


def _start(cfg: Config, run_dir: Path, program: str) -> tuple[Comm, torch.device, str]:
    """Horovod (with the collective watchdog), logging, placement, determinism. Returns (comm,
    device, the hardware map's SSD directory for this rank or "")."""
    cublas_note = cuda_determinism_env()  # before anything can initialise CUDA
    from hvctr.heap import fix_mmap_threshold

    heap_note = fix_mmap_threshold()  # HVCTR_MALLOC_TUNE=1: freed arrays go back (hvctr.heap)
    import torch  # here, not at the top: the preflight before it needs none of it

    from hvctr.determinism import deterministic_torch
    from hvctr.distributed import init_comm
    from hvctr.models.linear import describe as describe_products

    comm = init_comm(cfg.topology.ranks_per_virtual_node, cfg.train.stall_timeout_s, program=f"hvctr {program}",
                     backend=cfg.distributed.backend.value)
    if comm.rank == 0:
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    comm.barrier()  # comm: barrier: the run directory exists before any rank opens its log
    # comm: broadcast of rank 0's name for this start's error record: the first rank to fail
    # creates it and prints; the others' errors (often the same, or caused by it) go to their logs
    start = comm.broadcast_object(f"{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}", root=0, name="error_gate")
    set_error_gate(run_dir / "logs" / f"error-{start}.txt")
    from hvctr.formats.safefile import open_append  # O_NOFOLLOW: a link planted at the log is refused

    setup_logging(comm.rank, comm.size, cfg.metrics.all_ranks, file=str(run_dir / "logs" / f"rank-{comm.rank:05d}.log"),
                  open_file=open_append)
    from hvctr.topo.bind import apply_placement, binding_report, format_binding_table

    if cublas_note:
        log.warning(cublas_note)
    if heap_note and comm.rank == 0:
        log.info(heap_note)
    placement = apply_placement(cfg.topology, comm.local_rank, comm.local_size)
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
        threads_why = "train.threads"
    elif not placement.bound:  # ranks share the node's cpus: each takes its share
        from hvctr.topo.bind import default_threads

        host_ranks = comm.local_size if not cfg.topology.ranks_per_virtual_node else comm.size
        n, threads_why = default_threads(len(placement.allowed_at_start), os.environ, host_ranks)
        torch.set_num_threads(n)
    else:
        threads_why = "the hardware map's plan" + (" (topology.threads_per_rank)" if cfg.topology.threads_per_rank else "")
    if comm.rank == 0:
        log.info(f"torch threads: {torch.get_num_threads()} on rank 0, from {threads_why}")
        log.info(f"collectives: {comm!r}")
        log.info(f"dense layers' products on the CPU: {describe_products()}")
    deterministic_torch()
    # comm: allgather of every rank's effective binding, for one table on rank 0
    reports = comm.allgather_object(binding_report(placement), name="binding")
    log.info("rank binding:\n" + format_binding_table(reports))
    if comm.rank == 0:
        _write_json(run_dir / "binding.json", reports)
    device = torch.device(_device(cfg, placement.device))
    return comm, device, placement.ssd_dir


def _device(cfg: Config, planned: str) -> str:
    import torch

    want = cfg.train.device.value
    if want == "cpu":
        return "cpu"
    if want == "cuda" and not torch.cuda.is_available():
        raise ValueError("config key 'train.device': cuda asked for, but CUDA is not available on this node")
    return planned if planned.startswith("cuda") or want == "auto" else "cuda"


def run(args: argparse.Namespace, overrides: list[str]) -> int:
    stop = StopRequest().install()  # before the seconds of set-up: a preemption signal must not kill us
    checked = preflight(args.config, overrides, resume=args.resume, init_from=args.init_from)
    try:
        return _train(args, checked, stop)
    finally:
        if checked.lock is not None:
            checked.lock.release()


def _train(args: argparse.Namespace, checked: Checked, stop: StopRequest) -> int:
    cfg = checked.cfg
    run_dir = Path(cfg.train.run_dir)
    comm, device, ssd_dir = _start(cfg, run_dir, "train")
    from hvctr.rundir import write_identity
    from hvctr.train.trainer import Trainer

    if comm.rank == 0:  # only now: a refused resume has left the run directory as it was
        if checked.identity is not None:
            write_identity(run_dir, checked.identity)
        write_toml(cfg, run_dir / "config.toml")
    log.info(f"hvctr train: {comm.size} ranks on {comm.num_nodes} node(s), run dir {run_dir}, device {device}")
    for note in checked.notes:
        log.warning(note)
    if checked.sizing:
        log.info(checked.sizing)
    trainer = Trainer(cfg, comm, device, run_dir, resume=args.resume, init_from=args.init_from, stop=stop,
                      ssd_dir=ssd_dir, guard=checked.lock.check_in_place if checked.lock is not None else None)
    log.info(f"working shards: {trainer.shard_dir} (rank 0; from {trainer.shard_dir_source}; "
             f"storage.shard_dir, else the hardware map's SSD, else $SLURM_TMPDIR / $TMPDIR, else the run "
             f"directory{'; scratch: removed at exit' if trainer.shard_scratch else ''})")
    summary = trainer.train_and_evaluate()
    if comm.rank == 0:
        _write_json(run_dir / "summary.json", summary)
        log.info(format_summary(summary))
    if trainer.preempted:
        log.warning(f"stopped by a signal after a checkpoint; resume with --resume (exit {EXIT_REQUEUE})")
        return EXIT_REQUEUE
    return 0


def run_eval(args: argparse.Namespace, overrides: list[str]) -> int:
    run_dir = Path(args.run_dir)
    if not (run_dir / "config.toml").is_file():
        raise ValueError(f"{run_dir} is not a run directory: {run_dir / 'config.toml'} is missing")
    checked = preflight(str(run_dir / "config.toml"), overrides, resume=True, eval_only=True, run_dir=run_dir,
                        command="hvctr eval")
    try:
        return _eval(args, checked.cfg, run_dir)
    finally:
        if checked.lock is not None:
            checked.lock.release()


def _eval(args: argparse.Namespace, cfg: Config, run_dir: Path) -> int:
    comm, device, ssd_dir = _start(cfg, run_dir, "eval")
    from hvctr.train.trainer import Trainer

    trainer = Trainer(cfg, comm, device, run_dir, resume=True, ssd_dir=ssd_dir)
    try:
        if trainer.state.step == 0:
            raise ValueError(f"{run_dir}: no complete checkpoint to evaluate")
        result = trainer.evaluate(args.split)
    finally:
        trainer.close()
    if comm.rank == 0:
        _write_json(run_dir / f"eval-{args.split}.json", result)
        log.info(f"eval {args.split}: " + "  ".join(f"{k} {v:.5g}" for k, v in result.items()))
    return 0


def _write_json(path: Path, obj: Any) -> None:
    """``path`` never half-written (hvctr.rundir.write_json)."""
    from hvctr.rundir import write_json

    write_json(path, obj)


def format_summary(s: dict[str, Any]) -> str:
    ev, nan = s.get("eval", {}), float("nan")
    split = s["time_split_s"]
    total = max(sum(split.values()), 1e-9)
    lines = [
        "summary",
        f"  validation     AUC {ev.get('auc', nan):.4f}   logloss {ev.get('logloss', nan):.4f}   "
        f"NE {ev.get('ne', nan):.4f}   COPC {ev.get('copc', nan):.3f} (actual / predicted CTR)   "
        f"({ev.get('count', 0):,.0f} rows)",
        f"  throughput     {s['samples_per_s']:,.0f} samples/s   {s['samples']:,} samples in {s['seconds']:.1f} s",
        "  time split     " + "   ".join(f"{k} {v:.1f} s ({100 * v / total:.0f}%)" for k, v in split.items()),
        f"  merge bytes    dense {s['dense_bytes_per_sample']:.1f} B/sample   sparse {s['sparse_bytes_per_sample']:.1f} B/sample",
        f"  cache          hit rate {s['store'].get('cache_hit_rate', 0):.3f}   shard rows {s['store'].get('shard_rows', 0):,.0f}",
    ]
    return "\n".join(lines)
