"""Linear probing, vectorised over a batch of keys: shared by the shard index and the cache.

A table has ``nslots`` slots; key k starts at ``home[k]`` and walks ``home, home+1, ...``
(mod nslots). Both functions look at ``window`` consecutive slots of every pending key per
numpy step, so a batch costs a few array operations per window, not a Python step per key.
Callers provide how a window of slots is read:

- ``load(slots) -> (table_keys, empty)``: the keys stored in ``slots`` ([m, window]), with
  dead slots (tombstones) showing a key no real key equals, and whether each slot has never
  been used (a lookup stops there: the key is absent).
- ``free(slots) -> bool [m, window]``: whether a slot may take a new key (empty or dead).
"""

from __future__ import annotations

from typing import Callable

import numpy as np

Load = Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]]


def find(keys: np.ndarray, home: np.ndarray, nslots: int, load: Load, window: int = 8) -> np.ndarray:
    """Slot holding each key, or -1 where the key is absent (int64 [n])."""
    n = keys.shape[0]
    out = np.full(n, -1, dtype=np.int64)
    todo = np.arange(n)
    step = np.arange(window, dtype=np.int64)
    probed = 0
    while todo.size and probed < nslots:
        slots = (home[todo, None] + (probed + step)) % nslots
        table_keys, empty = load(slots)
        match = table_keys == keys[todo, None]
        stop = match | empty
        done = stop.any(axis=1)
        first = stop.argmax(axis=1)
        rows = np.flatnonzero(done)
        hit = match[rows, first[rows]]
        out[todo[rows[hit]]] = slots[rows[hit], first[rows[hit]]]
        todo = todo[~done]
        probed += window
    return out


def claim(home: np.ndarray, nslots: int, free: Callable[[np.ndarray], np.ndarray],
          take: Callable[[np.ndarray], None], window: int = 8) -> np.ndarray:
    """Claims one free slot per entry of ``home`` (keys known absent and unique); int64 [n].

    Each round, every pending key picks the first free slot of its current window; where
    several pick the same slot, the one earliest in the batch wins and ``take(slots)`` marks
    the winners' slots used; the others look again (the taken slot is no longer free). The
    result depends only on the table and the batch order, so it is deterministic.
    """
    n = home.shape[0]
    out = np.full(n, -1, dtype=np.int64)
    offset = np.zeros(n, dtype=np.int64)
    todo = np.arange(n)
    step = np.arange(window, dtype=np.int64)
    while todo.size:
        if int(offset[todo].min()) >= nslots:
            raise AssertionError("probing table has no free slot")  # callers bound the load factor
        slots = (home[todo, None] + offset[todo, None] + step) % nslots
        ok = free(slots)
        has = ok.any(axis=1)
        offset[todo[~has]] += window
        cand = todo[has]
        cand_slot = slots[has, ok[has].argmax(axis=1)]
        won_slot, first = np.unique(cand_slot, return_index=True)
        winners = cand[first]
        take(won_slot)
        out[winners] = won_slot
        placed = np.zeros(n, dtype=bool)
        placed[winners] = True
        todo = todo[~placed[todo]]
    return out
