"""The two engines of distributed.backend side by side, written into BENCHMARKS.md.

    python -m bench.engines --work-dir /var/tmp/btrain [--ranks 2,4] [--rounds 3]

The same job on Horovod and on torch.distributed (gloo), in interleaved rounds: hvctr k = 8,
DNN 26 x 16 -> 512-256-1, batch 4096 a rank, one epoch of bench.train's synthetic data (made in
--work-dir, reused where it is there), at each rank count of --ranks (more ranks than cores run
oversubscribed, as the MPI tests do). Reported: samples/s (medians over rounds) and their ratio,
AUC (the two engines train the same bits where OpenMPI's ring is pinned; here it is not, as in
a real job: OpenMPI picks its algorithm), and the time each engine spent in each collective
phase on rank 0: the dense merge (a grouped allreduce a window), the pull, push and warm
exchanges (alltoalls), from the run's own counters.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from bench.report import machine_line, publish
from bench.train import _with_load, hvctr_run, make_data

HEADING = "## The collectives' engines: Horovod and torch.distributed"
FLAGS = ["--merge.every_k_steps=8"]
BACKENDS = ("horovod", "torch")


def measure(work: Path, rows: int, ranks: list[int], rounds: int) -> dict[str, Any]:
    data, _ = make_data(work, rows)
    out: dict[str, Any] = {"rows": rows, "ranks": ranks, "rounds": []}
    for i in range(rounds):
        runs = []
        for w in ranks:
            for b in BACKENDS:
                print(f"round {i + 1}/{rounds}: {w} ranks, {b}", flush=True)
                r = _with_load(lambda: hvctr_run(work, data, f"engine_{b}_{w}.e{i + 1}",
                                                 FLAGS + [f"--distributed.backend={b}"], np_=w))
                runs.append({**r, "backend": b, "ranks": w})
        out["rounds"].append(runs)
    return out


def _phases(r: dict[str, Any]) -> str:
    ex = r.get("exchange", {})
    return (f"merge {r['time_split_s'].get('merge', 0.0):.1f} s; pull {ex.get('pull_exchange_s', 0.0):.2f}, "
            f"push {ex.get('push_exchange_s', 0.0):.2f}, warm {ex.get('warm_exchange_s', 0.0):.2f}, "
            f"ahead {ex.get('ahead_exchange_s', 0.0):.2f} s")


def render(res: dict[str, Any], command: str, machine: str) -> str:
    R = res["rounds"]
    lines = [HEADING, "", f"Command: `{command}`  ", f"Machine: {machine}  ",
             f"Data: {res['rows']:,} synthetic rows (bench.train's, seed 11). Job: hvctr k = 8, DNN 26 x 16 -> "
             f"512-256-1, batch 4096 a rank, one epoch, one thread a rank (ranks above the 2 cores oversubscribed). "
             f"Speeds: medians of {len(R)} interleaved rounds. Collective phases: rank 0's seconds in the last "
             f"round (merge: the window's dense merge and the push's rows left behind, as the meter counts it; "
             f"pull, push, warm, ahead: the alltoalls of each table operation, without their cache and shard "
             f"work).", "",
             "| ranks | engine | samples/s (median) | per round | torch / horovod | AUC | collective phases, rank 0 |",
             "|---|---|---|---|---|---|---|"]
    for w in res["ranks"]:
        idx = {b: next(j for j, r in enumerate(R[0]) if r["ranks"] == w and r["backend"] == b) for b in BACKENDS}
        sps = {b: statistics.median([rnd[j]["samples_per_s"] for rnd in R]) for b, j in idx.items()}
        for b, j in idx.items():
            per = ", ".join(f"{rnd[j]['samples_per_s']:,.0f}" for rnd in R)
            ratio = f"{sps['torch'] / sps['horovod']:.2f}x" if b == "torch" else "-"
            lines.append(f"| {w} | {b} | {sps[b]:,.0f} | {per} | {ratio} | {R[-1][j]['auc']:.4f} | "
                         f"{_phases(R[-1][j])} |")
    loads = "; ".join(f"round {i + 1}: " + ", ".join(f"{r.get('load_before', float('nan')):.1f}" for r in rnd)
                      for i, rnd in enumerate(R))
    lines += ["", f"Load average (1 min) before each run, in the table's order (2 cpus): {loads}."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.engines", description=__doc__.splitlines()[0])
    p.add_argument("--work-dir", required=True, help="bench.train's data directory (made there if absent)")
    p.add_argument("--rows", type=int, default=2_200_000)
    p.add_argument("--ranks", default="2", help="comma list of rank counts (default 2)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--benchmarks", default="", help="markdown file to write the section into (default: none)")
    args = p.parse_args(argv)
    ranks = [int(x) for x in args.ranks.split(",") if x.strip()]
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    command = "python -m bench.engines " + " ".join(sys.argv[1:] if argv is None else argv)
    t0 = time.time()
    res = measure(work, args.rows, ranks, args.rounds)
    publish(render(res, command, machine_line()), t0, args.benchmarks, HEADING)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
