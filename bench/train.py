"""Training benchmarks, measured side by side in one run, written into BENCHMARKS.md.

    python -m bench.train [--rows 2200000] [--repeats 3] [--quick]

On one synthetic data set (data_prep synth: Bayes-optimal AUC known) and one model (DNN,
26 fields x 16 dims, MLP 512-256-1, batch 4096 per rank, one epoch, 2 ranks of one torch
thread each: on a machine of more than 2 cpus the others are the ranks' prefetch and Horovod threads'):
1. interleaved rounds of: hvctr sync, hvctr k = 8, the plain PyTorch baseline (one process,
   2 threads, nn.Embedding + SparseAdam), TorchRec (one process, 2 threads,
   FusedEmbeddingBagCollection with fused rowwise Adagrad: fbgemm has no CPU Adam; skipped
   with a line saying so where the bench extra is not installed), the MLP-only ceiling and
   the MLP-with-input-gradient floor (2 processes of 1 thread each, bench.baseline); speeds
   are medians over rounds, so a noisy neighbour hits every system alike; the machine's load
   average is recorded before each run;
2. the k sweep (k = 1, 4, 16 beside the rounds' 8) and the merge.states variants at k = 8;
3. fp16 compression at k = 8; the CPU cache at 10% of the table at k = 8 (out of core).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.report import machine_line, write_section
from hvctr.config import MergeConfig, MergeStates
from hvctr.formats import RowLayout

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable
MPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
           "OMPI_MCA_mpi_yield_when_idle": "1", "OMPI_MCA_btl_vader_single_copy_mechanism": "none",
           "OMPI_MCA_rmaps_base_oversubscribe": "1"}
ROW_BYTES = RowLayout(16).row_bytes  # the benchmark's dim 16: w, w1, m, v, step
DEFAULT_STATES = MergeConfig().states.value  # what runs without a --merge.states flag merge
OTHER_STATES = tuple(s.value for s in MergeStates if s.value != DEFAULT_STATES)
# One torch thread a rank: 2 ranks compute on 2 threads, as TorchRec and plain PyTorch (one process of
# 2 threads) and the floor and the ceiling (2 processes of 1 thread) do, on any machine. On 2 cpus it
# is what hvctr chooses itself; where there are more, the cpus beyond 2 are the ranks' other threads'
# (prefetch, Horovod's), never more compute threads than the references have.
COMPUTE_THREADS_PER_RANK = 1


def _run(cmd: list[str], log: Path, timeout: int = 3600, cwd: Path | None = None,
         env: dict[str, str] | None = None) -> None:
    with open(log, "w") as f:
        r = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, **MPI_ENV, **(env or {})},
                           timeout=timeout, cwd=cwd)
    if r.returncode != 0:
        raise RuntimeError(f"benchmark command failed ({r.returncode}), see {log}: {' '.join(cmd)}")


def make_data(work: Path, rows: int, seed: int = 11, multi_hot: str = "") -> tuple[Path, float]:
    """data_prep synth at ``seed`` (``multi_hot``: its --multi-hot sizes, the fields of more than
    one value then prepared as multi-valued) into ``work``/shards, reused where it is there."""
    data = work / "shards"
    made = work / "synth.seed"
    want = f"{seed}" + (f" --multi-hot {multi_hot}" if multi_hot else "")
    if (data / "manifest.json").exists() and made.exists() and made.read_text().strip() != want:
        raise SystemExit(f"{work} holds data of data_prep synth --seed {made.read_text().strip()}, not {want}: "
                         f"give --work-dir another directory")
    if not (data / "manifest.json").exists():
        tsv = work / "synth.tsv"
        hot = ["--multi-hot", multi_hot] if multi_hot else []
        out = subprocess.run([PY, "-m", "data_prep", "synth", "--rows", str(rows), "--seed", str(seed), "--out", str(tsv),
                              *hot], check=True, capture_output=True, text=True).stdout
        (work / "synth.out").write_text(out)
        if multi_hot:
            from data_prep.synth import parse_multi_hot
            from hvctr.formats import CAT_NAMES

            hot = ["--multi-valued", ",".join(CAT_NAMES[f] for f, k in enumerate(parse_multi_hot(multi_hot)) if k > 1)]
        _run([PY, "-m", "data_prep", "criteo", "--input", str(tsv), "--out", str(data), "--shards", "8",
              "--valid-fraction", "0.0909", *hot], work / "prep.log")
        tsv.unlink()
        made.write_text(want)
    bayes = next(float(line.split("expected")[1].split(",")[0]) for line in (work / "synth.out").read_text().splitlines()
                 if "Bayes-optimal AUC" in line)
    return data, bayes


def hvctr_run(work: Path, data: Path, name: str, flags: list[str], src: Path | None = None,
              np_: int = 2) -> dict[str, Any]:
    """One training run of ``np_`` ranks (2); a run whose summary exists is not repeated
    (resumable bench). ``src``: run the hvctr of that source tree (a checkout of an earlier
    commit, its kernels built) instead of this one's."""
    run_dir = work / "runs" / name
    if not (run_dir / "summary.json").exists():
        shutil.rmtree(run_dir, ignore_errors=True)
        run_dir.mkdir(parents=True)
        cmd = ["mpirun", "-np", str(np_), "--bind-to", "none", *(["-x", f"PYTHONPATH={src}"] if src else []),
               PY, "-m", "mpi4py", "-m", "hvctr", "train",
               f"--data.train_dir={data}", f"--train.run_dir={run_dir}", "--metrics.log_every_steps=1000",
               "--storage.rows_per_rank=4000000", "--storage.max_working_set_rows=2000000",
               f"--train.threads={COMPUTE_THREADS_PER_RANK}", *flags]
        _run(cmd, work / f"{name}.log", cwd=src)
        for big in ("shards", "checkpoints"):  # about 2 GB a run: keep the summary and the logs
            shutil.rmtree(run_dir / big, ignore_errors=True)
    s = json.loads((run_dir / "summary.json").read_text())
    return {"system": name.split(".")[0], "samples_per_s": s["samples_per_s"], "auc": s["eval"]["auc"],
            "logloss": s["eval"]["logloss"], "calibration": _calibration(s["eval"]), "time_split_s": s["time_split_s"],
            "dense_bytes_per_sample": s["dense_bytes_per_sample"], "sparse_bytes_per_sample": s["sparse_bytes_per_sample"],
            "cache_hit_rate": s["store"]["cache_hit_rate"], "shard_rows_rank0": s["store"]["shard_rows"],
            "ahead_s": s.get("exchange", {}).get("ahead_total_s", 0.0), "exchange": s.get("exchange", {}),
            "flags": flags}


