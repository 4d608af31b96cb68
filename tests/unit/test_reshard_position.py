"""The position in an epoch across ``hvctr reshard`` (issue 28, "also measure and state").

hvctr.data.layout computes, as intervals per data shard, which rows an epoch's batches hold in
the reader's layout (rank r of W reads the shards s % W == r one after the other); here it is
held to a row-by-row enumeration of the same layout, and to the figures measured on the
27,000-row set of 6 shards, 2 ranks of 256 rows to checkpoint 0 at batch 20, resharded to 1
(tests/e2e/test_reshard_mid_epoch.py runs it): the rest of the epoch trains 620 rows a second
time and leaves out 620 that an epoch on 1 rank trains.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from hvctr.data.layout import epoch_batches, reshard_coverage, trained_intervals


def _streams(rows: np.ndarray, world: int) -> list[list[tuple[int, int]]]:
    return [[(s, i) for s in range(r, rows.size, world) for i in range(rows[s])] for r in range(world)]


def _trained(rows, world, batch, first, end) -> set[tuple[int, int]]:
    return {row for stream in _streams(rows, world) for row in stream[first * batch:end * batch]}


@pytest.mark.parametrize("seed", range(6))
def test_the_intervals_are_the_rows_the_layout_reads(seed):
    rng = np.random.default_rng(seed)
    rows = rng.integers(0, 60, rng.integers(3, 9))
    for world, batch in itertools.product((1, 2, 3), (4, 7)):
        if rows.size < world:
            continue
        n = epoch_batches(rows, world, batch)
        assert n == min(len(s) for s in _streams(rows, world)) // batch
        first, end = sorted(rng.integers(0, n + 1, 2))
        start, stop = trained_intervals(rows, world, batch, first, end)
        got = {(s, i) for s in range(rows.size) for i in range(start[s], stop[s])}
        assert got == _trained(rows, world, batch, first, end)


@pytest.mark.parametrize("seed", range(6))
def test_the_coverage_of_a_resharded_epoch_is_counted_row_by_row(seed):
    rng = np.random.default_rng(100 + seed)
    rows = rng.integers(5, 60, rng.integers(4, 9))
    for (w0, b0), (w1, b1) in itertools.product(itertools.product((1, 2, 3), (4, 6)), repeat=2):
        done = int(rng.integers(0, epoch_batches(rows, w0, b0) + 1))
        at = done * b0 * w0 // (b1 * w1)  # the same samples, in the new size's batches
        c = reshard_coverage(rows, (w0, b0, done), (w1, b1, at))
        n1 = epoch_batches(rows, w1, b1)
        before, after = _trained(rows, w0, b0, 0, done), _trained(rows, w1, b1, at, n1)
        full = _trained(rows, w1, b1, 0, n1)
        assert (c.rows, c.before, c.twice) == (rows.sum(), len(before), len(before & after))
        assert c.left_out == len(full - before - after) and c.dropped == rows.sum() - len(full)


def test_the_measured_reshard_of_2_ranks_to_1():
    rows = np.full(6, 4500)
    same_batch = reshard_coverage(rows, (2, 256, 20), (1, 256, 40))
    assert (same_batch.before, same_batch.twice, same_batch.left_out, same_batch.dropped) == (10240, 620, 620, 120)
    global_batch = reshard_coverage(rows, (2, 256, 20), (1, 512, 20))  # data.global_batch_size = 512
    assert (global_batch.twice, global_batch.left_out, global_batch.dropped) == (620, 620, 376)
    at_a_boundary = reshard_coverage(rows, (2, 256, 0), (1, 256, 0))
    assert (at_a_boundary.twice, at_a_boundary.left_out) == (0, 0)
    # what the batch scaled by W / W' did at a fixed global batch: batch 40 of 52, 10,240 rows left out
    assert reshard_coverage(rows, (2, 256, 20), (1, 512, 40)).left_out == 10240
