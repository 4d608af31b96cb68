"""Accuracy against ranks: test AUC and logloss of the same data trained by W ranks, for each
merge rule, from `hvctr simulate` (the real runtime, W ranks in one process, in turn) and,
where the machine allows, real `mpirun -np W` jobs beside them.

    python -m bench.accuracy --data /tmp/acc/d2m --ranks 1,2,4,8,16,32,64 --modes sync,8,32 \
        --rules "plain=;sqrt=--merge.lr_scaling=sqrt" --work-dir /tmp/acc/work [--real 2,4,8] \
        [--write BENCHMARKS.md] [--plot docs/accuracy_ranks.png]

A mode is `sync` or a number k (k-step merging every k steps). A rule is `name=flags`, the
flags any `--section.key=value` overrides, separated by spaces. Each run is one epoch over the
training split; storage.rows_per_rank is sized from the data's distinct-key estimate for W.
Results go to <work-dir>/accuracy.json as they come (a rerun skips the runs already there),
then a table per data set: AUC and logloss at each W, and the gap to W = 1 of the same mode.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from bench.report import machine_line, write_section

REPO = Path(__file__).resolve().parents[1]
SECTION = "## Accuracy against ranks"
MPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
           "OMPI_MCA_rmaps_base_oversubscribe": "1", "OMPI_MCA_mpi_yield_when_idle": "1",
           "OMPI_MCA_btl_vader_single_copy_mechanism": "none",
           # the ring allreduce, whose summation order hvctr simulate reproduces: real and simulated runs
           # are then bit-equal (tests/e2e/test_simulate.py), not merely close
           "OMPI_MCA_coll_tuned_use_dynamic_rules": "1", "OMPI_MCA_coll_tuned_allreduce_algorithm": "4"}


def parse_rules(text: str) -> dict[str, list[str]]:
    rules = {}
    for item in filter(None, (s.strip() for s in text.split(";"))):
        name, _, flags = item.partition("=")
        rules[name.strip()] = flags.split()
    return rules


def with_seeds(rules: dict[str, list[str]], seeds: list[int]) -> dict[str, list[str]]:
    """Each rule once per seed: the first seed keeps the rule's name, the others are name+seedS."""
    if not seeds:
        return rules
    out = {}
    for name, flags in rules.items():
        for i, seed in enumerate(seeds):
            out[name if i == 0 else f"{name}+seed{seed}"] = [*flags, f"--train.seed={seed}"]
    return out


def mode_flags(mode: str) -> list[str]:
    return ["--merge.mode=sync"] if mode == "sync" else ["--merge.mode=kstep", f"--merge.every_k_steps={int(mode)}"]


def rows_per_rank(data: str, world: int) -> int:
    """Shard capacity for W ranks: 1.6x the data's distinct keys over W (load factor 0.8, skew)."""
    manifest = json.loads((Path(data) / "manifest.json").read_text())
    distinct = manifest["totals"]["distinct_keys_estimate_total"]
    return max(1 << 15, int(math.ceil(distinct * 1.6 / world)))


def run_one(how: str, data: str, world: int, mode: str, flags: list[str], work: Path, threads: int,
            batch: int, global_batch: int = 0) -> dict:
    """One epoch of one configuration; the simulation's JSON summary or the real run's eval.
    ``global_batch`` > 0 fixes the global batch (data.global_batch_size: each rank takes it / W)."""
    run_dir = work / "runs" / f"{how}-{Path(data).name}-g{global_batch}-w{world}-{mode}-{abs(hash(tuple(flags))) % 10**8}"
    shutil.rmtree(run_dir, ignore_errors=True)
    batch_flag = f"--data.global_batch_size={global_batch}" if global_batch else f"--data.batch_size_per_rank={batch}"
    common = [f"--data.train_dir={data}", f"--train.run_dir={run_dir}", batch_flag,
              f"--storage.rows_per_rank={rows_per_rank(data, world)}", "--checkpoint.every_windows=0",
              *mode_flags(mode), *flags]
    env = dict(os.environ, **MPI_ENV)
    t0 = time.time()
    if how == "sim":
        cmd = [sys.executable, "-m", "hvctr", "simulate", "--ranks", str(world), "--threads", str(threads), *common]
        r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stderr[-3000:]}")
        out = json.loads(r.stdout.strip().splitlines()[-1])
    else:
        mpi = ["mpirun", "-np", str(world), "--bind-to", "none", sys.executable, "-m", "mpi4py", "-m", "hvctr"]
        cmd = [*mpi, "train", "--train.threads=1", *common]
        r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stderr[-3000:]}")
        summary = json.loads((run_dir / "summary.json").read_text())  # hvctr train's: the eval under "eval"
        out = {"auc": summary["eval"]["auc"], "logloss": summary["eval"]["logloss"], "steps": summary["steps"]}
    shutil.rmtree(run_dir / "shards", ignore_errors=True)
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
    label = Path(data).name + (f"-G{global_batch}" if global_batch else "")
    return {"how": how, "data": label, "batch": global_batch // world if global_batch else batch,
            "global_batch": global_batch, "ranks": world, "mode": mode, "flags": flags,
            "auc": out["auc"], "logloss": out["logloss"], "steps": out.get("steps"), "wall_s": round(time.time() - t0, 1)}


