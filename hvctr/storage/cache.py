"""Tier 2: the CPU row cache, a fixed number of entries inside a byte budget of anonymous memory.

Every array is allocated once at construction (after placement pinned the process, so first
touch puts the pages on the rank's NUMA node) and sized so that their sum stays within
``storage.cpu_cache_bytes``: rows with their optimiser state, keys, shard positions, dirty
flags, policy state and a key -> entry hash table (linear probing, 2 slots per entry,
tombstones on eviction, rebuilt when they pile up).

The cache knows nothing of the shard: ``insert`` returns the dirty rows it evicted and the
caller (EmbeddingStore) writes them back. Eviction picks victims in batches (at least 1/256
of the entries, so its O(entries) selection is amortised) among entries not touched by the
current operation, by policy:

- ``CachePolicy.LRU``: least recently used operation first;
- ``CachePolicy.LFU``: fewest accesses first, ties by recency, every count halved after
  ``storage.lfu_aging_lookups`` key lookups (aging lets yesterday's hot keys go).

An entry inserted with ``hold=True`` (the prefetch's warm, for the next window's pull) is not
evicted until an "access" lookup reads it: a window's push and the warm's own later rows cannot
push out what the pull is about to read. ``n_held`` counts them; the store keeps it within half
the entries, so the other half is always there to evict.
"""

from __future__ import annotations

import numpy as np

from hvctr.config import CachePolicy
from hvctr.formats import EMPTY_KEY, mix64
from hvctr.kernels import native
from hvctr.kernels.select import kth_smallest
from hvctr.storage import _probe

_HASH_SALT = np.uint64(0x8CB92BA72F3D8DD7)
_EMPTY, _DEAD, _CLAIMED = -1, -2, -3  # table entry codes; >= 0 is an entry index
_TICK_BITS = 40
_HELD = -1  # tick of an entry held for the read that comes for it (insert(hold=True))

_SLOT_DTYPE = np.dtype([("key", "<u8"), ("ent", "<i8")])
# bytes per entry besides the row: key 8, shard position 8, dirty 1, tick 8, count 4, table slot
# of the entry 8, free-stack slot 8, and two hash-table slots (key 8 + entry 8) each.
ENTRY_OVERHEAD_BYTES = 8 + 8 + 1 + 8 + 4 + 8 + 8 + 2 * _SLOT_DTYPE.itemsize


