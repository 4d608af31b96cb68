"""The formats every part of hvctr agrees on: the data shard, the feature key, the table row.

This package is a leaf: it imports nothing of hvctr outside itself (a test holds it to that),
so data_prep, the store, the optimiser, export and score, and the C kernels (through
``c_header()``) all take their contract from here, and nothing else defines it.

Data shard (what ``python -m data_prep`` writes, ``hvctr.data.reader`` reads). Row layout
(Criteo): label, I1..I13 (integers, may be empty or negative), C1..C26 (hex strings, may be
empty). A shard file ``<split>-<s:05d>.h5`` holds, for N rows:

    labels      float32 [N]       0.0 or 1.0
    dense       float32 [N, 13]   log1p(max(x, 0)), a missing value -> 0
    keys        uint64  [N, 26]   one feature key per categorical field
    key_sketch  uint8   [26, 2^SKETCH_BITS]  HyperLogLog registers of each field's keys

Key rule (one key space for every field, PaddleBox's "feasign"), field f = 0 for C1 .. 25 for C26:
- a hex value of 1..16 digits: ``mix64((f << 56) ^ int(value, 16))``;
- anything else (non-hex, longer): ``mix64(fnv1a64(b"%d\\x1f" % f + value))``;
- a missing (empty) value is the string rule's empty value, so each field has its own key;
- a key equal to EMPTY_KEY (the shard index's empty marker) becomes EMPTY_KEY_REMAP.

Ownership: ``bucket(key) = mix64(key) >> 52`` (4096 virtual buckets), ``owner =
bucket_owner[bucket]``; changing the world size moves whole buckets, never rehashes keys.

The row: float32 ``[w (dim) | w1 (1) | m (dim+1) | v (dim+1) | step (1)]`` with the default
sparse optimiser (Adam); the first dim+1 values are the model, the rest is the optimiser's state
that moves, merges and is checkpointed with it (row-wise Adam and Adagrad keep less: RowLayout).
A new row depends on its key and the seed alone (``init_rows``).
"""

from __future__ import annotations

import enum

import numpy as np

# --- the data shard ------------------------------------------------------------------------

FORMAT = "hvctr-data"
FORMAT_VERSION = 1  # one key per field per row: ``keys`` uint64 [N, 26]
# Multi-valued fields (data_prep --multi-valued): a field holds 0..n keys a row. The shard keeps
# ``lengths`` uint16 [N, 26] (keys of each field of each row; 1 in every one-valued field),
# ``offsets`` int64 [N + 1] (row r's keys are keys[offsets[r]:offsets[r + 1]], field by field),
# ``keys`` uint64 [offsets[N]]; the manifest names the fields ("multi_valued"). Data without
# multi-valued fields is still written as version 1, byte for byte as before.
MULTI_VALUED_VERSION = 2
SUPPORTED_VERSIONS = (1, 2)
MAX_FIELD_KEYS = (1 << 16) - 1  # keys of one field in one row: the uint16 of ``lengths``
NUM_DENSE = 13
NUM_FIELDS = 26  # categorical fields: one key each per row (version 1), 0..n (version 2's multi-valued)
NUM_COLS = 1 + NUM_DENSE + NUM_FIELDS
DENSE_NAMES = [f"I{i}" for i in range(1, NUM_DENSE + 1)]
CAT_NAMES = [f"C{i}" for i in range(1, NUM_FIELDS + 1)]
COLUMN_NAMES = ["label", *DENSE_NAMES, *CAT_NAMES]
SPLITS = ("train", "valid")
DATASETS = ("labels", "dense", "keys", "key_sketch")
MULTI_VALUED_DATASETS = ("labels", "dense", "lengths", "offsets", "keys", "key_sketch")  # version 2
SKETCH_BITS = 12  # 4096 registers per field: about 1.6% relative error on distinct counts
# The shard file format is pinned so files written by any h5py read the same everywhere.
HDF5_LIBVER = ("v110", "v110")
SAMPLE_BYTES = 4 + 4 * NUM_DENSE + 8 * NUM_FIELDS  # one row of labels + dense + keys


def shard_name(split: str, shard: int) -> str:
    return f"{split}-{shard:05d}.h5"


