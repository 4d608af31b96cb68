"""Multi-hot data: hvctr against TorchRec's DLRM and DLRM_DCN modules, written into BENCHMARKS.md.

    python -m bench.multi_hot --data-set 21=/var/tmp/mh21 --data-set 22=/var/tmp/mh22 [--rounds 2]

On each data set (data_prep synth at its seed with MLPerf DLRM-DCNv2's multi_hot_sizes, each
field of size K drawing 0..K values a row; the fields of K > 1 prepared as multi-valued; made in
the directory given, reused where it is there) and in interleaved rounds: the same model on both
sides, DLRM (bottom MLP 512-256-16 on the dense features, pairwise dots, top MLP 512-256-1) and
DLRM-DCNv2 (the bottom MLP's output and the embeddings through 3 cross layers of rank 64, then
the top MLP), 26 fields x 16 dims pooled by sum, the table trained by row-wise Adagrad at
TorchRec's rate and the dense part by Adam:

- hvctr: model.arch = dlrm / dlrm-dcnv2, train.sparse_optimizer = rowwise_adagrad, k = 8 at 2
  ranks of one thread, batch 4096 a rank (as bench.train's peers run it), and at TorchRec's
  batch, data.global_batch_size = 4096 (2 x 2048: the same samples a step and steps an epoch as
  TorchRec at 4096, which is what its AUC is compared at); and DLRM with full Adam rows, for the
  AUC of row-wise states against per-column ones on this data;
- TorchRec (bench.baseline --runs torchrec --arch ...): its DLRM / DLRM_DCN modules over one
  FusedEmbeddingBagCollection (fbgemm's fused EXACT_ROWWISE_ADAGRAD, sum pooling), one process of
  2 threads, the KeyedJaggedTensors built in its training loop (kjt_build_s); at batch 4096 and
  at 8192, the global batch of hvctr's 2 x 4096.

Speeds are medians over rounds; AUC is the last round's. --systems runs a subset (the table pairs
what ran).
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

HEADING = "## Multi-hot data: hvctr against TorchRec's DLRM and DLRM_DCN"
MLPERF_SIZES = "3,2,1,2,6,1,1,1,1,7,3,8,1,6,9,5,1,1,1,12,100,27,10,3,1,1"  # MLPerf DLRM-DCNv2's multi_hot_sizes
TORCHREC_LR = 0.002  # bench.baseline's sparse_lr for TorchRec's fused row-wise Adagrad
CROSS_RANK = 64
COMMON = ["--merge.every_k_steps=8", "--storage.dim=16", "--model.bottom_mlp=512,256,16", "--model.hidden=512,256",
          "--model.pooling=sum", f"--model.cross_rank={CROSS_RANK}", "--model.cross_layers=3"]
ROWWISE = ["--train.sparse_optimizer=rowwise_adagrad", f"--train.sparse_lr={TORCHREC_LR}"]
SYSTEMS: dict[str, tuple[str, list[str]]] = {  # name: ("hvctr" | "torchrec", flags)
    "hvctr_dlrm": ("hvctr", COMMON + ["--model.arch=dlrm"] + ROWWISE),
    "torchrec_dlrm": ("torchrec", ["--arch", "dlrm"]),
    "torchrec_dlrm_b8192": ("torchrec", ["--arch", "dlrm", "--batch-size", "8192"]),
    "hvctr_dlrm-dcnv2": ("hvctr", COMMON + ["--model.arch=dlrm-dcnv2"] + ROWWISE),
    "torchrec_dlrm-dcnv2": ("torchrec", ["--arch", "dlrm-dcnv2", "--cross-rank", str(CROSS_RANK)]),
    "torchrec_dlrm-dcnv2_b8192": ("torchrec", ["--arch", "dlrm-dcnv2", "--cross-rank", str(CROSS_RANK),
                                               "--batch-size", "8192"]),
    "hvctr_dlrm_g4096": ("hvctr", COMMON + ["--model.arch=dlrm", "--data.global_batch_size=4096"] + ROWWISE),
    "hvctr_dlrm-dcnv2_g4096": ("hvctr", COMMON + ["--model.arch=dlrm-dcnv2", "--data.global_batch_size=4096"]
                               + ROWWISE),
    "hvctr_dlrm_adam": ("hvctr", COMMON + ["--model.arch=dlrm"]),
}
# hvctr's run: (TorchRec at batch 4096, TorchRec at batch 8192): the global batch of hvctr's run is
# 8192 (2 x 4096) or, for the _g4096 runs, 4096
PAIRS = {"hvctr_dlrm": ("torchrec_dlrm", "torchrec_dlrm_b8192"),
         "hvctr_dlrm-dcnv2": ("torchrec_dlrm-dcnv2", "torchrec_dlrm-dcnv2_b8192"),
         "hvctr_dlrm_g4096": ("torchrec_dlrm", "torchrec_dlrm_b8192"),
         "hvctr_dlrm-dcnv2_g4096": ("torchrec_dlrm-dcnv2", "torchrec_dlrm-dcnv2_b8192")}


def measure(data_sets: list[tuple[int, Path]], rows: int, rounds: int, sizes: str,
            systems: list[str]) -> dict[str, Any]:
    made = [(seed, work, *make_data(work, rows, seed, multi_hot=sizes)) for seed, work in data_sets]
    per_set: list[dict[str, Any]] = []
    for seed, _, data, bayes in made:
        m = json.loads((data / "manifest.json").read_text())
        train = m["shards"]["train"]
        per_set.append({"seed": seed, "bayes_auc": bayes, "rounds": [],
                        "keys_per_row": sum(r["keys"] for r in train) / sum(r["rows"] for r in train)})
    out: dict[str, Any] = {"rows": rows, "sizes": sizes, "sets": per_set}
    for i in range(rounds):
        for (seed, work, data, _), res in zip(made, per_set):
            print(f"round {i + 1}/{rounds}, data set seed {seed}", flush=True)
            tag = f"mh{i + 1}"
            runs = []
            for name in systems:
                kind, flags = SYSTEMS[name]
                if kind == "torchrec":
                    r = _with_load(lambda: reference_run(work, data, "torchrec", f"{name}.{tag}", flags))
                else:
                    r = _with_load(lambda: hvctr_run(work, data, f"{name}.{tag}", flags))
                runs.append({**r, "system": name})
            res["rounds"].append(runs)
            (data_sets[0][1] / "multi_hot.json").write_text(json.dumps(out, indent=1))
    return out


def _median(rounds: list[list[dict[str, Any]]], i: int) -> float | None:
    values = [r[i]["samples_per_s"] for r in rounds if r[i].get("samples_per_s")]
    return statistics.median(values) if values else None


def render(res: dict[str, Any], command: str, machine: str) -> str:
    keys = ", ".join(f"seed {s['seed']}: {s['keys_per_row']:.1f}" for s in res["sets"])
    lines = [HEADING, "", f"Command: `{command}`  ", f"Machine: {machine}  ",
             f"Data: {res['rows']:,} synthetic rows a set (data_prep synth --multi-hot {res['sizes']}, MLPerf "
             f"DLRM-DCNv2's multi_hot_sizes: a field of size K draws 0..K values a row; 8 shards, 9.09% held out); "
             f"keys a row ({keys}). Model, both sides: 26 fields x 16 dims pooled by sum; DLRM: bottom MLP 512-256-16, "
             f"pairwise dots, top MLP 512-256-1; DLRM-DCNv2: 3 cross layers of rank {CROSS_RANK} over the bottom "
             f"MLP's output and the embeddings, then the top MLP. Table: row-wise Adagrad at {TORCHREC_LR} (fbgemm's "
             f"fused EXACT_ROWWISE_ADAGRAD in TorchRec; hvctr's rowwise_adagrad), dense part Adam at 0.001. hvctr: "
             f"k = 8 at 2 ranks of one thread, batch 4096 a rank (_g4096: data.global_batch_size = 4096, 2 x 2048, "
             f"TorchRec's batch), one epoch (its rates at one rank, merge.lr_scaling = sqrt); TorchRec: its DLRM / "
             f"DLRM_DCN modules, one process of 2 threads, batch 4096 and 8192 "
             f"(the global batch of hvctr's 2 x 4096: the same steps an epoch), one epoch. "
             f"Speeds: medians of {len(res['sets'][0]['rounds'])} interleaved rounds; AUC of the last.", "",
             "| data set | system | samples/s (median) | per round | vs TorchRec, same model (batch 4096 / 8192) | AUC "
             "| AUC vs TorchRec (batch 4096 / 8192) | AUC vs hvctr DLRM Adam |", "|---|---|---|---|---|---|---|---|"]
    for s in res["sets"]:
        R = s["rounds"]
        names = [r["system"] for r in R[0]]
        sps = {n: _median(R, i) for i, n in enumerate(names)}
        auc = {n: R[-1][i].get("auc") for i, n in enumerate(names)}
        for i, n in enumerate(names):
            per = ", ".join(f"{r[i]['samples_per_s']:,.0f}" for r in R if r[i].get("samples_per_s"))
            ratio = lambda a, b: f"{a / b:.2f}x" if a and b else "-"  # noqa: E731
            diff = lambda a, b: f"{a - b:+.4f}" if a is not None and b is not None else "-"  # noqa: E731
            peers = PAIRS.get(n, ())
            lines.append(f"| seed {s['seed']} (Bayes {s['bayes_auc']:.4f}) | {n} | "
                         + (f"{sps[n]:,.0f}" if sps[n] else "skipped") + f" | {per} | "
                         + (" / ".join(ratio(sps[n], sps.get(p)) for p in peers) or "-") + " | "
                         + (f"{auc[n]:.4f}" if auc[n] is not None else "-")
                         + f" | {' / '.join(diff(auc[n], auc.get(p)) for p in peers) or '-'} | "
                         + (diff(auc[n], auc.get("hvctr_dlrm_adam")) if n == "hvctr_dlrm" else "-") + " |")
    kjt = "; ".join(f"seed {s['seed']}: " + ", ".join(
        f"{r['system']} {r['kjt_build_s']:.1f} s of {r['train_s']:.1f} s" for r in s["rounds"][-1]
        if "kjt_build_s" in r) for s in res["sets"])
    lines += ["", f"TorchRec's time building its KeyedJaggedTensors inside the timed loop (last round): {kjt}."]
    loads = "; ".join(f"seed {s['seed']} round {j + 1}: " + ", ".join(f"{r.get('load_before', float('nan')):.1f}"
                                                                        for r in rnd)
                      for s in res["sets"] for j, rnd in enumerate(s["rounds"]))
    lines += ["", f"Load average (1 min) before each run, in the table's order (2 cpus): {loads}."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.multi_hot", description=__doc__.splitlines()[0])
    p.add_argument("--data-set", action="append", required=True, metavar="SEED=DIR",
                   help="a data set: data_prep synth's seed and the work directory holding (or to hold) it; repeat")
    p.add_argument("--rows", type=int, default=600_000)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--multi-hot", default=MLPERF_SIZES, help="data_prep synth --multi-hot sizes (default MLPerf's)")
    p.add_argument("--systems", default=",".join(SYSTEMS),
                   help=f"comma-separated runs, in this order (default all: {', '.join(SYSTEMS)})")
    p.add_argument("--benchmarks", default="", help="markdown file to write the section into (default: none)")
    args = p.parse_args(argv)
    sets = data_set_specs(p, args.data_set)
    systems = [n.strip() for n in args.systems.split(",") if n.strip()]
    unknown = [n for n in systems if n not in SYSTEMS]
    if unknown or not systems:
        p.error(f"--systems: unknown {', '.join(unknown) or '(none given)'}; known: {', '.join(SYSTEMS)}")
    command = "python -m bench.multi_hot " + " ".join(sys.argv[1:] if argv is None else argv)
    t0 = time.time()
    res = measure(sets, args.rows, args.rounds, args.multi_hot, systems)
    publish(render(res, command, machine_line()), t0, args.benchmarks, HEADING)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
