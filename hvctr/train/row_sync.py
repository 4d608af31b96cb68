"""A window's shared rows synchronised at every local step (merge.shared_rows).

The pull chose them (hvctr.storage.shared_rows: which rows, and why); here each step's sparse
gradients are split: the rows this rank alone moves until the window's end take the local lazy
Adam step, the shared ones take sync's step, the same on every rank that holds them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from hvctr.optim import sparse_adam_step
from hvctr.storage.shared_rows import SharedRows

if TYPE_CHECKING:
    from hvctr.distributed.protocol import Comm


class SharedRowSync:
    """The shared rows of one window on one rank: ``split_step`` at each local step."""

    def __init__(self, comm: "Comm", shared: SharedRows, working_rows: int, device: torch.device) -> None:
        self.comm, self.total = comm, shared.total
        positions = torch.from_numpy(shared.positions).to(device)
        index = torch.from_numpy(shared.index).to(device)
        self.number_at = torch.full((working_rows,), -1, dtype=torch.int64, device=device)  # position -> number
        self.number_at[positions] = index
        self.held_at = torch.full((shared.total,), -1, dtype=torch.int64, device=device)  # number -> position
        self.held_at[index] = positions

    def split_step(self, rows: torch.Tensor, idx: torch.Tensor, grad: torch.Tensor, lr: float, beta1: float,
                   beta2: float, eps: float, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Sync's Adam step on the shared rows (every rank calls it at every step, touched or
        not: it is a collective); returns the rest of ``idx`` and ``grad``, for the local step.

        The step takes the gradients' sum over the ranks, not sync's mean (the sum / W): Adam's
        step is the same up to eps (m / sqrt(v) does not change when every gradient is scaled),
        and its moments stay at the scale of one rank's gradient, which the row's local steps
        take where it is not shared in a later window (with the mean, a row shared in one window
        and not in the next would start the next with v about (W / c)^2 too small)."""
        number = self.number_at[idx]
        mine = number >= 0
        c = grad.shape[1]
        acc = torch.zeros((self.total, c + 1), dtype=torch.float32, device=grad.device)
        acc[number[mine], :c] = grad[mine]
        acc[number[mine], c] = 1.0
        # comm: one allreduce (Sum) of the shared rows' gradients and touch counts, every step
        summed = self.comm.allreduce_sum([acc], name)[0].to(grad.device)
        step = torch.nonzero((summed[:, c] > 0) & (self.held_at >= 0)).reshape(-1)
        if step.numel():  # the sum over ranks: W x sync's mean, the scale of one rank's local gradient
            sparse_adam_step(rows, self.held_at[step], summed[step, :c], lr, beta1, beta2, eps)
        rest = torch.nonzero(~mine).reshape(-1)
        return idx[rest], grad[rest]
