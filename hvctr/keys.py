"""Feature keys and their owners: pure functions of (keys, world size), vectorised in numpy.

A feature key is a uint64 (PaddleBox's "feasign"); all fields share one key space.
- ``mix64``: the splitmix64 finaliser, a bijection on uint64 with good avalanche.
- ``bucket(key) = mix64(key) >> 52``: 4096 virtual buckets. A bucket, not a key, is the unit
  of ownership: ``owner = bucket_owner[bucket(key)]``, so changing the world size moves whole
  buckets between shard files instead of rehashing every key.
- The slot of a key inside its owner's shard uses an independent hash, ``mix64(key ^ seed)``
  (see hvctr.storage): with the owner's bits reused, a rank would only use a fraction of its slots.

EMPTY_KEY marks an empty slot in a shard's index; data_prep remaps a real key equal to it.

``unique_in_order(keys)``: distinct keys in order of first occurrence, with the inverse, in one
pass over a hash table (a C kernel, hvctr.native; numpy's sort where no compiler is
found): windows, exchanges and stores deduplicate keys with it, not with a sort.
"""

from __future__ import annotations

import numpy as np

from hvctr import native

NUM_BUCKETS = 4096
BUCKET_SHIFT = np.uint64(64 - 12)
EMPTY_KEY = np.uint64(0xFFFFFFFFFFFFFFFF)
EMPTY_KEY_REMAP = np.uint64(0xFFFFFFFFFFFFFFFE)

_C1 = np.uint64(0xBF58476D1CE4E5B9)
_C2 = np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)


def mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, elementwise on a uint64 array (wraps mod 2^64, as intended)."""
    z = np.asarray(x, dtype=np.uint64)
    with np.errstate(over="ignore"):
        z = (z ^ (z >> _S30)) * _C1
        z = (z ^ (z >> _S27)) * _C2
    return z ^ (z >> _S31)


def bucket(keys: np.ndarray) -> np.ndarray:
    """Virtual bucket of each key, 0 .. NUM_BUCKETS-1 (int64)."""
    return (mix64(keys) >> BUCKET_SHIFT).astype(np.int64)


def default_bucket_owner(world_size: int) -> np.ndarray:
    """The bucket table of a fresh run: buckets dealt round-robin, ``owner = bucket % W``."""
    if world_size < 1:
        raise ValueError(f"world size must be >= 1, got {world_size}")
    return (np.arange(NUM_BUCKETS, dtype=np.int64) % world_size).astype(np.int32)


def owner_of(keys: np.ndarray, bucket_owner: np.ndarray) -> np.ndarray:
    """Owning rank of each key under a bucket table (int64)."""
    return bucket_owner[bucket(keys)].astype(np.int64)


def remap_empty(keys: np.ndarray) -> np.ndarray:
    """Replaces the reserved EMPTY_KEY by EMPTY_KEY_REMAP, in place; returns keys."""
    keys[keys == EMPTY_KEY] = EMPTY_KEY_REMAP
    return keys


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
