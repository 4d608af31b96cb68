"""Measures the sparse path of one training step beside the MLP step it must stay small against.

    python -m hvctr.optim.bench --threads 1 --repeats 15

One window of ``--window`` batches of 4096 samples x 26 fields, keys drawn per field from a
power law (Zipf, exponent 1.1) over Criteo Kaggle's field cardinalities; the working set is
the window's unique keys. Per batch it times batch_unique, gather_rows, sum_rows_grad and
sparse_adam_step, with the C kernels and with the torch reference path, and the DNN step
(forward, backward, Adam) on the gathered batch. Each figure is the median over ``--repeats``
interleaved rounds; one JSON line per measurement.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

from hvctr.models import DNN
from hvctr.optim import _native
from hvctr.optim.sparse_adam import batch_unique, gather_rows, row_width, sparse_adam_step, sum_rows_grad

# Distinct values per categorical field of Criteo Kaggle (C1..C26).
CRITEO_CARDINALITIES = [1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194, 27,
                        14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572]


def power_law_positions(samples: int, seed: int, exponent: float = 1.1) -> np.ndarray:
    """Working-set positions [samples, 26] of keys drawn with P(rank r) ~ r^-exponent per field.

    Exponent 1.1 gives what DESIGN.md reports for Criteo-like data: about 5.8 unique rows per
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


def _median_ms(fn: Callable[[], object], repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hvctr.optim.bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--window", type=int, default=8, help="batches per window (the working set's span)")
    p.add_argument("--batch-size", type=int, default=4096)
    p.add_argument("--dim", type=int, default=16)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    B, D = args.batch_size, args.dim
    pos_all = torch.from_numpy(power_law_positions(args.window * B, seed=0))
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
    parts = {
        "batch_unique": lambda: batch_unique(pos),
        "gather_rows": lambda: gather_rows(rows, pos, D),
        "sum_rows_grad": lambda: sum_rows_grad(pos, grad, uniq),
        "sparse_adam_step": lambda: sparse_adam_step(rows, idx, summed, 1e-3, 0.9, 0.999, 1e-8),
    }
    times: dict[str, list[float]] = {}
    for _ in range(args.repeats):  # interleaved rounds: load from other processes hits every figure alike
        times.setdefault("mlp_step", []).extend(_median_ms(mlp_step, 1))
        for path in ("native", "torch"):
            with (_native.disabled() if path == "torch" else contextlib.nullcontext()):
                for name, fn in parts.items():
                    times.setdefault(f"{path}.{name}", []).extend(_median_ms(fn, 1))
    med = {k: statistics.median(v) for k, v in times.items()}
    info = {"batch_size": B, "fields": pos.shape[1], "dim": D, "threads": args.threads, "window": args.window,
            "working_set_rows": U, "unique_rows_per_sample_batch": idx.numel() / B,
            "unique_rows_per_sample_window": U / (args.window * B), "native": _native.lib() is not None}
    print(json.dumps({"bench": "sparse_path_setup", **info}))
    for path in ("native", "torch"):
        total = sum(med[f"{path}.{n}"] for n in parts)
        line = {"bench": "sparse_path", "path": path, **{n + "_ms": round(med[f"{path}.{n}"], 3) for n in parts},
                "total_ms": round(total, 3), "mlp_step_ms": round(med["mlp_step"], 3),
                "total_over_mlp_step": round(total / med["mlp_step"], 4)}
        print(json.dumps(line))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
