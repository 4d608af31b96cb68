"""Linear probing, vectorised over a batch of keys: shared by the shard index and the cache.

A table has ``nslots`` slots; key k starts at ``home[k]`` and walks ``home, home+1, ...``
(mod nslots). Each numpy step probes one slot for every key still pending: a flat gather
(about 1 ns per key) beats gathering a window of slots per key (numpy's per-row overhead made
that 10-40x slower), and at the load factors used most keys finish in one or two steps.
Callers say how a slot reads:

- ``load(slots) -> (table_keys, empty)``: the keys stored in ``slots``, where dead slots
  (tombstones) show a key no real key equals, and whether each slot was never used (a
  lookup stops there: the key is absent).
- ``free(slots) -> bool``: whether a slot may take a new key (empty or dead).
"""

from __future__ import annotations

from typing import Callable

import numpy as np

Load = Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]]


def find(keys: np.ndarray, home: np.ndarray, nslots: int, load: Load) -> np.ndarray:
    """Slot holding each key, or -1 where the key is absent (int64 [n])."""
    out = np.full(keys.shape[0], -1, dtype=np.int64)
    todo = np.arange(keys.shape[0])
    cur = home.astype(np.int64, copy=True)
    want = keys
    for _ in range(nslots):
        if not todo.size:
            break
        table_keys, empty = load(cur)
        match = table_keys == want
        out[todo[match]] = cur[match]
        go_on = ~(match | empty)
        todo, cur, want = todo[go_on], cur[go_on] + 1, want[go_on]
        cur[cur == nslots] = 0
    return out


def claim(home: np.ndarray, nslots: int, free: Callable[[np.ndarray], np.ndarray],
          take: Callable[[np.ndarray, np.ndarray], None]) -> np.ndarray:
    """Claims one free slot for each entry of ``home`` (keys known absent and unique).

    Each step, every pending key looks at its current slot; where it is free, the key
    earliest in the batch among those there wins and ``take(slots, batch_indices)`` marks
    it used; the others look again (no longer free) and move on. The result depends only
    on the table and the batch order: deterministic. Returns the slots (int64 [n]).
    """
    n = home.shape[0]
    out = np.full(n, -1, dtype=np.int64)
    todo = np.arange(n)
    cur = home.astype(np.int64, copy=True)
    for _ in range(nslots + n):
        if not todo.size:
            return out
        ok = free(cur)
        won_slot, first = np.unique(cur[ok], return_index=True)
        winners = todo[ok][first]
        take(won_slot, winners)
        out[winners] = won_slot
        placed = np.zeros(n, dtype=bool)
        placed[winners] = True
        stay = ~placed[todo]
        move = ~ok[stay]  # losers of a contested free slot stay to see it taken
        todo, cur = todo[stay], cur[stay]
        cur[move] += 1
        cur[cur == nslots] = 0
    raise AssertionError("probing table has no free slot")  # callers bound the load factor
