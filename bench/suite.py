"""``hvctr bench``: every benchmark, a BENCHMARKS.md and its plots, from scratch.

    hvctr bench                # the whole suite: about 25 minutes on this machine (2 cores)
    hvctr bench --quick        # smaller data, fewer repeats: under 5 minutes
    hvctr bench --calibrate    # only this machine's rates for hvctr plan (into the work directory)
    hvctr bench --write-benchmarks   # refresh the checkout's BENCHMARKS.md, bench/*.png, rates

Results go to the work directory (``--work-dir``, default a fresh temporary one): its
BENCHMARKS.md, plots/ and rates.toml. Only ``--write-benchmarks``, used when the project
refreshes its reference figures, writes the checkout's BENCHMARKS.md, bench/*.png and the
planner's default rates (hvctr/plan/rates.toml); a user's run never replaces them.
    hvctr bench --only training,planner --dry-run
    hvctr bench --plots-only --work-dir DIR   # the plots again, from an earlier run's results

Each part is one benchmark module run as its own process (its threads, its MPI jobs), in
this order; each replaces its own "## " section of BENCHMARKS.md:

    preprocessing  bench.preprocess         TSV -> shards, 1 vs 2 processes
    store          bench.storage     shard reads, cache lookups, policies, 2-rank pull + push
    sparse         bench.sparse       the sparse path of a step against the MLP step
    placement      bench.topo        pinned vs unpinned vs packed ranks
    training       bench.train       hvctr vs plain PyTorch vs the MLP ceiling, k sweep, fp16, out of core
    planner        bench.plan_check        hvctr plan's predictions against runs (writes the rates)

A module that prints its figures instead of writing a section gets one written here: its
command, the machine, and what it printed. Then the plots (bench.plots) and a "## Plots"
section with the wall time of every part. A part that fails is reported and the rest run;
the exit code is then 1.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench.report import machine_line, write_section

REPO = Path(__file__).resolve().parents[1]
VM_MAP = "slurm/hwmaps/vm-2cpu.toml"


@dataclass(frozen=True)
class Part:
    module: str
    heading: str
    full: tuple[str, ...]  # arguments of the whole suite; {md}, {work}, {rates} are filled in
    quick: tuple[str, ...]
    writes_section: bool  # the module writes its own section of {md}
    timeout_s: int


PARTS: dict[str, Part] = {
    "preprocessing": Part("bench.preprocess", "## Preprocessing",
                          ("--rows", "2000000", "--repeat", "2", "--benchmarks", "{md}"),
                          ("--rows", "200000", "--repeat", "1", "--benchmarks", "{md}"), True, 900),
    "store": Part("bench.storage", "## Embedding store", ("--write", "{md}"),
                  ("--repeats", "3", "--shard-rows", "200000", "--policy-keys", "50000", "--windows", "4",
                   "--write", "{md}"), True, 900),
    "sparse": Part("bench.sparse", "## Sparse path", ("--repeats", "15", "--write", "{md}"),
                   ("--repeats", "3", "--write", "{md}"), True, 600),
    "placement": Part("bench.topo", "## Placement", ("--map", VM_MAP, "--rounds", "5", "--write", "{md}"),
                      ("--map", VM_MAP, "--rounds", "1", "--mib", "64", "--iters", "3", "--write", "{md}"), True, 900),
    "training": Part("bench.train", "## Training", ("--work-dir", "{work}/training", "--benchmarks", "{md}"),
                     ("--quick", "--work-dir", "{work}/training", "--benchmarks", "{md}"), True, 2400),
    "planner": Part("bench.plan_check", "## Planner: predicted vs measured",
                    ("--work-dir", "{work}/planner", "--write", "{md}", "--rates-out", "{rates}"),
                    ("--rows", "100000", "--ranks", "1,2", "--modes", "sync,8", "--work-dir", "{work}/planner",
                     "--write", "{md}", "--rates-out", "{rates}"), True, 1800),
}
PLOTS_SECTION = "## Plots"
# Where --write-benchmarks puts the results (relative to the checkout): the project's reference.
CHECKOUT = {"benchmarks": "BENCHMARKS.md", "plots_dir": "bench", "rates": "hvctr/plan/rates.toml"}


def outputs(args: argparse.Namespace, work: Path) -> dict[str, Path]:
    """The files this run writes: the flags given, else the checkout's (--write-benchmarks),
    else the work directory's. Nothing in the checkout is written unless asked for."""
    here = {"benchmarks": work / "BENCHMARKS.md", "plots_dir": work / "plots", "rates": work / "rates.toml"}
    out = {}
    for key, default in here.items():
        given = getattr(args, key)
        out[key] = Path(given).resolve() if given else (REPO / CHECKOUT[key] if args.write_benchmarks else default)
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="smaller data and fewer repeats: under 5 minutes")
    p.add_argument("--calibrate", action="store_true",
                   help="only measure this machine's rates for hvctr plan, into --rates")
    p.add_argument("--only", default="", help=f"comma-separated parts to run (of {', '.join(PARTS)})")
    p.add_argument("--skip", default="", help="comma-separated parts not to run")
    p.add_argument("--work-dir", help="scratch and results directory (default: a fresh temporary one, kept)")
    p.add_argument("--write-benchmarks", action="store_true",
                   help=f"write the checkout's reference figures: {CHECKOUT['benchmarks']}, plots in "
                        f"{CHECKOUT['plots_dir']}/, the planner's default rates {CHECKOUT['rates']}")
    p.add_argument("--benchmarks", help="the markdown file to write (default: <work-dir>/BENCHMARKS.md)")
    p.add_argument("--plots-dir", help="where the PNG plots go (default: <work-dir>/plots)")
    p.add_argument("--rates", help="the rates file calibration writes (default: <work-dir>/rates.toml)")
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    p.add_argument("--plots-only", action="store_true",
                   help="run no benchmark: draw the plots from the results in --work-dir (training/results.json, "
                        "planner/check.json) and rewrite the Plots section")


