"""Dense-side reductions: the k-step model merge, and the synchronous baseline's gradient average.

KStepMerger sits beside the optimiser, as torchft's LocalSGD does: ranks take k local Adam
steps, then one grouped allreduce averages the dense parameters and the Adam moments that
``merge.states`` names. It is not ``hvd.DistributedOptimizer``, which averages gradients every
step (that is SyncGradients, the baseline).

Control flags (stop, checkpoint) ride in the same grouped allreduce as int-valued float32
sums, so a request raised on one rank is seen by every rank at the same window boundary.

An outer step (``merge.outer_lr``, ``merge.outer_momentum``; SlowMo, arXiv 1910.00643, and
DiLoCo, arXiv 2311.08105) treats the window's averaged move as a pseudo-gradient: with
``d = start - average``, ``u = momentum * u + d`` and ``params = start - outer_lr * u``. Every
rank holds the same start, average and u, so the result is the same on every rank; 1 and 0
(the defaults) are plain averaging, bit for bit. u is checkpointed with the dense state.

``merge.compression = fp16`` sends each parameter's move since the last merge, not the
parameter, in float16 (the average is start + the mean move: a move is small, so its float16
rounding is small beside it, where rounding the parameters themselves would cost each merge
about 1e-3 of their size), and m cast to float16, inside the one grouped allreduce; Adam's v
(1e-8 .. 1e-11, below fp16's smallest normal 6e-5) always travels in float32. Every rank holds
the same start, so every rank gets the same average.

``merge.dense_every_steps`` merges the dense model more often than the rows: the trainer calls
merge() inside the window too (its flags are ignored there; requests are read at the window's
end). Its default (-1, auto) is resolved by hvctr.config.resolve.resolve_merge. Why the dense
model merges more often than the rows at many ranks, and what it recovers (measured, with the
data set, global batch and steps a rank of each figure): docs/merging.md and BENCHMARKS.md.

``merge.dense_gradients = powersgd`` (PowerSGD) keeps the dense model synchronous instead: its
gradients are averaged every step, each weight matrix's as two rank-r factors, and every rank
takes the same Adam step; the window's end then sums the control flags alone.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import torch

from hvctr.config import Compression, DenseGradients, MergeConfig, MergeStates

if TYPE_CHECKING:
    from hvctr.distributed.protocol import Comm

NUM_FLAGS = 2  # [stop requested, checkpoint requested]


class _DenseReducer:
    def __init__(self, comm: Comm, cfg: MergeConfig, params: Sequence[torch.Tensor],
                 hierarchical: bool = False) -> None:
        self.comm = comm
        self.cfg = cfg
        self.params = list(params)
        # Hierarchical only where it differs from one flat allreduce: one node, or one rank per
        # node, would make it the flat allreduce under another name (the summary says which ran).
        self.hierarchical = hierarchical and 1 < comm.num_nodes < comm.size
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


class PowerSGD:
    """The dense gradients averaged over the ranks every step at a fraction of their bytes
    (Vogels, Karimireddy and Jaggi, arXiv 1905.13727). Each weight matrix's gradient M (n x m,
    plus this rank's error of the last step) is sent as P = M Q (n x r), then, P summed and
    orthonormalised, as Q = M^T P (m x r); every rank then applies P Q^T / W, the same on every
    rank, and keeps M - P Q^T as its error for the next step. Q starts from one seeded draw on
    every rank and carries over (one power iteration a step). Vectors, and matrices whose factors
    would not be smaller, travel whole, with the first factors. Two grouped allreduces a step.

    The error feedback is each rank's own and is not checkpointed: a resumed run starts it from
    zero (its model then differs from an uninterrupted run's by that last step's error)."""

    def __init__(self, reducer: "_DenseReducer", rank: int, seed: int) -> None:
        self.reducer = reducer
        gen = torch.Generator().manual_seed(seed)
        self.q: dict[int, torch.Tensor] = {}
        self.err: dict[int, torch.Tensor] = {}
        for i, p in enumerate(reducer.params):
            n, m = (p.shape[0], p[0].numel()) if p.dim() >= 2 else (1, p.numel())
            if p.dim() >= 2 and rank * (n + m) < n * m:
                self.q[i] = torch.randn(m, rank, generator=gen, dtype=p.dtype)
                self.err[i] = torch.zeros(n, m, dtype=p.dtype)
        self.whole = [i for i in range(len(reducer.params)) if i not in self.q]

    def average(self, name: str) -> None:
        """Replaces every dense parameter's .grad by the (approximate) average over the ranks."""
        params = self.reducer.params
        size = self.reducer.comm.size
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        with torch.no_grad():
            mats = {i: grads[i].reshape(self.err[i].shape) + self.err[i] for i in self.q}
            first = [mats[i] @ self.q[i] for i in self.q] + [grads[i] for i in self.whole]
            summed = self.reducer._sum(first, f"{name}.p")  # comm: grouped allreduce (Sum) of P and the vectors
            for k, i in enumerate(self.whole):
                params[i].grad = summed[len(self.q) + k] / size
            basis = [torch.linalg.qr(s, mode="reduced").Q for s in summed[:len(self.q)]]
            second = [mats[i].T @ b for i, b in zip(self.q, basis)]
            q_sum = self.reducer._sum(second, f"{name}.q")  # comm: grouped allreduce (Sum) of Q
            for i, b, qs in zip(list(self.q), basis, q_sum):
                q = qs / size
                approx = b @ q.T
                self.err[i] = mats[i] - approx
                params[i].grad = approx.reshape(params[i].shape)
                self.q[i] = q