class KeySketch:
    """HyperLogLog registers per field (2^SKETCH_BITS each); max-mergeable, order-free.

    Keys are mix64 outputs (uniform bits), so the low bits pick the register and the rest
    give the rank; no second hash is needed."""

    def __init__(self, registers: np.ndarray | None = None) -> None:
        m = 1 << SKETCH_BITS
        self.registers = np.zeros((NUM_FIELDS, m), dtype=np.uint8) if registers is None else registers

    def update(self, keys: np.ndarray) -> None:
        m = 1 << SKETCH_BITS
        low = (keys & np.uint64(m - 1)).astype(np.int64)
        rest = keys >> np.uint64(SKETCH_BITS)
        # rank = leading zeros of the 64-p remaining bits + 1; frexp is exact below 2^53
        rank = (65 - SKETCH_BITS - np.frexp(rest.astype(np.float64))[1]).astype(np.uint8)
        idx = low + np.arange(NUM_FIELDS, dtype=np.int64) * m
        np.maximum.at(self.registers.reshape(-1), idx.reshape(-1), rank.reshape(-1))

    def update_fields(self, keys: np.ndarray, fields: np.ndarray) -> None:
        """``update`` for flat keys (a version 2 shard's): ``fields`` names each key's field, 0..25."""
        m = 1 << SKETCH_BITS
        low = (keys & np.uint64(m - 1)).astype(np.int64)
        rest = keys >> np.uint64(SKETCH_BITS)
        rank = (65 - SKETCH_BITS - np.frexp(rest.astype(np.float64))[1]).astype(np.uint8)
        np.maximum.at(self.registers.reshape(-1), low + np.asarray(fields, dtype=np.int64) * m, rank)

    def merge(self, other: "KeySketch") -> None:
        np.maximum(self.registers, other.registers, out=self.registers)

    def estimate(self) -> np.ndarray:
        """Distinct keys per field (HyperLogLog with the small-range correction)."""
        m = 1 << SKETCH_BITS
        alpha = 0.7213 / (1 + 1.079 / m)
        z = np.sum(np.exp2(-self.registers.astype(np.float64)), axis=1)
        raw = alpha * m * m / z
        zeros = np.count_nonzero(self.registers == 0, axis=1)
        linear = m * np.log(m / np.maximum(zeros, 1))
        return np.where((raw <= 2.5 * m) & (zeros > 0), linear, raw)


# --- the feature key -----------------------------------------------------------------------

NUM_BUCKETS = 4096
BUCKET_SHIFT = np.uint64(64 - 12)
EMPTY_KEY = np.uint64(0xFFFFFFFFFFFFFFFF)
EMPTY_KEY_REMAP = np.uint64(0xFFFFFFFFFFFFFFFE)

_C1 = np.uint64(0xBF58476D1CE4E5B9)
_C2 = np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)
FNV_OFFSET = np.uint64(0xCBF29CE484222325)
FNV_PRIME = np.uint64(0x100000001B3)
_FIELD_SHIFT = np.uint64(56)


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


def fnv1a64_bytes(data: bytes, h: int = int(FNV_OFFSET)) -> int:
    """FNV-1a over a Python bytes object; the scalar reference of the vectorised hash."""
    for b in data:
        h = ((h ^ b) * int(FNV_PRIME)) & 0xFFFFFFFFFFFFFFFF
    return h


def field_prefix_state(f: int) -> np.uint64:
    """FNV state after the bytes ``b"%d\\x1f" % f``: where a field's string hash starts."""
    return np.uint64(fnv1a64_bytes(b"%d\x1f" % f))


FIELD_FNV_STATE = np.array([field_prefix_state(f) for f in range(NUM_FIELDS)], dtype=np.uint64)
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
    return int(EMPTY_KEY_REMAP) if k == m else k


# --- the row -------------------------------------------------------------------------------

# Distinct odd constants so that the init stream (per column) and the slot hash never coincide.
_INIT_SALT = np.uint64(0x6A09E667F3BCC909)
_COLUMN_STEP = np.uint64(0x9E3779B97F4A7C15)  # the golden-ratio increment of splitmix64
_U24 = np.uint64(40)  # keep the top 24 bits: exact in float32 and float64


