"""Which of a window's rows are shared: synchronised at every step instead of merged at its end.

``merge.shared_rows = N`` (k-step mode). Averaging the copies of a row at a window's end loses
most where many ranks move the same row between merges (issue 31: the rows' merge is what is left
of k-step's gap to sync at 64 ranks). For at most N rows a window, those the most ranks touch,
the window runs sync's algorithm instead (HugeCTR's hybrid embedding and ScaleFreeCTR keep their
hottest rows replicated and synchronised every step in the same spirit):

- at the pull each owner chooses, among the keys it was asked for by at least 2 ranks, the
  ceil(N / W) asked for by the most ranks (ties: the order it received them in); an allgather of
  the owners' counts numbers the shared rows 0 .. total - 1 in owner order, and every rank learns
  the number of each row of its working set that is shared (one alltoall of one int64 a row);
- at the window's start each rank tells each owner which of its shared rows every step will
  touch; at every step it sends the owners its gradients of the shared rows it touched, each
  owner sums them over the ranks and takes one lazy Adam step on its own copy of each row any
  rank touched, with the gradient summed over the ranks: sync's step (its mean over the global
  batch is the sum / W, and Adam's step does not change with the gradients' scale but for eps),
  with Adam's moments at the scale of the local steps the row takes in windows where it is not
  shared; then it serves each rank the values of the rows its next step reads
  (hvctr.train.row_sync). Only touched rows travel, as in sync's own sparse path;
- at the push the owner keeps its own copy, Adam's moments included (the holders' copies of a
  shared row are the values they last read, and are not merged).

Shared rows are a window's choice: nothing persists past its push, so checkpoints and resume are
those of k-step. The cost, a rank a step: its touched shared rows' gradients out and its next
step's shared rows in, D + 1 floats each (two alltoalls); a window: one int64 a pulled row and
one a touched shared row a step (its schedule); an owner keeps its shared rows (full rows) from
the pull to the push.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class SharedRows:
    """One window's shared rows as one rank sees them."""

    total: int  # shared rows of the window over all owners: the length of each step's allreduce
    positions: np.ndarray  # int64: working-set positions of the shared rows this rank holds
    index: np.ndarray  # int64: each one's number among the shared rows (0 .. total - 1)
    owned: np.ndarray  # int64: as an owner, the keys it shares (indices into its request's distinct keys)
    owner_first: np.ndarray  # int64 [W + 1]: owner o's shared rows are numbered owner_first[o] .. [o + 1] - 1
    rows: np.ndarray  # float32 [owned, width]: as an owner, its shared rows (as pulled, then as stepped)


def choose_owned(asked_by: np.ndarray, limit: int, world_size: int) -> np.ndarray:
    """The keys an owner shares, as indices into its request's distinct keys (ascending):
    ``asked_by[j]`` ranks asked for key j; at most ceil(limit / world_size) keys, those asked for
    by the most ranks and by at least 2, ties broken by j (the order the keys arrived in)."""
    quota = -(-int(limit) // max(int(world_size), 1))
    candidates = np.flatnonzero(asked_by >= 2)
    if quota <= 0 or candidates.size == 0:
        return np.zeros(0, dtype=np.int64)
    if candidates.size > quota:
        order = np.argsort(-asked_by[candidates], kind="stable")  # most ranks first, ties by position
        candidates = np.sort(candidates[order[:quota]])
    return candidates.astype(np.int64, copy=False)
