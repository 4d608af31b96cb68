"""The dense layers' matrix products on the CPU: oneDNN's, not MKL's.

The models' Linear layers (the MLPs, DLRM's bottom MLP, DCN's cross layers; not DeepFM's and
Wide & Deep's 13 -> 1 linear term on the dense features) go through
``linear(x, weight, bias, relu)``. For float32 tensors on the CPU it runs
``torch.ops.mkldnn._linear_pointwise`` (oneDNN, which torch's CPU wheels carry) in a
``torch.autograd.Function`` of its own: the forward with the ReLU fused into the GEMM where a
ReLU follows, and the input gradient as a second oneDNN product with the weight. The weight
gradient (gy^T x) stays torch's own product: oneDNN takes it as a linear of two transposed
operands, which it copies first, and measured alone it was no faster (10.4 against 10.2 ms for
the DNN's 416 -> 512 layer at batch 2048; within 5% either way for the benchmarks' other
layers). The bias gradient is a column sum. Anywhere else (CUDA, other dtypes, a torch without
oneDNN) it is ``F.linear`` (and ``relu``).

Why: torch's CPU ``addmm`` / ``mm`` call MKL, whose sgemm on this project's machine (AMD EPYC
with AVX-512) ran the DNN's first layer (4096 x 416 x 512) at 76-95 GFLOP/s on one core, where
oneDNN ran it at about 105. A step of the dense part, forward and backward with the
embeddings' gradient, on one core: ``python -m bench.gemm`` (BENCHMARKS.md, "The dense layers'
products"). The sums are float32 ones in another order: results differ from MKL's in the last
bits (relative 1e-7 to 1e-6), and are the same run to run, and for one thread or two.

``HVCTR_CPU_GEMM=mkl`` in the environment puts every layer back on torch's own products (MKL):
for an A/B on another CPU (on Intel CPUs MKL is tuned too; unmeasured here).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import Tensor, nn

GEMMS = ("onednn", "mkl")


def _onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def cpu_gemm(environ=os.environ) -> str:
    """Which products the CPU layers use: ``HVCTR_CPU_GEMM`` (onednn or mkl), oneDNN where
    torch has it by default. A value other than those two is an error naming the variable."""
    want = environ.get("HVCTR_CPU_GEMM", "").strip().lower() or "onednn"
    if want not in GEMMS:
        raise ValueError(f"HVCTR_CPU_GEMM={environ['HVCTR_CPU_GEMM']!r}: expected one of {', '.join(GEMMS)}")
    return "onednn" if want == "onednn" and _onednn_available() else "mkl"


_USE_ONEDNN = cpu_gemm() == "onednn"


def describe() -> str:
    """For rank 0's log: which products the CPU layers use, and how to change it."""
    if _USE_ONEDNN:
        return "oneDNN (HVCTR_CPU_GEMM=mkl for torch's own)"
    why = "HVCTR_CPU_GEMM=mkl" if _onednn_available() else "this torch has no oneDNN linear"
    return f"torch's own ({why})"


def _mm(a: Tensor, b_t: Tensor) -> Tensor:
    """a @ b_t.T through oneDNN: a [M, K], b_t [N, K]."""
    return torch.ops.mkldnn._linear_pointwise(a, b_t, None, "none", [], "")


class _OneDNNLinear(torch.autograd.Function):
    """y = x W^T + b (then ReLU where ``relu``) and the input gradient through oneDNN; the weight
    gradient through torch's own product."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None, relu: bool) -> Tensor:
        w = weight.contiguous()  # a column slice (linear_over_blocks' blocks) becomes its own matrix
        y = torch.ops.mkldnn._linear_pointwise(x, w, bias, "relu" if relu else "none", [], "")
        ctx.save_for_backward(x, w, y if relu else None)
        ctx.relu, ctx.has_bias = relu, bias is not None
        return y

    @staticmethod
    def backward(ctx, gy: Tensor):
        x, w, y = ctx.saved_tensors
        if ctx.relu:
            gy = torch.ops.aten.threshold_backward(gy, y, 0)  # ReLU's gradient, from its output
        gx = _mm(gy, w.t().contiguous()) if ctx.needs_input_grad[0] else None
        gw = gy.t().mm(x) if ctx.needs_input_grad[1] else None  # torch's own: see the module's docstring
        gb = gy.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return gx, gw, gb, None


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, relu: bool = False) -> Tensor:
    """``F.linear(x, weight, bias)``, then ``relu`` where asked: through oneDNN for a 2-D float32
    input on the CPU (see the module's docstring), else torch's own."""
    if (_USE_ONEDNN and x.dim() == 2 and x.device.type == "cpu" and x.dtype == torch.float32
            and weight.dtype == torch.float32):
        return _OneDNNLinear.apply(x, weight, bias, relu)
    y = F.linear(x, weight, bias)
    return torch.relu(y) if relu else y


def run_layers(layers: list[nn.Module], x: Tensor) -> Tensor:
    """``nn.Sequential(*layers)(x)`` with every Linear through ``linear`` and a ReLU right
    after a Linear fused into it."""
    i = 0
    while i < len(layers):
        layer = layers[i]
        if isinstance(layer, nn.Linear):
            relu = i + 1 < len(layers) and isinstance(layers[i + 1], nn.ReLU)
            x = linear(x, layer.weight, layer.bias, relu)
            i += 2 if relu else 1
        else:
            x = layer(x)
            i += 1
    return x


class Layers(nn.Sequential):
    """An ``nn.Sequential`` of Linear and ReLU layers (the same parameters, the same state-dict
    keys) whose forward runs them through ``run_layers``."""

    def forward(self, x: Tensor) -> Tensor:
        return run_layers(list(self), x)
