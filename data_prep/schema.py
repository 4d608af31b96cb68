"""What a data shard holds and how a raw value becomes a feature key.

Row layout (Criteo): label, I1..I13 (integers, may be empty or negative), C1..C26 (hex
strings, may be empty). A shard file holds, for N rows:

    labels      float32 [N]       0.0 or 1.0
    dense       float32 [N, 13]   log1p(max(x, 0)), a missing value -> 0
    keys        uint64  [N, 26]   one feature key per categorical field
    key_sketch  uint8   [26, 2^SKETCH_BITS]  HyperLogLog registers of each field's keys

Key rule (../shared/DESIGN.md, "Keys and sharding"), field f = 0 for C1 .. 25 for C26:
- a hex value of 1..16 digits: ``mix64((f << 56) ^ int(value, 16))``;
- anything else (non-hex, longer): ``mix64(fnv1a64(b"%d\\x1f" % f + value))``, a 64-bit
  string hash of (field, value);
- a missing (empty) value is the string rule's empty value, so each field has its own
  missing key;
- a key equal to hvctr.keys.EMPTY_KEY (the shard index's empty marker) becomes EMPTY_KEY_REMAP.
"""

from __future__ import annotations

import numpy as np

from hvctr.keys import mix64, remap_empty

FORMAT = "hvctr-data"
FORMAT_VERSION = 1
NUM_DENSE = 13
NUM_CAT = 26
NUM_COLS = 1 + NUM_DENSE + NUM_CAT
DENSE_NAMES = [f"I{i}" for i in range(1, NUM_DENSE + 1)]
CAT_NAMES = [f"C{i}" for i in range(1, NUM_CAT + 1)]
COLUMN_NAMES = ["label", *DENSE_NAMES, *CAT_NAMES]
SPLITS = ("train", "valid")
DATASETS = ("labels", "dense", "keys", "key_sketch")
SKETCH_BITS = 12  # 4096 registers per field: about 1.6% relative error on distinct counts
# The shard file format is pinned so files written by any h5py read the same everywhere.
HDF5_LIBVER = ("v110", "v110")

FNV_OFFSET = np.uint64(0xCBF29CE484222325)
FNV_PRIME = np.uint64(0x100000001B3)
_FIELD_SHIFT = np.uint64(56)


def shard_name(split: str, shard: int) -> str:
    return f"{split}-{shard:05d}.h5"


def fnv1a64_bytes(data: bytes, h: int = int(FNV_OFFSET)) -> int:
    """FNV-1a over a Python bytes object; the scalar reference of the vectorised hash."""
    for b in data:
        h = ((h ^ b) * int(FNV_PRIME)) & 0xFFFFFFFFFFFFFFFF
    return h


def field_prefix_state(f: int) -> np.uint64:
    """FNV state after the bytes ``b"%d\\x1f" % f``: where a field's string hash starts."""
    return np.uint64(fnv1a64_bytes(b"%d\x1f" % f))


FIELD_FNV_STATE = np.array([field_prefix_state(f) for f in range(NUM_CAT)], dtype=np.uint64)
MISSING_KEYS = remap_empty(mix64(FIELD_FNV_STATE.copy()))


def hex_keys(field: np.ndarray, value: np.ndarray) -> np.ndarray:
    """Keys of hex values: mix64((field << 56) ^ value), empty marker remapped."""
    f = np.asarray(field, dtype=np.uint64)
    return remap_empty(mix64((f << _FIELD_SHIFT) ^ np.asarray(value, dtype=np.uint64)))


def string_keys(fnv_state: np.ndarray) -> np.ndarray:
    """Keys of non-hex values from their finished FNV-1a states (prefix included)."""
    return remap_empty(mix64(np.asarray(fnv_state, dtype=np.uint64)))


def key_of(f: int, value: str | bytes) -> int:
    """The key of one value of field f (0-based), computed the slow, obvious way: the reference."""
    raw = value.encode() if isinstance(value, str) else value
    m = 0xFFFFFFFFFFFFFFFF
    if 1 <= len(raw) <= 16 and all(c in b"0123456789abcdefABCDEF" for c in raw):
        x = ((f << 56) ^ int(raw, 16)) & m
    else:
        x = fnv1a64_bytes(b"%d\x1f" % f + raw)
    k = int(mix64(np.array([x], dtype=np.uint64))[0])
    return 0xFFFFFFFFFFFFFFFE if k == m else k
