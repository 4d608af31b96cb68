"""``hvctr sweep report`` and ``hvctr sweep best``: what a study found, read from its journal.

report: one row per trial (number, state, parameters, last validation AUC and logloss, steps
trained, wall time, the step it was pruned at, the run directory), printed and written to
DIR/report/trials.md and trials.csv; plots as PNG: auc_over_trials.png (each trial's last AUC
by trial number, by state, with the best so far) and auc_vs_params.png (AUC against each
parameter, a log axis for log ranges).

best: the config of the best complete trial for the "fully train" stage: the study's base
config and overrides with the trial's parameters, ``train.max_steps = 0`` (all the data, all
epochs), written as TOML with a header naming the trial.
"""

from __future__ import annotations

import argparse
import csv
import io
import math
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import TrialState

from hvctr.formats import safefile
from hvctr.formats.space import remedy
from hvctr.config import load_config, to_toml
from hvctr.sweep.space import space_from_dict
from hvctr.sweep.study import StudyDir


def _study(path: str) -> tuple[StudyDir, dict[str, Any], optuna.Study]:
    sd = StudyDir(path)
    settings = sd.settings()  # ValueError when DIR holds no study
    if not sd.journal.is_file():
        raise ValueError(f"{sd.path}: {sd.journal.name} is missing: the study has no journal")
    try:
        study = optuna.load_study(study_name="hvctr-sweep", storage=sd.storage())
    except KeyError:
        raise ValueError(f"{sd.journal}: holds no hvctr sweep study") from None
    return sd, settings, study


def trial_rows(study: optuna.Study, keys: list[str]) -> list[dict[str, Any]]:
    rows = []
    for t in study.get_trials(deepcopy=False):
        a = t.user_attrs
        rows.append({"trial": t.number, "state": t.state.name.lower(),
                     **{k: t.params.get(k, "") for k in keys},
                     "auc": a.get("auc", ""), "logloss": a.get("logloss", ""), "steps": a.get("steps", ""),
                     "wall_s": a.get("wall_s", ""), "pruned_at": a.get("pruned_at_step", ""),
                     "note": a.get("failed", f"retry of {a['retry_of']}" if "retry_of" in a else
                                   "the base config" if a.get("baseline") else ""),
                     "run_dir": a.get("run_dir", "")})
    return rows


def _cell(column: str, v: Any) -> str:
    if not isinstance(v, float):
        return str(v)
    if column in ("auc", "logloss"):
        return f"{v:.4f}"
    return f"{v:.0f}" if column == "wall_s" else f"{v:.3g}"


def markdown(rows: list[dict[str, Any]], columns: list[str]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_cell(c, r[c]) for c in columns) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def run_report(args: argparse.Namespace) -> int:
    sd, settings, study = _study(args.study)
    space = space_from_dict(settings["space"])
    keys = [p.key for p in space.params]
    rows = trial_rows(study, keys)
    out = Path(args.out) if args.out else sd.path / "report"
    columns = ["trial", "state", *keys, "auc", "logloss", "steps", "wall_s", "pruned_at", "note"]
    table = markdown(rows, columns)
    csv_text = io.StringIO(newline="")
    w = csv.DictWriter(csv_text, fieldnames=list(rows[0]) if rows else columns)
    w.writeheader()
    w.writerows(rows)
    try:  # each file whole or not at all (a fresh temporary file, then renamed)
        safefile.make_dir(out)
        safefile.write_text(out / "trials.md", table)
        safefile.write_text(out / "trials.csv", csv_text.getvalue())
        plots = _plots(rows, space, out)
    except OSError as e:  # a full or read-only disk: one message naming the file
        raise ValueError(f"cannot write {e.filename or out}: {e.strerror or e} (no file of the report is left "
                         f"half-written): {remedy(e, out)}, or choose another --out") from None
    counts = {s: sum(r["state"] == s for r in rows) for s in ("complete", "pruned", "fail", "running", "waiting")}
    print(table + "\n" + "  ".join(f"{k} {v}" for k, v in counts.items() if v))
    done = [r for r in rows if r["state"] == "complete"]
    if done:
        best = max(done, key=lambda r: r["auc"])
        print(f"best: trial {best['trial']}, AUC {best['auc']:.4f} ({best['run_dir']})")
    print(f"written: {out / 'trials.md'}, {out / 'trials.csv'}" + "".join(f", {p}" for p in plots))
    return 0