def selected(only: str, skip: str) -> list[str]:
    names = [n for n in only.split(",") if n] or list(PARTS)
    dropped = [n for n in skip.split(",") if n]
    unknown = sorted(set(names + dropped) - set(PARTS))
    if unknown:
        raise ValueError(f"unknown benchmark part(s) {unknown}; parts: {', '.join(PARTS)}")
    return [n for n in PARTS if n in names and n not in dropped]


def command(part: Part, quick: bool, md: str, work: str, rates: str) -> list[str]:
    args = [a.format(md=md, work=work, rates=rates) for a in (part.quick if quick else part.full)]
    return [sys.executable, "-m", part.module, *args]


def _fallback_section(part: Part, cmd: list[str], output: str) -> str:
    shown = " ".join(["python", *cmd[1:]]).replace(str(REPO) + "/", "")
    body = "\n".join(line for line in output.splitlines() if line.strip())
    return (f"{part.heading}\n\nCommand: `{shown}`  \nMachine: {machine_line()}\n\n"
            f"What it printed (one JSON line per measurement, medians over interleaved rounds):\n\n"
            f"```\n{body}\n```\n")


def run_part(name: str, cmd: list[str], md: Path, log: Path) -> tuple[bool, float]:
    part = PARTS[name]
    before = md.read_text() if md.exists() else ""
    t0 = time.time()
    print(f"[bench] {name}: {' '.join(cmd)}", flush=True)
    try:
        with open(log, "w") as f:
            r = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=REPO, timeout=part.timeout_s)
        ok = r.returncode == 0
    except subprocess.TimeoutExpired:
        ok = False
    seconds = time.time() - t0
    if not ok:
        print(f"[bench] {name} FAILED after {seconds:.0f} s; see {log}", flush=True)
        return False, seconds
    after = md.read_text() if md.exists() else ""
    if not part.writes_section and after == before:  # the module printed its figures: keep them
        write_section(md, part.heading, _fallback_section(part, cmd, log.read_text()))
    _drop_run_dirs(log.parent / name)
    print(f"[bench] {name} done in {seconds:.0f} s", flush=True)
    return True, seconds


def _drop_run_dirs(work: Path) -> None:
    """Training runs leave shard and checkpoint files of hundreds of MB per rank; only their
    summaries and metrics are read after the part, and the disk is shared."""
    for run in work.glob("runs/*"):
        for big in ("shards", "checkpoints"):
            shutil.rmtree(run / big, ignore_errors=True)


def _cache_sweep(quick: bool) -> tuple[list[dict], list[tuple[float, float]], int]:
    """Hit rates of LRU and LFU on Zipf(1.1) keys over cache sizes, and the planner's model."""
    from hvctr.plan.keyfreq import zipf_curve
    from bench.storage import bench_policy

    n_keys, batch = (50_000, 2048) if quick else (200_000, 2048)
    fracs = [0.01, 0.05, 0.2] if quick else [0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5]
    policy = bench_policy(n_keys, 300 if quick else 1000, batch, fracs)
    curve = zipf_curve(n_keys, 1.1, fields=1)
    grid = [0.002 * 1.25 ** i for i in range(32) if 0.002 * 1.25 ** i < 0.9]
    return policy, [(f, curve.hit_rate(batch, f * n_keys)) for f in grid], n_keys