def _calibration(ev: dict[str, Any]) -> float:
    """Predicted CTR / actual CTR. Summaries written before hvctr had "calibration" (issue 16)
    held this ratio under "copc"; since then "copc" is actual / predicted, as Paddle's."""
    return ev["calibration"] if "calibration" in ev else ev["copc"]


REFERENCES = {"plain": "pytorch_plain", "torchrec": "torchrec", "ceiling": "mlp_ceiling", "floor": "mlp_floor"}
# The baselines a user would run instead (plain PyTorch, TorchRec) compute their DNN with hvctr's
# module, so that the model is the same function; they run it on torch's own products (MKL), as
# their users get them, not on hvctr.models.linear's oneDNN ones. ``onednn=True`` runs them on
# hvctr's (system name + "_onednn"): what of a ratio is the GEMM library. The floor and the
# ceiling are hvctr's compute bounds: hvctr's products always.
USERS_GEMM = {"HVCTR_CPU_GEMM": "mkl"}


def reference_run(work: Path, data: Path, which: str, tag: str, flags: list[str] = (),
                  onednn: bool = False) -> dict[str, Any]:
    """One bench.baseline run (``flags``: more of its options, e.g. --arch dlrm), its result
    kept under ``work`` (a rerun of the benchmark reads it)."""
    user = which in ("plain", "torchrec")
    suffix = "_onednn" if user and onednn else ""
    system = REFERENCES[which] + suffix
    out = work / f"{which}{suffix}.{tag}.jsonl"
    if not out.exists():
        tmp = out.with_name(out.name + ".tmp")
        _run([PY, "-m", "bench.baseline", "--data", str(data), "--runs", which, "--out", str(tmp), *flags],
             out.with_suffix(".log"), env=USERS_GEMM if user and not onednn else None)
        tmp.replace(out)
    r = json.loads(out.read_text().splitlines()[-1])
    if "skipped" in r:
        print(f"{system}: skipped: {r['skipped']}", flush=True)
        return {"system": system, "skipped": r["skipped"], "samples_per_s": None, "auc": None}
    return {"system": system, "samples_per_s": r["samples_per_s"], "auc": r.get("valid_auc"),
            "logloss": r.get("valid_logloss"),
            **{k: r[k] for k in ("sparse_optimizer", "sparse_lr", "threads", "versions", "kjt_build_s", "train_s")
               if k in r}}


