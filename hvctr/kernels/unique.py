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


def unique_in_order(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(uniq, first, inverse) of a 1-D uint64 array: the distinct keys in order of first
    occurrence, the index of each one's first occurrence (increasing), and for each key its
    index in uniq (int64). ``uniq[inverse]`` is ``keys``."""
    flat = np.ascontiguousarray(keys.reshape(-1), dtype=np.uint64)
    lib = native.lib()
    if lib is not None and 0 < flat.size < (1 << 30):
        bits = hash_table_bits(flat.size)
        table = np.full(1 << bits, -1, dtype=np.int32)
        uniq = np.empty(flat.size, dtype=np.uint64)
        first = np.empty(flat.size, dtype=np.int64)
        inverse = np.empty(flat.size, dtype=np.int64)
        k = lib.hv_unique_u64(flat.ctypes.data, flat.size, table.ctypes.data, bits,
                              uniq.ctypes.data, first.ctypes.data, inverse.ctypes.data)
        return uniq[:k], first[:k], inverse
    uniq, first, inverse = np.unique(flat, return_index=True, return_inverse=True)
    order = np.argsort(first, kind="stable")
    rank = np.empty_like(order)
    rank[order] = np.arange(order.size)
    return uniq[order], first[order], rank[inverse.reshape(-1)]
