"""Measures the sparse path of one training step beside the MLP step it must stay small against.

    python -m bench.sparse --threads 1 --repeats 15 [--write BENCHMARKS.md]

One window of ``--window`` batches of 4096 samples x 26 fields, keys drawn per field from a
power law (Zipf, exponent 1.1) over Criteo Kaggle's field cardinalities; the working set is
the window's unique keys. Per batch it times batch_unique, gather_rows, sum_rows_grad and
sparse_adam_step, with the C kernels and with the torch reference path, and the DNN step
(forward, backward, Adam) on the gathered batch. batch_unique runs ahead of the step (the
window carries it, computed in the prefetch thread), so the sparse path of the step,
``total_ms``, is the other three; ``ahead_ms`` is batch_unique. Each figure is the median over
``--repeats`` interleaved rounds; one JSON line per measurement.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

from hvctr.determinism import deterministic_torch
from hvctr.models import DNN
from hvctr.kernels import native as _native
from hvctr.optim.sparse_adam import batch_unique, gather_rows, row_width, sparse_adam_step, sum_rows_grad

# Distinct values per categorical field of Criteo Kaggle (C1..C26).
CRITEO_CARDINALITIES = [1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194, 27,
                        14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572]


def power_law_positions(samples: int, seed: int, exponent: float = 1.1) -> np.ndarray:
    """Working-set positions [samples, 26] of keys drawn with P(rank r) ~ r^-exponent per field.

    Exponent 1.1 gives what was measured for Criteo-like cardinalities (2026-11-30): about 5.8 unique rows per
    sample in a batch of 4096 and 3.4 in a window of 8 batches.
    """
    rng = np.random.default_rng(seed)
    card = np.array(CRITEO_CARDINALITIES, dtype=np.float64)
    a = 1.0 - exponent  # inverse CDF of the continuous power law on [1, card + 1)
    u = rng.random((samples, card.size))
    ranks = np.floor(((card ** a - 1) * u + 1) ** (1 / a)).astype(np.int64) - 1
    offsets = np.concatenate([[0], np.cumsum(card[:-1])]).astype(np.int64)
    _, inverse = np.unique(ranks + offsets, return_inverse=True)
    return inverse.reshape(samples, card.size)


def _times_ms(fn: Callable[[], object], repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


QUIET_MLP_STEP_MS = 76.0  # measured 2026-11-30: the MLP step per 4096 rows on 1 thread, quiet machine
PARTS = ("batch_unique", "gather_rows", "sum_rows_grad", "sparse_adam_step")
AHEAD = ("batch_unique",)  # computed with the window, in the prefetch thread
STEP_PARTS = tuple(n for n in PARTS if n not in AHEAD)  # what the training step runs per batch


def measure(repeats: int, window: int, batch_size: int, dim: int, threads: int) -> list[dict]:
    """The setup line, then one line per path (native, torch): medians in ms and the ratio."""
    torch.set_num_threads(threads)
    deterministic_torch()
    B, D = batch_size, dim
    pos_all = torch.from_numpy(power_law_positions(window * B, seed=0))
    U = int(pos_all.max()) + 1
    g = torch.Generator().manual_seed(0)
    rows = torch.rand(U, row_width(D), generator=g) * 0.01
    pos = pos_all[:B]
    uniq = batch_unique(pos)
    dense = torch.rand(B, 13, generator=g)
    labels = (torch.rand(B, generator=g) < 0.25).float()
    model = DNN(num_fields=pos.shape[1], dim=D)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    leaf = gather_rows(rows, pos, D)

    def mlp_step() -> None:
        opt.zero_grad()
        leaf.grad = None
        F.binary_cross_entropy_with_logits(model(dense, leaf[..., :D], leaf[..., D]), labels).backward()
        opt.step()

    mlp_step()
    grad = leaf.grad.clone()
    idx, summed = sum_rows_grad(pos, grad, uniq)
    fns = dict(zip(PARTS, (lambda: batch_unique(pos), lambda: gather_rows(rows, pos, D),
                           lambda: sum_rows_grad(pos, grad, uniq),
                           lambda: sparse_adam_step(rows, idx, summed, 1e-3, 0.9, 0.999, 1e-8))))
    times: dict[str, list[float]] = {}
    for _ in range(repeats):  # interleaved rounds: load from other processes hits every figure alike
        times.setdefault("mlp_step", []).extend(_times_ms(mlp_step, 1))
        for path in ("native", "torch"):
            with (_native.disabled() if path == "torch" else contextlib.nullcontext()):
                for name, fn in fns.items():
                    times.setdefault(f"{path}.{name}", []).extend(_times_ms(fn, 1))
    med = {k: statistics.median(v) for k, v in times.items()}
    lines = [{"bench": "sparse_path_setup", "batch_size": B, "fields": pos.shape[1], "dim": D, "threads": threads,
              "window": window, "working_set_rows": U, "batch_unique_rows": idx.numel(),
              "unique_rows_per_sample_batch": idx.numel() / B, "unique_rows_per_sample_window": U / (window * B),
              "native": _native.lib() is not None}]
    for path in ("native", "torch"):
        total = sum(med[f"{path}.{n}"] for n in STEP_PARTS)
        ahead = sum(med[f"{path}.{n}"] for n in AHEAD)
        lines.append({"bench": "sparse_path", "path": path, **{n + "_ms": round(med[f"{path}.{n}"], 3) for n in PARTS},
                      "total_ms": round(total, 3), "ahead_ms": round(ahead, 3), "mlp_step_ms": round(med["mlp_step"], 3),
                      "total_over_mlp_step": round(total / med["mlp_step"], 4)})
    return lines


_WHAT = {"batch_unique": "batch_unique (positions -> unique rows + inverse): ahead, with the window",
         "gather_rows": "gather_rows (rows[pos, :D+1] as a leaf)",
         "sum_rows_grad": "sum_rows_grad (gradient summed per row)",
         "sparse_adam_step": "sparse_adam_step (lazy Adam, per-row steps, in place)"}


def section(lines: list[dict], command: str) -> str:
    """The "## Sparse path" section of BENCHMARKS.md for these results."""
    from bench.report import machine_line  # noqa: PLC0415 (only the --write path needs it)

    setup, native, ref = lines
    load = os.getloadavg()[0]
    rows = [f"| {_WHAT[n]} | {native[n + '_ms']:.2f} | {ref[n + '_ms']:.2f} |" for n in STEP_PARTS]
    ahead = [f"| {_WHAT[n]} | {native[n + '_ms']:.2f} | {ref[n + '_ms']:.2f} |" for n in AHEAD]
    return "\n".join([
        "## Sparse path", "",
        f"Command: `{command}`  ",
        f"Machine: {machine_line()}; load average {load:.1f} at the end. {setup['threads']} torch thread(s), "
        "`torch.use_deterministic_algorithms(True)`, medians over interleaved rounds. Other jobs may share "
        "the cores: the ratio to the MLP step, timed in the same rounds, is the figure.", "",
        f"A batch of {setup['batch_size']} samples x {setup['fields']} fields from a window of {setup['window']} "
        f"batches; keys per field Zipf(1.1) over Criteo Kaggle's cardinalities: "
        f"{setup['unique_rows_per_sample_batch']:.2f} unique rows per sample in the batch "
        f"({setup['batch_unique_rows']:,} rows), {setup['unique_rows_per_sample_window']:.2f} in the window "
        f"(working set {setup['working_set_rows']:,} rows). The MLP step is the DNN {setup['fields']} x "
        f"{setup['dim']} -> 512-256-1 forward, backward and Adam on the same batch.", "",
        "| per batch | C kernels (ms) | torch ops (ms) |", "|---|---|---|", *rows,
        f"| **sparse path of the step** | **{native['total_ms']:.2f}** | **{ref['total_ms']:.2f}** |",
        *ahead,
        f"| MLP step, same rounds | {native['mlp_step_ms']:.1f} | {ref['mlp_step_ms']:.1f} |",
        f"| **sparse path / MLP step** | **{native['total_over_mlp_step']:.3f}** | "
        f"**{ref['total_over_mlp_step']:.3f}** |", "",
        "batch_unique is not in the step: the window carries each batch's unique positions, computed "
        "where the window is built (the prefetch thread; the main thread between windows when "
        "data.prefetch is off). The C path (plain C through ctypes, compiled on first use) is what runs on the CPU; the torch path "
        "runs on CUDA and where no C compiler exists. Memory-bound kernels and the MLP's GEMMs do not slow "
        "down alike under load, so the ratio is a guide, not a constant. Against the 76 ms MLP step "
        f"measured on a quiet machine (2026-11-30), this run's C sparse path is "
        f"{native['total_ms'] / QUIET_MLP_STEP_MS:.3f} of a step.",
    ]) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.sparse", description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--window", type=int, default=8, help="batches per window (the working set's span)")
    p.add_argument("--batch-size", type=int, default=4096)
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--write", metavar="MD", help="also write the '## Sparse path' section of this markdown file")
    args = p.parse_args(argv)
    lines = measure(args.repeats, args.window, args.batch_size, args.dim, args.threads)
    for line in lines:
        print(json.dumps(line), flush=True)
    if args.write:
        from bench.report import write_section  # noqa: PLC0415

        shown = " ".join(["python -m bench.sparse", *[a for a in (argv if argv is not None else sys.argv[1:])
                                                            if not a.startswith("--write") and a != args.write]])
        write_section(args.write, "## Sparse path", section(lines, shown))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