def _with_load(run) -> dict[str, Any]:
    """run() with the machine's 1-minute load average just before it (2 cpus: above 2, other
    jobs shared them)."""
    load = os.getloadavg()[0]
    return {**run(), "load_before": round(load, 2)}


def measure(work: Path, rows: int, repeats: int, seed: int = 11) -> dict[str, Any]:
    data, bayes = make_data(work, rows, seed)
    rounds: list[list[dict[str, Any]]] = []
    for i in range(repeats):
        print(f"round {i + 1}/{repeats}", flush=True)
        tag = f"r{i + 1}"
        runs = [lambda: hvctr_run(work, data, f"hvctr_sync.{tag}", ["--merge.mode=sync"]),
                lambda: hvctr_run(work, data, f"hvctr_k8.{tag}", ["--merge.every_k_steps=8"]),
                *[lambda w=w: reference_run(work, data, w, tag) for w in REFERENCES]]
        rounds.append([_with_load(run) for run in runs])
    k8 = rounds[-1][1]
    table_bytes = 2 * k8["shard_rows_rank0"] * ROW_BYTES
    sweep = [hvctr_run(work, data, f"hvctr_k{k}", [f"--merge.every_k_steps={k}"]) for k in (1, 4, 16)]
    sweep += [hvctr_run(work, data, f"hvctr_k8_{s.replace('+', '_')}", ["--merge.every_k_steps=8", f"--merge.states={s}"])
              for s in OTHER_STATES]
    extra = [hvctr_run(work, data, "hvctr_k8_fp16", ["--merge.every_k_steps=8", "--merge.compression=fp16"]),
             hvctr_run(work, data, "hvctr_k8_cache10", ["--merge.every_k_steps=8",
                                                        f"--storage.cpu_cache_bytes={int(0.1 * table_bytes / 2)}"])]
    return {"rows": rows, "bayes_auc": bayes, "rounds": rounds, "sweep": sweep, "extra": extra,
            "table_bytes": table_bytes}


PEERS_HEADING = "## Training against TorchRec"
PEER_REFERENCES = ("torchrec", "floor", "ceiling")  # plain PyTorch is in the full benchmark's rounds


def measure_peers(work: Path, rows: int, repeats: int, before: Path | None, seed: int = 11) -> dict[str, Any]:
    """Interleaved rounds of hvctr k = 8 (all cached, and the cache at 10% of the table), the
    same at an earlier commit (``before``, where given), TorchRec, the floor and the ceiling:
    the figures of issue 19, without sync, plain PyTorch and the sweep."""
    data, bayes = make_data(work, rows, seed)
    rounds: list[list[dict[str, Any]]] = []
    table_bytes = 0
    for i in range(repeats):
        print(f"round {i + 1}/{repeats}", flush=True)
        tag = f"r{i + 1}"
        k8 = _with_load(lambda: hvctr_run(work, data, f"hvctr_k8.{tag}", ["--merge.every_k_steps=8"]))
        table_bytes = table_bytes or 2 * k8["shard_rows_rank0"] * ROW_BYTES
        runs = [lambda: k8,
                lambda: hvctr_run(work, data, f"hvctr_k8_cache10.{tag}", [
                    "--merge.every_k_steps=8", f"--storage.cpu_cache_bytes={int(0.1 * table_bytes / 2)}"]),
                *([lambda: hvctr_run(work, data, f"hvctr_k8_before.{tag}", ["--merge.every_k_steps=8"], src=before)]
                  if before else []),
                *[lambda w=w: reference_run(work, data, w, tag) for w in PEER_REFERENCES],
                lambda: reference_run(work, data, "torchrec", tag, onednn=True)]
        rounds.append([k8, *(_with_load(run) for run in runs[1:])])
        (work / "results.json").write_text(json.dumps({"rows": rows, "seed": seed, "bayes_auc": bayes, "rounds": rounds,
                                                       "table_bytes": table_bytes}, indent=1))
    return {"rows": rows, "seed": seed, "bayes_auc": bayes, "rounds": rounds, "table_bytes": table_bytes}