class KStepMerger(_DenseReducer):
    """Averages the dense model every ``merge.every_k_steps`` local steps (or, with
    ``merge.dense_gradients = powersgd``, its gradients every step: ``average_gradients``)."""

    def __init__(self, comm: Comm, cfg: MergeConfig, params: Sequence[torch.Tensor],
                 hierarchical: bool = False, seed: int = 0) -> None:
        super().__init__(comm, cfg, params, hierarchical)
        self.powersgd = PowerSGD(self, cfg.powersgd_rank, seed) if cfg.dense_gradients is DenseGradients.POWERSGD else None
        self.merge_m = cfg.states is MergeStates.PARAMS_M_V
        self.merge_v = cfg.states in (MergeStates.PARAMS_V, MergeStates.PARAMS_M_V)
        self.outer = cfg.outer_lr != 1.0 or cfg.outer_momentum != 0.0
        self.moves = cfg.compression is Compression.FP16  # parameters travel as moves since the last merge
        self.start: list[torch.Tensor] = []  # the parameters after the last merge (outer step, fp16 moves)
        self.momentum: list[torch.Tensor] = [torch.zeros_like(p) for p in self.params] if self.outer else []

    def mark_start(self) -> None:
        """Takes the parameters as the next window's start: before the first window (after a
        checkpoint load); merge() moves it on by itself."""
        if self.outer or self.moves:
            self.start = [p.detach().clone() for p in self.params]

    def _outer_step(self) -> None:
        """params (the average, in place) <- start - outer_lr * u, u = momentum * u + (start - average)."""
        if len(self.start) != len(self.params):
            raise RuntimeError("KStepMerger: the outer step needs the window's start: call mark_start() first")
        lr, beta = self.cfg.outer_lr, self.cfg.outer_momentum
        for p, start, u in zip(self.params, self.start, self.momentum):
            u.mul_(beta).add_(start - p.detach())
            p.detach().copy_(start - lr * u)
            start.copy_(p.detach())

    def merge(self, moments: tuple[list[torch.Tensor], list[torch.Tensor]], flags: Sequence[int],
              name: str) -> list[int]:
        """Averages params (and m, v) in place; returns the flags summed over ranks."""
        if self.powersgd is not None:  # the dense model is the same on every rank: the flags alone
            # comm: one allreduce (Sum) of the control flags
            summed = self._sum([torch.tensor(list(flags), dtype=torch.float32)], name)
            return [int(round(f)) for f in summed[0].tolist()]
        m_list, v_list = moments
        wire_dtype = torch.float16 if self.cfg.compression is Compression.FP16 else torch.float32
        if self.moves and len(self.start) != len(self.params):
            raise RuntimeError("KStepMerger: fp16 moves need the last merge's parameters: call mark_start() first")
        sent = [p.detach() - s for p, s in zip(self.params, self.start)] if self.moves else [p.detach() for p in self.params]
        lossy: list[torch.Tensor] = sent + (list(m_list) if self.merge_m else [])
        exact: list[torch.Tensor] = list(v_list) if self.merge_v else []
        payload = [t.detach().to(wire_dtype) for t in lossy] + [t.detach().float() for t in exact]
        payload.append(torch.tensor(list(flags), dtype=torch.float32))
        summed = self._sum(payload, name)
        scale = 1.0 / self.comm.size
        n = len(self.params)
        with torch.no_grad():
            for i, (dst, src) in enumerate(zip(list(self.params) + lossy[n:] + exact, summed[:-1])):
                avg = src.to(dst.dtype) * scale
                dst.copy_(self.start[i] + avg if self.moves and i < n else avg)
            if self.outer:
                self._outer_step()
            elif self.moves:
                for p, s in zip(self.params, self.start):
                    s.copy_(p.detach())
        return [int(round(f)) for f in summed[-1].tolist()]

    def average_gradients(self, name: str) -> None:
        """merge.dense_gradients = powersgd: the dense gradients averaged over the ranks (PowerSGD)."""
        self.powersgd.average(name)


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
