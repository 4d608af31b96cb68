"""``hvctr report --run-dir R``: one picture of a run, R/report.png, and its summary printed.

    hvctr report --run-dir runs/demo/run          # writes runs/demo/run/report.png

It reads what ``hvctr train`` left in the run directory: metrics.jsonl (progress records:
training loss, samples/s, cache hit rate; eval records: validation AUC, logloss, NE, COPC,
every ``metrics.eval_every_windows`` and at the end) and summary.json (the time split and the
closing figures). Six panels, each against samples trained: training loss with validation
logloss, validation AUC, validation NE, samples/s, the CPU cache's hit rate, and the time split.
matplotlib is needed for the picture only (``pip install hvctr[report]``); without it the
summary is still printed.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from hvctr.formats.textfile import read_json, read_text


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--run-dir", required=True, help="a run directory written by hvctr train or hvctr simulate")
    p.add_argument("--out", help="where to write the picture (default: <run-dir>/report.png)")


def read_metrics(run_dir: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(progress records, eval records) of metrics.jsonl, each sorted by step; a resumed run
    appended to the same file, so a step written twice keeps its last record."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise ValueError(f"{run_dir} has no metrics.jsonl: not a run directory of hvctr train")
    by_kind: dict[str, dict[tuple[int, bool], dict[str, Any]]] = {"progress": {}, "eval": {}}
    for n, line in enumerate(read_text(path, "metrics file").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            raise ValueError(f"{path}, line {n}: not JSON (a run killed while writing leaves a cut last line: "
                             f"remove it)") from None
        if not isinstance(rec, dict):
            raise ValueError(f"{path}, line {n}: not a metrics record (a JSON object): damaged")
        if rec.get("event") in by_kind:
            by_kind[rec["event"]][(rec.get("step", 0), bool(rec.get("final")))] = rec
    return tuple(sorted(d.values(), key=lambda r: (r.get("step", 0), bool(r.get("final"))))
                 for d in by_kind.values())


def _samples_per_step(run_dir: Path, summary: dict[str, Any] | None) -> float:
    """Global samples a step trained: from the summary, else the config and the binding table."""
    if summary and summary.get("steps"):
        return summary["samples"] / summary["steps"]
    from hvctr.formats.tomlfile import read_toml

    cfg = read_toml(run_dir / "config.toml", "run config") if (run_dir / "config.toml").is_file() else {}
    batch = cfg.get("data", {}).get("batch_size_per_rank", 0)
    ranks = len(read_json(run_dir / "binding.json", "binding table")) if (run_dir / "binding.json").is_file() else 1
    return float(batch * ranks) or 1.0


def plot(run_dir: Path, out: Path, progress: list[dict], evals: list[dict], summary: dict | None) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a login or compute node
    import matplotlib.pyplot as plt
    from matplotlib.ticker import EngFormatter

    per_step = _samples_per_step(run_dir, summary)

    def samples(r: dict) -> float:
        return r.get("samples", r.get("step", 0) * per_step)

    fig, ax = plt.subplots(2, 3, figsize=(15, 8.5))
    final = (summary or {}).get("eval") or (evals[-1] if evals else {})
    figures = f": validation AUC {final['auc']:.4f}, NE {final.get('ne', float('nan')):.4f}" if final else ""
    fig.suptitle(f"hvctr run {run_dir}{figures}", fontsize=13)
    xs = [samples(r) for r in progress]
    ex = [samples(r) for r in evals]

    def panel(a, title: str, ylabel: str, empty: str = "") -> None:
        a.set_title(title)
        a.set_xlabel("samples trained")
        a.xaxis.set_major_formatter(EngFormatter(sep=""))  # 150k, 1.5M: labels that do not collide
        a.set_ylabel(ylabel)
        a.grid(alpha=0.3)
        if empty:
            a.text(0.5, 0.5, empty, ha="center", va="center", transform=a.transAxes, fontsize=9, color="0.4")

    a = ax[0, 0]
    a.plot(xs, [r["loss"] for r in progress], label="training loss (mean since the last line)")
    if evals:
        a.plot(ex, [r["logloss"] for r in evals], "o-", label="validation logloss")
    a.legend(fontsize=8)
    panel(a, "loss", "logloss", "" if progress else "no progress records")
    no_eval = "" if evals else "no validation records\n(set metrics.eval_every_windows)"
    a = ax[0, 1]
    a.plot(ex, [r["auc"] for r in evals], "o-", color="tab:green")
    panel(a, "validation AUC", "AUC", no_eval)
    a = ax[0, 2]
    a.plot(ex, [r.get("ne", float("nan")) for r in evals], "o-", color="tab:purple", label="NE")
    a.axhline(1.0, color="0.5", lw=0.8, ls="--", label="NE = 1: predicting the base CTR")
    if evals:
        a.legend(fontsize=8)
    panel(a, "validation normalized entropy", "NE (lower is better)", no_eval)
    a = ax[1, 0]
    a.plot(xs, [r["samples_per_s"] for r in progress], color="tab:orange")
    panel(a, "throughput (all ranks)", "samples/s", "" if progress else "no progress records")
    a = ax[1, 1]
    hits = [(x, r["cache_hit_rate"]) for x, r in zip(xs, progress) if "cache_hit_rate" in r]
    a.plot([h[0] for h in hits], [h[1] for h in hits], color="tab:red")
    a.set_ylim(0, 1.02)
    panel(a, "CPU cache hit rate (owners, so far)", "hit rate", "" if hits else "no cache records")
    a = ax[1, 2]
    split = (summary or {}).get("time_split_s", {})
    if split:
        a.bar(list(split), list(split.values()), color="tab:gray")
        total = sum(split.values()) or 1.0
        for i, v in enumerate(split.values()):
            a.text(i, v, f"{100 * v / total:.0f}%", ha="center", va="bottom", fontsize=9)
    a.set_title("time split (rank 0)")
    a.set_xlabel("phase")
    a.set_ylabel("seconds")
    if not split:
        a.text(0.5, 0.5, "no summary.json yet", ha="center", va="center", transform=a.transAxes, color="0.4")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def run(args: argparse.Namespace, overrides: list[str]) -> int:
    if overrides:
        raise ValueError(f"hvctr report takes no config overrides, got {' '.join(overrides)}")
    run_dir = Path(args.run_dir)
    progress, evals = read_metrics(run_dir)
    summary_path = run_dir / "summary.json"
    summary = read_json(summary_path, "run summary") if summary_path.is_file() else None
    if summary is not None and not isinstance(summary, dict):
        raise ValueError(f"run summary {summary_path}: not a summary (a JSON object): damaged")
    out = Path(args.out) if args.out else run_dir / "report.png"
    try:
        import matplotlib  # noqa: F401
    except ModuleNotFoundError:
        print("hvctr report: matplotlib is not installed (pip install 'hvctr[report]'): no picture written")
    else:
        print(f"hvctr report: wrote {plot(run_dir, out, progress, evals, summary)}")
    if summary is not None:
        from hvctr.train.cmd import format_summary

        print(format_summary(summary))
    else:
        print(f"{run_dir}: no summary.json (the run has not finished): {len(progress)} progress and "
              f"{len(evals)} validation records so far")
    if evals:
        nan = float("nan")
        print("validation during training:")
        for r in evals:
            print(f"  step {r['step']:>8}  samples {r.get('samples', 0):>12,}  AUC {r['auc']:.4f}  "
                  f"logloss {r['logloss']:.4f}  NE {r.get('ne', nan):.4f}  COPC {r.get('copc', nan):.3f}"
                  + ("  (final)" if r.get("final") else ""))
    return 0
