"""EmbeddingStore: one rank's owned part of the table (SSD shard + CPU cache + admission).

Every method takes keys this rank owns, as a 1-D uint64 array of unique keys (the exchange
deduplicates before it calls, and the store trusts it: it checks only under
HVCTR_DEBUG_CHECKS=1), and is safe to call from two threads (one lock; ``warm`` lets go of it
between chunks, and while it reads a chunk's rows, so that the main thread's pull, push and
write-back run beside the prefetch: ``_Fence`` keeps what they wrote meanwhile from being
cached old).

``defer_write`` hands over rows that nothing reads before the next window trains (the push's
rows the next window does not hold, hvctr.storage.exchange), with their places (cache entry or
shard position) looked up at once, while the shard still remembers them; ``start_deferred``
writes them on a thread of their own while that window trains. Every other method waits for
them first (``settle``; ``warm``, in the prefetch thread, until that thread starts), ``read``
too unless its caller says its keys are not among them: no reader ever sees a deferred row old.

Reads go cache -> shard -> new row. A new key is admitted once it has been counted
``storage.admit_after`` times (online, in a count-min sketch); until then it reads the shared
default row (zeros) and its writes are dropped. An admitted new key gets its init row from
the key (hvctr.formats), a shard position at once (so a full shard fails at the read that
needs the room) and a dirty cache entry; the row reaches the shard on eviction or flush.
"""

from __future__ import annotations

import os
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

from hvctr import memcg
from hvctr.config import StorageConfig, WriteBehind
from hvctr.formats import default_bucket_owner, mix64, owner_of
from hvctr.kernels import init_rows, unique_in_order
from hvctr.kernels.diskio import IOStats
from hvctr.storage.cache import RowCache
from hvctr.formats import RowLayout, SparseOptimizer, default_row
from hvctr.storage.position_log import Tag
from hvctr.storage.shard import Shard, pending_bytes_for, recent_positions_for, strictly_increasing

_WARM_CHUNK = 1 << 16  # keys per locked step of warm()
_FLUSH_CHUNK_BYTES = 64 << 20  # rows written per step of flush()
_CLEAN_GENERATION = -1  # row_meta generation of bulk-loaded rows: in no checkpoint delta

# HVCTR_DEBUG_CHECKS=1 (read at import; tests may set the attribute): the store checks that the
# keys each method gets are unique. The exchange deduplicates what it hands over (a window's
# keys are unique, an owner dedups what ranks send), so by default the store trusts it and
# skips a hash pass per call. load_rows (checkpoint files) always checks.
DEBUG_CHECKS = os.environ.get("HVCTR_DEBUG_CHECKS", "") == "1"


def shard_path(shard_dir: str | Path, rank: int) -> str:
    """The working shard file of ``rank`` under ``shard_dir``."""
    return os.path.join(str(shard_dir), f"shard-r{rank:05d}.h5")


def as_keys(keys: np.ndarray) -> np.ndarray:
    """A 1-D uint64 view of keys given as uint64 or as int64 (torch's view of them)."""
    keys = np.ascontiguousarray(keys)
    if keys.dtype == np.int64:
        keys = keys.view(np.uint64)
    if keys.dtype != np.uint64 or keys.ndim != 1:
        raise ValueError(f"keys must be a 1-D uint64 (or int64 view) array, got {keys.dtype} {keys.shape}")
    return keys


def require_unique(keys: np.ndarray) -> np.ndarray:
    """``keys`` as a 1-D uint64 array; ValueError if a key occurs twice."""
    keys = as_keys(keys)
    # Sorted input (np.unique's, or torch.unique's int64 order) proves uniqueness in O(n);
    # other orders (the exchange's, first occurrence) take one hash pass.
    if keys.size > 1 and not (strictly_increasing(keys) or strictly_increasing(keys.view(np.int64))):
        if unique_in_order(keys, distinct=keys.size)[0].size != keys.size:
            raise ValueError("EmbeddingStore methods take unique keys; deduplicate first (np.unique)")
    return keys


def _unique_keys(keys: np.ndarray) -> np.ndarray:
    """Keys handed over by the exchange: trusted unique, checked under DEBUG_CHECKS only."""
    return require_unique(keys) if DEBUG_CHECKS else as_keys(keys)


@dataclass
class RowPositions:
    """Where a read found each of its keys' rows on the shard (int64, -1: none, an unadmitted
    key), as of the store's ``epoch`` then. A shard's rows never move but where the epoch
    changes (compact, load_rows, close: ``EmbeddingStore._quiesce``), so a write of the same
    keys in the same epoch need not look their places up again: an owner's push writes the rows
    its pull read, often past the shard's RecentPositions by then (issue 32's out-of-core profile:
    a tenth of the prefetch thread's time went to looking them up again)."""
    pos: np.ndarray
    epoch: int

    def take(self, idx: np.ndarray) -> "RowPositions":
        return RowPositions(self.pos[idx], self.epoch)


