"""The learning rates of a step at W ranks: the configured rates, scaled for the world size.

W ranks each see 1/W of the data. Averaging their models every k steps (or their gradients
every step) moves the model about as far per window as one rank would, while W times the
samples were consumed: at one epoch the model is under-trained by a factor that grows with W
(the 0.02 AUC that 8 ranks lost on 2M rows). ``merge.lr_scaling`` makes up for it as large-batch
SGD does (Goyal et al., arXiv 1706.02677): both learning rates x W (``linear``) or x sqrt(W)
(``sqrt``, the usual rule for Adam), reached over ``merge.lr_warmup_steps`` steps from the
configured rates. A pure function of (step, W, config): every rank, a resumed run and the
in-process simulation compute the same rate.

What grows is the global batch, not the rank count as such: with ``data.global_batch_size`` set,
W ranks take G / W rows each, the global batch stays G, and every rule here is the identity
(``batch_growth`` = 1): the configured rates and Adam's constants hold at every W.

``merge.adam_scaling = sqrt`` also shortens Adam's memory as the world grows: 1 - beta1 and
1 - beta2 x sqrt(W), eps / W^(1/4). Each step of a rank now stands for about sqrt(W) steps'
worth of samples, so the moments should average over fewer of them; the form follows the
SDE scaling rule for Adam (Malladi et al., arXiv 2205.10287: 1 - beta x kappa, eps / sqrt(kappa)
for a batch kappa times larger), with kappa = sqrt(W), chosen by measurement (kappa = W, the
rule's own choice for synchronous training, lost AUC at W = 8). It applies to dense and sparse Adam.

The other world-size rules, the global batch's per-rank share (``batch_growth``, ``size_batch``)
and ``merge.dense_every_steps = -1`` (``resolve_merge``), live beside the config they resolve, in
hvctr.config.resolve.
"""

from __future__ import annotations

import math

from hvctr.config import AdamScaling, LrScaling, MergeConfig, TrainConfig


def world_factor(rule: LrScaling, growth: int) -> float:
    """The factor the rates reach after warmup for a global batch ``growth`` times one rank's."""
    if rule is LrScaling.LINEAR:
        return float(growth)
    if rule is LrScaling.SQRT:
        return math.sqrt(growth)
    return 1.0


class LearningRates:
    """``dense(step)`` and ``sparse(step)``: the rates of the step with this (0-based) index."""

    def __init__(self, train: TrainConfig, merge: MergeConfig, growth: int) -> None:
        """``growth``: the global batch over one rank's (``batch_growth``: W, or 1 at a fixed global batch)."""
        self.base_dense, self.base_sparse = train.dense_lr, train.sparse_lr
        self.target = world_factor(merge.lr_scaling, growth)
        self.warmup = merge.lr_warmup_steps
        kappa = math.sqrt(growth) if merge.adam_scaling is AdamScaling.SQRT else 1.0
        # Adam's constants at this world size (the configured ones at W = 1 or without adam_scaling)
        self.beta1 = max(0.0, 1.0 - kappa * (1.0 - train.beta1)) if kappa != 1.0 else train.beta1
        self.beta2 = max(0.0, 1.0 - kappa * (1.0 - train.beta2)) if kappa != 1.0 else train.beta2
        self.eps = train.eps / math.sqrt(kappa) if kappa != 1.0 else train.eps

    def factor(self, step: int) -> float:
        if self.warmup <= 0 or self.target == 1.0:
            return self.target
        return 1.0 + (self.target - 1.0) * min(1.0, (step + 1) / self.warmup)

    def dense(self, step: int) -> float:
        return self.base_dense * self.factor(step)

    def sparse(self, step: int) -> float:
        return self.base_sparse * self.factor(step)

    def describe(self) -> str:
        adam = f"; Adam betas ({self.beta1:.4g}, {self.beta2:.6g}), eps {self.eps:.3g}"
        if self.target == 1.0:
            return f"dense_lr {self.base_dense:g}, sparse_lr {self.base_sparse:g}{adam}"
        ramp = f" over {self.warmup} warmup steps" if self.warmup else ""
        return (f"dense_lr {self.base_dense:g} -> {self.base_dense * self.target:g}, sparse_lr {self.base_sparse:g} -> "
                f"{self.base_sparse * self.target:g} (x{self.target:.3g}{ramp}){adam}")
