"""Distinct keys in order of first occurrence, in one pass over a hash table.

``unique_in_order(keys)`` is how windows, exchanges and stores deduplicate keys: a C kernel
(hvctr.kernels.native), numpy's sort under HVCTR_NATIVE=0. The order of first
occurrence, not sorted order, is what keeps a window's working set independent of timing.
"""

from __future__ import annotations

import numpy as np

from hvctr.kernels import native


def hash_table_bits(n: int) -> int:
    """log2 of the slots of an open-addressing table for ``n`` keys (at least 2n slots)."""
    return max(4, int(2 * n - 1).bit_length())


def unique_in_order(keys: np.ndarray, distinct: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(uniq, first, inverse) of a 1-D uint64 array: the distinct keys in order of first
    occurrence, the index of each one's first occurrence (increasing), and for each key its
    index in uniq (int64). ``uniq[inverse]`` is ``keys``.

    ``distinct``: about how many distinct keys to expect (default: an eighth of the keys, as in
    a window, whose batches share their keys; callers whose keys are mostly distinct say so).
    The C pass's table is sized for that many, so that it stays in the CPU's caches; where the
    keys hold more, the pass starts again with a table for all of them (the result is the same
    either way). A window of 3.7M multi-hot keys with 260k distinct (bench.multi_hot's DLRM):
    49-85 ms with a table for every key (32 MiB), 27-30 ms with the default (python -m
    bench.host_kernels); a one-hot window (852k keys, 57k distinct) alike either way; keys all
    distinct, the wasted first pass costs 5-20%."""
    flat = np.ascontiguousarray(keys.reshape(-1), dtype=np.uint64)
    lib = native.lib()
    if lib is not None and 0 < flat.size < (1 << 30):
        n = flat.size
        limit = min(n, max(distinct if distinct is not None else n // 8, 1 << 12))
        inverse = np.empty(n, dtype=np.int64)
        while True:
            bits = hash_table_bits(limit)
            table = np.full(1 << bits, -1, dtype=np.int32)
            uniq = np.empty(limit, dtype=np.uint64)
            first = np.empty(limit, dtype=np.int64)
            k = lib.hv_unique_u64(flat.ctypes.data, n, table.ctypes.data, bits, limit,
                                  uniq.ctypes.data, first.ctypes.data, inverse.ctypes.data)
            if k >= 0:
                return uniq[:k], first[:k], inverse
            limit = n  # more distinct keys than expected: a table for all of them cannot fill
    uniq, first, inverse = np.unique(flat, return_index=True, return_inverse=True)
    order = np.argsort(first, kind="stable")
    rank = np.empty_like(order)
    rank[order] = np.arange(order.size)
    return uniq[order], first[order], rank[inverse.reshape(-1)]
