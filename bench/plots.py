"""The PNG plots of BENCHMARKS.md, drawn from the results the benchmark modules leave behind.

- ``k_sweep.png``: training samples/s and AUC against k, with sync, plain PyTorch and the
  MLP-only ceiling as lines (bench.train's results.json);
- ``cache_hit.png``: CPU cache hit rate against cache size for LRU and LFU with aging
  (measured here on Zipf(1.1) keys, bench.storage.bench_policy) and the planner's
  ideal frequency cache on the same law (hvctr.plan.keyfreq);
- ``time_split.png``: where a step's time goes: the training runs' split (compute, pull,
  merge, io) and the planner's prediction beside the measured split of its check runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only: no display on a batch node
import matplotlib.pyplot as plt  # noqa: E402

PHASES = ("compute", "pull", "merge", "io")
COLORS = {"compute": "#4c72b0", "pull": "#dd8452", "merge": "#55a868", "io": "#8172b3", "prefetch": "#c44e52"}


def _k_of(run: dict[str, Any]) -> int | None:
    if any(f == "--merge.mode=sync" for f in run.get("flags", [])):
        return None
    ks = [int(f.split("=")[1]) for f in run.get("flags", []) if "every_k_steps" in f]
    states = [f for f in run.get("flags", []) if "merge.states" in f or "compression" in f or "cache_bytes" in f]
    return ks[0] if ks and not states else None


def plot_k_sweep(train: dict[str, Any], out: Path) -> None:
    """samples/s and AUC against k (params+m+v, all cached), sync and the references as lines."""
    last = train["rounds"][-1]
    by_name = {r["system"]: r for r in last}
    runs = {k: r for r in [*train["sweep"], by_name["hvctr_k8"]] if (k := _k_of(r)) is not None}
    ks = sorted(runs)
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
    a.plot(ks, [runs[k]["samples_per_s"] for k in ks], "o-", label="hvctr k-step")
    for name, style, label in (("hvctr_sync", "--", "hvctr sync"), ("pytorch_plain", ":", "plain PyTorch"),
                               ("mlp_ceiling", "-.", "MLP-only ceiling")):
        if name in by_name:
            a.axhline(by_name[name]["samples_per_s"], linestyle=style, color="gray" if name != "hvctr_sync" else "C3",
                      label=label)
    a.set(xscale="log", xlabel="k (steps between merges)", ylabel="samples/s (2 ranks)", title="throughput")
    a.set_xticks(ks, [str(k) for k in ks])
    a.legend(fontsize=8)
    b.plot(ks, [runs[k]["auc"] for k in ks], "o-", label="hvctr k-step")
    if "hvctr_sync" in by_name:
        b.axhline(by_name["hvctr_sync"]["auc"], linestyle="--", color="C3", label="hvctr sync")
    b.axhline(train["bayes_auc"], linestyle=":", color="gray", label="Bayes-optimal")
    b.set(xscale="log", xlabel="k (steps between merges)", ylabel="validation AUC", title="accuracy")
    b.set_xticks(ks, [str(k) for k in ks])
    b.legend(fontsize=8)
    fig.suptitle(f"k sweep: {train['rows']:,} synthetic rows, one epoch, 2 ranks on 2 cores", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def plot_cache_hits(policy: list[dict[str, Any]], model: list[tuple[float, float]], n_keys: int, out: Path) -> None:
    """Hit rate against the cache's share of the keys: LRU, LFU, and the ideal frequency cache."""
    fracs = [r["cache_frac"] for r in policy]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(fracs, [r["lru"] for r in policy], "o-", label="LRU (measured)")
    ax.plot(fracs, [r["lfu"] for r in policy], "s-", label="LFU with aging (measured)")
    ax.plot(fracs, [r["static_top_keys"] for r in policy], "^:", label="hottest keys, counted (measured)")
    ax.plot([m[0] for m in model], [m[1] for m in model], "-", color="gray", label="planner: ideal cache, Zipf(1.1)")
    ax.set(xscale="log", xlabel=f"cache size, share of the {n_keys:,} keys", ylabel="hit rate",
           title="CPU cache hit rate, Zipf(1.1) keys", ylim=(0, 1))
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def _stack(ax, labels: list[str], parts: list[dict[str, float]], keys: tuple[str, ...], ylabel: str) -> None:
    bottom = [0.0] * len(labels)
    for key in keys:
        vals = [p.get(key, 0.0) for p in parts]
        ax.bar(labels, vals, bottom=bottom, label=key, color=COLORS.get(key))
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_ylim(0, 1.08 * max(bottom + [1e-9]))
    ax.set_ylabel(ylabel)
    ax.tick_params(axis="x", labelsize=8, rotation=20)


def plot_time_split(train: dict[str, Any] | None, check: dict[str, Any] | None, out: Path) -> None:
    """Left: seconds per rank of each training run by phase. Right: the planner's split per step
    against the measured one, for the check's 2-rank runs."""
    panels = [p for p in (train, check) if p]
    if not panels:
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4), squeeze=False)
    i = 0
    if train:
        last = train["rounds"][-1]
        runs = [r for r in [*last, *train["sweep"][:3]] if "time_split_s" in r]
        runs.sort(key=lambda r: (_k_of(r) or 0))
        _stack(axes[0][i], [r["system"].replace("hvctr_", "") for r in runs], [r["time_split_s"] for r in runs],
               PHASES, "seconds per rank, one epoch")
        axes[0][i].set_title(f"training, {train['rows']:,} rows, 2 ranks", fontsize=10)
        axes[0][i].legend(fontsize=8)
        i += 1
    if check:
        rows = [r for r in check["results"] if r["ranks"] == 2] or check["results"]
        labels, parts = [], []
        for r in rows:
            m, p = r["measured"], r["predicted"]
            # the whole run's phases, scaled to the step time the check compares (its fastest window)
            whole = sum(m["time_split_s"].values())
            scale = m["step_s"] / whole if m.get("step_s") and whole else 1.0 / m["steps"]
            labels += [f"{r['mode']} meas.", f"{r['mode']} plan"]
            parts += [{k: 1e3 * v * scale for k, v in m["time_split_s"].items()},
                      {("prefetch" if k == "prep" else k): 1e3 * v for k, v in p.get("split_s", {}).items()}]
        _stack(axes[0][i], labels, parts, ("compute", "pull", "merge", "io", "prefetch"), "ms per step")
        axes[0][i].set_title(f"planner vs measured, {rows[0]['ranks']} rank(s): measured = the checked step time,\n"
                             "split as the run's phases; plan = a steady step, prefetch where not hidden", fontsize=9)
        axes[0][i].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