def render_peers(res: dict[str, Any], command: str, machine: str) -> str:
    R = res["rounds"]
    names = [r["system"] for r in R[0]]
    sps = {n: _median(R, i, "samples_per_s") for i, n in enumerate(names)}
    auc = {n: R[-1][i]["auc"] for i, n in enumerate(names)}
    by = {r["system"]: r for r in R[-1]}
    trec = by.get("torchrec", {"skipped": "not run"})
    lines = [PEERS_HEADING, "", f"Command: `{command}`  ", f"Machine: {machine}  ",
             f"Data: {res['rows']:,} synthetic rows (data_prep synth --seed {res.get('seed', 11)}, 8 shards, 9.09% held "
             f"out), "
             f"Bayes-optimal AUC {res['bayes_auc']:.4f}. Model: DNN, 26 fields x 16 dims, MLP 512-256-1, batch 4096 "
             f"per rank (hvctr: 2 ranks of 1 thread), one epoch. Speeds: "
             + (f"medians of {len(R)} interleaved rounds." if len(R) > 1 else "one round (no median)."), ""]
    if "skipped" in trec:
        lines += [f"TorchRec: skipped ({trec['skipped']}).", ""]
    else:
        v = trec.get("versions", {})
        lines += [f"TorchRec {v.get('torchrec', '?')} (fbgemm-gpu-cpu {v.get('fbgemm_gpu', '?')}, torch {v.get('torch', '?')}): "
                  "FusedEmbeddingBagCollection, one table for the 26 fields (one key space, as hvctr's), "
                  f"{trec.get('sparse_optimizer', '?')} at lr {trec.get('sparse_lr', '?')} on the table (fbgemm has no "
                  f"CPU Adam), Adam on the DNN, one process of {trec.get('threads', '?')} threads; keys mapped to rows up "
                  "front (not timed), as the plain baseline. Its DNN is hvctr's module on torch's own products "
                  "(MKL), as a TorchRec user runs it; torchrec_onednn: the same on hvctr's oneDNN products "
                  "(hvctr.models.linear), which hvctr, the floor and the ceiling use.", ""]
    lines += ["| system | samples/s (median) | per round | vs TorchRec | vs floor | vs ceiling | AUC | AUC vs TorchRec |",
              "|---|---|---|---|---|---|---|---|"]
    for i, n in enumerate(names):
        per = ", ".join(f"{r[i]['samples_per_s']:,.0f}" for r in R if r[i].get("samples_per_s"))
        a = auc[n]
        lines.append(f"| {n} | " + (f"{sps[n]:,.0f}" if sps[n] else "skipped") + f" | {per} | "
                     f"{_ratio(sps[n], sps.get('torchrec'))} | {_ratio(sps[n], sps.get('mlp_floor'))} | "
                     f"{_ratio(sps[n], sps.get('mlp_ceiling'))} | " + (f"{a:.4f}" if a is not None else "-") + " | "
                     + (f"{a - auc['torchrec']:+.4f}" if a is not None and auc.get("torchrec") is not None else "-") + " |")
    if sps.get("torchrec") and sps.get("hvctr_k8"):
        lines += ["", f"hvctr k = 8 at {sps['hvctr_k8'] / sps['torchrec']:.2f}x TorchRec's samples/s (target 1.15x), AUC "
                  f"{auc['hvctr_k8'] - auc['torchrec']:+.4f} against it (target no lower than -0.001); "
                  f"{sps['hvctr_k8'] / sps['mlp_floor']:.2f}x the MLP-with-input-gradient floor (target 0.9x)."]
    loads = "; ".join(f"round {j + 1}: " + ", ".join(f"{r.get('load_before', float('nan')):.1f}" for r in rnd)
                      for j, rnd in enumerate(R))
    lines += ["", "hvctr: samples/s over each rank's run (data, pulls, merges and the final checkpoint included); "
              "torchrec, pytorch_plain: the training loop of one process of 2 threads; mlp_ceiling: the MLP alone, "
              "2 processes of 1 thread; mlp_floor: the same computing the gradient of its embedding input (what "
              "every embedding model computes): hvctr's compute floor.", "",
              f"Load average (1 min) before each run, in the table's order (2 cpus: above 2, other jobs shared "
              f"them): {loads}."]
    if "hvctr_k8_cache10" in sps and sps["hvctr_k8"]:
        ooc = by["hvctr_k8_cache10"]
        lines += ["", f"Out of core: the CPU cache at 10% of the table (the table {res['table_bytes'] / 2**20:.0f} MiB over "
                  f"both ranks, the cache {0.1 * res['table_bytes'] / 2 / 2**20:.1f} MiB a rank) runs at "
                  f"{sps['hvctr_k8_cache10'] / sps['hvctr_k8']:.2f}x the all-cached k = 8 (medians; target 0.95x), hit "
                  f"rate {ooc['cache_hit_rate']:.3f}, AUC {ooc['auc']:.4f}."]
    lines += ["", "Time split (seconds per rank, rank 0, last round; the training thread's phases, and beside them "
              "the prefetch thread's pull of the rows the window before does not hold, storage.pull_ahead). Exposed: "
              "the training thread's time that is not compute, of its windows (pull + merge) and of the whole run "
              "(with io: the final checkpoint and the end of the pass):", "",
              "| run | compute | pull | merge | io | total | pulled ahead | exposed, windows | exposed, run |",
              "|---|---|---|---|---|---|---|---|---|"]
    for n in names:
        if "time_split_s" in by.get(n, {}):
            t = by[n]["time_split_s"]
            c, pm, total = t.get("compute", 0), t.get("pull", 0) + t.get("merge", 0), sum(t.values())
            ahead = by[n].get("ahead_s")
            lines.append(f"| {n} | " + " | ".join(f"{t.get(k, 0):.1f}" for k in ("compute", "pull", "merge", "io"))
                         + f" | {total:.1f} | " + (f"{ahead:.1f}" if ahead is not None else "-")
                         + f" | {pm / (c + pm):.1%} | {(total - c) / total:.1%} |")
    return "\n".join(lines) + "\n"


