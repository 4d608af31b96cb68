"""hvctr.kernels.unique.unique_in_order: the C pass with its table sized for the distinct keys
expected, started again with a table for every key where there are more, answers as numpy's
sort-based fallback does, whatever the hint."""

from __future__ import annotations

import numpy as np
import pytest

from hvctr.kernels import native, unique_in_order


def _cases():
    rng = np.random.default_rng(3)
    pool = rng.integers(0, 2**64 - 2, size=5000, dtype=np.uint64)
    yield "a window: 1/20 distinct", rng.choice(pool[:2500], 50_000)
    yield "all distinct", rng.permutation(pool)
    yield "one key", np.full(7, 42, dtype=np.uint64)
    yield "shared low bits", (np.arange(20_000, dtype=np.uint64) % np.uint64(3000)) << np.uint64(32)
    yield "exactly the limit", np.repeat(pool[:4096], 3)  # 4096 distinct: the smallest table's limit


@pytest.mark.parametrize("distinct", [None, 1, 4096, 10**9])
def test_unique_in_order_answers_as_numpy_whatever_the_hint(distinct):
    for name, keys in _cases():
        got = unique_in_order(keys, distinct=distinct)
        with native.disabled():
            want = unique_in_order(keys)
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g, w, err_msg=name)
        uniq, first, inverse = got
        np.testing.assert_array_equal(uniq[inverse], keys, err_msg=name)
        np.testing.assert_array_equal(keys[first], uniq, err_msg=name)


def test_the_c_pass_stops_past_its_limit_and_says_so():
    """The kernel's own contract: -1 once a key beyond ``limit`` distinct ones comes."""
    lib = native.lib()
    if lib is None:
        pytest.skip("HVCTR_NATIVE=0")
    keys = np.arange(100, dtype=np.uint64)
    for limit, want in ((10, -1), (100, 100)):
        table = np.full(256, -1, dtype=np.int32)
        out = [np.empty(limit, np.uint64), np.empty(limit, np.int64), np.empty(100, np.int64)]
        k = lib.hv_unique_u64(keys.ctypes.data, 100, table.ctypes.data, 8, limit, *(a.ctypes.data for a in out))
        assert k == want
