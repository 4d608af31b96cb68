"""Dense-side reductions: the k-step model merge, and the synchronous baseline's gradient average.

KStepMerger sits beside the optimiser, as torchft's LocalSGD does: ranks take k local Adam
steps, then one grouped allreduce averages the dense parameters and the Adam moments that
``merge.states`` names. It is not ``hvd.DistributedOptimizer``, which averages gradients every
step (that is SyncGradients, the baseline).

Control flags (stop, checkpoint) ride in the same grouped allreduce as int-valued float32
sums, so a request raised on one rank is seen by every rank at the same window boundary.

``merge.compression = fp16`` casts the parameters and m to float16 on the wire, as Horovod's
fp16 compressor does (cast, allreduce, cast back), inside the one grouped allreduce; Adam's v
(1e-8 .. 1e-11, below fp16's smallest normal 6e-5) always travels in float32.
"""

from __future__ import annotations

from typing import Sequence

import torch

from hvctr.config import Compression, MergeConfig, MergeStates

NUM_FLAGS = 2  # [stop requested, checkpoint requested]


class _DenseReducer:
    def __init__(self, comm, cfg: MergeConfig, params: Sequence[torch.Tensor], hierarchical: bool = False) -> None:
        self.comm = comm
        self.cfg = cfg
        self.params = list(params)
        self.hierarchical = hierarchical
        self.bytes_sent = 0  # payload bytes this rank contributed to dense reductions
        self.calls = 0

    def _sum(self, tensors: list[torch.Tensor], name: str) -> list[torch.Tensor]:
        self.bytes_sent += sum(t.numel() * t.element_size() for t in tensors)
        self.calls += 1
        if self.hierarchical:
            # comm: hierarchical grouped allreduce (Sum): node first, then across nodes
            return self.comm.allreduce_sum_hierarchical(tensors, name=name)
        # comm: one grouped allreduce (Sum) of every dense tensor and the control flags
        return self.comm.allreduce_sum(tensors, name=name)


class KStepMerger(_DenseReducer):
    """Averages the dense model every ``merge.every_k_steps`` local steps."""

    def __init__(self, comm, cfg: MergeConfig, params: Sequence[torch.Tensor],
                 hierarchical: bool = False) -> None:
        super().__init__(comm, cfg, params, hierarchical)
        self.merge_m = cfg.states is MergeStates.PARAMS_M_V
        self.merge_v = cfg.states in (MergeStates.PARAMS_V, MergeStates.PARAMS_M_V)

    def merge(self, moments: tuple[list[torch.Tensor], list[torch.Tensor]], flags: Sequence[int],
              name: str) -> list[int]:
        """Averages params (and m, v) in place; returns the flags summed over ranks."""
        m_list, v_list = moments
        wire_dtype = torch.float16 if self.cfg.compression is Compression.FP16 else torch.float32
        lossy: list[torch.Tensor] = list(self.params) + (list(m_list) if self.merge_m else [])
        exact: list[torch.Tensor] = list(v_list) if self.merge_v else []
        payload = [t.detach().to(wire_dtype) for t in lossy] + [t.detach().float() for t in exact]
        payload.append(torch.tensor(list(flags), dtype=torch.float32))
        summed = self._sum(payload, name)
        scale = 1.0 / self.comm.size
        with torch.no_grad():
            for dst, src in zip(lossy + exact, summed[:-1]):
                dst.copy_(src.to(dst.dtype) * scale)
        return [int(round(f)) for f in summed[-1].tolist()]


class SyncGradients(_DenseReducer):
    """The synchronous baseline: dense gradients averaged over ranks before every Adam step."""

    def average(self, flags: Sequence[int], name: str) -> list[int]:
        wire_dtype = torch.float16 if self.cfg.compression is Compression.FP16 else torch.float32
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        payload = [g.to(wire_dtype) for g in grads] + [torch.tensor(list(flags), dtype=torch.float32)]
        summed = self._sum(payload, name)
        scale = 1.0 / self.comm.size
        for p, s in zip(self.params, summed[:-1]):
            p.grad = s.to(p.dtype) * scale
        return [int(round(f)) for f in summed[-1].tolist()]
