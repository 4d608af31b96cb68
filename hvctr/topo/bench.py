"""What binding changes for two ranks on one node: pinned vs unpinned vs packed, side by side.

    python -m hvctr.topo.bench --map slurm/hwmaps/vm-2cpu.toml --rounds 5

Two worker processes (the two ranks of a node) run the same memory-bound kernels at once:

- ``gather``: random rows of a table larger than the last-level cache (the embedding
  gather: latency-bound), 64-byte rows, one cache line each;
- ``triad``: ``a = b + s * c`` over arrays larger than the cache (bandwidth-bound).

Modes, interleaved within every round so that load from other processes hits all alike:

- ``pinned``: each worker applies its row of the plan (affinity + preferred memory policy)
  before it allocates, as ``apply_placement`` does;
- ``unpinned``: no binding; the kernel scheduler places and moves the workers;
- ``packed``: both workers bound to the first rank's cpus: what two binding layers that
  disagree produce (mpirun's default --bind-to core, or two ranks that compute the same
  local rank).

Prints one JSON line per round and mode, then the median ratios to ``unpinned``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODES = ("pinned", "unpinned", "packed")


def _worker(mode: str, kernel: str, rank: int, hwmap_path: str, mib: int, iters: int, sync: str) -> None:
    import numpy as np

    from hvctr.config import MemoryPolicy
    from hvctr.topo.bind import set_memory_policy
    from hvctr.topo.discover import discover
    from hvctr.topo.hwmap import load_map
    from hvctr.topo.plan import plan_node

    hwmap = load_map(hwmap_path) if hwmap_path else discover()
    plans = plan_node(hwmap, 2, os.sched_getaffinity(0), oversubscribe=True)
    if mode != "unpinned":
        plan = plans[rank if mode == "pinned" else 0]
        os.sched_setaffinity(0, plan.cpus)
        set_memory_policy(MemoryPolicy.PREFERRED, plan.numa_node)
    if kernel == "gather":
        rows = (mib << 20) // 64
        table = np.ones((rows, 16), dtype=np.float32)  # first touch after binding
        idx = np.random.default_rng(rank).integers(0, rows, size=1 << 20)
        out = np.empty((idx.size, 16), np.float32)
        work, nbytes = (lambda: np.take(table, idx, axis=0, out=out)), idx.size * 64
    else:
        n = (mib << 20) // 4 // 3
        a, b, c = np.zeros(n, np.float32), np.ones(n, np.float32), np.ones(n, np.float32)

        def work() -> None:
            np.multiply(c, 3.0, out=a)
            np.add(a, b, out=a)
        nbytes = n * 4 * 4  # read c, write a, read a and b, write a
    work()  # warm: page tables, caches
    Path(sync, f"ready{rank}").touch()
    while not Path(sync, "go").exists():  # both workers start the timed part together
        time.sleep(0.0005)
    m0 = _migrations()
    t0 = time.monotonic()  # CLOCK_MONOTONIC: comparable across the two processes
    for _ in range(iters):
        work()
    t1 = time.monotonic()
    print(json.dumps({"start": t0, "end": t1, "bytes": iters * nbytes, "cpus": sorted(os.sched_getaffinity(0)),
                      "migrations": _migrations() - m0}))


def _migrations() -> int:
    """How often the scheduler moved this process to another cpu (each move leaves L1/L2 behind)."""
    try:
        text = Path("/proc/self/sched").read_text()
    except OSError:
        return -1
    for line in text.splitlines():
        if line.startswith("se.nr_migrations"):
            return int(line.split(":")[1])
    return -1


def _pair(mode: str, kernel: str, hwmap: str, mib: int, iters: int) -> dict:
    """Both workers' bytes over the span from the first start to the last end: the pair's rate."""
    with tempfile.TemporaryDirectory() as sync:
        procs = [subprocess.Popen([sys.executable, "-m", "hvctr.topo.bench", "--worker", mode, kernel, str(r),
                                   hwmap, str(mib), str(iters), sync], stdout=subprocess.PIPE, text=True)
                 for r in range(2)]
        while not all(Path(sync, f"ready{r}").exists() for r in range(2)):
            if any(p.poll() not in (None, 0) for p in procs):
                raise RuntimeError(f"bench worker ({mode}, {kernel}) failed")
            time.sleep(0.01)
        Path(sync, "go").touch()
        results = [json.loads(p.communicate()[0].strip().splitlines()[-1]) for p in procs]
    span = max(r["end"] for r in results) - min(r["start"] for r in results)
    return {"mode": mode, "kernel": kernel, "gbs": sum(r["bytes"] for r in results) / span / 1e9,
            "migrations_per_s": sum(r["migrations"] for r in results) / span, "cpus": [r["cpus"] for r in results]}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--worker":
        mode, kernel, rank, hwmap, mib, iters, sync = argv[1:8]
        _worker(mode, kernel, int(rank), hwmap, int(mib), int(iters), sync)
        return 0
    p = argparse.ArgumentParser(prog="python -m hvctr.topo.bench", description=__doc__.split("\n")[0])
    p.add_argument("--map", default="", help="hardware map (default: discover this machine)")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--mib", type=int, default=256, help="table and triad size per worker")
    p.add_argument("--iters", type=int, default=10)
    args = p.parse_args(argv)
    runs: dict[tuple[str, str], list[float]] = {}
    moves: dict[str, list[float]] = {}
    load0 = os.getloadavg()[0]  # other processes on the machine skew every mode; say how busy it was
    for rnd in range(args.rounds):
        for kernel in ("gather", "triad"):
            for mode in MODES[rnd % 3:] + MODES[: rnd % 3]:  # rotate the order: no mode always runs first
                r = _pair(mode, kernel, args.map, args.mib, args.iters)
                runs.setdefault((kernel, mode), []).append(r["gbs"])
                moves.setdefault(mode, []).append(r["migrations_per_s"])
                print(json.dumps({"round": rnd, **r}), flush=True)
    print(f"load average (1 min) at start {load0:.2f}, at end {os.getloadavg()[0]:.2f}; {os.cpu_count()} cpus")
    print("cpu migrations per second, both workers: " + ", ".join(
        f"{m} median {statistics.median(v):.1f}" for m, v in moves.items()))
    for kernel in ("gather", "triad"):
        base = runs[(kernel, "unpinned")]
        for mode in ("pinned", "packed"):
            ratios = [x / b for x, b in zip(runs[(kernel, mode)], base)]
            print(f"{kernel}: {mode}/unpinned median {statistics.median(ratios):.3f} "
                  f"(min {min(ratios):.3f}, max {max(ratios):.3f}, {len(ratios)} rounds); "
                  f"unpinned pair {statistics.median(base):.2f} GB/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
