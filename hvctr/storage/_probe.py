"""Linear probing, vectorised over a batch of keys: shared by the shard index and the cache.

A table has ``nslots`` slots; key k starts at ``home[k]`` and walks ``home, home+1, ...``
(mod nslots). Each numpy step probes every pending key at once. The first steps look at one
slot per key (a flat gather, about 1 ns per key: most keys finish in one or two steps);
the few keys still pending then look at windows of 32 slots per step, so the long probe
runs of a well-filled table cost a few steps instead of one step per slot. (Windows for
every key from the start are 10-40x slower: numpy's fancy indexing pays per gathered row.)
Callers say how slots read (``slots`` is [m] or [m, window]):

- ``load(slots) -> (table_keys, empty)``: the keys stored in ``slots``, where dead slots
  (tombstones) show a key no real key equals, and whether each slot was never used (a
  lookup stops there: the key is absent).
- ``free(slots) -> bool``: whether a slot may take a new key (empty or dead).

Where the C kernels are loaded, tables of 16-byte records {key, value} (the cache's and the
shard's) probe in C instead: ``find_values`` and ``claim_slots``, one pass in batch order
(hvctr/kernels/hv_kernels.c, hv_probe_find and hv_probe_claim). They place a key where the
numpy ``claim`` may place it one slot further on (it resolves a batch's collisions step by
step), but every placement is a valid probe run: a lookup finds the same value either way.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from hvctr.kernels import native

Load = Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]]
_FLAT_STEPS = 4
_WINDOW = np.arange(32, dtype=np.int64)


def _slots(cur: np.ndarray, step: int, nslots: int) -> np.ndarray:
    """The slots pending keys look at this step: [m] early on, [m, 32] afterwards."""
    return cur if step < _FLAT_STEPS else (cur[:, None] + _WINDOW) % nslots


def find(keys: np.ndarray, home: np.ndarray, nslots: int, load: Load) -> np.ndarray:
    """Slot holding each key, or -1 where the key is absent (int64 [n])."""
    out = np.full(keys.shape[0], -1, dtype=np.int64)
    todo = np.arange(keys.shape[0])
    cur = home.astype(np.int64, copy=True)
    step = probed = 0
    while todo.size and probed < nslots:
        slots = _slots(cur, step, nslots)
        table_keys, empty = load(slots)
        if slots.ndim == 1:
            match, stop = table_keys == keys[todo], None
            out[todo[match]] = cur[match]
            done = match | empty
            width = 1
        else:
            match = table_keys == keys[todo, None]
            hit_or_empty = match | empty
            done = hit_or_empty.any(axis=1)
            first = hit_or_empty.argmax(axis=1)
            r = np.flatnonzero(done)
            hit = r[match[r, first[r]]]
            out[todo[hit]] = slots[hit, first[hit]]
            width = _WINDOW.size
        todo, cur = todo[~done], (cur[~done] + width) % nslots
        step, probed = step + 1, probed + width
    return out


def claim(home: np.ndarray, nslots: int, free: Callable[[np.ndarray], np.ndarray],
          take: Callable[[np.ndarray, np.ndarray], None]) -> np.ndarray:
    """Claims one free slot for each entry of ``home`` (keys known absent and unique).

    Each step, every pending key picks the first free slot it sees; where several pick the
    same slot, the one earliest in the batch wins and ``take(slots, batch_indices)`` marks
    it used (slots ascending); the others look again from where they were (the slot is no
    longer free). The result depends only on the table and the batch order: deterministic.
    Returns the slots (int64 [n]).
    """
    n = home.shape[0]
    out = np.full(n, -1, dtype=np.int64)
    todo = np.arange(n)
    cur = home.astype(np.int64, copy=True)
    step = 0
    while todo.size:
        if step > nslots + n:  # every step places a key or moves every pending key on
            raise AssertionError("probing table has no free slot")  # callers bound the load factor
        slots = _slots(cur, step, nslots)
        ok = free(slots)
        if slots.ndim == 1:
            has, pick, width = ok, cur, 1
        else:
            has = ok.any(axis=1)
            pick, width = slots[np.arange(slots.shape[0]), ok.argmax(axis=1)], _WINDOW.size
        won_slot, first = np.unique(pick[has], return_index=True)
        winners = todo[has][first]
        take(won_slot, winners)
        out[winners] = won_slot
        placed = np.zeros(n, dtype=bool)
        placed[winners] = True
        stay = ~placed[todo]
        move = ~has[stay]  # keys that saw no free slot move on; losers look again
        todo, cur = todo[stay], cur[stay]
        cur[move] = (cur[move] + width) % nslots
        step += 1
    return out


def native_table(table: np.ndarray):
    """The C kernels, where they are loaded and ``table`` is a contiguous array of 16-byte
    {key, value} records they can probe in place; else None (the numpy path runs)."""
    lib = native.lib()
    if lib is None or table.dtype.itemsize != 16 or not table.flags.c_contiguous:
        return None
    return lib


def find_values(lib, table: np.ndarray, keys: np.ndarray, salt: np.uint64, empty_by_key: bool) -> np.ndarray:
    """The value stored with each key, or -1 where it is absent (int64 [n]): the C probe."""
    keys = np.ascontiguousarray(keys, dtype=np.uint64)
    out = np.empty(keys.shape[0], dtype=np.int64)
    if keys.shape[0]:
        lib.hv_probe_find(table.ctypes.data, table.shape[0], keys.ctypes.data, keys.shape[0], int(salt),
                          int(empty_by_key), out.ctypes.data)
    return out


def claim_slots(lib, table: np.ndarray, keys: np.ndarray, values: np.ndarray, salt: np.uint64,
                empty_by_key: bool) -> tuple[np.ndarray, int]:
    """Stores keys -> values (absent, unique) in the first free slot from each home, in batch
    order; returns (each key's slot, how many dead slots were reused): the C claim."""
    keys = np.ascontiguousarray(keys, dtype=np.uint64)
    values = np.ascontiguousarray(values, dtype=np.int64)
    slots = np.empty(keys.shape[0], dtype=np.int64)
    if keys.shape[0] == 0:
        return slots, 0
    reused = lib.hv_probe_claim(table.ctypes.data, table.shape[0], keys.ctypes.data, values.ctypes.data,
                                keys.shape[0], int(salt), int(empty_by_key), slots.ctypes.data)
    if reused < 0:
        raise AssertionError(f"probing table has no free slot for key {-1 - reused}")  # callers bound the load
    return slots, int(reused)
