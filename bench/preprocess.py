"""Preprocessing throughput, measured side by side in one run, written into BENCHMARKS.md.

    python -m bench.preprocess --rows 2000000            # ~1 minute on 2 cores

1. ``data_prep synth`` writes the input (its rate is the generator's figure).
2. ``data_prep criteo`` turns it into shards with 1 process (no mpirun) and with 2 (mpirun
   -np 2), alternating, ``--repeat`` times each; the median of each is reported. The input is
   in the page cache for both. A rate "in job" is rows / the job's own elapsed time (from its
   manifest: after MPI start-up, up to the complete manifest); "wall" includes the launcher.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from data_prep import synth
from data_prep.__main__ import keep_freed_memory
from bench.report import write_section

REPO = Path(__file__).resolve().parents[1]
SECTION = "## Preprocessing"
MPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
           "OMPI_MCA_mpi_yield_when_idle": "1", "OMPI_MCA_btl_vader_single_copy_mechanism": "none",
           "OMPI_MCA_rmaps_base_oversubscribe": "1"}


def _criteo(np_: int, tsv: Path, out: Path, shards: int) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    launch = [sys.executable]
    if np_ > 1:
        launch = ["mpirun", "-np", str(np_), "--bind-to", "none", sys.executable, "-m", "mpi4py"]
    cmd = [*launch, "-m", "data_prep", "criteo", "--input", str(tsv), "--out", str(out),
           "--shards", str(shards), "--valid-fraction", "0.05"]
    t0 = time.monotonic()
    subprocess.run(cmd, env={**os.environ, **MPI_ENV}, check=True, capture_output=True)
    wall = time.monotonic() - t0
    m = json.loads((out / "manifest.json").read_text())
    rows = m["totals"]["rows"]
    s = m["sessions"][-1]
    return {"rows": rows, "wall_s": wall, "job_s": s["elapsed_s"], "cpu_s": sum(s["work_cpu_s"]),
            "phase_s": s["phase_s"], "checksums": m["shards"]}


def measure(rows: int, shards: int, repeat: int, work: Path) -> dict:
    tsv = work / "bench.tsv"
    load_before = os.getloadavg()[0]
    gen = synth.generate(rows, seed=1, out=str(tsv))
    runs: dict[int, list[dict]] = {1: [], 2: []}
    for _ in range(repeat):
        for np_ in (1, 2):
            runs[np_].append(_criteo(np_, tsv, work / f"out{np_}", shards))
    assert runs[1][0]["checksums"] == runs[2][0]["checksums"], "1 and 2 processes wrote different shards"
    res = {"rows": rows, "tsv_bytes": tsv.stat().st_size, "shards": shards, "repeat": repeat,
           "synth_rows_per_s": rows / gen["seconds"], "synth_auc": gen["expected_auc"]}
    for np_, rs in runs.items():
        res[f"p{np_}_job_rows_per_s"] = statistics.median(r["rows"] / r["job_s"] for r in rs)
        res[f"p{np_}_wall_rows_per_s"] = statistics.median(r["rows"] / r["wall_s"] for r in rs)
        # rows per CPU-second of parsing and writing, summed over the processes (waits at
        # collectives excluded): other work on the machine inflates wall time far more than this
        res[f"p{np_}_cpu_rows_per_s"] = statistics.median(r["rows"] / r["cpu_s"] for r in rs)
    res["speedup_job"] = res["p2_job_rows_per_s"] / res["p1_job_rows_per_s"]
    res["speedup_wall"] = res["p2_wall_rows_per_s"] / res["p1_wall_rows_per_s"]
    res["loadavg"] = (load_before, os.getloadavg()[0])  # other work on the machine shows here
    res["nice"] = os.nice(0)
    res["autogroup"] = _autogroup_nice()
    return res


def _autogroup_nice() -> int:
    """The nice value of this session's scheduler autogroup (with autogroups on, plain nice only
    ranks processes within a session)."""
    try:
        return int(open("/proc/self/autogroup").read().split("nice")[1])
    except (OSError, IndexError, ValueError):
        return 0


def _cpu() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown cpu"


def render(res: dict, command: str) -> str:
    k = lambda x: f"{x / 1e3:,.0f}k"
    return f"""{SECTION}