def key_of(r: dict, rule: str) -> str:
    return f"{r['how']}|{r['data']}|{rule}|{r['mode']}|{r['ranks']}"


# Rule names used in BENCHMARKS.md and what they set (besides the mode); "defaults" is the config's.
LEGEND = {
    "defaults": "the defaults: merge.lr_scaling = sqrt, merge.adam_scaling = sqrt (both the identity at a fixed "
                "global batch, G=...: the global batch does not grow); merge.dense_gradients = auto (since "
                "2026-12-05: from 8 ranks on the dense gradients averaged every step as rank-16 factors, "
                "PowerSGD; before it, and below 8 ranks, local dense steps, with merge.dense_every_steps = -1: "
                "from 32 ranks on merged every 4 steps, its moves in fp16). Tables measured before a default say so",
    "powersgd16": "--merge.dense_gradients=powersgd --merge.powersgd_rank=16: what the defaults resolve to from 8 "
                  "ranks on since 2026-12-05",
    "powersgd": "--merge.dense_gradients=powersgd --merge.powersgd_rank=4 (the rank's default before 16 was chosen)",
    "outer-mom0.5": "the defaults with merge.outer_momentum = 0.5 (SlowMo's outer momentum on the averaged dense move)",
    "rates-x-sqrt(W)": "at a fixed global batch, both rates x sqrt(W) (Adam as configured; --data.batch_size_per_rank=G/W)",
    "scaled-by-W": "at a fixed global batch, the rates x sqrt(W) and Adam's memory / sqrt(W) all the same (what "
                   "the defaults did before they followed the global batch; --data.batch_size_per_rank=G/W)",
    "none": "--merge.lr_scaling=none --merge.adam_scaling=none (the rates and Adam as configured)",
    "lr-sqrt": "lr_scaling = sqrt, adam_scaling = none", "lr-linear": "lr_scaling = linear, adam_scaling = none",
    "lr-linear+wu16": "lr-linear with lr_warmup_steps = 16", "lr-sqrt+wu16": "lr-sqrt with lr_warmup_steps = 16",
    "lr-w^0.75": "both rates x W^0.75 (an experiment, not a config value)",
    "lr-w^0.75+adam": "both rates x W^0.75 and adam_scaling = sqrt (experiment)",
    "lr-w^0.75+wu16": "both rates x W^0.75, warmup 16 steps (experiment)",
    "lr-sqrt+outer-mom0.5": "lr-sqrt with outer_momentum = 0.5 (SlowMo)",
    "lr-sqrt+states-pmv": "lr-sqrt with states = params+m+v (the seed paper's k-step Adam)",
    "lr-sqrt+sparse-sum": "lr-sqrt with sparse_rule = sum", "lr-sqrt+sparse-sqrt": "lr-sqrt with sparse_rule = sqrt",
    "none+sparse-sqrt": "none with sparse_rule = sqrt",
    "lr-sqrt-dense-only": "dense rate x sqrt(W), sparse rate as configured (experiment)",
    "lr-sqrt-dense-only+sparse-sqrt": "lr-sqrt-dense-only with sparse_rule = sqrt (experiment)",
    "lr-sqrt+adam-kappa-W": "lr-sqrt with Adam's 1 - beta x W, eps / sqrt(W) (Malladi et al.'s own kappa; experiment)",
    "defaults+sparse-sqrt": "the defaults with sparse_rule = sqrt",
    "defaults+states-pmv": "the defaults with states = params+m+v (Adam's moments merged too)",
    "states-pmv": "the defaults with merge.states = params+m+v (the seed paper's k-step Adam: Adam's moments "
                  "merged with the parameters, 3x the dense bytes)",
    "kwarm64": "the defaults with merge.k_warmup_steps = 64 (windows grow from 1 step to k over the first 64 steps)",
    "kwarm122": "the defaults with merge.k_warmup_steps = 122 (over the first half of the epoch)",
    "sparse-sqrt": "the defaults with merge.sparse_rule = sqrt",
    "outer-lr2": "the defaults with merge.outer_lr = 2 (the averaged dense move doubled)",
    "mom0.5+kwarm122": "outer_momentum = 0.5 and k_warmup_steps = 122 together",
    "seed2": "the defaults with train.seed = 2 (another dense initialisation: a second sample of each gap)",
    "window-end": "--merge.dense_every_steps=0: the dense model merges at the window's end only (the defaults "
                  "below 32 ranks; at 32 and 64 what the defaults were before merge.dense_every_steps)",
    "dense4-fp16": "--merge.dense_every_steps=4 --merge.compression=fp16: what the defaults resolved to from 32 "
                   "ranks on before merge.dense_gradients (the dense model merged every 4 steps, its moves in fp16)",
    "dense2-fp16": "--merge.dense_every_steps=2 --merge.compression=fp16: the dense model merged every 2 steps "
                   "(a quarter of sync's dense bytes, over the issue's 1/6)",
    "diag-dense-sync": "a diagnostic patch, not a config value: the dense gradients averaged every step (as sync), "
                       "the rows merged every k steps (which part of the model the gap comes from)",
    "vnoise": "an experimental patch, not kept: dense Adam's v during local steps minus the rank's gradient noise "
              "x (1 - 1/W), the noise estimated from consecutive gradients",
    "sparse-steps": "an experimental patch, not kept: an owner scales a row's mean move by the distinct steps one "
                    "rank would have taken on it over the contributors' mean",
    "seed3": "the defaults with train.seed = 3",
    "seed2+outer-mom0.5": "seed 2 with merge.outer_momentum = 0.5 (its gap is to the defaults' W = 1, seed 0: "
                          "0.0001 above seed 2's)",
}


