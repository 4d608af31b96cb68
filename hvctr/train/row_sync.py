"""A window's shared rows synchronised at every local step (merge.shared_rows).

The pull chose them (hvctr.storage.shared_rows: which rows, and why); here each step's sparse
gradients are split: the rows this rank alone moves until the window's end take the local lazy
Adam step; the shared ones take sync's step at their owner, which serves their values back.

Only the rows a step touches travel, as sync's own sparse path does: at the window's start each
rank tells each owner which of its shared rows every step of the window will touch (one alltoall
of int64 numbers); then at step i each rank sends the owners its gradients of the shared rows it
touched (one alltoall), every owner sums them over the ranks (ascending source rank) and takes
one lazy Adam step on its own copy of each row any rank touched, and sends each rank the values
of the rows its step i + 1 touches (a second alltoall; none after the window's last step). A
holder's copy of a shared row is therefore current whenever its forward reads it, and the owner's
copy, Adam's moments included, is the row's one value, which the push keeps.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import numpy as np
import torch

from hvctr.formats import RowLayout
from hvctr.optim import sparse_step
from hvctr.storage.shared_rows import SharedRows

if TYPE_CHECKING:
    from hvctr.distributed.protocol import Comm


class SharedRowSync:
    """The shared rows of one window on one rank, as a holder and as an owner.

    ``touched``: for each local step of the window, the working-set positions it touches
    (distinct; the positions ``split_step`` is then given gradients for). Every rank builds one
    per window (a collective), and calls ``split_step`` at each of the window's steps."""

    def __init__(self, comm: "Comm", shared: SharedRows, rows: torch.Tensor, layout: RowLayout,
                 touched: Sequence[np.ndarray | torch.Tensor], name: str, bf16: bool = False) -> None:
        self.comm = comm
        self.bf16 = bool(bf16)  # merge.shared_rows_bf16: gradients and values as bfloat16 on the wire
        self.float_bytes = 2 if self.bf16 else 4
        if int(rows.shape[1]) != layout.width:
            raise ValueError(f"{name}: rows of {int(rows.shape[1])} columns, {layout} has {layout.width}")
        self.layout = layout  # train.sparse_optimizer's: the owner steps its rows with it
        self.bytes_sent = self.bytes_received = 0
        world, me = comm.size, comm.rank
        number_at = np.full(int(rows.shape[0]), -1, dtype=np.int64)  # working-set position -> number
        number_at[shared.positions] = shared.index
        self.number_at = torch.from_numpy(number_at).to(rows.device)
        self.held_at = np.full(shared.total, -1, dtype=np.int64)  # number -> working-set position
        self.held_at[shared.index] = shared.positions
        first = shared.owner_first
        # as a holder: each step's shared numbers, ascending (owner order), and how many go to each owner
        self.numbers: list[np.ndarray] = []
        self.splits: list[np.ndarray] = []
        bounds = []  # per step, where each owner's numbers start and end in it
        for pos in touched:
            pos = pos.cpu().numpy() if isinstance(pos, torch.Tensor) else np.asarray(pos)
            n = number_at[pos]
            n = np.sort(n[n >= 0])
            self.numbers.append(n)
            bounds.append(np.searchsorted(n, first))
            self.splits.append(np.diff(bounds[-1]))
        steps = len(self.numbers)
        # comm: alltoall of the window's schedule: to each owner, per step the count, then the numbers
        sends = []
        for o in range(world):
            counts = np.array([s[o] for s in self.splits], dtype=np.int64)
            sends.append(np.concatenate([counts, *(n[b[o]:b[o + 1]] for n, b in zip(self.numbers, bounds))]))
        got, received = comm.alltoall(torch.from_numpy(np.concatenate(sends)), [s.size for s in sends],
                                      f"{name}.schedule")
        got = got.numpy()
        self._count(8 * sum(s.size for i, s in enumerate(sends) if i != me),
                    8 * sum(int(c) for i, c in enumerate(_ints(received)) if i != me))
        # as an owner: per step, the local index of every row each rank sends (and then needs),
        # ranks in ascending order, and how many each
        self.owned = torch.from_numpy(shared.rows)  # the owner's copies: Adam steps them in place
        base = first[me]
        self.incoming: list[np.ndarray] = [None] * steps  # type: ignore[list-item]
        self.incoming_splits: list[np.ndarray] = [None] * steps  # type: ignore[list-item]
        chunks, at = [], 0
        for c in _ints(received):
            counts = got[at:at + steps]
            offsets = at + steps + np.concatenate([[0], np.cumsum(counts)])
            chunks.append((counts, offsets))
            at += c
        for i in range(steps):
            self.incoming_splits[i] = np.array([cnt[i] for cnt, _ in chunks], dtype=np.int64)
            parts = [got[off[i]:off[i + 1]] for _, off in chunks]
            self.incoming[i] = (np.concatenate(parts) if parts else np.zeros(0, np.int64)) - base

    def _count(self, sent: int, received: int) -> None:
        self.bytes_sent += int(sent)
        self.bytes_received += int(received)

    def split_step(self, rows: torch.Tensor, step: int, idx: torch.Tensor, grad: torch.Tensor, lr: float,
                   beta1: float, beta2: float, eps: float, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Sync's Adam step on the shared rows of local step ``step`` (every rank calls it at every
        step, touched or not: two collectives); returns the rest of ``idx`` and ``grad``, for
        the local step, and leaves the next step's shared rows in ``rows`` at their owners' values.

        The owner steps on the gradients' sum over the ranks, not sync's mean (the sum / W):
        Adam's step is the same up to eps (m / sqrt(v) does not change when every gradient is
        scaled), and its moments stay at the scale of one rank's gradient, which the row's local
        steps take where it is not shared in a later window (with the mean, a row shared in one
        window and not in the next would start the next with v about (W / c)^2 too small)."""
        me = self.comm.rank
        number = self.number_at[idx]
        mine = number >= 0
        c = grad.shape[1]
        ours = number[mine].cpu().numpy()
        order = np.argsort(ours, kind="stable")
        if not np.array_equal(ours[order], self.numbers[step]):
            raise ValueError(f"{name}: the step's shared rows are not those the window's schedule named")
        send = grad[mine].detach().cpu()[torch.from_numpy(order)].contiguous()
        splits = self.splits[step]
        # comm: alltoall of the shared rows' gradients to their owners, every step
        got, received = self.comm.alltoall(self._wire(send), [int(s) for s in splits], f"{name}.grads")
        got = self._unwire(got)
        self._count(_off_rank(splits, me) * self.float_bytes * c, _off_rank(received, me) * self.float_bytes * c)
        local = self.incoming[step]
        if local.size:  # summed in ascending source rank (np.add.at is sequential), then one step a row
            acc = np.zeros((self.owned.shape[0], c), dtype=np.float32)
            np.add.at(acc, local, got.numpy())
            stepped = np.unique(local)
            sparse_step(self.layout, self.owned, torch.from_numpy(stepped), torch.from_numpy(acc[stepped]),
                        lr, beta1, beta2, eps)
        if step + 1 < len(self.numbers):
            need = self.incoming[step + 1]
            m = self.layout.model
            values = self.owned[torch.from_numpy(need), m].contiguous()
            out = self.incoming_splits[step + 1]
            # comm: alltoall of the rows each rank's next step reads, from their owners
            back, _ = self.comm.alltoall(self._wire(values), [int(s) for s in out], f"{name}.values")
            back = self._unwire(back)
            self._count(_off_rank(out, me) * self.float_bytes * c,
                        _off_rank(self.splits[step + 1], me) * self.float_bytes * c)
            at = torch.from_numpy(self.held_at[self.numbers[step + 1]]).to(rows.device)
            rows[at, m] = back.to(rows.device)
        rest = torch.nonzero(~mine).reshape(-1)
        return idx[rest], grad[rest]


    def _wire(self, t: torch.Tensor) -> torch.Tensor:
        """float32 as it travels: itself, or rounded to bfloat16 and sent as its int16 bits (the
        collectives carry integer types everywhere; bfloat16, not everywhere)."""
        return t.to(torch.bfloat16).view(torch.int16) if self.bf16 else t

    def _unwire(self, t: torch.Tensor) -> torch.Tensor:
        return t.view(torch.bfloat16).to(torch.float32) if self.bf16 else t


def _ints(splits) -> list[int]:
    return [int(s) for s in (splits.tolist() if hasattr(splits, "tolist") else splits)]


def _off_rank(splits, me: int) -> int:
    """Rows of a split list that cross the wire: every rank's but this one's own."""
    s = _ints(splits)
    return sum(s) - s[me]