Command: `{command}` ({time.strftime('%Y-%m-%d')}; {os.cpu_count()} cores, no GPU, {_cpu()};
1-minute load average {res['loadavg'][0]:.1f} before, {res['loadavg'][1]:.1f} after: above ~2 other work shared the cores;
run at niceness {res.get('nice', 0)}, scheduler autogroup niceness {res.get('autogroup', 0)}{
' so that other work got little of them' if res.get('autogroup', 0) < 0 else ''}).
Input: {res['rows']:,} synthetic Criteo rows from `data_prep synth` ({res['tsv_bytes'] / 1e6:,.0f} MB of TSV,
in the page cache); `data_prep criteo --shards {res['shards']} --valid-fraction 0.05`; 1 and 2 processes
alternated, {res['repeat']} runs each, medians. "In job": rows / the job's own elapsed time from its
manifest (parse + assemble + checksums, after MPI start-up); "wall": the whole command, launcher included;
"per CPU-second": rows / the CPU seconds the processes spent parsing and writing (waits
excluded; what other work on the machine changes least).

| step | processes | rows/s in job | rows/s per process | rows/s wall | rows per CPU-second per process |
|---|---|---|---|---|---|
| TSV -> shards | 1 | {k(res['p1_job_rows_per_s'])} | {k(res['p1_job_rows_per_s'])} \
| {k(res['p1_wall_rows_per_s'])} | {k(res['p1_cpu_rows_per_s'])} |
| TSV -> shards | 2 (`mpirun -np 2`) | {k(res['p2_job_rows_per_s'])} | {k(res['p2_job_rows_per_s'] / 2)} \
| {k(res['p2_wall_rows_per_s'])} | {k(res['p2_cpu_rows_per_s'])} |
| `data_prep synth` | 1 | {k(res['synth_rows_per_s'])} | {k(res['synth_rows_per_s'])} | | |

2 processes / 1: **{res['speedup_job']:.2f}x** in job, {res['speedup_wall']:.2f}x wall (mpirun's start-up is
about a second). The shards of both runs have identical checksums. The generator's data has a
Bayes-optimal AUC of {res['synth_auc']:.4f} (expected, from its true probabilities).
"""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.preprocess", description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=2_000_000)
    p.add_argument("--shards", type=int, default=8)
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--work-dir", help="scratch directory (default: a temporary one, removed after)")
    p.add_argument("--benchmarks", default="", help="markdown file to write the section into (default: none)")
    p.add_argument("--no-write", action="store_true", help="print the section only")
    args = p.parse_args(argv)
    keep_freed_memory()  # as the data_prep command does: the generator runs in this process
    exe = Path(sys.executable)
    exe_name = str(exe.relative_to(REPO)) if exe.is_relative_to(REPO) else "python"
    command = f"{exe_name} -m bench.preprocess " + " ".join(sys.argv[1:] if argv is None else argv)
    if os.nice(0) != 0:
        command = f"nice -n {os.nice(0)} {command}"
    if _autogroup_nice() != 0:  # how it was started: its own session, that session's priority
        command = f"setsid sh -c 'echo {_autogroup_nice()} > /proc/self/autogroup && exec {command}'"
    with tempfile.TemporaryDirectory(dir=args.work_dir) as work:
        res = measure(args.rows, args.shards, args.repeat, Path(work))
    text = render(res, command.strip())
    print(text)
    print(json.dumps({k: v for k, v in res.items()}, indent=1))
    if args.benchmarks and not args.no_write:
        write_section(args.benchmarks, SECTION, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