def make_plots(work: Path, plots: Path, quick: bool) -> list[str]:
    from bench import plots as bench_plots

    plots.mkdir(parents=True, exist_ok=True)
    made = []
    train_json, check_json = work / "training" / "results.json", work / "planner" / "check.json"
    train = json.loads(train_json.read_text()) if train_json.exists() else None
    check = json.loads(check_json.read_text()) if check_json.exists() else None
    if train:
        bench_plots.plot_k_sweep(train, plots / "k_sweep.png")
        made.append("k_sweep.png")
    policy, model, n_keys = _cache_sweep(quick)
    bench_plots.plot_cache_hits(policy, model, n_keys, plots / "cache_hit.png")
    made.append("cache_hit.png")
    if train or check:
        bench_plots.plot_time_split(train, check, plots / "time_split.png")
        made.append("time_split.png")
    return made


def plots_section(made: list[str], plots: Path, md: Path, times: dict[str, tuple[bool, float]], argv: list[str],
                  source: str = "") -> str:
    rel = os.path.relpath(plots, md.parent)
    what = {"k_sweep.png": "samples/s and AUC against k (training)",
            "cache_hit.png": "CPU cache hit rate against cache size: LRU, LFU with aging, the planner's ideal cache",
            "time_split.png": "where a step's time goes: the training runs, and the planner against its check runs"}
    cmd = f"hvctr bench {' '.join(argv)}".rstrip()
    lines = [PLOTS_SECTION, "", f"Command: `{cmd}`  ", f"Machine: {machine_line()}", ""]
    lines += [source, ""] if source else []
    lines += [f"- {what[m]}: ![{m}]({rel}/{m})" for m in made]
    lines += ["", "Wall time of each part: " + ", ".join(
        f"{n} {s / 60:.1f} min" + ("" if ok else " (FAILED)") for n, (ok, s) in times.items())
        + f"; in all {sum(s for _, s in times.values()) / 60:.1f} min."]
    return "\n".join(lines) + "\n"


def order_sections(md: Path) -> None:
    """Puts the suite's sections in its order (others after them, as they were)."""
    text = md.read_text()
    head, *chunks = text.split("\n## ")
    sections = {"## " + c.split("\n", 1)[0]: "## " + c.rstrip("\n") for c in chunks}
    order = [p.heading for p in PARTS.values()] + [PLOTS_SECTION]
    ordered = [sections.pop(h) for h in order if h in sections] + list(sections.values())
    tmp = md.with_name(md.name + ".tmp")
    tmp.write_text(head.rstrip("\n") + "\n\n" + "\n\n".join(ordered) + "\n")
    os.replace(tmp, md)


def run(args: argparse.Namespace, overrides: list[str]) -> int:
    if overrides:
        raise ValueError(f"hvctr bench takes no config overrides, got {overrides}")
    names = [] if args.plots_only else selected(args.only, args.skip)
    if args.plots_only and not args.work_dir:
        raise ValueError("--plots-only needs --work-dir: the directory of an earlier run's results")
    work = Path(args.work_dir or ("WORK_DIR" if args.dry_run else tempfile.mkdtemp(prefix="hvctr-bench-"))).resolve()
    out = outputs(args, work)
    md, plots_dir, rates = out["benchmarks"], out["plots_dir"], out["rates"]
    if args.calibrate:
        from bench.calibrate import calibrate, default_ranks

        if args.dry_run:
            print(f"calibrate {default_ranks()} ranks -> {rates}")
            return 0
        work.mkdir(parents=True, exist_ok=True)
        rf = calibrate(str(rates), default_ranks(), args.quick)
        print(f"wrote {rates}: {rf.source}; use it with hvctr plan --rates {rates}")
        return 0
    cmds = {n: command(PARTS[n], args.quick, str(md), str(work), str(rates)) for n in names}
    if args.dry_run:
        for n, c in cmds.items():
            print(f"{n}: {' '.join(c)}")
        return 0
    work.mkdir(parents=True, exist_ok=True)
    if not md.exists():
        md.write_text("# Benchmarks\n")
    times = {n: run_part(n, c, md, work / f"{n}.log") for n, c in cmds.items()}
    t0 = time.time()
    made = make_plots(work, plots_dir, args.quick)
    times["plots"] = (True, time.time() - t0)
    argv = (["--quick"] if args.quick else []) + (["--write-benchmarks"] if args.write_benchmarks else []) + ([f"--only {args.only}"] if args.only else []) + (
        [f"--skip {args.skip}"] if args.skip else []) + ([f"--plots-only --work-dir {work}"] if args.plots_only else [])
    source = ("Drawn from the results of earlier runs (the Training and Planner sections' runs); the cache "
              "hit rates are measured here." if args.plots_only else "")
    write_section(md, PLOTS_SECTION, plots_section(made, plots_dir, md, times, argv, source))
    order_sections(md)
    print(f"[bench] {md} and {len(made)} plots in {plots_dir} written; work directory {work}")
    return 0 if all(ok for ok, _ in times.values()) else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.suite", description=__doc__.splitlines()[0])
    add_arguments(p)
    return run(p.parse_args(argv), [])


if __name__ == "__main__":
    raise SystemExit(main())
