"""Rows whose categorical fields hold 0..n values each (multi-valued fields): one bag a (row, field).

A ``Bags`` is the jagged form of a ``[rows, F]`` array: ``values`` holds every row's values, row
by row and within a row field by field (the data shard's order, format version 2), and
``lengths [rows, F]`` how many of them each (row, field) bag holds. The values are keys where
they come from a data shard, positions in the working set once a window has numbered them.

    bags = Bags(values=np.array([7, 8, 9, 4]), lengths=np.array([[2, 0], [1, 1]]))
    bags.bag_offsets()       # [0, 2, 2, 3, 4]: bag b is values[off[b]:off[b + 1]]
    bags.rows_slice(1, 2)    # row 1 alone: values [9, 4], lengths [[1, 1]]

One-valued data (version 1) stays a plain ``[rows, F]`` array everywhere: every path that takes
``Bags`` also takes that array, and a one-valued batch never becomes a ``Bags``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Bags:
    values: np.ndarray  # [nnz]: keys (uint64) or working-set positions (int64)
    lengths: np.ndarray  # [rows, F] unsigned or int: values of each (row, field) bag

    def __post_init__(self) -> None:
        if self.lengths.ndim != 2:
            raise ValueError(f"Bags: lengths must be [rows, fields], got shape {self.lengths.shape}")
        if self.values.ndim != 1:
            raise ValueError(f"Bags: values must be flat, got shape {self.values.shape}")

    @property
    def rows(self) -> int:
        return int(self.lengths.shape[0])

    @property
    def fields(self) -> int:
        return int(self.lengths.shape[1])

    def bag_offsets(self) -> np.ndarray:
        """int64 [rows * F + 1]: bag b = (row b // F, field b % F) is values[off[b]:off[b + 1]]."""
        off = np.zeros(self.lengths.size + 1, dtype=np.int64)
        np.cumsum(self.lengths.reshape(-1), out=off[1:])
        if off[-1] != self.values.size:
            raise ValueError(f"Bags: lengths sum to {int(off[-1])} values, {self.values.size} held")
        return off

    def row_offsets(self) -> np.ndarray:
        """int64 [rows + 1]: row r's values are values[off[r]:off[r + 1]]."""
        off = np.zeros(self.rows + 1, dtype=np.int64)
        np.cumsum(self.lengths.sum(axis=1, dtype=np.int64), out=off[1:])
        return off

    def rows_slice(self, lo: int, hi: int, row_offsets: np.ndarray | None = None) -> "Bags":
        """Rows [lo, hi) (``row_offsets``: this Bags' row_offsets(), where the caller keeps them)."""
        off = self.row_offsets() if row_offsets is None else row_offsets
        return Bags(self.values[off[lo]:off[hi]], self.lengths[lo:hi])

    def with_values(self, values: np.ndarray) -> "Bags":
        """The same bags holding other values (a window's positions in place of its keys)."""
        if values.shape != self.values.shape:
            raise ValueError(f"Bags: {values.shape[0]} values for bags of {self.values.size}")
        return Bags(values, self.lengths)


def concat_bags(parts: list[Bags]) -> Bags:
    """The rows of ``parts``, one after another."""
    return Bags(np.concatenate([p.values for p in parts]), np.concatenate([p.lengths for p in parts]))


def empty_bags(fields: int, dtype=np.uint64) -> Bags:
    return Bags(np.zeros(0, dtype=dtype), np.zeros((0, fields), dtype=np.uint16))


def field_pooling_mask(pooling, num_fields: int) -> np.ndarray:
    """uint8 [F]: 1 where a field's bag is pooled by its mean, 0 by its sum. ``pooling``: the
    names (or enum members) of model.pooling, one for all fields or one a field."""
    names = [getattr(p, "value", p) for p in pooling]
    if len(names) == 1:
        names = names * num_fields
    if len(names) != num_fields:
        raise ValueError(f"config key 'model.pooling': {len(names)} entries; give one (every field) or "
                         f"model.num_fields = {num_fields}")
    bad = sorted(set(names) - {"sum", "mean"})
    if bad:
        raise ValueError(f"config key 'model.pooling': {bad} not one of ['sum', 'mean']")
    return np.array([n == "mean" for n in names], dtype=np.uint8)