class AdmissionSketch:
    """Counts of not-yet-stored keys: a count-min sketch, 4 rows of saturating uint16.

    ``add(keys)`` counts each key once and returns its estimated count (never below the true
    count, so a key is never admitted late; collisions only admit some early).
    """

    ROWS = 4

    def __init__(self, slots: int) -> None:
        self.slots = int(slots)
        self.table = np.zeros((self.ROWS, self.slots), dtype=np.uint16)
        self._salts = mix64(np.arange(1, self.ROWS + 1, dtype=np.uint64) * np.uint64(0xA24BAED4963EE407))

    def _cols(self, keys: np.ndarray) -> np.ndarray:
        return (mix64(keys[None, :] ^ self._salts[:, None]) % np.uint64(self.slots)).astype(np.int64)

    def estimate(self, keys: np.ndarray) -> np.ndarray:
        cols = self._cols(keys)
        return self.table[np.arange(self.ROWS)[:, None], cols].min(axis=0).astype(np.int64)

    def add(self, keys: np.ndarray) -> np.ndarray:
        cols = self._cols(keys)
        est = np.minimum(self.table[np.arange(self.ROWS)[:, None], cols].min(axis=0).astype(np.int64) + 1, 65535)
        for r in range(self.ROWS):  # conservative update; maximum.at handles shared counters
            np.maximum.at(self.table[r], cols[r], est.astype(np.uint16))
        return est


class _Fence:
    """The shard positions written while one of warm()'s reads ran without the lock."""

    def __init__(self, epoch: int) -> None:
        self.epoch = epoch
        self.written: list[np.ndarray] = []

    def wrote(self, pos: np.ndarray) -> np.ndarray:
        """Which of ``pos`` were written meanwhile (bool)."""
        if not self.written:
            return np.zeros(pos.shape[0], dtype=bool)
        return np.isin(pos, np.concatenate(self.written))


