"""What the planner assumes of a GPU it has no measurement of: the datasheet, derated.

On a GPU node the dense model, the gather of a batch's rows and the sparse and dense Adam
steps run on the device, not on the host: their time comes from the GPU's rates, never from
a CPU's (the rates file of this project's VM would put an A100's step at 115 ms for an MLP it
runs in a few ms). Where the rates file carries GPU figures (``gpu_flops_per_s``,
``gpu_bytes_per_s``, ``gpu_kernel_s``, ``gpu_sparse_keys_per_s``: measured on the node by
``hvctr bench --calibrate``, bench.calibrate.gpu_rates), the planner uses them; else it derives
them here from the model name in the hardware map and says so ("assumed"):

    matrix products   FP32 peak x MATMUL_EFFICIENCY   (the marginal cost of a sample)
    memory-bound ops  HBM bandwidth x BANDWIDTH_EFFICIENCY  (dense Adam)
    the sparse path   SPARSE_KEYS_PER_HBM_BYTE x HBM bandwidth batch keys/s (the gather of a
                      batch's rows, the per-row gradient sum, lazy Adam: sorting and indexing,
                      not bandwidth, set it)
    a kernel          KERNEL_S (launch and eager PyTorch's dispatch, per kernel of a step)

Peaks are NVIDIA's published datasheet figures for the SXM/PCIe part named (dense, no
sparsity). The efficiencies and the per-kernel and per-key costs were fitted to one NVIDIA
H200 machine (torch 2.11, CUDA 13.0, 16 host cores; ``python -m bench.gpu_step``, BENCHMARKS.md
"The planner's GPU step against an H200"), where a step of the default DNN at batch 4096 took
3.9-6.6 ms in two runs: about 130 kernels at 25-45 us each, eager PyTorch's dispatch on the
host, set it, not the GPU's arithmetic (0.26 ms of FLOPs). The sparse path ran 1.15e8 batch keys/s
there; another GPU's is that scaled by its HBM bandwidth (an assumption).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

MATMUL_EFFICIENCY = 0.5  # the H200: 0.58 of its FP32 peak, the DNN's forward + backward from batch 4096 to 65536
BANDWIDTH_EFFICIENCY = 0.6  # the H200: a 256 MiB device copy at 0.64-0.70 of its HBM bandwidth
KERNEL_S = 40e-6  # the H200's host: 25-45 us a kernel inside a step (launch, dispatch, autograd, Python)
SPARSE_KEYS_PER_HBM_BYTE = 1.15e8 / 4.8e12  # the H200: 1.15e8 batch keys/s on 4.8 TB/s


@dataclass(frozen=True)
class GpuSpec:
    name: str
    fp32_flops_per_s: float  # peak, CUDA cores
    hbm_bytes_per_s: float
    memory_bytes: float
    host_link_bytes_per_s: float  # PCIe to the host, what a copy of the working set reaches (Gen3 12, Gen4 25, Gen5 50 GB/s)

    @property
    def flops_per_s(self) -> float:
        return self.fp32_flops_per_s * MATMUL_EFFICIENCY

    @property
    def bytes_per_s(self) -> float:
        return self.hbm_bytes_per_s * BANDWIDTH_EFFICIENCY


# (pattern on the map's model name, spec); the first match wins, so specific names come first
KNOWN: tuple[tuple[str, GpuSpec], ...] = (
    (r"A100.*80\s*GB.*PCIE|A100.*PCIE.*80\s*GB", GpuSpec("A100 PCIe 80GB", 19.5e12, 1.935e12, 80e9, 25e9)),
    (r"A100.*80\s*GB", GpuSpec("A100 SXM4 80GB", 19.5e12, 2.039e12, 80e9, 25e9)),
    (r"A100", GpuSpec("A100 40GB", 19.5e12, 1.555e12, 40e9, 25e9)),
    (r"H200", GpuSpec("H200 SXM 141GB", 67e12, 4.8e12, 141e9, 50e9)),
    (r"H100.*PCIE", GpuSpec("H100 PCIe 80GB", 51e12, 2.0e12, 80e9, 50e9)),
    (r"H100", GpuSpec("H100 SXM5 80GB", 67e12, 3.35e12, 80e9, 50e9)),
    (r"L40S", GpuSpec("L40S 48GB", 91.6e12, 0.864e12, 48e9, 25e9)),
    (r"V100.*32\s*GB", GpuSpec("V100 SXM2 32GB", 15.7e12, 0.9e12, 32e9, 12e9)),
    (r"V100", GpuSpec("V100 SXM2 16GB", 15.7e12, 0.9e12, 16e9, 12e9)),
)


def spec_for(model: str) -> GpuSpec | None:
    """The datasheet of the GPU a hardware map names (None: not one the planner knows)."""
    for pattern, spec in KNOWN:
        if re.search(pattern, model, re.IGNORECASE):
            return spec
    return None


@dataclass(frozen=True)
class GpuRates:
    """Per rank (one GPU each): what the device part of a step costs."""

    flops_per_s: float  # the dense model's forward and backward
    bytes_per_s: float  # memory-bound kernels
    kernel_s: float  # per kernel launched
    sparse_keys_per_s: float  # batch keys through the gather, the gradient sum and lazy Adam
    host_link_bytes_per_s: float  # host <-> device copies (0: unknown)
    source: str  # "measured (rates file)" or what was assumed


def gpu_rates(model: str, flops_per_s: float = 0.0, bytes_per_s: float = 0.0, kernel_s: float = 0.0,
              sparse_keys_per_s: float = 0.0, host_link_bytes_per_s: float = 0.0) -> GpuRates | None:
    """The rates file's GPU figures where it has them (> 0), the rest from ``model``'s datasheet;
    None when neither says anything (a GPU the planner does not know, and no measurement)."""
    if flops_per_s and bytes_per_s and kernel_s and sparse_keys_per_s:
        return GpuRates(flops_per_s, bytes_per_s, kernel_s, sparse_keys_per_s, host_link_bytes_per_s,
                        "measured (rates file)")
    spec = spec_for(model)
    if spec is None:
        return None
    host_link_bytes_per_s = host_link_bytes_per_s or spec.host_link_bytes_per_s
    assumed = []
    if not flops_per_s:
        flops_per_s = spec.flops_per_s
        assumed.append(f"{spec.fp32_flops_per_s / 1e12:g} TFLOP/s FP32 peak x {MATMUL_EFFICIENCY:g}")
    if not bytes_per_s:
        bytes_per_s = spec.bytes_per_s
        assumed.append(f"{spec.hbm_bytes_per_s / 1e12:g} TB/s HBM x {BANDWIDTH_EFFICIENCY:g}")
    if not kernel_s:
        kernel_s = KERNEL_S
        assumed.append(f"{KERNEL_S * 1e6:g} us a kernel")
    if not sparse_keys_per_s:
        sparse_keys_per_s = SPARSE_KEYS_PER_HBM_BYTE * spec.hbm_bytes_per_s
        assumed.append(f"{sparse_keys_per_s / 1e6:.0f}M sparse keys/s (the H200's, scaled by HBM bandwidth)")
    return GpuRates(flops_per_s, bytes_per_s, kernel_s, sparse_keys_per_s, host_link_bytes_per_s,
                    f"assumed from the datasheet of the {spec.name} ({'; '.join(assumed)}; hvctr.plan.gpus)")
