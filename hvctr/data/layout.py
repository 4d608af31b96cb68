"""Which rows of which data shard an epoch's batches hold: the layout of hvctr.data.reader, as
intervals, for a position carried across a change of world size (``hvctr reshard``).

Rank r of W reads the shards s with s % W == r, one after the other (its stream), in batches of
B rows; an epoch is the batches every rank holds in full (the minimum over ranks), so each rank
drops its stream's remainder. Batches [0, b) of rank r hold rows [0, b B) of its stream, which
is every row of its first shards and a first part of one more: per data shard, one interval.

After a reshard mid-epoch the resumed run continues the epoch at the same number of samples, in
the new layout: rank r' of W' takes its stream's rows from b' B' on. Where W' B' rows a step
replace W B (the same samples), the rows of the epoch before and after are not the same split
of the data, so some rows are trained twice in that epoch and some not at all (``Coverage``);
from the next epoch on, every row once an epoch again. A reshard at an epoch boundary is exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def epoch_batches(shard_rows: np.ndarray, world_size: int, batch_size: int) -> int:
    """Batches per epoch: the full batches the rank with the fewest rows holds."""
    return min(int(shard_rows[r::world_size].sum()) // batch_size for r in range(world_size))


def trained_intervals(shard_rows: np.ndarray, world_size: int, batch_size: int, first: int,
                      end: int) -> tuple[np.ndarray, np.ndarray]:
    """(start, stop) per data shard of the rows batches [first, end) of every rank hold (none
    where ``first >= end``: a position past the epoch's end)."""
    rows = np.asarray(shard_rows, dtype=np.int64)
    end = max(first, end)
    start, stop = np.zeros_like(rows), np.zeros_like(rows)
    for rank in range(world_size):  # one vector step per rank, over its shards
        mine = np.arange(rank, rows.size, world_size)
        offset = np.concatenate([[0], np.cumsum(rows[mine])[:-1]])
        start[mine] = np.clip(first * batch_size - offset, 0, rows[mine])
        stop[mine] = np.clip(end * batch_size - offset, 0, rows[mine])
    return start, stop


@dataclass(frozen=True)
class Coverage:
    """The rows of one epoch interrupted by a reshard, against the data's rows."""
    rows: int  # the train split's rows
    before: int  # trained before the reshard (at the old size)
    twice: int  # trained before and again after it, in the same epoch
    left_out: int  # an epoch at the new size trains them, this one does not (neither part of it)
    dropped: int  # what an uninterrupted epoch at the new size leaves out (its ranks' remainders)


def reshard_coverage(shard_rows: np.ndarray, old: tuple[int, int, int], new: tuple[int, int, int]) -> Coverage:
    """The epoch a reshard interrupted: ``old`` = (world size, rows per batch, batches done) before
    it, ``new`` = (world size, rows per batch, batch it resumes at) after it."""
    rows = np.asarray(shard_rows, dtype=np.int64)
    (w0, b0, done), (w1, b1, at) = old, new
    n1 = epoch_batches(rows, w1, b1)
    _, e0 = trained_intervals(rows, w0, b0, 0, done)  # per shard [0, e0) before
    s1, e1 = trained_intervals(rows, w1, b1, at, n1)  # [s1, e1) after
    _, f1 = trained_intervals(rows, w1, b1, 0, n1)  # [0, f1) in an uninterrupted epoch, e1 <= f1
    twice = np.clip(np.minimum(e0, e1) - s1, 0, None)
    held = np.minimum(e0, f1) + (e1 - s1) - twice  # of [0, f1), the rows either part trained
    return Coverage(rows=int(rows.sum()), before=int(e0.sum()), twice=int(twice.sum()),
                    left_out=int((f1 - held).sum()), dropped=int((rows - f1).sum()))