class EmbeddingStore:
    """One rank's part of the embedding table. See the module docstring for the semantics.

    ``EmbeddingStore(cfg, path, rank=0, world_size=1, bucket_owner=None, create=None)``:
    create None opens ``path`` if it exists, else creates it; True always creates a fresh
    shard; False requires it to exist. bucket_owner defaults to hvctr.formats' round robin.
    ``optimizer`` (train.sparse_optimizer) fixes the rows' layout; an existing shard must have it.
    """

    def __init__(self, cfg: StorageConfig, path: str | Path, rank: int = 0, world_size: int = 1,
                 bucket_owner: np.ndarray | None = None, create: bool | None = None,
                 optimizer: SparseOptimizer = SparseOptimizer.ADAM) -> None:
        self.cfg = cfg
        self.layout = RowLayout(cfg.dim, optimizer)
        self.path = str(path)
        # storage.write_behind: auto flushes and drops the shard's writes under a memory limit only
        self.write_behind = (cfg.write_behind is WriteBehind.ON
                             or (cfg.write_behind is WriteBehind.AUTO and memcg.current() is not None))
        exists = os.path.exists(self.path)
        if create is False and not exists:
            raise ValueError(f"shard file {self.path} does not exist")
        if create or not exists:
            if cfg.rows_per_rank < 1:
                raise ValueError("storage.rows_per_rank = 0 (size from the data) must be decided before a shard "
                                 "is created (hvctr.train.preflight.size_shard)")
            owner = default_bucket_owner(world_size) if bucket_owner is None else bucket_owner
            self.shard = Shard.create(self.path, dim=cfg.dim, optimizer=optimizer, capacity=cfg.rows_per_rank,
                                      world_size=world_size, rank=rank, bucket_owner=owner, seed=cfg.seed,
                                      init_scale=cfg.init_scale, max_load_factor=cfg.max_load_factor,
                                      **self._io())
        else:
            self.shard = Shard.open(self.path, **self._io())
            self._check_matches(rank, world_size)
        self.cache = RowCache(self.layout.width, cfg.cpu_cache_bytes, cfg.cache_policy, cfg.lfu_aging_lookups)
        self.admission = AdmissionSketch(cfg.admit_sketch_slots) if cfg.admit_after > 1 else None
        self._default = default_row(self.layout)
        self._lock = threading.RLock()
        self._reads_done = threading.Condition(self._lock)  # warm()'s reads outside the lock: none left
        self._fences: list[_Fence] = []  # warm()'s reads in flight outside the lock
        self._epoch = 0  # bumped where rows move or the shard closes: a read in flight is dropped whole
        self._deferred: _DeferredWrite | None = None  # rows handed over by defer_write, not yet all stored
        self._deferred_done = threading.Condition(self._lock)  # warm() waits on it
        self.counters = dict.fromkeys(
            ("created", "unadmitted_reads", "dropped_writes", "writeback_rows", "writethrough_rows",
             "warmed_rows", "fenced_warm_rows", "readonly_init_rows", "deferred_rows", "recalled_positions"), 0)
        self.shard_s = 0.0  # seconds inside shard calls (index probes, row reads and writes)
        self.total_s = 0.0  # seconds inside store methods
        self._thread_times = threading.local()  # the same, per calling thread (exchange timing)

    def _io(self) -> dict:
        return {"io": self.cfg.shard_io.value, "io_threads": self.cfg.io_threads, "write_behind": self.write_behind,
                "recent_positions": recent_positions_for(self.cfg.cpu_cache_bytes),
                "position_log": self.cfg.position_log, "pending_bytes": pending_bytes_for(self.cfg.cpu_cache_bytes)}

    def _check_matches(self, rank: int, world_size: int) -> None:
        s = self.shard
        for key, have, want in (("storage.dim", s.layout.dim, self.cfg.dim), ("storage.seed", s.init_seed, self.cfg.seed),
                                ("train.sparse_optimizer", s.layout.optimizer.value, self.layout.optimizer.value),
                                ("rank", s.rank, rank), ("world_size", s.world_size, world_size)):
            if have != want:
                s.close()
                raise ValueError(f"shard file {self.path} was made with {key}={have}, this run has {want}: "
                                 f"use a fresh storage.shard_dir (or the settings the shard was made with)")

    @contextmanager
    def _timed(self, shard: bool = False):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            dt = time.perf_counter() - t0
            tl = self._thread_times
            if shard:
                self.shard_s += dt
                tl.shard_s = getattr(tl, "shard_s", 0.0) + dt
            else:
                self.total_s += dt
                tl.total_s = getattr(tl, "total_s", 0.0) + dt

    def _credit_time(self, dt: float) -> None:
        """Time a shard call took outside ``_timed`` (warm()'s reads without the lock)."""
        tl = self._thread_times
        self.shard_s += dt
        self.total_s += dt
        tl.shard_s = getattr(tl, "shard_s", 0.0) + dt
        tl.total_s = getattr(tl, "total_s", 0.0) + dt

    def _open_fence(self) -> "_Fence":
        """Starts recording the shard positions written from now on (the lock held)."""
        fence = _Fence(self._epoch)
        self._fences.append(fence)
        return fence

    def _close_fence(self, fence: "_Fence") -> None:
        self._fences.remove(fence)
        if not self._fences:
            self._reads_done.notify_all()

    def _quiesce(self) -> None:
        """Waits for warm()'s reads outside the lock, and drops what they read (the lock held):
        before rows move (compact), are loaded, or the shard closes."""
        while self._fences:
            self._reads_done.wait()
        self._epoch += 1

    # --- writes after the next window's pull --------------------------------------------

    def defer_write(self, keys: np.ndarray, rows: np.ndarray, placed: RowPositions | None = None) -> None:
        """``write(keys, rows, placed)`` later: held until ``start_deferred`` writes them on a
        thread, or until any other method needs them stored. The caller promises that nothing
        reads these keys before then, but through this store, and that only ``read(...,
        deferred_ok=True)`` of other keys comes first. Their places are looked up now (but those
        ``placed`` gives): the shard's recent positions hold them now, not after the next
        window's lookups."""
        self.settle()
        keys = _unique_keys(keys)
        rows = np.asarray(rows, dtype=np.float32)
        self._check_rows(keys, rows)
        if keys.size == 0:
            return
        with self._lock, self._timed():
            ent = self.cache.lookup(keys, "peek")
            pos = np.full(keys.shape[0], -1, dtype=np.int64)
            if placed is not None and placed.epoch == self._epoch:
                pos[:] = placed.pos
            cached = ent >= 0
            pos[cached] = self.cache.pos[ent[cached]]  # an eviction meanwhile writes it back there
            miss = np.flatnonzero(pos < 0)
            if miss.size:
                with self._timed(shard=True), self.shard.attributed("push"):
                    pos[miss] = self.shard.lookup(keys[miss])
            self._deferred = _DeferredWrite(keys, rows, pos)
            self.counters["deferred_rows"] += keys.size

    def start_deferred(self) -> None:
        """Writes the deferred rows on a thread of their own; returns at once."""
        d = self._deferred
        if d is not None and d.thread is None:
            with self._lock:
                d.thread = threading.Thread(target=self._write_deferred, args=(d,), daemon=True,
                                            name=f"hvctr-deferred-write-{self.shard.rank}")
                d.thread.start()
                self._deferred_done.notify_all()  # a warm waiting for the pull goes on beside it

    def _write_deferred(self, d: "_DeferredWrite") -> None:
        try:
            self._write_now(d.keys, d.rows, d.pos, exact=True)
        except BaseException as e:  # raised by the settle that waits for it
            d.error = e
        finally:
            with self._lock:
                d.done = True
                self._deferred_done.notify_all()

    def settle(self) -> None:
        """Returns once the deferred rows are stored (writing them here if no thread took them);
        a failure of their thread is raised here. A no-op inside that thread."""
        d = self._deferred
        if d is None or threading.current_thread() is d.thread:
            return
        if d.thread is None:
            try:
                self._write_now(d.keys, d.rows, d.pos, exact=True)
            finally:
                with self._lock:
                    self._deferred, d.done = None, True
                    self._deferred_done.notify_all()
            return
        d.thread.join()
        with self._lock:
            self._deferred = None
        if d.error is not None:
            raise RuntimeError(f"rank {self.shard.rank if self.shard else '?'}: writing a window's rows to "
                               f"{self.path} after the next window's pull failed: {d.error}") from d.error

    def _await_deferred(self) -> None:
        """warm()'s wait for deferred rows no thread writes yet (from the prefetch thread, which
        must not write them itself: the thread that deferred them starts them after its pull). Until that
        pull, its window's warmed rows are held in the cache and the next warm would find no
        room; from then on the two run beside each other, as a warm and a push always did."""
        d = self._deferred
        if d is None or d.thread is not None:
            return
        if threading.current_thread() is d.owner:  # no other thread would start them
            self.settle()
            return
        with self._lock:
            while self._deferred is d and d.thread is None:
                self._deferred_done.wait()

    def thread_times(self) -> tuple[float, float]:
        """(seconds in store methods, of which in shard calls) spent by the calling thread."""
        tl = self._thread_times
        return getattr(tl, "total_s", 0.0), getattr(tl, "shard_s", 0.0)

    # --- the training path -------------------------------------------------------------

    def read(self, keys: np.ndarray, count: bool = True, deferred_ok: bool = False,
             tag: Tag | None = None) -> np.ndarray:
        """Rows of ``keys`` (float32 [n, width]); new admitted keys are created with init rows.

        ``count=False`` does not count the keys towards admission (a second read of the same
        window, e.g. sync mode's gradient push). ``deferred_ok``: none of ``keys`` is among the
        deferred rows (``defer_write``), so the read need not wait for them. ``tag``: the
        training window's (epoch, first batch): the shard logs the positions it looked up or
        created for the same window of the next pass (hvctr.storage.position_log).
        """
        return self.read_placed(keys, count, deferred_ok, tag)[0]

    def read_placed(self, keys: np.ndarray, count: bool = True, deferred_ok: bool = False,
                    tag: Tag | None = None) -> tuple[np.ndarray, RowPositions]:
        """``read``, and where it found each row on the shard: a ``write`` of the same keys
        given them looks none up again (an owner's push of the rows its pull read)."""
        if not deferred_ok:
            self.settle()
        keys = _unique_keys(keys)
        with self._lock, self._timed():
            ent = self.cache.lookup(keys, "access")
            out = np.empty((keys.shape[0], self.layout.width), dtype=np.float32)
            self.cache.take(ent, out)
            pos = np.full(keys.shape[0], -1, dtype=np.int64)
            hit = ent >= 0
            pos[hit] = self.cache.pos[ent[hit]]
            miss = np.flatnonzero(~hit)
            if miss.size:
                if tag is not None:  # the warm's recall, where no warm ran (data.prefetch = false)
                    with self._timed(shard=True), self.shard.attributed("pull"):
                        self.counters["recalled_positions"] += self.shard.recall(tag)
                # count=False is a window's second read of its rows (a push's old rows)
                with self.shard.attributed("pull" if count else "push"):
                    if miss.size == keys.shape[0]:  # every key missed (a small cache): into out itself
                        pos = self._read_misses(keys, count, out, tag)
                    else:
                        rows = np.empty((miss.size, self.layout.width), dtype=np.float32)
                        pos[miss] = self._read_misses(keys[miss], count, rows, tag)
                        out[miss] = rows
            return out, RowPositions(pos, self._epoch)

    def _read_misses(self, keys: np.ndarray, count: bool, out: np.ndarray, tag: Tag | None = None) -> np.ndarray:
        """The rows of keys the cache does not hold, into ``out``; returns their shard positions
        (-1: not stored). A window's rows are copied as few times as the order of the shard
        asks: every whole-window copy is 65 MB at 327k rows of D = 16 (issue 26)."""
        with self._timed(shard=True):
            pos = self.shard.lookup(keys)
            found = np.flatnonzero(pos >= 0)
            if found.size == keys.shape[0]:
                self.shard.read_rows(pos, out=out)
            else:
                out[found] = self.shard.read_rows(pos[found])
        new = np.flatnonzero(pos < 0)
        admitted = self._admit(keys[new], count)
        out[new[~admitted]] = self._default
        self.counters["unadmitted_reads"] += int(np.count_nonzero(~admitted))
        new = new[admitted]
        if new.size:
            out[new] = init_rows(keys[new], self.layout, self.cfg.init_scale, self.cfg.seed)
            with self._timed(shard=True):
                pos[new] = self.shard.insert(keys[new])
            self.counters["created"] += new.size
        self.shard.remember(tag, keys, pos)
        # New rows first: those the cache cannot take must be written through, found ones
        # are on the shard already and are simply not cached.
        order = np.concatenate((new, found))
        dirty = np.zeros(order.size, dtype=bool)
        dirty[:new.size] = True
        n_in = self._cache_insert(keys[order], self._offered_rows(out, order), pos[order], dirty)
        if n_in < new.size:
            rest = new[n_in:]
            self._write_shard_at(pos, keys, out, rest)
            self.counters["writethrough_rows"] += rest.size
        return pos

    def _admit(self, keys: np.ndarray, count: bool) -> np.ndarray:
        """Which new keys may be stored now."""
        if self.admission is None or keys.size == 0:
            return np.ones(keys.shape[0], dtype=bool)
        seen = self.admission.add(keys) if count else self.admission.estimate(keys)
        return seen >= self.cfg.admit_after

    def _cache_insert(self, keys: np.ndarray, rows: np.ndarray, pos: np.ndarray, dirty: np.ndarray | bool,
                      hold: bool = False) -> int:
        n_in, (vk, vp, vr) = self.cache.insert(keys, rows, pos, dirty, hold)
        if vk.size:
            self._write_shard(vp, vk, vr)
            self.counters["writeback_rows"] += vk.size
        return n_in

    def _offered_rows(self, rows: np.ndarray, idx: np.ndarray) -> np.ndarray:
        """rows[idx] as RowCache.insert reads them: it caches at most a prefix of what it is
        offered, never more than its capacity, so only that prefix is copied."""
        return rows[idx[:self.cache.capacity]]

    def _write_shard_at(self, pos: np.ndarray, keys: np.ndarray, rows: np.ndarray, idx: np.ndarray) -> None:
        """``_write_shard(pos[idx], keys[idx], rows[idx])`` with one copy of the rows, in the
        shard's order (Shard.write_rows copies rows it gets out of order)."""
        idx = idx[np.argsort(pos[idx], kind="stable")]
        self._write_shard(pos[idx], keys[idx], rows[idx])

    def _write_shard(self, pos: np.ndarray, keys: np.ndarray, rows: np.ndarray, cause: str = "writeback") -> None:
        """Rows to the shard: evicted dirty rows and rows the cache could not take
        ("writeback"), or a flush's dirty rows ("flush")."""
        for fence in self._fences:
            fence.written.append(np.array(pos, dtype=np.int64))
        with self._timed(shard=True), self.shard.attributed(cause):
            self.shard.write_rows(pos, keys, rows)

    def write(self, keys: np.ndarray, rows: np.ndarray, placed: RowPositions | None = None) -> None:
        """Stores new values of ``keys`` into the cache, dirty (written through if it is full).

        Keys the store does not hold are created if admitted (without counting), else their
        rows are dropped (unadmitted keys keep reading the default row). ``placed``: where a
        ``read_placed`` of these keys found them (used where its epoch is still the store's).
        """
        self.settle()
        keys = _unique_keys(keys)
        rows = np.asarray(rows, dtype=np.float32)
        self._check_rows(keys, rows)
        if placed is not None and placed.pos.shape != keys.shape:
            raise ValueError(f"write: {placed.pos.shape[0]} positions for {keys.shape[0]} keys")
        self._write_now(keys, rows, placed=placed)

    def _check_rows(self, keys: np.ndarray, rows: np.ndarray) -> None:
        if rows.shape != (keys.shape[0], self.layout.width):
            raise ValueError(f"write: rows of shape {rows.shape} for {keys.shape[0]} keys of width {self.layout.width}")

    def _write_now(self, keys: np.ndarray, rows: np.ndarray, pos: np.ndarray | None = None,
                   placed: RowPositions | None = None, exact: bool = False) -> None:
        """write() after its checks; ``pos``: each key's shard position where known (a deferred
        write's, looked up at defer_write: ``exact``, -1 is a key the shard lacks; or
        ``placed``'s where its epoch is the store's: -1 is not known), else looked up here for
        the keys the cache lacks."""
        with self._lock, self._timed():
            if placed is not None and placed.epoch == self._epoch:
                pos = placed.pos
            ent = self.cache.lookup(keys, "pin")
            self.cache.put(ent, rows)
            miss = np.flatnonzero(ent < 0)
            if miss.size:
                with self.shard.attributed("push"):
                    if miss.size == keys.shape[0]:  # every key missed (a small cache): no copy of the rows
                        self._write_misses(keys, rows, pos, exact)
                    else:
                        self._write_misses(keys[miss], rows[miss], None if pos is None else pos[miss], exact)

    def _write_misses(self, keys: np.ndarray, rows: np.ndarray, known: np.ndarray | None = None,
                      exact: bool = False) -> None:
        if known is None:
            with self._timed(shard=True):
                pos = self.shard.lookup(keys)
        else:
            pos = known.copy()
            # not known: a key the read did not store (unadmitted), which a read since may have created
            unknown = np.flatnonzero(pos < 0) if not exact else np.zeros(0, dtype=np.int64)
            if unknown.size:
                with self._timed(shard=True):
                    pos[unknown] = self.shard.lookup(keys[unknown])
        new = np.flatnonzero(pos < 0)
        admitted = self._admit(keys[new], count=False)
        self.counters["dropped_writes"] += int(np.count_nonzero(~admitted))
        keep = np.ones(keys.shape[0], dtype=bool)
        keep[new[~admitted]] = False
        new = new[admitted]
        if new.size:
            with self._timed(shard=True):
                pos[new] = self.shard.insert(keys[new])
            self.counters["created"] += new.size
        idx = np.flatnonzero(keep)
        n_in = self._cache_insert(keys[idx], self._offered_rows(rows, idx), pos[idx], True)
        rest = idx[n_in:]
        if rest.size:
            self._write_shard_at(pos, keys, rows, rest)
            self.counters["writethrough_rows"] += rest.size

    def warm(self, keys: np.ndarray, tag: Tag | None = None) -> None:
        """Brings the shard rows of ``keys`` into the cache; answers nothing, changes no value.

        Keys the shard does not hold are left alone (rows are created only by ``read``, and
        admission counts only there), so warming never changes what a later read returns.
        The rows it brings are held in the cache until a read takes them (RowCache), at most
        half of the cache's entries held at a time: where a window's rows outnumber that, the
        rest are left to the read, which would otherwise read again the rows this warm's later
        chunks and the push before the read evicted.

        Past the rows it may hold, it looks up the positions of the rest (as many as the
        shard's RecentPositions keep in half a generation): the read then reads their rows
        without reading their index blocks on the training thread's path.

        A chunk's rows are read with the lock released, so that the training thread's pull,
        push and write-back run beside the reads rather than wait for them (issue 26: the
        device then has both threads' requests in flight). A row written to the shard while it
        was being read may have been read old: it is not cached (``_Fence``), nor is a key the
        cache took meanwhile (the cache's copy is newer or the same).
        """
        self._await_deferred()
        keys = _unique_keys(keys)
        if tag is not None:
            with self._lock, self._timed(shard=True), self.shard.attributed("warm"):
                self.counters["recalled_positions"] += self.shard.recall(tag)
        recent = self.shard.recent
        ahead = recent.size // 2 if recent is not None else 0  # positions it may look up past the rows it holds
        for start in range(0, keys.shape[0], _WARM_CHUNK):
            chunk = keys[start:start + _WARM_CHUNK]
            with self._lock, self._timed(), self.shard.attributed("warm"):
                room = max(self.cache.capacity // 2 - self.cache.n_held, 0)  # rows it may hold for the read
                if room == 0 and ahead == 0:
                    return
                ent = self.cache.lookup(chunk, "pin")
                at = np.flatnonzero(ent < 0)  # the chunk's keys to read: not cached, maybe on the shard
                at = at[self.shard.may_hold(chunk[at])][:room + ahead]
                if at.size == 0:
                    continue
                # Past the rows it may hold, the keys' positions alone: the shard keeps them
                # (RecentPositions), so the read finds these rows without their index blocks.
                with self._timed(shard=True):
                    pos = self.shard.lookup(chunk[at])
                    self.shard.remember(tag, chunk[at], pos)
                ahead -= max(at.size - room, 0)
                at, pos = at[:room], pos[:room]
                found = np.flatnonzero(pos >= 0)
                if found.size == 0:
                    continue
                at, pos = at[found], pos[found]
                fence = self._open_fence()
            try:
                t0 = time.perf_counter()
                rows, io = self.shard.read_rows_detached(pos)  # the lock is free meanwhile
                dt = time.perf_counter() - t0
            except BaseException:
                with self._lock:
                    self._close_fence(fence)
                raise
            with self._lock:  # the fence closes where its positions are read: no write slips between
                self._close_fence(fence)
                self._credit_time(dt)
                if fence.epoch != self._epoch:  # the shard was closed, compacted or loaded meanwhile
                    return
                self._take_warmed(chunk, at, pos, rows, fence, io, dt)

    def _take_warmed(self, chunk: np.ndarray, at: np.ndarray, pos: np.ndarray, rows: np.ndarray, fence: _Fence,
                     io: IOStats, dt: float) -> None:
        """warm()'s rows of ``chunk[at]`` (read at ``pos`` without the lock) into the cache, held,
        but for those written meanwhile and those the cache took meanwhile."""
        with self._timed(), self.shard.attributed("warm"):
            self.shard.credit_read(io, rows.nbytes, dt)
            ent = self.cache.lookup(chunk, "pin")  # the chunk's cached rows kept from the insert's evictions
            keep = (ent[at] < 0) & ~fence.wrote(pos)
            self.counters["fenced_warm_rows"] += int(np.count_nonzero(ent[at] < 0)) - int(np.count_nonzero(keep))
            keep = np.flatnonzero(keep)[:max(self.cache.capacity // 2 - self.cache.n_held, 0)]
            n_in = self._cache_insert(chunk[at[keep]], rows[keep], pos[keep], False, hold=True)
            self.counters["warmed_rows"] += n_in

    def read_only(self, keys: np.ndarray) -> np.ndarray:
        """Rows for evaluation: nothing is inserted, counted or evicted.

        A key the store does not hold reads its init row (computed, not stored), or the
        default row when admission is on (what training read for it).
        """
        self.settle()
        keys = _unique_keys(keys)
        with self._lock, self._timed(), self.shard.attributed("eval"):
            ent = self.cache.lookup(keys, "peek")
            out = np.empty((keys.shape[0], self.layout.width), dtype=np.float32)
            hit = ent >= 0
            out[hit] = self.cache.rows[ent[hit]]
            miss = np.flatnonzero(~hit)
            with self._timed(shard=True):
                pos = self.shard.lookup(keys[miss])
                found = pos >= 0
                out[miss[found]] = self.shard.read_rows(pos[found])
            unseen = miss[~found]
            if self.admission is None:
                out[unseen] = init_rows(keys[unseen], self.layout, self.cfg.init_scale, self.cfg.seed)
            else:
                out[unseen] = self._default
            self.counters["readonly_init_rows"] += unseen.size
            return out

    # --- persistence -------------------------------------------------------------------

    def flush(self) -> None:
        """Writes every dirty cached row to the shard (they stay cached, clean) and the state."""
        self.settle()
        with self._lock, self._timed():
            d = self.cache.dirty_entries()
            if d.size:
                # in file order, a bounded chunk of rows at a time: a cache of many GiB flushes
                # without a copy of all its dirty rows beside it
                d = d[np.argsort(self.cache.pos[d], kind="stable")]
                chunk = max(_FLUSH_CHUNK_BYTES // self.layout.row_bytes, 1)
                rows = np.empty((min(chunk, d.size), self.layout.width), dtype=np.float32)
                for start in range(0, d.size, chunk):
                    ent = d[start:start + chunk]
                    part = rows[:ent.size]
                    self.cache.take(ent, part)
                    self._write_shard(self.cache.pos[ent], self.cache.keys[ent], part, "flush")
                    self.cache.mark_clean(ent)
                self.counters["writeback_rows"] += d.size
            self.shard.save_state(clean=False)

    def end_pass(self) -> None:
        """Closes a pass over the data (TTL clock): rows written from now on are seen in the next."""
        self.settle()
        with self._lock:
            self.flush()
            self.shard.pass_index += 1
            self.shard.save_state(clean=False)

    @property
    def pass_index(self) -> int:
        """The TTL clock: passes ended so far (end_pass counts them; checkpoints carry it)."""
        return self.shard.pass_index

    def set_pass_index(self, value: int) -> None:
        """Restores the TTL clock from a checkpoint."""
        self.settle()
        with self._lock:
            self.shard.pass_index = int(value)
            self.shard.save_state(clean=False)

    def compact(self) -> int:
        """Drops rows not written during the last ``storage.ttl_passes`` passes; returns how many.

        Rewrites the shard (temporary file, then rename) and empties the cache. Rows dropped
        here appear in no checkpoint delta: write a new checkpoint base after compacting.
        """
        if self.cfg.ttl_passes == 0:
            return 0
        self.settle()
        with self._lock, self.shard.attributed("compact"):
            self._quiesce()
            self.flush()
            self.cache.clear()
            old, tmp = self.shard, self.path + ".compact"
            new = Shard.create(tmp, dim=self.cfg.dim, optimizer=self.layout.optimizer, capacity=old.capacity,
                               world_size=old.world_size, rank=old.rank, bucket_owner=old.bucket_owner,
                               seed=self.cfg.seed, init_scale=old.init_scale,
                               max_load_factor=self.cfg.max_load_factor, **self._io())
            new.pass_index, new.generation = old.pass_index, old.generation
            oldest = old.pass_index - self.cfg.ttl_passes
            dropped = 0
            for start in range(0, old.n_rows, 1 << 16):
                meta = old.read_meta(start, start + (1 << 16))
                rows = old.read_range(start, start + (1 << 16))
                keep = meta["last_seen"] >= oldest
                dropped += int(np.count_nonzero(~keep))
                pos = new.insert(meta["key"][keep])
                new.write_rows(pos, meta["key"][keep], rows[keep], meta["last_seen"][keep],
                               meta["generation"][keep])
            new.close()
            old.close()
            os.replace(tmp, self.path)
            self.shard = Shard.open(self.path, **self._io())
            return dropped

    def count_rows(self, delta_only: bool = False, chunk_rows: int = 1 << 18) -> int:
        """How many rows ``iter_rows(delta_only=...)`` yields now (flushes first, reads only
        row_meta): a checkpoint reserves its file's space before writing a byte of it."""
        self.settle()
        self.flush()
        with self._lock, self.shard.attributed("checkpoint"):
            if not delta_only:
                return self.shard.n_rows
            return sum(int(np.count_nonzero(self.shard.read_meta(start, start + chunk_rows)["generation"]
                                            == self.shard.generation))
                       for start in range(0, self.shard.n_rows, chunk_rows))

    def iter_rows(self, chunk_rows: int = 1 << 16, delta_only: bool = False,
                  with_last_seen: bool = False) -> Iterator[tuple[np.ndarray, ...]]:
        """Every stored (keys, rows), in shard order, in chunks; flushes first.

        ``delta_only``: only rows written since the last checkpoint mark. ``with_last_seen``:
        (keys, rows, last_seen) with each row's TTL pass (int32), so that a checkpoint carries
        the TTL clock. Do not interleave with writes (between windows, as checkpoints are).
        """
        self.settle()
        self.flush()
        for start in range(0, self.shard.n_rows, chunk_rows):
            with self._lock, self.shard.attributed("checkpoint"):
                meta = self.shard.read_meta(start, start + chunk_rows)
                if delta_only:
                    sel = np.flatnonzero(meta["generation"] == self.shard.generation)
                    rows = self.shard.read_rows(start + sel)
                    meta = meta[sel]
                else:
                    rows = self.shard.read_range(start, start + chunk_rows)
            if meta.size:
                yield (meta["key"], rows, meta["last_seen"]) if with_last_seen else (meta["key"], rows)

    def mark_checkpoint(self) -> None:
        """Starts a new checkpoint generation: later writes form the next delta."""
        self.settle()
        with self._lock:
            self.flush()
            self.shard.generation += 1
            self.shard.save_state(clean=False)

    def take_checkpoint_delta(self, chunk_rows: int = 1 << 16) -> tuple[np.ndarray, np.ndarray]:
        """(keys, rows) written since the last mark, then the mark: the next delta starts empty."""
        self.settle()
        with self._lock:
            parts = list(self.iter_rows(chunk_rows, delta_only=True))
            self.mark_checkpoint()
        if not parts:
            return np.zeros(0, dtype=np.uint64), np.zeros((0, self.layout.width), dtype=np.float32)
        return np.concatenate([k for k, _ in parts]), np.concatenate([r for _, r in parts])

    def load_rows(self, keys: np.ndarray, rows: np.ndarray, last_seen: np.ndarray | None = None) -> None:
        """Bulk load (a checkpoint's base or delta): upserts straight into the shard.

        Loaded rows belong to no delta (they are already in a checkpoint); cached copies of
        these keys are dropped so that reads see the loaded values. ``last_seen``: each row's
        TTL pass as saved (default: the current pass).
        """
        self.settle()
        keys = require_unique(keys)
        rows = np.asarray(rows, dtype=np.float32)
        foreign = owner_of(keys, self.shard.bucket_owner) != self.shard.rank
        if foreign.any():
            raise ValueError(f"load_rows into {self.path}: {int(foreign.sum())} keys (e.g. {int(keys[foreign][0])}) "
                             f"belong to other ranks under this shard's bucket table")
        with self._lock, self._timed(), self.shard.attributed("load"):
            self._quiesce()
            ent = self.cache.lookup(keys, "peek")
            self.cache.discard(ent[ent >= 0])
            with self._timed(shard=True):
                pos = self.shard.lookup(keys)
                new = np.flatnonzero(pos < 0)
                pos[new] = self.shard.insert(keys[new])
                seen = None if last_seen is None else np.asarray(last_seen, dtype=np.int32)
                self.shard.write_rows(pos, keys, rows, last_seen=seen, generation=_CLEAN_GENERATION)

    # --- bookkeeping -------------------------------------------------------------------

    def stats(self) -> dict[str, float]:
        """Counters since creation: cache hits/misses/evictions, shard bytes, rows, times."""
        c, s = self.cache, self.shard
        lookups = c.hits + c.misses
        return {
            "cache_hits": c.hits, "cache_misses": c.misses, "cache_evictions": c.evictions,
            "cache_hit_rate": c.hits / lookups if lookups else 0.0,
            "cache_rows": c.size, "cache_capacity_rows": c.capacity, "cache_bytes": c.nbytes,
            "shard_rows": s.n_rows, "shard_capacity_rows": s.capacity,
            "shard_bytes_read": s.bytes_read, "shard_bytes_written": s.bytes_written,
            # the pread path's system calls and the bytes they moved (pages: more than the rows'
            # bytes), and the index blocks its probes read
            **{f"shard_io_{k}": v for k, v in s.io_stats.as_dict().items()},
            "shard_index_blocks_read": s.index_blocks_read,
            "shard_filtered_lookups": s.filtered_lookups,
            "shard_recent_position_hits": s.recent.hits if s.recent is not None else 0,
            "shard_recalled_position_hits": s.recalled_hits,
            "store_s": self.total_s, "shard_s": self.shard_s, "cache_s": self.total_s - self.shard_s,
            **self.counters,
        }

    def shard_traffic(self) -> dict[str, dict[str, float]]:
        """The shard's traffic split by cause: {cause: {rows_read, index_blocks_read, read_calls,
        read_bytes, write_calls, write_bytes, seconds}} (hvctr.storage.shard.CAUSE_COUNTERS). Causes:
        warm (the prefetch), pull (a window's reads of rows the cache lacks, new keys' index
        entries), push (its index lookups of rows the cache lacks; its old rows, where
        merge.sparse_rule or sync mode reads them again), writeback (evicted dirty rows and
        rows the cache could not take), flush (dirty rows at a checkpoint, pass end or close),
        index_flush (index entries waiting in memory), checkpoint (the rows a checkpoint
        copies), eval, load (a resume's rebuild), compact, open, other."""
        with self._lock:
            self.shard._settle()
            return {cause: dict(c) for cause, c in sorted(self.shard.by_cause.items())}

    def admission_state(self) -> np.ndarray | None:
        """The admission sketch's counters (for checkpoints), None when admission is off."""
        self.settle()
        return None if self.admission is None else self.admission.table.copy()

    def load_admission_state(self, table: np.ndarray | None) -> None:
        self.settle()
        if self.admission is not None and table is not None:
            self.admission.table[...] = table

    def close(self) -> None:
        self.settle()
        with self._lock:
            if self.shard is None:
                return
            self._quiesce()
            self.flush()
            self.shard.close()
            self.shard = None

    def __enter__(self) -> "EmbeddingStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _DeferredWrite:
    """Rows ``EmbeddingStore.defer_write`` holds, their shard positions, and the thread that writes them."""

    def __init__(self, keys: np.ndarray, rows: np.ndarray, pos: np.ndarray) -> None:
        self.keys, self.rows, self.pos = keys, rows, pos
        self.owner = threading.current_thread()  # the thread that deferred them, and starts or settles them
        self.thread: threading.Thread | None = None
        self.done = False
        self.error: BaseException | None = None
