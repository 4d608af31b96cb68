"""The exchange's message packing and owner-side merge: the C kernels against numpy."""

import contextlib

import numpy as np
import pytest
import torch

from hvctr.kernels import unique_in_order
from hvctr.kernels import native as _native
from hvctr.storage.exchange import (Asked, _pack, _unpack, held_by, merge_asked, merge_by_key, merge_messages, put_rows,
                                    take_rows)


def _messages(width, seed=0, ranks=3, per_rank=400):
    """What an owner receives: each rank's unique keys (overlapping across ranks) and rows."""
    rng = np.random.default_rng(seed)
    pool = rng.integers(0, 2**64 - 2, size=per_rank * 2, dtype=np.uint64)
    keys = [rng.choice(pool, size=per_rank, replace=False) for _ in range(ranks)]
    rows = [rng.standard_normal((per_rank, width)).astype(np.float32) for _ in range(ranks)]
    msg = np.concatenate([_pack(k, r, np.arange(per_rank)).numpy() for k, r in zip(keys, rows)])
    return torch.from_numpy(msg), [per_rank] * ranks, np.concatenate(keys), np.concatenate(rows)


@pytest.mark.parametrize("width", [52, 49, 1])  # an odd width leaves keys 4-byte aligned in a row
@pytest.mark.parametrize("divide", [False, True])
def test_merge_messages_equals_the_numpy_reference_bit_for_bit(width, divide):
    assert _native.lib() is not None, "the C kernels build on this machine"
    msg, splits, keys, rows = _messages(width)
    uniq, acc, count = merge_messages(msg, splits, divide)
    ref_uniq, ref_acc, ref_count = merge_by_key(keys, rows, np.asarray(splits))
    if divide:
        ref_acc = ref_acc / ref_count.astype(np.float32)[:, None]
    np.testing.assert_array_equal(uniq, unique_in_order(keys)[0])  # first occurrence order
    order = np.argsort(uniq)
    np.testing.assert_array_equal(uniq[order], ref_uniq)
    np.testing.assert_array_equal(count[order], ref_count)
    assert acc[order].tobytes() == ref_acc.tobytes()
    assert count.max() == 3 and count.min() == 1  # the case covers shared and single keys
    with _native.disabled():  # the numpy fallback answers the same
        f_uniq, f_acc, f_count = merge_messages(msg, splits, divide)
    assert f_acc.tobytes() == ref_acc.tobytes() and np.array_equal(f_uniq, ref_uniq)


@pytest.mark.parametrize("width", [52, 1])
@pytest.mark.parametrize("divide", [False, True])
def test_rows_merged_by_the_kept_request_equal_merged_messages_bit_for_bit(width, divide):
    """A push of a window whose owners kept its request sends rows without keys: the owner
    merges them by that request (merge_asked) into the same keys, in the same order, and the
    same floats as the messages with their keys (merge_messages), in C and in numpy."""
    msg, splits, keys, rows = _messages(width, seed=2)
    rows[5] = -0.0  # a single copy keeps its sign bit; NaN and inf pass as they are
    rows[7, 0], rows[9, 0] = np.nan, np.inf
    msg = _pack(keys, rows, np.arange(keys.shape[0]))  # the ranks' messages, concatenated
    uniq, first, inverse = unique_in_order(keys)  # what the owner kept when the keys came (warm or pull)
    asked = Asked(splits, uniq, inverse, first)
    for native in (True, False):
        with _native.disabled() if not native else contextlib.nullcontext():
            want = merge_messages(msg, splits, divide)
            got = merge_asked(rows, asked, divide)
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_array_equal(got[2], want[2])
        assert got[1].tobytes() == want[1].tobytes()
    gaps = Asked([0, 3, 0], uniq[:3], np.arange(3), np.arange(3))  # ranks that sent nothing
    np.testing.assert_array_equal(merge_asked(rows[:3], gaps, True)[1], rows[:3])
    none = Asked([0, 0, 0], uniq[:0], np.arange(0), np.arange(0))
    assert [a.shape[0] for a in merge_asked(rows[:0], none, True)] == [0, 0, 0]


def test_pack_puts_each_key_before_its_row_in_the_given_order():
    rng = np.random.default_rng(1)
    keys = rng.integers(0, 2**64 - 2, size=50, dtype=np.uint64)
    values = rng.standard_normal((50, 7)).astype(np.float32)
    order = rng.permutation(50)
    k, v = _unpack(_pack(keys, values, order))
    np.testing.assert_array_equal(k, keys[order])
    np.testing.assert_array_equal(v, values[order])
    packed = _pack(keys, values, order).numpy().tobytes()
    with _native.disabled():
        assert _pack(keys, values, order).numpy().tobytes() == packed
    empty = merge_messages(_pack(keys[:0], values[:0], order[:0]), [0, 0], True)
    assert [a.shape[0] for a in empty] == [0, 0, 0]


@pytest.mark.parametrize("native", [True, False], ids=["C", "numpy"])
def test_held_by_says_which_keys_the_next_window_holds(native):
    """What a push writes at once (held by the next window) and what it defers."""
    rng = np.random.default_rng(3)
    keys = rng.permutation(np.unique(rng.integers(0, 2**64 - 2, 5000, dtype=np.uint64)))
    held = np.unique(np.concatenate((rng.choice(keys, 1200, replace=False),
                                     rng.integers(0, 2**64 - 2, 700, dtype=np.uint64))))
    held = held[rng.permutation(held.size)]
    with _native.disabled() if not native else contextlib.nullcontext():
        got = held_by(keys, held)
    np.testing.assert_array_equal(got, np.isin(keys, held))
    assert got.sum() == 1200 and not held_by(keys, held[:0]).any()


@pytest.mark.parametrize("path", ["native", "numpy"])
@pytest.mark.parametrize("order", ["permuted", "subset", "in_order"])
def test_put_rows_and_take_rows_equal_numpy_indexing(path, order):
    """Where a reply's rows land in a working set (put_rows) and an answer's rows are laid out
    (take_rows): the C copies against numpy's fancy indexing, bit for bit."""
    rng = np.random.default_rng(7)
    values = rng.standard_normal((5000, 52)).astype(np.float32)
    idx = {"permuted": rng.permutation(5000), "subset": rng.permutation(5000)[:1234],
           "in_order": np.arange(5000)}[order]
    rows = rng.standard_normal((idx.size, 52)).astype(np.float32)
    with _native.disabled() if path == "numpy" else contextlib.nullcontext():
        if path == "native":
            assert _native.lib() is not None
        got = values.copy()
        put_rows(got, idx, rows)
        taken = take_rows(got, idx)
    want = values.copy()
    want[idx] = rows
    assert np.array_equal(got, want)
    assert np.array_equal(taken, rows)
