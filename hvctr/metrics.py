"""Evaluation metrics from histograms that ranks can sum: AUC, logloss, NE, COPC, calibration.

Each rank adds its predictions to an EvalAccumulator: positives and negatives counted per
prediction bucket, plus sums of logloss, predicted probability, labels and the count. These
are plain sums, so the job's metrics come from one sum-allreduce of ``tensors()`` (never by
gathering predictions on rank 0):

    acc = EvalAccumulator(cfg.metrics.auc_buckets)
    for batch in valid: acc.add_logits(model(...), labels)
    total = EvalAccumulator.from_tensors(comm.allreduce_sum(acc.tensors(), name="eval"))
    total.result()  # {"auc", "logloss", "ne", "copc", "calibration", "count", "ctr", "pred_ctr", ...}

The names follow the field's conventions, so a figure reads the same as in the papers and
tools it is compared with:

- ``ne``, normalized entropy (He et al., "Practical Lessons from Predicting Clicks on Ads at
  Facebook", 2014; TorchRec's NE): logloss / H(ctr), where H(p) = -(p log p + (1-p) log(1-p))
  is the logloss of always predicting the observed CTR. Below 1 the model beats that constant;
  unlike logloss it does not move with the data set's base rate.
- ``copc``, clicks over predicted clicks, as Paddle's fleet_util computes it: actual CTR /
  predicted CTR = sum(labels) / sum(predictions). Above 1 the model under-predicts.
- ``calibration``, TorchRec's CalibrationMetric: predicted / actual = 1 / copc. Above 1 the
  model over-predicts. (hvctr before issue 16 printed this ratio under the name COPC.)

Buckets are uniform in the logit, not in the probability: CTR predictions crowd near 0
(0.001-0.3), where uniform probability buckets are coarse in relative terms, while in the
logit they spread over a few units. With 2^16 buckets over logits in [-16, 16] a bucket is
5e-4 wide. A positive and a negative in one bucket count as half a correctly ordered pair,
which is exact for tied predictions and off by at most half a pair otherwise;
``auc_bin_error`` is that bound (an upper bound: tied predictions count in it but are exact),
computed from the histogram, so a result shows whether it met 1e-3.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

LOGIT_RANGE = 16.0  # logits beyond +-16 (p < 1.1e-7 or p > 1 - 1.1e-7) share the edge buckets
_P_CLIP = 1e-15  # logloss of a probability given as exactly 0 or 1, as sklearn's log_loss clips


class EvalAccumulator:
    """Per-bucket positive/negative counts and the sums behind logloss and COPC (float64)."""

    def __init__(self, num_buckets: int = 1 << 16, device: torch.device | str = "cpu") -> None:
        if num_buckets < 2:
            raise ValueError(f"num_buckets must be >= 2, got {num_buckets}")
        self.num_buckets = num_buckets
        self.hist = torch.zeros(2, num_buckets, dtype=torch.float64, device=device)  # [negatives, positives]
        self.sums = torch.zeros(4, dtype=torch.float64, device=device)  # logloss, prob, label, count

    # Adding predictions ----------------------------------------------------------------

    def add_logits(self, logits: Tensor, labels: Tensor) -> None:
        """Adds a batch given as logits (what the models return): exact logloss, no clipping."""
        z = logits.detach().reshape(-1).to(self.hist.device, torch.float64)
        y = self._labels(labels, z.numel())
        # logloss of sigmoid(z) against y, in the stable form softplus(z) - y * z
        loss = torch.nn.functional.softplus(z) - y * z
        self._add(z, y, loss, torch.sigmoid(z))

    def add(self, probs: Tensor, labels: Tensor) -> None:
        """Adds a batch given as click probabilities in [0, 1]."""
        p = probs.detach().reshape(-1).to(self.hist.device, torch.float64)
        if p.numel() and (float(p.min()) < 0 or float(p.max()) > 1):
            raise ValueError(f"probabilities must lie in [0, 1], got [{float(p.min())}, {float(p.max())}]")
        y = self._labels(labels, p.numel())
        pc = p.clamp(_P_CLIP, 1 - _P_CLIP)
        loss = -(y * pc.log() + (1 - y) * (-pc).log1p())
        self._add(pc.log() - (-pc).log1p(), y, loss, p)

    def _labels(self, labels: Tensor, n: int) -> Tensor:
        y = labels.detach().reshape(-1).to(self.hist.device, torch.float64)
        if y.numel() != n:
            raise ValueError(f"{n} predictions but {y.numel()} labels")
        if not bool(((y == 0) | (y == 1)).all()):
            raise ValueError("labels must be 0 or 1")
        return y

    def _add(self, z: Tensor, y: Tensor, loss: Tensor, p: Tensor) -> None:
        nb = self.num_buckets
        scaled = (z.clamp(-LOGIT_RANGE, LOGIT_RANGE) + LOGIT_RANGE) * (nb / (2 * LOGIT_RANGE))
        bucket = scaled.long().clamp_(0, nb - 1)
        counts = torch.bincount(bucket + nb * y.long(), minlength=2 * nb)
        self.hist += counts.view(2, nb).to(torch.float64)
        self.sums += torch.stack([loss.sum(), p.sum(), y.sum(), torch.tensor(float(y.numel()), dtype=torch.float64,
                                                                             device=y.device)])

    # Reduction across ranks --------------------------------------------------------------

    def tensors(self) -> list[Tensor]:
        """What to sum-allreduce across ranks: [hist (2, num_buckets), sums (4)], float64."""
        return [self.hist, self.sums]

    @classmethod
    def from_tensors(cls, tensors: list[Tensor]) -> "EvalAccumulator":
        hist, sums = tensors
        if hist.dim() != 2 or hist.shape[0] != 2 or sums.shape != (4,):
            raise ValueError(f"expected [hist (2, N), sums (4)], got {[tuple(t.shape) for t in tensors]}")
        acc = cls(hist.shape[1], device=hist.device)
        acc.hist.copy_(hist)
        acc.sums.copy_(sums)
        return acc

    def merge(self, other: "EvalAccumulator") -> None:
        """Adds another accumulator's counts (what the allreduce does across ranks)."""
        if other.num_buckets != self.num_buckets:
            raise ValueError(f"cannot merge {other.num_buckets} buckets into {self.num_buckets}")
        self.hist += other.hist.to(self.hist.device)
        self.sums += other.sums.to(self.sums.device)

    # Result ------------------------------------------------------------------------------

    def result(self) -> dict[str, float]:
        """AUC (nan without both classes), logloss, NE = logloss / H(ctr), COPC = ctr / pred_ctr,
        calibration = pred_ctr / ctr, and their inputs."""
        neg, pos = self.hist[0], self.hist[1]
        n_neg, n_pos = float(neg.sum()), float(pos.sum())
        loss_sum, prob_sum, label_sum, count = (float(x) for x in self.sums)
        if n_neg > 0 and n_pos > 0:
            neg_below = torch.cumsum(neg, 0) - neg
            auc = float((pos * (neg_below + 0.5 * neg)).sum()) / (n_pos * n_neg)
            bin_error = float((pos * neg).sum()) / (2 * n_pos * n_neg)
        else:
            auc = bin_error = math.nan
        nan = math.nan
        logloss = loss_sum / count if count else nan
        ctr = label_sum / count if count else nan
        base = base_entropy(ctr)
        return {
            "auc": auc,
            "auc_bin_error": bin_error,
            "logloss": logloss,
            "ne": logloss / base if base > 0 else nan,
            "copc": label_sum / prob_sum if prob_sum else nan,
            "calibration": prob_sum / label_sum if label_sum else nan,
            "count": int(count),
            "ctr": ctr,
            "pred_ctr": prob_sum / count if count else nan,
        }


def base_entropy(ctr: float) -> float:
    """H(ctr) in nats: the logloss of predicting the base rate ``ctr`` for every row (NE's
    denominator); 0 when every label is the same, nan for nan."""
    if math.isnan(ctr) or ctr <= 0 or ctr >= 1:
        return 0.0 if ctr in (0.0, 1.0) else math.nan
    return -(ctr * math.log(ctr) + (1 - ctr) * math.log1p(-ctr))
