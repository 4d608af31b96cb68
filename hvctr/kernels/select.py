"""The k-th smallest of an array, in time linear whatever its duplicates.

``kth_smallest(values, k)`` is how the CPU cache finds the score below which it evicts
(hvctr.storage.cache): a C kernel's radix selection (hvctr.kernels.native), numpy's partition
under HVCTR_NATIVE=0. numpy's partition (introselect) is linear on distinct values but slows
10-20x on an array mostly of one value, which a cache's eviction scores are (the entries that
came in one operation share their count and tick): 1.75M scores, 7,500 to evict, 18.7 ms with
distinct values, 184 ms with half of them equal, 318-331 ms with 90-99% (numpy 2.4).
"""

from __future__ import annotations

import numpy as np

from hvctr.kernels import native


def kth_smallest(values: np.ndarray, k: int) -> int:
    """The k-th smallest (0-based) of a 1-D array of non-negative integers (int64 or uint64)."""
    v = np.ascontiguousarray(values).reshape(-1)
    if not 0 <= k < v.size:
        raise IndexError(f"kth_smallest: k = {k} of {v.size} values")
    lib = native.lib()
    if lib is not None:
        v = v.view(np.uint64) if v.dtype == np.int64 else v.astype(np.uint64, copy=False)
        hist = np.empty(1 << 16, dtype=np.int64)
        return int(lib.hv_kth_smallest_u64(v.ctypes.data, v.size, k, hist.ctypes.data))
    return int(np.partition(v, k)[k])