def entries_for_budget(width: int, budget_bytes: int) -> int:
    """How many rows of ``width`` float32 a budget holds, every cache array counted."""
    return max(int(budget_bytes) // (4 * width + ENTRY_OVERHEAD_BYTES), 0)


class RowCache:
    """Rows by key, bounded by ``budget_bytes``; vectorised lookups, inserts and evictions.

    - ``lookup(keys, mode)`` -> entry index per key, -1 where absent. mode "access" counts a
      hit or miss and feeds the policy; "pin" only marks the entries as used by the current
      operation (never evicted by it); "peek" changes nothing.
    - ``rows[entry]`` is the row; ``update(entries, rows)`` overwrites and marks dirty.
    - ``insert(keys, rows, pos, dirty, hold=False) -> (n_inserted, victims)``: keys absent;
      the first n_inserted are cached (held until an access reads them, with ``hold``);
      victims = (keys, pos, rows) of dirty rows evicted to make room.
    - ``dirty_entries()``, ``mark_clean(entries)``, ``discard(entries)``, ``clear()``.
    """

    def __init__(self, width: int, budget_bytes: int, policy: CachePolicy = CachePolicy.LFU,
                 aging_lookups: int = 1 << 22) -> None:
        self.width = width
        self.policy = CachePolicy(policy)
        self.aging_lookups = max(int(aging_lookups), 1)
        self.capacity = c = entries_for_budget(width, budget_bytes)
        self.nslots = 2 * c
        self.keys = np.full(c, EMPTY_KEY, dtype=np.uint64)
        self.pos = np.full(c, -1, dtype=np.int64)
        self.rows = np.zeros((c, width), dtype=np.float32)
        self.dirty = np.zeros(c, dtype=bool)
        self.tick = np.zeros(c, dtype=np.int64)
        self.count = np.zeros(c, dtype=np.uint32)
        self.tslot = np.full(c, -1, dtype=np.int64)
        # One record per slot: a probe step is one gather of 16 bytes (two separate arrays
        # cost two cache misses per key, about 4x slower).
        self.table = np.empty(self.nslots, dtype=_SLOT_DTYPE)
        self.tab_key, self.tab_ent = self.table["key"], self.table["ent"]  # field views
        self.tab_key[:] = EMPTY_KEY
        self.tab_ent[:] = _EMPTY
        self._free = np.arange(c - 1, -1, -1, dtype=np.int64)  # a stack; entry 0 is used first
        self.n_free = c
        self.n_dead = 0
        self.n_held = 0  # entries held for a read (tick _HELD), never evicted until it comes
        self.now = 0  # operation counter: the LRU clock and the pin marker
        self._since_aging = 0
        self.hits = self.misses = self.evictions = 0

    @property
    def nbytes(self) -> int:
        arrays = (self.keys, self.pos, self.rows, self.dirty, self.tick, self.count, self.tslot,
                  self.table, self._free)
        return sum(a.nbytes for a in arrays)

    @property
    def size(self) -> int:
        return self.capacity - self.n_free

    # --- lookups -----------------------------------------------------------------------

    def _home(self, keys: np.ndarray) -> np.ndarray:
        return (mix64(keys ^ _HASH_SALT) % np.uint64(self.nslots)).astype(np.int64)

    def _load(self, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        rec = self.table[slots]
        return rec["key"], rec["ent"] == _EMPTY

    def lookup(self, keys: np.ndarray, mode: str = "access") -> np.ndarray:
        """Entry of each key (int64, -1 if absent). Starts a new operation unless mode is peek."""
        n = keys.shape[0]
        lib = _probe.native_table(self.table)
        if self.capacity == 0 or n == 0:
            ent = np.full(n, -1, dtype=np.int64)
        elif lib is not None:
            ent = _probe.find_values(lib, self.table, keys, _HASH_SALT, empty_by_key=False)
        else:
            slots = _probe.find(keys, self._home(keys), self.nslots, self._load)
            ent = np.full(n, -1, dtype=np.int64)
            hit = slots >= 0
            ent[hit] = self.tab_ent[slots[hit]]
        if mode == "peek":
            return ent
        assert mode in ("access", "pin"), mode
        self.now += 1
        hit = ent[ent >= 0]
        held = self.tick[hit] == _HELD
        if mode == "access":  # the read a hold waited for: the entry is an ordinary one again
            self.n_held -= int(np.count_nonzero(held))
            self.tick[hit] = self.now
        else:  # a pin only protects for this operation: a hold outlasts it
            self.tick[hit[~held]] = self.now
        if mode == "access":
            self.count[hit] += np.uint32(1)
            self.hits += hit.shape[0]
            self.misses += n - hit.shape[0]
            self._age(n)
        return ent

    def _age(self, n: int) -> None:
        self._since_aging += n
        if self._since_aging >= self.aging_lookups:
            self.count >>= np.uint32(1)
            self._since_aging = 0

    # --- updates -----------------------------------------------------------------------

    def update(self, entries: np.ndarray, rows: np.ndarray) -> None:
        self.rows[entries] = rows
        self.dirty[entries] = True

    def take(self, ent: np.ndarray, out: np.ndarray) -> None:
        """out[i] = rows[ent[i]] where ent[i] >= 0 (lookup's answer as it is: -1 rows are left)."""
        lib = native.lib()
        if lib is not None and out.flags.c_contiguous and out.dtype == np.float32 and out.shape[1] == self.width:
            ent = np.ascontiguousarray(ent, dtype=np.int64)
            lib.hv_take_rows(self.rows.ctypes.data, self.width, ent.ctypes.data, ent.shape[0], out.ctypes.data)
            return
        hit = ent >= 0
        out[hit] = self.rows[ent[hit]]

    def put(self, ent: np.ndarray, rows: np.ndarray) -> None:
        """update() of the entries ent[i] >= 0 with rows[i] (the others are skipped), without
        first copying the rows that hit."""
        lib = native.lib()
        hit = ent >= 0
        if lib is not None and rows.flags.c_contiguous and rows.dtype == np.float32 and rows.shape[1] == self.width:
            ent = np.ascontiguousarray(ent, dtype=np.int64)
            lib.hv_put_rows(self.rows.ctypes.data, self.width, ent.ctypes.data, ent.shape[0], rows.ctypes.data)
            self.dirty[ent[hit]] = True
            return
        self.update(ent[hit], rows[hit])

    def insert(self, keys: np.ndarray, rows: np.ndarray, pos: np.ndarray, dirty: np.ndarray | bool,
               hold: bool = False) -> tuple[int, tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """Caches as many of ``keys`` (absent, unique) as room allows, in order; ``hold``: kept
        (never evicted) until an access lookup reads them.

        Returns how many were inserted (a prefix of the batch) and the dirty victims
        (keys, shard positions, rows) that the caller must write back.
        """
        n = keys.shape[0]
        victims = self._evict(n - self.n_free) if n > self.n_free else _no_victims(self.width)
        m = min(n, self.n_free)
        if m == 0:
            return 0, victims
        ent = self._free[self.n_free - m:self.n_free][::-1].copy()
        self.n_free -= m
        self.keys[ent] = keys[:m]
        self.pos[ent] = pos[:m]
        lib = native.lib()
        if lib is not None and rows.flags.c_contiguous and rows.dtype == np.float32 and rows.shape[1] == self.width:
            lib.hv_put_rows(self.rows.ctypes.data, self.width, ent.ctypes.data, m, rows.ctypes.data)  # rows[:m]
        else:
            self.rows[ent] = rows[:m]
        self.dirty[ent] = dirty[:m] if isinstance(dirty, np.ndarray) else dirty
        self.tick[ent] = _HELD if hold else self.now  # pinned for the rest of this operation, or held
        self.n_held += m if hold else 0
        self.count[ent] = 1
        self._table_put(keys[:m], ent)
        return m, victims

    def _table_put(self, keys: np.ndarray, ent: np.ndarray) -> None:
        lib = _probe.native_table(self.table)
        if lib is not None:
            slots, reused = _probe.claim_slots(lib, self.table, keys, ent, _HASH_SALT, empty_by_key=False)
            self.n_dead -= reused
            self.tslot[ent] = slots
            return

        def free(slots: np.ndarray) -> np.ndarray:
            t = self.tab_ent[slots]
            return (t == _EMPTY) | (t == _DEAD)

        def take(slots: np.ndarray, _which: np.ndarray) -> None:
            self.n_dead -= int(np.count_nonzero(self.tab_ent[slots] == _DEAD))
            self.tab_ent[slots] = _CLAIMED

        slots = _probe.claim(self._home(keys), self.nslots, free, take)
        self.tab_key[slots] = keys
        self.tab_ent[slots] = ent
        self.tslot[ent] = slots

    def _evict(self, need: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Frees at least ``need`` entries (when enough are unpinned); returns dirty victims."""
        used = self.keys != EMPTY_KEY
        cand = np.flatnonzero(used & (self.tick != self.now) & (self.tick != _HELD))
        m = min(max(need, self.capacity // 256, 1), cand.shape[0])
        if m == 0:
            return _no_victims(self.width)
        if self.policy is CachePolicy.LFU:
            score = (self.count[cand].astype(np.int64) << _TICK_BITS) | (self.tick[cand] & ((1 << _TICK_BITS) - 1))
        else:
            score = self.tick[cand]
        sel = self._lowest(cand, score, m) if m < cand.shape[0] else cand
        d = sel[self.dirty[sel]]
        d = d[np.argsort(self.pos[d], kind="stable")]  # in file order: the write-back's runs
        victims = (self.keys[d], self.pos[d], self.rows[d])  # fancy indexing copies: the entries may be reused
        self._drop(sel)
        self.evictions += m
        return victims

    def _lowest(self, cand: np.ndarray, score: np.ndarray, m: int) -> np.ndarray:
        """The ``m`` candidates of lowest score; where the cut falls inside a group of equal
        scores (rows that came in one operation: a window's pull or warm, tens of thousands with
        count 1), the group's lowest shard positions. An arbitrary pick there spread each
        write-back batch over the group's pages, so that a page of the shard was written once
        for every batch that took one of its rows (0.41 pages a row in the 16.7 GB run, where
        the group's rows share a page 17 to 1); in file order, consecutive batches take
        consecutive pages. The cut is a radix selection (hvctr.kernels.select): numpy's partition
        took 177 of the 222 ms an insert of 7,500 rows spent in a full cache of 1.75M entries,
        as such groups make most scores equal."""
        cut = kth_smallest(score, m - 1)
        below = cand[score < cut]
        tie = cand[score == cut]
        rest = m - below.shape[0]
        if rest < tie.shape[0]:
            tie = tie[np.argpartition(self.pos[tie], rest - 1)[:rest]] if rest > 0 else tie[:0]
        return np.concatenate([below, tie])

    def _drop(self, ent: np.ndarray) -> None:
        held = self.tick[ent] == _HELD  # only discard drops a held entry
        self.n_held -= int(np.count_nonzero(held))
        self.tick[ent[held]] = 0
        slots = self.tslot[ent]
        self.tab_key[slots] = EMPTY_KEY
        self.tab_ent[slots] = _DEAD
        self.n_dead += ent.shape[0]
        self.keys[ent] = EMPTY_KEY
        self.pos[ent] = -1
        self.dirty[ent] = False
        self.tslot[ent] = -1
        self._free[self.n_free:self.n_free + ent.shape[0]] = ent
        self.n_free += ent.shape[0]
        if self.n_dead > self.nslots // 4:  # probes walk over tombstones: rebuild the table
            self._rebuild()

    def _rebuild(self) -> None:
        self.tab_key[:] = EMPTY_KEY
        self.tab_ent[:] = _EMPTY
        self.n_dead = 0
        live = np.flatnonzero(self.keys != EMPTY_KEY)
        if live.size:
            self._table_put(self.keys[live], live)

    def discard(self, entries: np.ndarray) -> None:
        """Forgets entries without writing them back (their rows are being replaced)."""
        if entries.size:
            self._drop(np.asarray(entries, dtype=np.int64))

    def dirty_entries(self) -> np.ndarray:
        return np.flatnonzero(self.dirty)

    def mark_clean(self, entries: np.ndarray) -> None:
        self.dirty[entries] = False

    def clear(self) -> None:
        """Empties the cache (dirty rows are lost: flush first)."""
        self.keys[:] = EMPTY_KEY
        self.pos[:] = -1
        self.dirty[:] = False
        self.tslot[:] = -1
        self.tab_key[:] = EMPTY_KEY
        self.tab_ent[:] = _EMPTY
        self.n_dead = 0
        self.tick[self.tick == _HELD] = 0
        self.n_held = 0
        self._free[:] = np.arange(self.capacity - 1, -1, -1, dtype=np.int64)
        self.n_free = self.capacity


def _no_victims(width: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return (np.zeros(0, dtype=np.uint64), np.zeros(0, dtype=np.int64), np.zeros((0, width), dtype=np.float32))
