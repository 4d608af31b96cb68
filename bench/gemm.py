"""The dense layers' products on one core: torch's own (MKL) against hvctr.models.linear (oneDNN).

    python -m bench.gemm [--rounds 5] [--steps 10] [--benchmarks BENCHMARKS.md]

For each model's dense part as hvctr trains it (forward, then backward with the embedding
input's gradient; no optimiser step), interleaved rounds of ``--steps`` steps of each product
kind in this one process of one thread; the medians go into the section "The dense layers'
products". The same modules, the same inputs: only hvctr.models.linear's switch differs
(``HVCTR_CPU_GEMM=mkl`` does the same for a whole run).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Callable

import torch
import torch.nn.functional as F

from bench.report import machine_line, publish
from hvctr.config import ModelArch, ModelConfig
from hvctr.models import build_model
from hvctr.models import linear as lin

HEADING = "## The dense layers' products"
# (name, arch, batch, dim, extra ModelConfig fields): the training benchmarks' models
MODELS = [("DNN 26 x 16 -> 512-256-1", ModelArch.DNN, 4096, 16, {}),
          ("DLRM 26 x 16, bottom 512-256-16, top 512-256-1", ModelArch.DLRM, 2048, 16,
           {"bottom_mlp": (512, 256, 16)}),
          ("DLRM-DCNv2 26 x 16, cross 3 of rank 64, top 512-256-1", ModelArch.DLRM_DCNV2, 2048, 16,
           {"bottom_mlp": (512, 256, 16), "cross_rank": 64}),
          ("DLRM 26 x 128 (MLPerf's widths), top 1024-1024-512-256-1", ModelArch.DLRM, 2048, 128,
           {"bottom_mlp": (512, 256, 128), "hidden": (1024, 1024, 512, 256)})]


def step_fn(arch: ModelArch, batch: int, dim: int, extra: dict) -> Callable[[], None]:
    """One forward + backward of ``arch``'s dense part on fixed random inputs."""
    torch.manual_seed(0)
    cfg = ModelConfig(arch=arch, **extra)
    model = build_model(cfg, dim=dim, seed=0)
    emb = torch.randn(batch, cfg.num_fields, dim, requires_grad=True)
    w1 = torch.randn(batch, cfg.num_fields)
    dense = torch.randn(batch, cfg.num_dense)
    labels = (torch.rand(batch) < 0.25).float()

    def step() -> None:
        model.zero_grad(set_to_none=True)
        emb.grad = None
        F.binary_cross_entropy_with_logits(model(dense, emb, w1), labels).backward()
    return step


def timed(step: Callable[[], None], steps: int, onednn: bool) -> float:
    """ms a step over ``steps`` steps, after one untimed."""
    lin._USE_ONEDNN = onednn
    step()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - t0) / steps * 1e3


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--benchmarks", default="", help="markdown file to write the section into (default: print only)")
    args = p.parse_args(argv)
    if lin.cpu_gemm({}) != "onednn":
        sys.exit("bench.gemm: this torch has no oneDNN linear (torch.ops.mkldnn._linear_pointwise): nothing to compare")
    torch.set_num_threads(1)
    t0, was = time.time(), lin._USE_ONEDNN
    machine = machine_line()
    rows = []
    try:
        for name, arch, batch, dim, extra in MODELS:
            step = step_fn(arch, batch, dim, extra)
            mkl, dnn = [], []
            for _ in range(args.rounds):
                mkl.append(timed(step, args.steps, False))
                dnn.append(timed(step, args.steps, True))
            m, d = statistics.median(mkl), statistics.median(dnn)
            rows.append(f"| {name} | {batch} | {m:.1f} | {d:.1f} | {d / m:.2f}x |")
            print(rows[-1], flush=True)
    finally:
        lin._USE_ONEDNN = was
    text = "\n".join([
        HEADING, "",
        f"Command: `python -m bench.gemm --rounds {args.rounds} --steps {args.steps}`  ",
        f"Machine: {machine}, torch {torch.__version__}, one thread  ",
        f"One process, one thread: forward and backward (the embeddings' gradient included, no optimiser step) of "
        f"each model's dense part, {args.steps} steps a round, medians of {args.rounds} interleaved rounds; the same "
        f"modules and inputs, only hvctr.models.linear's products switched (`HVCTR_CPU_GEMM=mkl` for a whole run).",
        "", "| model | batch | torch's own (MKL), ms a step | oneDNN, ms a step | ratio |", "|---|---|---|---|---|",
        *rows, ""])
    publish(text, t0, args.benchmarks, HEADING)


if __name__ == "__main__":
    main()