class SparseOptimizer(str, enum.Enum):
    """What a row keeps beside its model columns (config key train.sparse_optimizer): the row's
    optimiser, which fixes its layout (``RowLayout``)."""

    ADAM = "adam"  # Adam's m and v for every model column: 2 (D + 1) + 1 state floats
    # m for every model column, one v a row (fbgemm's PARTIAL_ROWWISE_ADAM): D + 3 state floats.
    # Adam with one m per row too would have no direction to step in: m is the mean gradient.
    ROWWISE_ADAM = "rowwise_adam"
    # one accumulated mean squared gradient a row (fbgemm's EXACT_ROWWISE_ADAGRAD, TorchRec's fused
    # optimiser and MLPerf's DLRM): 2 state floats
    ROWWISE_ADAGRAD = "rowwise_adagrad"


class RowLayout:
    """Column layout of a row for embedding dimension ``dim`` and its ``optimizer``'s states.

    - ``w``: slice of the dim embedding values; ``w1``: index of the first-order weight
    - ``model``: slice of the first dim+1 columns (w and w1): what the model reads
    - ``m``, ``v``: slices of the optimiser's moments: per model column, per row (one column)
      or none (an empty slice); row-wise Adagrad's accumulator is its ``v``
    - ``step``: index of the per-row step count (a float, it merges with the row): Adam's bias
      correction, and for every optimiser what merge.sparse_rule = matched reads
    - ``states``: slice of every column after the model's

    Widths, c = dim + 1: adam 3c + 1 (1,552 bytes at dim 128), rowwise_adam 2c + 2 (1,040),
    rowwise_adagrad c + 2 (524).
    """

    def __init__(self, dim: int, optimizer: "SparseOptimizer | str" = SparseOptimizer.ADAM) -> None:
        if dim < 1:
            raise ValueError(f"embedding dimension must be >= 1, got {dim}")
        self.dim = dim
        self.optimizer = SparseOptimizer(optimizer)
        c = self.model_width = dim + 1
        self.w = slice(0, dim)
        self.w1 = dim
        self.model = slice(0, c)
        m_cols, v_cols = {SparseOptimizer.ADAM: (c, c), SparseOptimizer.ROWWISE_ADAM: (c, 1),
                          SparseOptimizer.ROWWISE_ADAGRAD: (0, 1)}[self.optimizer]
        self.m = slice(c, c + m_cols)
        self.v = slice(c + m_cols, c + m_cols + v_cols)
        self.step = c + m_cols + v_cols
        self.width = self.step + 1
        self.states = slice(c, self.width)

    @classmethod
    def of_width(cls, width: int, optimizer: "SparseOptimizer | str" = SparseOptimizer.ADAM) -> "RowLayout":
        """The ``optimizer``'s layout whose rows are ``width`` columns wide (a ValueError if none is)."""
        optimizer = SparseOptimizer(optimizer)
        extra = cls(1, optimizer).width - 2  # width = a * c + b: read a and b off two layouts
        per_c = cls(2, optimizer).width - cls(1, optimizer).width
        b = extra + 2 - 2 * per_c
        if width < 2 * per_c + b or (width - b) % per_c:
            raise ValueError(f"a row of {width} columns is not {cls(1, optimizer).columns('D')}")
        return cls((width - b) // per_c - 1, optimizer)

    def columns(self, dim: "int | str | None" = None) -> str:
        """The columns of a row, as shards and docs spell them: ``w[16] w1[1] m[17] v[17] step[1]``."""
        d = self.dim if dim is None else dim
        c = self.model_width if dim is None else f"{dim}+1"
        size = lambda s: c if s.stop - s.start == self.model_width else s.stop - s.start  # noqa: E731
        parts = [f"w[{d}]", "w1[1]"]
        parts += [f"{name}[{size(s)}]" for name, s in (("m", self.m), ("v", self.v)) if s.stop > s.start]
        return " ".join(parts + ["step[1]"])

    @property
    def row_bytes(self) -> int:
        return 4 * self.width

    def __repr__(self) -> str:
        return f"RowLayout(dim={self.dim}, optimizer={self.optimizer.value}, width={self.width})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RowLayout) and (other.dim, other.optimizer) == (self.dim, self.optimizer)

    def __hash__(self) -> int:
        return hash((self.dim, self.optimizer))


def init_salt(seed: int) -> np.uint64:
    """The key salt of init_rows for ``seed``."""
    return mix64(np.uint64(seed & 0xFFFFFFFFFFFFFFFF) ^ _INIT_SALT)


def init_rows(keys: np.ndarray, layout: RowLayout, scale: float, seed: int) -> np.ndarray:
    """Initial rows of ``keys`` (uint64 [n]) as float32 [n, width].

    w and w1 are uniform in [-scale, scale) with 24 random bits each, drawn from
    ``mix64(mix64(key ^ s) + (j + 1) * golden)`` for column j, where s derives from seed;
    m, v and step are 0. Pure function of (key, seed, scale): no state, no torch RNG, so the
    initial model is the same whatever the world size, the order ranks see keys, or the device.
    The reference: hvctr.kernels.init_rows computes the same bits in C.
    """
    keys = np.asarray(keys, dtype=np.uint64)
    s = init_salt(seed)
    base = mix64(keys ^ s)
    cols = (np.arange(1, layout.model_width + 1, dtype=np.uint64) * _COLUMN_STEP)
    with np.errstate(over="ignore"):
        bits = mix64(base[:, None] + cols[None, :]) >> _U24
    # k / 2^23 - 1 is exact in float64 and lies in [-1, 1); one rounding to float32 at the end.
    unit = bits.astype(np.float64) * (2.0 ** -23) - 1.0
    out = np.zeros((keys.shape[0], layout.width), dtype=np.float32)
    out[:, layout.model] = (unit * float(scale)).astype(np.float32)
    return out


def default_row(layout: RowLayout) -> np.ndarray:
    """The shared row of keys not (yet) admitted (storage.admit_after): all zeros, read-only.

    Zero embedding and first-order weight: an unadmitted key contributes nothing to the
    model, as in PaddleBox, and its updates are dropped rather than stored.
    """
    row = np.zeros(layout.width, dtype=np.float32)
    row.flags.writeable = False
    return row


# The C macros' prefix of each optimiser's layout (hv_row.h), and its number in hv_row_layout.
C_LAYOUTS = {SparseOptimizer.ADAM: "HV_ROW", SparseOptimizer.ROWWISE_ADAM: "HV_RWADAM",
             SparseOptimizer.ROWWISE_ADAGRAD: "HV_RWADAGRAD"}


def c_header() -> str:
    """The row layouts and the key constants as C, generated from this module: the file
    ``hvctr/kernels/hv_row.h`` the kernels are compiled with (tests/unit/test_native_build.py
    holds the two equal; the loaded library's layouts are checked against RowLayout too), so C
    and Python cannot disagree. Offsets are in floats, for a row whose model part is
    ``c = dim + 1`` columns wide: ``<prefix>_M``, ``_V``, ``_STEP``, ``_WIDTH`` for each
    optimiser (``C_LAYOUTS``)."""
    lines = []
    for optimizer, prefix in C_LAYOUTS.items():
        one, two = RowLayout(1, optimizer), RowLayout(2, optimizer)  # offsets are a * c + b: read them off two
        for name, at in (("M", lambda lay: lay.m.start), ("V", lambda lay: lay.v.start),
                         ("STEP", lambda lay: lay.step), ("WIDTH", lambda lay: lay.width)):
            a = at(two) - at(one)
            b = at(one) - a * one.model_width
            lines.append(f"#define {prefix}_{name}(c) ({a} * (c){f' + {b}' if b else ''})\n")
    return (
        "/* generated by hvctr.formats.c_header(): do not edit; regenerate with\n"
        "   python -c 'import hvctr.formats as f; print(f.c_header(), end=\"\")' > hvctr/kernels/hv_row.h */\n"
        "#ifndef HV_ROW_H\n"
        "#define HV_ROW_H\n"
        + "".join(lines) +
        f"#define HV_EMPTY_KEY 0x{int(EMPTY_KEY):X}ULL\n"
        "#endif\n"
    )
