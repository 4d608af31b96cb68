"""Deterministic torch for every hvctr process that trains, scores or measures a step.

``deterministic_torch()``: ``torch.use_deterministic_algorithms(True)`` (the same inputs give
the same results bit for bit, run to run; on CUDA with hvctr.train.cmd's cuBLAS workspace), and
torch's ``fill_uninitialized_memory`` off. That fill, on by default in deterministic mode, writes
NaN into every tensor torch.empty (and every op's output) allocates before the op writes it:
a guard for code that would read memory it never wrote, paid by every op. hvctr reads none
(its results are checked bit-identical across runs, prefetch on and off, engines and thread
counts, in tests/), and torch's documentation names turning the fill off as the way for such a
program to stay deterministic without its cost. Its cost is small: the trainer's DNN step on one
thread (batch 4096, 26 x 16 embeddings) takes 106.9 ms of CPU with it and 106.1 without
(`python -m bench.step`, hvctr_nan_fill against hvctr), 51 fills a step by torch's profiler;
DLRM's step, 91 fills, within its spread (BENCHMARKS.md, "Multi-hot data").
"""

from __future__ import annotations

import torch
import torch.utils.deterministic


def deterministic_torch() -> None:
    """Deterministic algorithms on, the NaN fill of fresh tensors off (module docstring)."""
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = False
