"""Row-wise optimiser states (train.sparse_optimizer) side by side, written into BENCHMARKS.md.

    python -m bench.row_states --data-set 11=/var/tmp/btrain --data-set 12=/var/tmp/bt32/p12 [--rounds 2]

On each data set (data_prep synth at its seed, 2.2M rows, made by bench.train's make_data in
the directory given, reused where it is there) and in interleaved rounds: hvctr k = 8 at 2 ranks
with each sparse optimiser (adam at its default rate; rowwise_adam at Adam's rate;
rowwise_adagrad at TorchRec's rate and at 5x it), and TorchRec's fused row-wise Adagrad (one
process of 2 threads, bench.baseline), the same optimiser as hvctr's rowwise_adagrad. Model: DNN,
26 fields x 16 dims, MLP 512-256-1, batch 4096 a rank. Speeds are medians over rounds; AUC is the
last round's (every run is deterministic up to the dense reductions' order). Beside them, what
each optimiser's row costs: bytes a row, and keys a GB of SSD shard (rows, index and metadata at
storage.max_load_factor, hvctr.plan.model.shard_bytes).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from bench.report import data_set_specs, machine_line, publish
from bench.train import _with_load, hvctr_run, make_data, reference_run
from hvctr.formats import RowLayout, SparseOptimizer
from hvctr.plan.model import shard_bytes

HEADING = "## Row-wise optimiser states"
TORCHREC_LR = 0.002  # bench.baseline's sparse_lr for TorchRec's fused row-wise Adagrad
K8 = ["--merge.every_k_steps=8"]
SYSTEMS = {  # name: hvctr flags (None: TorchRec)
    "hvctr_adam": K8,
    "hvctr_rowwise_adam": K8 + ["--train.sparse_optimizer=rowwise_adam"],
    "hvctr_rowwise_adagrad": K8 + ["--train.sparse_optimizer=rowwise_adagrad", f"--train.sparse_lr={TORCHREC_LR}"],
    "hvctr_rowwise_adagrad_lr5x": K8 + ["--train.sparse_optimizer=rowwise_adagrad",
                                        f"--train.sparse_lr={5 * TORCHREC_LR}"],
    "torchrec": None,
}


OUT_OF_CORE = ("hvctr_adam", "hvctr_rowwise_adagrad")  # with --out-of-core: also with the cache at 10% of Adam's table


def measure(data_sets: list[tuple[int, Path]], rows: int, rounds: int, out_of_core: bool = False) -> dict[str, Any]:
    out: dict[str, Any] = {"rows": rows, "sets": []}
    made = [(seed, work, *make_data(work, rows, seed)) for seed, work in data_sets]
    per_set: list[dict[str, Any]] = [{"seed": seed, "bayes_auc": bayes, "rounds": []} for seed, _, _, bayes in made]
    for i in range(rounds):
        for (seed, work, data, _), res in zip(made, per_set):
            print(f"round {i + 1}/{rounds}, data set seed {seed}", flush=True)
            tag = f"rs{i + 1}"
            runs = []
            for name, flags in SYSTEMS.items():
                r = _with_load(lambda: reference_run(work, data, "torchrec", tag) if flags is None
                               else hvctr_run(work, data, f"{name}.{tag}", flags))
                runs.append({**r, "system": name})
            if out_of_core:  # the same cache bytes: a row-wise row is smaller, so the cache holds more of them
                cache = int(0.1 * runs[0]["shard_rows_rank0"] * RowLayout(16).row_bytes)
                res["cache_bytes"] = cache
                for name in OUT_OF_CORE:
                    flags = SYSTEMS[name] + [f"--storage.cpu_cache_bytes={cache}"]
                    r = _with_load(lambda: hvctr_run(work, data, f"{name}_cache10.{tag}", flags))
                    runs.append({**r, "system": f"{name}_cache10"})
            res["rounds"].append(runs)
            (data_sets[0][1] / "row_states.json").write_text(json.dumps({**out, "sets": per_set}, indent=1))
    out["sets"] = per_set
    return out


def _median(rounds: list[list[dict[str, Any]]], i: int) -> float | None:
    values = [r[i]["samples_per_s"] for r in rounds if r[i].get("samples_per_s")]
    return statistics.median(values) if values else None


def render(res: dict[str, Any], command: str, machine: str, dim: int = 16) -> str:
    lines = [HEADING, "", f"Command: `{command}`  ", f"Machine: {machine}  ",
             f"Data: {res['rows']:,} synthetic rows a set (data_prep synth at the seeds below, 8 shards, 9.09% held out). "
             f"Model: DNN, 26 fields x {dim} dims, MLP 512-256-1, batch 4096 a rank; hvctr k = 8 at 2 ranks of one "
             f"thread, one epoch; TorchRec: FusedEmbeddingBagCollection with fused row-wise Adagrad at lr {TORCHREC_LR} "
             f"(fbgemm's EXACT_ROWWISE_ADAGRAD, the optimiser of hvctr's rowwise_adagrad), one process of 2 threads. "
             f"hvctr's rates are at one rank (merge.lr_scaling = sqrt scales them by sqrt(2)). Speeds: medians of "
             f"{len(res['sets'][0]['rounds'])} interleaved rounds; AUC of the last.", "",
             "| data set | system | samples/s (median) | per round | vs hvctr adam | vs TorchRec | AUC | AUC vs adam "
             "| AUC vs TorchRec |", "|---|---|---|---|---|---|---|---|---|"]
    for s in res["sets"]:
        R = s["rounds"]
        names = [r["system"] for r in R[0]]
        sps = {n: _median(R, i) for i, n in enumerate(names)}
        auc = {n: R[-1][i].get("auc") for i, n in enumerate(names)}
        for i, n in enumerate(names):
            per = ", ".join(f"{r[i]['samples_per_s']:,.0f}" for r in R if r[i].get("samples_per_s"))
            ratio = lambda a, b: f"{a / b:.2f}x" if a and b else "-"  # noqa: E731
            diff = lambda a, b: f"{a - b:+.4f}" if a is not None and b is not None else "-"  # noqa: E731
            base = sps["hvctr_adam_cache10"] if n.endswith("_cache10") else sps["hvctr_adam"]
            lines.append(f"| seed {s['seed']} (Bayes {s['bayes_auc']:.4f}) | {n} | "
                         + (f"{sps[n]:,.0f}" if sps[n] else "skipped") + f" | {per} | "
                         f"{ratio(sps[n], base)} | {ratio(sps[n], sps.get('torchrec'))} | "
                         + (f"{auc[n]:.4f}" if auc[n] is not None else "-")
                         + f" | {diff(auc[n], auc['hvctr_adam'])} | {diff(auc[n], auc.get('torchrec'))} |")
    ooc = [s for s in res["sets"] if "cache_bytes" in s]
    if ooc:
        lines += ["", "`_cache10`: the CPU cache at 10% of Adam's table a rank (" + ", ".join(
            f"seed {s['seed']}: {s['cache_bytes'] / 2**20:.1f} MiB" for s in ooc) + "), the same bytes for both "
            "optimisers: row-wise Adagrad's rows are 0.37x Adam's at D = 16, so the cache holds 2.7x as many; "
            "`vs hvctr adam` of these rows is against hvctr_adam_cache10. Hit rates (rank 0, last round): " + "; ".join(
            f"seed {s['seed']}: " + ", ".join(f"{r['system']} {r['cache_hit_rate']:.3f}" for r in s["rounds"][-1]
                                              if r["system"].endswith("_cache10")) for s in ooc) + "."]
    loads = "; ".join(f"seed {s['seed']} round {j + 1}: " + ", ".join(f"{r.get('load_before', float('nan')):.1f}"
                                                                        for r in rnd)
                      for s in res["sets"] for j, rnd in enumerate(s["rounds"]))
    lines += ["", f"Load average (1 min) before each run, in the table's order (2 cpus): {loads}."]
    lines += ["", "What a row costs (float32; keys a GB of SSD: the shard's rows, index and metadata at "
              "storage.max_load_factor 0.8, hvctr.plan.model.shard_bytes):", "",
              "| train.sparse_optimizer | columns | bytes a row, D = 16 | D = 128 | keys a GB of SSD, D = 16 | D = 128 |",
              "|---|---|---|---|---|---|"]
    for o in SparseOptimizer:
        per_key = {d: shard_bytes(1 << 20, d, 0.8, o)["total"] / (1 << 20) for d in (16, 128)}
        lines.append(f"| {o.value} | {RowLayout(dim, o).columns('D')} | {RowLayout(16, o).row_bytes:,} | "
                     f"{RowLayout(128, o).row_bytes:,} | {1e9 / per_key[16] / 1e6:.2f}M | {1e9 / per_key[128] / 1e6:.2f}M |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.row_states", description=__doc__.splitlines()[0])
    p.add_argument("--data-set", action="append", required=True, metavar="SEED=DIR",
                   help="a data set: data_prep synth's seed and the work directory holding (or to hold) it; repeat")
    p.add_argument("--rows", type=int, default=2_200_000)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out-of-core", action="store_true",
                   help="also adam and rowwise_adagrad with the cache at 10%% of Adam's table (the same bytes)")
    p.add_argument("--benchmarks", default="", help="markdown file to write the section into (default: none)")
    args = p.parse_args(argv)
    sets = data_set_specs(p, args.data_set)
    command = "python -m bench.row_states " + " ".join(sys.argv[1:] if argv is None else argv)
    t0 = time.time()
    res = measure(sets, args.rows, args.rounds, args.out_of_core)
    publish(render(res, command, machine_line()), t0, args.benchmarks, HEADING)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
