"""hvctr.kernels.select.kth_smallest: the C radix selection and numpy's partition give the k-th
smallest value, on distinct values and on arrays mostly of one value (a cache's scores)."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

from hvctr.kernels import native
from hvctr.kernels.select import kth_smallest


def _arrays():
    rng = np.random.default_rng(7)
    yield rng.integers(0, 2**62, 10_000)  # distinct, all 64 bits in play
    mostly_one = rng.integers(0, 2**50, 10_000)
    mostly_one[rng.random(10_000) < 0.95] = (3 << 40) | 12345  # a cache's (count, tick) group
    yield mostly_one
    yield np.full(1000, 5, dtype=np.int64)  # one value only
    yield rng.integers(0, 4, 5000).astype(np.uint64)  # a few small values
    yield np.array([2**64 - 1, 0, 2**63], dtype=np.uint64)  # the top bits


@pytest.mark.parametrize("use_native", [True, False])
def test_kth_smallest_is_the_sorted_arrays_kth(use_native):
    with native.disabled() if not use_native else contextlib.nullcontext():
        for a in _arrays():
            s = np.sort(a)
            for k in sorted({0, 1, a.size // 3, a.size // 2, a.size - 1}):
                assert kth_smallest(a, k) == int(s[k]), (a.dtype, a.size, k)


def test_kth_smallest_refuses_a_k_outside_the_array():
    with pytest.raises(IndexError, match="k = 3 of 3"):
        kth_smallest(np.arange(3), 3)
    with pytest.raises(IndexError):
        kth_smallest(np.arange(3), -1)