def _plots(rows: list[dict[str, Any]], space, out: Path) -> list[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("hvctr sweep report: no plots: matplotlib is not installed (pip install 'hvctr[sweep]')")
        return []
    scored = [r for r in rows if isinstance(r["auc"], float)]
    colors = {"complete": "tab:blue", "pruned": "tab:orange", "fail": "tab:red", "running": "tab:gray"}
    fig, ax = plt.subplots(figsize=(7, 4))
    for state, color in colors.items():
        sel = [r for r in scored if r["state"] == state]
        if sel:
            ax.scatter([r["trial"] for r in sel], [r["auc"] for r in sel], c=color, label=state, s=24)
    best, xs, ys = -math.inf, [], []
    for r in sorted((r for r in scored if r["state"] == "complete"), key=lambda r: r["trial"]):
        best = max(best, r["auc"])
        xs.append(r["trial"])
        ys.append(best)
    if xs:
        ax.step(xs, ys, where="post", c="k", lw=1, label="best complete so far")
    ax.set_xlabel("trial")
    ax.set_ylabel("validation AUC (last evaluation)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths = [out / "auc_over_trials.png"]
    _save(fig, paths[0])
    plt.close(fig)
    n = len(space.params)
    fig, axes = plt.subplots(1, n, figsize=(3.6 * n, 3.4), squeeze=False)
    for ax, p in zip(axes[0], space.params):
        for state, color in colors.items():
            sel = [r for r in scored if r["state"] == state and r[p.key] != ""]
            if sel:
                xv = [r[p.key] for r in sel]
                if p.choices is not None:  # categorical: positions of the choices
                    xv = [list(p.choices).index(v) if v in p.choices else -1 for v in xv]
                ax.scatter(xv, [r["auc"] for r in sel], c=color, s=18, label=state)
        if p.choices is not None:
            ax.set_xticks(range(len(p.choices)), [str(c) for c in p.choices])
        if p.log:
            ax.set_xscale("log")
        ax.set_xlabel(p.key)
    axes[0][0].set_ylabel("validation AUC")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    paths.append(out / "auc_vs_params.png")
    _save(fig, paths[1])
    plt.close(fig)
    return paths


def _save(fig, path: Path) -> None:
    """The figure as a PNG at ``path``, whole or not at all; an OSError names ``path``."""
    data = io.BytesIO()
    fig.savefig(data, format="png", dpi=110)
    safefile.write_bytes(path, data.getvalue())


def run_best(args: argparse.Namespace) -> int:
    sd, settings, study = _study(args.study)
    done = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    if not done:
        raise ValueError(f"{sd.path}: no complete trial yet (hvctr sweep report lists them)")
    best = max(done, key=lambda t: t.value)
    overrides = [*settings["overrides"], *(f"--{k}={v}" for k, v in best.params.items()), "--train.max_steps=0"]
    cfg = load_config(settings["config"] or None, overrides)
    steps = best.user_attrs.get("steps", "?")
    header = (f"# hvctr sweep best: trial {best.number} of {sd.path.resolve()}, validation AUC {best.value:.4f} "
              f"after {steps} steps\n#   ({best.user_attrs.get('run_dir', '')})\n"
              "# parameters: " + ", ".join(f"{k} = {v}" for k, v in best.params.items()) + "\n"
              "# the full training stage: train.max_steps = 0 (all epochs); point data.train_dir at the full data:\n"
              f"#   HVCTR_CONFIG={args.out} HVCTR_DATA=/path/to/full/shards sbatch slurm/train.sbatch\n")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    safefile.write_text(out, header + to_toml(cfg))  # a fresh temporary file: never through a planted link
    print(f"hvctr sweep best: trial {best.number} (AUC {best.value:.4f}) -> {out}")
    return 0