def render(results: dict[str, dict], command: str) -> str:
    shown = command if command.startswith("Commands:") else f"Command: `{command}`"
    lines = [SECTION, "", f"{shown}  ", f"Machine: {machine_line()}", "",
             "Test AUC (its gap to W = 1 of the same data and mode), logloss, after one epoch over the same data, "
             "W simulated ranks (`hvctr simulate`: the real runtime, bit-equal to `mpirun -np W` at W = 2, 3) "
             "unless marked real.", ""]
    rows: dict[tuple, dict[int, dict]] = {}
    for k, r in results.items():
        how, data, rule, mode, world = k.split("|")
        rows.setdefault((data, rule, mode, how), {})[int(world)] = r
    worlds = sorted({int(k.split("|")[-1]) for k in results})
    lines.append("| data | rule | mode | how | " + " | ".join(f"W={w}" for w in worlds) + " |")
    lines.append("|---|---|---|---|" + "---|" * len(worlds))
    for (data, rule, mode, how), by_w in sorted(rows.items()):
        # the baseline: W = 1 of this rule (a rule can act at W = 1: an outer step, a seed), in this
        # mode or another (at W = 1 the modes coincide: one rank's Adam, merged with itself), else
        # any rule's W = 1 of the data, this mode first (the rates and Adam's constants of every
        # rule are the configured ones at W = 1)
        ones = [r[1] for (d, ru, m, h), r in sorted(rows.items(), key=lambda kv: (kv[0][1] != rule, kv[0][2] != mode))
                if d == data and h == "sim" and 1 in r]
        base = ones[0] if ones else None
        cells = []
        for w in worlds:
            r = by_w.get(w)
            if not r:
                cells.append("")
                continue
            gap = "" if not base or w == 1 else f" ({r['auc'] - base['auc']:+.4f})"
            cells.append(f"{r['auc']:.4f}{gap}, {r['logloss']:.4f}")
        mode_name = "sync" if mode == "sync" else f"k={mode}"
        first = next(iter(by_w.values()))
        fixed = first.get("global_batch", 0)
        batch = f"G={fixed} (B=G/W)" if fixed else f"B={first.get('batch', 4096)}"
        lines.append(f"| {data}, {batch} | {rule} | {mode_name} | {how} | " + " | ".join(cells) + " |")
    named = sorted({k.split("|")[2] for k in results} & set(LEGEND))
    lines += ["", "Rules:", ""] + [f"- {n}: {LEGEND[n]}" for n in named]
    return "\n".join(lines) + "\n"


