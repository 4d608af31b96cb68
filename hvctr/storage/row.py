"""The row of the embedding table and its deterministic initialisation.

A row is float32 ``[w (dim) | w1 (1) | m (dim+1) | v (dim+1) | step (1)]``: the first dim+1
values are the model (the embedding and the first-order weight DeepFM and Wide & Deep read),
the rest is the sparse Adam state that moves, merges and is checkpointed with the model.

A new row depends on its key and the seed alone (counter-based, computed in numpy, never with
torch's RNG): the initial model is then the same whatever the world size, the order in which
ranks first see keys, or the device (CPU and CUDA runs agree bit for bit).
"""

from __future__ import annotations

import numpy as np

from hvctr.keys import mix64

# Distinct odd constants so that the init stream (per column) and the slot hash never coincide.
_INIT_SALT = np.uint64(0x6A09E667F3BCC909)
_COLUMN_STEP = np.uint64(0x9E3779B97F4A7C15)  # the golden-ratio increment of splitmix64
_U24 = np.uint64(40)  # keep the top 24 bits: exact in float32 and float64


class RowLayout:
    """Column layout of a row for embedding dimension ``dim``.

    - ``width = 3 * (dim + 1) + 1`` float32 values per row
    - ``w``: slice of the dim embedding values; ``w1``: index of the first-order weight
    - ``model``: slice of the first dim+1 columns (w and w1): what the model reads
    - ``m``, ``v``: slices of Adam's moments of the model columns (dim+1 each)
    - ``step``: index of the per-row Adam step count (a float, it merges with the row)
    """

    def __init__(self, dim: int) -> None:
        if dim < 1:
            raise ValueError(f"embedding dimension must be >= 1, got {dim}")
        self.dim = dim
        self.model_width = dim + 1
        self.width = 3 * (dim + 1) + 1
        self.w = slice(0, dim)
        self.w1 = dim
        self.model = slice(0, dim + 1)
        self.m = slice(dim + 1, 2 * (dim + 1))
        self.v = slice(2 * (dim + 1), 3 * (dim + 1))
        self.step = 3 * (dim + 1)

    @property
    def row_bytes(self) -> int:
        return 4 * self.width

    def __repr__(self) -> str:
        return f"RowLayout(dim={self.dim}, width={self.width})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RowLayout) and other.dim == self.dim

    def __hash__(self) -> int:
        return hash(self.dim)


def init_rows(keys: np.ndarray, layout: RowLayout, scale: float, seed: int) -> np.ndarray:
    """Initial rows of ``keys`` (uint64 [n]) as float32 [n, width].

    w and w1 are uniform in [-scale, scale) with 24 random bits each, drawn from
    ``mix64(mix64(key ^ s) + (j + 1) * golden)`` for column j, where s derives from seed;
    m, v and step are 0. Pure function of (key, seed, scale): no state, no torch RNG.
    """
    keys = np.asarray(keys, dtype=np.uint64)
    s = mix64(np.uint64(seed & 0xFFFFFFFFFFFFFFFF) ^ _INIT_SALT)
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
