"""One training step of hvctr's DNN against the compute floor, in thread CPU time.

    python -m bench.step [--reps 30] [--working-set 120000]

On a shared machine wall-clock times follow the neighbours; a step's CPU time (one thread,
time.thread_time) much less so. Interleaved, on one thread, batch 4096 x 26 fields x 16 dims,
MLP 512-256-1, positions drawn uniformly from a working set of ``--working-set`` rows:

- ``hvctr``: the trainer's step: gather_embeddings, forward, backward, sum_embedding_grads,
  lazy Adam on the touched rows, dense Adam (each part timed);
- ``hvctr_gather_rows``: the same with gather_rows + sum_rows_grad (the step before issue 19);
- ``hvctr_nan_fill``: the trainer's step with torch's NaN fill of fresh tensors on, as
  torch.use_deterministic_algorithms has it by default (hvctr.determinism turns it off);
- ``floor``: the MLP alone with the gradient of its embedding input, and dense Adam
  (bench.baseline's floor).

Medians of the repetitions, in ms of CPU per step.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
import torch.nn.functional as F
import torch.utils.deterministic

from hvctr.determinism import deterministic_torch
from hvctr.formats import NUM_DENSE
from hvctr.models import DNN
from hvctr.optim import (batch_unique, gather_embeddings, gather_rows, row_width, sparse_adam_step,
                         sum_embedding_grads, sum_rows_grad)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.step", description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--working-set", type=int, default=120_000)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    deterministic_torch()
    B, F_, D, U = 4096, 26, 16, args.working_set
    rng = np.random.default_rng(0)
    rows = torch.from_numpy(rng.random((U, row_width(D)), dtype=np.float32) * 0.01)
    rows[:, -1] = 1.0  # step counts
    pos = [torch.from_numpy(rng.integers(0, U, (B, F_))) for _ in range(8)]
    uniq = [batch_unique(p) for p in pos]
    dense, labels = torch.randn(B, NUM_DENSE), (torch.rand(B) < 0.25).float()
    torch.manual_seed(0)
    model = DNN(F_, D)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    mlp = DNN(F_, D).mlp
    opt_floor = torch.optim.Adam(mlp.parameters(), lr=1e-3)
    emb_in = torch.randn(B, F_ * D, requires_grad=True)
    times: dict[str, list[float]] = {}

    def timed(name, f):
        t0 = time.thread_time()
        out = f()
        times.setdefault(name, []).append(time.thread_time() - t0)
        return out

    def hvctr(i: int, split: bool, tag: str = "") -> None:
        tag = tag or ("hvctr" if split else "hvctr_gather_rows")
        p = pos[i % 8]
        if split:
            emb, w1 = timed(f"{tag}.gather", lambda: gather_embeddings(rows, p, D))
        else:
            g = timed(f"{tag}.gather", lambda: gather_rows(rows, p, D))
            emb, w1 = g[..., :D], g[..., D]

        def fwd_bwd():
            loss = F.binary_cross_entropy_with_logits(model(dense, emb, w1), labels)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            return float(loss.detach())

        timed(f"{tag}.forward_backward", fwd_bwd)
        if split:
            idx, grad = timed(f"{tag}.sum_grads", lambda: sum_embedding_grads(p, emb.grad, w1.grad, uniq[i % 8]))
        else:
            idx, grad = timed(f"{tag}.sum_grads", lambda: sum_rows_grad(p, g.grad, uniq[i % 8]))
        timed(f"{tag}.row_adam", lambda: sparse_adam_step(rows, idx, grad, 1e-3, 0.9, 0.999, 1e-8))
        timed(f"{tag}.dense_adam", opt.step)

    def floor(i: int) -> None:
        def fwd_bwd():
            emb_in.grad = None
            opt_floor.zero_grad()
            F.binary_cross_entropy_with_logits(mlp.forward_blocks([emb_in, dense]).squeeze(1), labels).backward()

        timed("floor.forward_backward", fwd_bwd)
        timed("floor.dense_adam", opt_floor.step)

    def nan_filled(i: int) -> None:
        torch.utils.deterministic.fill_uninitialized_memory = True
        try:
            hvctr(i, True, "hvctr_nan_fill")
        finally:
            torch.utils.deterministic.fill_uninitialized_memory = False

    steps = {"hvctr": lambda i: hvctr(i, True), "hvctr_gather_rows": lambda i: hvctr(i, False),
             "hvctr_nan_fill": nan_filled, "floor": floor}
    for i in range(3):  # warm-up
        for f in steps.values():
            f(i)
    times.clear()
    for i in range(args.reps):
        for name, f in steps.items():
            timed(name, lambda: f(i))
    med = {k: 1e3 * float(np.median(v)) for k, v in times.items()}
    for name in steps:
        parts = ", ".join(f"{k.split('.', 1)[1]} {v:.1f}" for k, v in med.items() if k.startswith(name + "."))
        ratio = f"; floor / {name} = {med['floor'] / med[name]:.2f}" if name != "floor" else ""
        print(f"{name}: {med[name]:.1f} ms CPU per step ({parts}){ratio}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