def _median(rounds: list[list[dict[str, Any]]], i: int, key: str) -> float | None:
    values = [r[i][key] for r in rounds if r[i].get(key) is not None]
    return statistics.median(values) if values else None


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a and b else "-"


def render(res: dict[str, Any], command: str, machine: str) -> str:
    R = res["rounds"]
    names = [r["system"] for r in R[0]]
    sps = {n: _median(R, i, "samples_per_s") for i, n in enumerate(names)}
    auc = {n: R[-1][i]["auc"] for i, n in enumerate(names)}
    sync, k8 = R[-1][0], R[-1][1]
    trec = next((r for r in R[-1] if r["system"] == "torchrec"), {"skipped": "not run"})
    loads = "; ".join(f"round {j + 1}: " + ", ".join(f"{r['load_before']:.1f}" for r in rnd) for j, rnd in enumerate(R)
                      if all("load_before" in r for r in rnd))
    lines = ["## Training", "",
             f"Command: `{command}`  ", f"Machine: {machine}  ",
             f"Data: {res['rows']:,} synthetic rows (data_prep synth, 9.09% held out), Bayes-optimal AUC "
             f"{res['bayes_auc']:.4f}. Model: DNN, 26 fields x 16 dims, MLP 512-256-1, batch 4096 per rank, "
             f"one epoch. Speeds: medians of {len(R)} interleaved rounds. No GPU on this machine (the CUDA path on "
             "an H200: \"The GPU step: the planner against an H200\").", ""]
    if "skipped" in trec:
        lines += [f"TorchRec: skipped ({trec['skipped']}).", ""]
    else:
        v = trec.get("versions", {})
        lines += [f"TorchRec {v.get('torchrec', '?')} (fbgemm-gpu-cpu {v.get('fbgemm_gpu', '?')}, torch "
                  f"{v.get('torch', '?')}): FusedEmbeddingBagCollection, one table for the 26 fields (one key space, "
                  f"as hvctr's), {trec.get('sparse_optimizer', '?')} at lr {trec.get('sparse_lr', '?')} on the table "
                  "(fbgemm has no CPU Adam), Adam on the DNN, one process of "
                  f"{trec.get('threads', '?')} threads, keys mapped to rows up front (not timed), as the plain baseline.",
                  ""]
    lines += ["| system | samples/s (median) | vs TorchRec | vs PyTorch plain | vs floor | vs ceiling | AUC | AUC vs Bayes |",
              "|---|---|---|---|---|---|---|---|"]
    for n in names:
        a = auc[n]
        lines.append(f"| {n} | " + (f"{sps[n]:,.0f}" if sps[n] else "skipped") + f" | {_ratio(sps[n], sps.get('torchrec'))} | "
                     f"{_ratio(sps[n], sps['pytorch_plain'])} | {_ratio(sps[n], sps.get('mlp_floor'))} | "
                     f"{_ratio(sps[n], sps['mlp_ceiling'])} | "
                     + (f"{a:.4f} | {a - res['bayes_auc']:+.4f} |" if a is not None else "- | - |"))
    lines += ["", "hvctr: 2 ranks of 1 torch thread (mpirun -np 2); samples/s over each rank's run (data, pulls, "
              "merges and the final checkpoint included). pytorch_plain, torchrec: one process of 2 threads, the "
              "training loop. mlp_ceiling: the MLP alone, 2 processes of 1 thread; mlp_floor: the same with the "
              "gradient of the embedding input (what every embedding model computes), hvctr's compute floor."]
    if loads:
        lines += ["", f"Load average (1 min) before each run, in the table's order: {loads}."]
    if res["rows"] < 1_000_000:  # --quick
        steps = int(res["rows"] * (1 - 0.0909)) // (2 * 4096)
        lines += ["", f"A quick run: {res['rows']:,} rows give each of the 2 ranks about {steps} steps of 4096 "
                  "(the plain baseline takes twice as many, of the same size, in one process), too few for "
                  "the models to converge alike: its AUC figures are not comparable, and the targets below "
                  "are for the full run (2.2M rows)."]
    if sps.get("torchrec"):
        lines += ["", f"Against TorchRec: k = 8 at {sps['hvctr_k8'] / sps['torchrec']:.2f}x its samples/s (target 1.0x), "
                  f"AUC {auc['hvctr_k8'] - auc['torchrec']:+.4f} (target no lower than -0.001); "
                  f"{sps['hvctr_k8'] / sps['mlp_floor']:.2f}x the MLP-with-input-gradient floor (target 0.85x)."]
    lines += ["", f"Targets: k = 8 at {sps['hvctr_k8'] / sps['pytorch_plain']:.2f}x the plain PyTorch baseline (target "
              f"1.0x) and {sps['hvctr_k8'] / sps['mlp_ceiling']:.2f}x the MLP-only ceiling (target 0.65x), AUC "
              f"{auc['hvctr_k8'] - auc['pytorch_plain']:+.4f} against the baseline (target no lower than -0.003); "
              f"AUC below Bayes by {res['bayes_auc'] - auc['hvctr_k8']:.4f} (k = 8) and "
              f"{res['bayes_auc'] - auc['hvctr_sync']:.4f} (sync), target under 0.03.",
              "", "k = 8 against sync (same data, last round):", "",
              "| | sync | k = 8 | ratio |", "|---|---|---|---|",
              f"| dense merge bytes/sample | {sync['dense_bytes_per_sample']:.1f} | {k8['dense_bytes_per_sample']:.1f} | "
              f"{k8['dense_bytes_per_sample'] / sync['dense_bytes_per_sample']:.3f} |",
              f"| sparse exchange bytes/sample | {sync['sparse_bytes_per_sample']:.1f} | {k8['sparse_bytes_per_sample']:.1f} | "
              f"{k8['sparse_bytes_per_sample'] / sync['sparse_bytes_per_sample']:.3f} |",
              f"| samples/s (median) | {sps['hvctr_sync']:,.0f} | {sps['hvctr_k8']:,.0f} | {sps['hvctr_k8'] / sps['hvctr_sync']:.2f} |",
              f"| AUC | {sync['auc']:.4f} | {k8['auc']:.4f} | {k8['auc'] - sync['auc']:+.4f} |", "",
              f"The k sweep and merge.states (one run each; k = 8 {DEFAULT_STATES}, the default, from the last round; "
              "calibration = predicted CTR / actual CTR, 1 / COPC):", "",
              "| run | k | merge.states | samples/s | AUC | logloss | calibration | dense B/sample | sparse B/sample |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in [*res["sweep"][:3], k8, *res["sweep"][3:], *res["extra"]]:
        k = next((f.split("=")[1] for f in r["flags"] if "every_k_steps" in f), "-")
        st = next((f.split("=")[1] for f in r["flags"] if "states" in f), DEFAULT_STATES)
        lines.append(f"| {r['system']} | {k} | {st} | {r['samples_per_s']:,.0f} | {r['auc']:.4f} | {r['logloss']:.4f} | "
                     f"{r['calibration']:.3f} | {r['dense_bytes_per_sample']:.1f} | {r['sparse_bytes_per_sample']:.1f} |")
    fp16, ooc = res["extra"]
    by_states = {DEFAULT_STATES: k8, **dict(zip(OTHER_STATES, res["sweep"][3:]))}
    lines += ["", "merge.states at k = 8: " + "; ".join(
        f"`{st}` AUC {r['auc']:.4f}, logloss {r['logloss']:.4f}, calibration {r['calibration']:.3f}, dense "
        f"{r['dense_bytes_per_sample']:.1f} B/sample ({r['dense_bytes_per_sample'] / sync['dense_bytes_per_sample']:.3f}x sync)"
        for st, r in by_states.items()) + f". The default is `{DEFAULT_STATES}` (hvctr.config says why)."]
    lines += ["", f"fp16 compression at k = 8 costs {round(k8['auc'] - fp16['auc'], 4) + 0.0:+.4f} AUC (k = 8 minus fp16) and sends "
              f"{fp16['dense_bytes_per_sample'] / k8['dense_bytes_per_sample']:.2f}x the dense bytes (Adam's v stays float32).",
              f"Out of core: with the CPU cache at 10% of the table ({res['table_bytes'] / 2**20:.0f} MiB in all), k = 8 runs at "
              f"{ooc['samples_per_s'] / k8['samples_per_s']:.2f}x the all-cached throughput (this run against the last "
              f"round's), hit rate {ooc['cache_hit_rate']:.3f}, AUC {ooc['auc']:.4f} (all cached: {k8['auc']:.4f}).",
              "", "Time split of the k = 8 run (seconds per rank, rank 0): "
              + ", ".join(f"{k} {v:.1f}" for k, v in k8["time_split_s"].items()) + "."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.train", description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=2_200_000)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="300k rows, one round")
    p.add_argument("--work-dir", help="scratch directory (kept; data is reused when present)")
    p.add_argument("--benchmarks", default="", help="markdown file to write the Training section into (default: none)")
    p.add_argument("--no-write", action="store_true")
    p.add_argument("--peers", action="store_true",
                   help=f"only the rounds against TorchRec, the floor and the ceiling, k = 8 all cached and out of core "
                        f"(the section {PEERS_HEADING!r}); no sync, no sweep")
    p.add_argument("--before", help="with --peers: also run hvctr k = 8 from this source tree (an earlier commit, "
                                    "its kernels built), as hvctr_k8_before")
    p.add_argument("--seed", type=int, default=11, help="data_prep synth's seed (one data set a work directory)")
    args = p.parse_args(argv)
    if args.quick:
        args.rows, args.repeats = 300_000, 1
    command = "python -m bench.train " + " ".join(sys.argv[1:] if argv is None else argv)
    machine = machine_line()
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="hvctr-train-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    if args.peers:
        res = measure_peers(work, args.rows, args.repeats, Path(args.before).resolve() if args.before else None,
                            args.seed)
        text = (render_peers(res, command, machine) + f"\nWall time of the benchmark: {(time.time() - t0) / 60:.1f} min, "
                f"load average {os.getloadavg()[0]:.1f} at the end.\n")
        print(text)
        if args.benchmarks and not args.no_write:
            write_section(args.benchmarks, PEERS_HEADING, text)
        return 0
    res = measure(work, args.rows, args.repeats, args.seed)
    (work / "results.json").write_text(json.dumps(res, indent=1))
    text = render(res, command, machine) + f"\nWall time of the benchmark: {(time.time() - t0) / 60:.1f} min.\n"
    print(text)
    if args.benchmarks and not args.no_write:
        write_section(args.benchmarks, "## Training", text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
