"""A training window: the k batches trained between two merges, and their working set.

The window's unique keys are the working set: pulled from their owners before the window's
first step, pushed back at its end. Every batch key is remapped to its position in that set,
so the k steps gather rows with one index operation and never look at a key again.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class Window:
    index: int  # window number since the start of the run (names its collectives)
    epoch: int
    first_batch: int  # index within the epoch of the window's first batch
    labels: np.ndarray  # float32 [n, B]
    dense: np.ndarray  # float32 [n, B, num_dense]
    positions: np.ndarray  # int64 [n, B, F]: index of each key in unique_keys
    unique_keys: np.ndarray  # uint64 [U], sorted

    @property
    def num_batches(self) -> int:
        return int(self.labels.shape[0])


def fitting_prefix(keys: np.ndarray, max_rows: int) -> int:
    """Largest number of leading batches whose union of keys has at most max_rows keys.

    keys: uint64 [n, B, F]. One sort: the batch that first introduces each key gives the
    number of new keys per batch, and their running sum the working set of every prefix.
    """
    n = keys.shape[0]
    if n == 0:
        return 0
    _, first = np.unique(keys.reshape(-1), return_index=True)
    per_batch = np.bincount(first // (keys.shape[1] * keys.shape[2]), minlength=n)
    return int(np.searchsorted(np.cumsum(per_batch), max_rows, side="right"))


def build_window(index: int, epoch: int, first_batch: int, labels: np.ndarray,
                 dense: np.ndarray, keys: np.ndarray) -> Window:
    unique_keys, inverse = np.unique(keys.reshape(-1), return_inverse=True)
    return Window(index=index, epoch=epoch, first_batch=first_batch, labels=labels, dense=dense,
                  positions=inverse.reshape(keys.shape).astype(np.int64, copy=False),
                  unique_keys=unique_keys)