def plot(results: dict[str, dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series: dict[tuple, list[tuple[int, float]]] = {}
    for k, r in results.items():
        how, data, rule, mode, world = k.split("|")
        series.setdefault((data, rule, mode, how), []).append((int(world), r["auc"]))
    datas = sorted({s[0] for s in series})
    fig, axes = plt.subplots(1, len(datas), figsize=(6.5 * len(datas), 4.2), squeeze=False)
    for ax, data in zip(axes[0], datas):
        for (d, rule, mode, how), pts in sorted(series.items()):
            if d != data:
                continue
            pts.sort()
            label = f"{rule}, {'sync' if mode == 'sync' else 'k=' + mode}" + (" (real)" if how == "real" else "")
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o" if how == "sim" else "x",
                    ls="-" if how == "sim" else ":", label=label)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("ranks W")
        ax.set_ylabel("test AUC")
        ax.set_title(data)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.accuracy", description=__doc__.splitlines()[0])
    p.add_argument("--data", required=True, help="comma-separated data_prep output directories")
    p.add_argument("--ranks", default="1,2,4,8,16,32,64")
    p.add_argument("--modes", default="sync,8,32")
    p.add_argument("--rules", default="default=", help="name=flags;name=flags ...")
    p.add_argument("--batch", type=int, default=4096, help="data.batch_size_per_rank")
    p.add_argument("--global-batch", type=int, default=0,
                   help="data.global_batch_size: the global batch fixed at every W (each rank G / W rows); "
                        "replaces --batch")
    p.add_argument("--seeds", default="",
                   help="comma-separated train.seed values: every rule runs once per seed (named rule+seedS past the "
                        "first), so that a rule's effect can be told from a seed's; default: the config's seed only")
    p.add_argument("--real", default="", help="rank counts to also run as real mpirun jobs, e.g. 2,4,8")
    p.add_argument("--threads", type=int, default=max(1, len(os.sched_getaffinity(0))))
    p.add_argument("--work-dir", required=True)
    p.add_argument("--write", default="", help="markdown file to write the section into (default: none)")
    p.add_argument("--plot", default="", help="PNG of AUC against W (default: none)")
    args = p.parse_args(argv)
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    store = work / "accuracy.json"
    results: dict[str, dict] = json.loads(store.read_text()) if store.exists() else {}
    rules = with_seeds(parse_rules(args.rules), [int(x) for x in filter(None, args.seeds.split(","))])
    plan = [(how, data, rule, mode, w)
            for data in args.data.split(",") for rule in rules for mode in args.modes.split(",")
            for how, ranks in (("sim", args.ranks), ("real", args.real)) for w in map(int, filter(None, ranks.split(",")))]
    for i, (how, data, rule, mode, w) in enumerate(plan):
        label = Path(data).name + (f"-G{args.global_batch}" if args.global_batch else "")
        k = f"{how}|{label}|{rule}|{mode}|{w}"
        if k in results:
            continue
        r = run_one(how, data, w, mode, rules[rule], work, args.threads, args.batch, args.global_batch)
        # Several drivers may share a work directory: merge into what is there now, then rename.
        results = {**(json.loads(store.read_text()) if store.exists() else {}), **results, k: r}
        tmp = store.with_name(f"{store.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(results, indent=1))
        os.replace(tmp, store)
        print(f"[{i + 1}/{len(plan)}] {k}: AUC {r['auc']:.4f} logloss {r['logloss']:.4f} "
              f"steps/rank {r['steps']} ({r['wall_s']:.0f} s)", flush=True)
    command = "python -m bench.accuracy " + " ".join(a if " " not in a else f'"{a}"' for a in (argv or sys.argv[1:]))
    text = render(results, command)
    print(text)
    if args.write:
        write_section(args.write, SECTION, text)
    if args.plot:
        plot(results, Path(args.plot))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
