"""The planner against real runs on this machine: predicted vs measured bytes and step time.

    python -m bench.plan_check [--rows 300000] [--ranks 1,2,3] [--modes sync,1,4,8] [--write BENCHMARKS.md]

1. Synthetic data (data_prep synth + criteo, 8 shards), as the training benchmark makes it.
2. This machine's rates, measured right before and right after each run with its number of
   ranks (other jobs on a shared machine come and go; each per-item time is the mean of the
   two calibrations); ``--rates`` to use a file instead.
3. One ``hvctr train`` per (ranks, mode): the DNN of the defaults, batch 4096 per rank.
4. For each run, the plan of the same job (``--data``: the unique-key curve of this data;
   the vm-2cpu map; one torch thread per rank, as an unbound rank runs), and:
   - sparse bytes per step: rank 0's ``sparse_exchange_bytes`` (pull, warm, push) over its
     steps, against the plan's per-window bytes summed over the run's windows;
   - dense bytes per step: ``dense_merge_bytes`` (the merge's payload) likewise;
   - step time: the fastest window's time per step among the windows after the first (the
     first pulls only new rows and nothing is prefetched for it), from the progress records
     of metrics.jsonl, without the last window unless it is the only one (it may be short,
     and the end of the pass, which writes the cache's dirty rows back, comes before its
     record). The fastest, as the rates are the fastest of their repeats: on a machine that
     other jobs share, the least disturbed figures are those of an exclusive node; the
     median window is reported beside it.
Bounds: bytes within 10%, step time within 30% where ranks do not outnumber cores; with
more ranks than cores the figures are reported, not bounded.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench.report import machine_line, write_section
from hvctr.config import MergeMode
from hvctr.plan.keyfreq import KeyCurve, data_curve
from hvctr.plan.model import Job, dense_payload_bytes, dense_params, plan, sparse_bytes_per_window
from hvctr.plan.rates import Rates, RatesFile, load_rates, write_rates

REPO = Path(__file__).resolve().parents[1]
SECTION = "## Planner: predicted vs measured"
MAP = REPO / "slurm" / "hwmaps" / "vm-2cpu.toml"
BYTES_BOUND, TIME_BOUND = 0.10, 0.30


def windows_of(steps: int, k: int) -> list[int]:
    """Batches per window of a run of ``steps`` steps in windows of k (the last may be short)."""
    return [k] * (steps // k) + ([steps % k] if steps % k else [])


def predict(job: Job, node, rates: RatesFile, curve: KeyCurve, steps: int, last_only: bool,
            last_steps: int) -> dict[str, Any]:
    """The plan of a run of ``steps`` steps of ``job``: the bytes of all its windows, and the
    time per step of a full window (or, when only the last window is timed, of that window
    and the end of the pass after it)."""
    wins = windows_of(steps, job.k)
    B, W = job.batch_size_per_rank, job.world_size
    sparse = sum(sum(sparse_bytes_per_window(curve(n * B), W, job.dim, job.mode, job.prefetch).values())
                 for n in wins)
    payload = dense_payload_bytes(dense_params(job.model, job.dim), job.mode, job.states, job.compression)
    dense = payload * (steps if job.mode is MergeMode.SYNC else sum(job.dense_merges(n) for n in wins))
    entry = rates.for_ranks(job.ranks_per_node)
    f = plan(job, node, entry, curve).figures
    step_s = f["step_s"]
    if last_only:
        last = plan(replace(job, every_k_steps=last_steps), node, entry, curve).figures
        step_s = last["step_s"] + f["end_of_pass_s"] / last_steps
    split = {k: f[f"{k}_s_per_step"] for k in ("compute", "pull", "merge")}
    split["prep"] = max(f["step_s"] - sum(split.values()), 0.0)  # the prefetch time not hidden
    return {"sparse_bytes": sparse, "dense_bytes": dense, "step_s": step_s, "split_s": split}


def measured(run_dir: Path) -> dict[str, Any]:
    """Counters of the run's summary, and the time per step of each window after the first,
    from the progress records (one after every window). The last window is left out when
    there are others: it may be short, and its record comes after the end of the pass."""
    s = json.loads((run_dir / "summary.json").read_text())
    events = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    prog = [e for e in events if e.get("event") == "progress"]
    if len(prog) < 2:
        raise RuntimeError(f"{run_dir}: fewer than two progress records; use more rows")
    spans = [(b["step"] - a["step"], b["time"] - a["time"]) for a, b in zip(prog, prog[1:])]
    timed = [dt / n for n, dt in (spans[:-1] or spans)]
    return {"steps": s["steps"], "sparse_bytes": s["sparse_exchange_bytes"], "dense_bytes": s["dense_merge_bytes"],
            "window_step_s": timed, "step_s": min(timed), "median_step_s": statistics.median(timed),
            "last_only": len(spans) == 1, "last_steps": spans[-1][0],
            "samples_per_s": s["samples_per_s"], "time_split_s": s["time_split_s"]}


def _train(work: Path, data: Path, ranks: int, mode: str) -> Path:
    from bench.train import PY, _run

    run_dir = work / "runs" / f"w{ranks}-{mode}"
    if run_dir.exists():
        shutil.rmtree(run_dir)
    merge = ["--merge.mode=sync"] if mode == "sync" else [f"--merge.every_k_steps={mode}"]
    cmd = ["mpirun", "-np", str(ranks), "--bind-to", "none", PY, "-m", "mpi4py", "-m", "hvctr", "train",
           f"--data.train_dir={data}", f"--train.run_dir={run_dir}", "--metrics.log_every_steps=1",
           "--train.threads=1", *merge]  # one torch thread a rank, as the plan (node_info(threads=1)) has it
    _run(cmd, work / f"w{ranks}-{mode}.log")
    return run_dir


def _measure_rates(work: Path, ranks: int, quick: bool) -> Rates:
    """One entry measured now with min(ranks, cpus) ranks side by side."""
    from bench.calibrate import run_ranks

    r = min(ranks, os.cpu_count() or 1)
    return Rates(ranks_per_node=r, **run_ranks(r, work, quick)["rates"])


def bracket(before: Rates, after: Rates) -> Rates:
    """Rates of a run measured between two calibrations: each per-item time is the mean of
    the two (so each rate is their harmonic mean); a run is as likely to meet either load."""
    def mean(name: str) -> float:
        a, b = getattr(before, name), getattr(after, name)
        if name.endswith("_s"):
            return (a + b) / 2
        return 2 / (1 / a + 1 / b) if a > 0 and b > 0 else max(a, b)

    names = [f.name for f in dataclasses.fields(Rates) if f.name != "ranks_per_node"]
    return Rates(ranks_per_node=before.ranks_per_node, **{n: mean(n) for n in names})


def check(work: Path, rows: int, ranks: list[int], modes: list[str], rates_path: str | None,
          quick_calibration: bool = True) -> dict[str, Any]:
    from hvctr.config import load_config
    from hvctr.plan.cmd import job_from, node_info
    from hvctr.topo.hwmap import load_map
    from bench.train import make_data

    data, _ = make_data(work, rows)
    curve = data_curve(str(data))
    hwmap = load_map(MAP)
    given = load_rates(rates_path) if rates_path else None
    out, last = [], {}
    for w in ranks:
        node = node_info(hwmap, w, threads=1)
        # Other jobs on a shared machine come and go: each run's rates are measured right
        # before and right after it, with the run's number of ranks (at most the cpus).
        before = None if given else _measure_rates(work, w, quick_calibration)
        for mode in modes:
            load = os.getloadavg()[0]
            run_dir = _train(work, data, w, mode)
            m = measured(run_dir)
            for big in ("shards", "checkpoints"):  # hundreds of MB per rank: the disk is shared
                shutil.rmtree(run_dir / big, ignore_errors=True)
            after = None if given else _measure_rates(work, w, quick_calibration)
            rates = given or RatesFile(name="this machine", source="bracketing calibrations",
                                       entries=(bracket(before, after),))
            before = after
            flags = ["--merge.mode=sync"] if mode == "sync" else [f"--merge.every_k_steps={mode}"]
            job = job_from(load_config(None, flags), 1, w, int(curve.keys), int(curve.rows[-1]))
            p = predict(job, node, rates, curve, m["steps"], m["last_only"], m["last_steps"])
            out.append({"ranks": w, "mode": mode, "oversubscribed": w > (os.cpu_count() or 1),
                        "measured": m, "predicted": p, "load": [load, os.getloadavg()[0]]})
            last[rates.entries[0].ranks_per_node] = rates.entries[0]
            print(json.dumps(out[-1]), flush=True)
    every = RatesFile(name=os.uname().nodename, source=f"measured by python -m bench.plan_check around its runs, "
                                                       f"{time.strftime('%Y-%m-%d %H:%M')}",
                      entries=tuple(last[r] for r in sorted(last)))
    write_rates(every, work / "rates.toml")
    source = given.source if given else ("measured with the run's number of ranks (at most the cpus) right before "
                                         "and right after each run; each per-item time is the mean of the two")
    states = load_config(None, []).merge.states.value
    return {"rows": rows, "rates": rates_path or str(work / "rates.toml"), "results": out, "curve": curve.source,
            "states": states,
            "rates_source": source}


def _err(pred: float, meas: float) -> float:
    return 0.0 if pred == meas else (pred - meas) / meas if meas else float("inf")


def render(res: dict[str, Any], command: str, machine: str) -> str:
    lines = [SECTION, "", f"Command: `{command}`  ", f"Machine: {machine}  ",
             f"Data: {res['rows']:,} synthetic rows (data_prep synth, 8 shards, 9.09% held out); keys: {res['curve']}. "
             "Model: DNN 26 x 16 dims, MLP 512-256-1, batch 4096 per rank, one epoch, one torch thread per rank, "
             f"cache holding the whole table, merge.states = {res.get('states', 'the default')}. Rates: "
             + res["rates_source"] + ".",
             "", "Bytes are per step, rank 0's counters (sparse: pull + warm + push; dense: the merge's payload) "
             "against the plan summed over the run's windows. Step time: the fastest of the run's windows after "
             "the first (each window's time per step, from the progress record written after it; the median "
             "window in brackets), leaving out the last, which may be short and is followed by the end of the pass, "
             "unless it is the only one (the plan then adds the end of the pass). The rates are likewise the fastest "
             "of their repeats: on a machine other jobs share, the least disturbed figures stand for an exclusive "
             "node. Load avg: the machine's 1-minute load average before and after the run (2 cpus: "
             f"above 2, other jobs shared them). Bounds: bytes within {BYTES_BOUND:.0%}, step time within "
             f"{TIME_BOUND:.0%}; 3 ranks on 2 cores are oversubscribed: reported, not bounded.", "",
             "| ranks | merge | steps | sparse B/step measured | predicted | error | dense B/step measured | predicted "
             "| error | step ms measured (median) | predicted | error | load avg | within bounds |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["results"]:
        m, p = r["measured"], r["predicted"]
        steps = m["steps"]
        es, ed = _err(p["sparse_bytes"], m["sparse_bytes"]), _err(p["dense_bytes"], m["dense_bytes"])
        tm, tp = 1e3 * m["step_s"], 1e3 * p["step_s"]
        et = _err(tp, tm)
        ok_bytes = abs(es) <= BYTES_BOUND and abs(ed) <= BYTES_BOUND
        verdict = ("bytes yes, time reported (oversubscribed)" if r["oversubscribed"] and ok_bytes else
                   "yes" if ok_bytes and abs(et) <= TIME_BOUND else "NO")
        mode = "sync" if r["mode"] == "sync" else f"k = {r['mode']}"
        lines.append(f"| {r['ranks']} | {mode} | {steps} | {m['sparse_bytes'] / steps:,.0f} "
                     f"| {p['sparse_bytes'] / steps:,.0f} "
                     f"| {es:+.1%} | {m['dense_bytes'] / steps:,.0f} | {p['dense_bytes'] / steps:,.0f} | {ed:+.1%} "
                     f"| {tm:,.0f} ({1e3 * m.get('median_step_s', m['step_s']):,.0f}) | {tp:,.0f} | {et:+.1%} | {r['load'][0]:.1f}-{r['load'][1]:.1f} | {verdict} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.plan_check", description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=300_000)
    p.add_argument("--ranks", default="1,2,3")
    p.add_argument("--modes", default="sync,1,4,8", help="sync and values of k")
    p.add_argument("--rates", default=None, help="a rates file to use instead of measuring around each run")
    p.add_argument("--rates-out", default="", help="also copy the rates measured here to this file")
    p.add_argument("--full-calibration", action="store_true", help="more repeats in each calibration")
    p.add_argument("--work-dir", help="scratch directory (kept; data is reused when present)")
    p.add_argument("--write", default="", help="markdown file to update (default: none)")
    args = p.parse_args(argv)
    command = "python -m bench.plan_check " + " ".join(sys.argv[1:] if argv is None else argv)
    machine = machine_line()
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="hvctr-plan-check-"))
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    res = check(work, args.rows, [int(x) for x in args.ranks.split(",")], args.modes.split(","), args.rates,
                quick_calibration=not args.full_calibration)
    if args.rates_out and not args.rates:
        Path(args.rates_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.rates_out).write_text((work / "rates.toml").read_text())
    (work / "check.json").write_text(json.dumps(res, indent=1))
    text = render(res, command.strip(), machine) + f"\nWall time: {(time.time() - t0) / 60:.1f} min, load average " \
                                                   f"{os.getloadavg()[0]:.1f} at the end.\n"
    print(text)
    if args.write:
        write_section(args.write, SECTION, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
