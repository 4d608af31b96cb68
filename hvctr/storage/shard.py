"""Tier 1: one rank's SSD shard, a plain HDF5 file read and written by file offset.

Layout (every dataset contiguous, uncompressed, allocated at creation and 4 KiB aligned)::

    /bucket_owner  int32 [4096]            owner rank of each virtual bucket (hvctr.formats)
    /index         {key u64, row i64} [S]  open addressing, S = capacity / max_load_factor
                                           rounded up to whole 4 KiB blocks (256 entries)
    /rows          float32 [capacity, W]   the rows (hvctr.formats), dense, in insertion order
    /row_meta      {key u64, last_seen i4, generation i4} [capacity]
                                           key of each row, the pass it was last written in
                                           (TTL) and the checkpoint generation (deltas)
    /state         {n_rows, generation, pass_index, clean} i8 [1]
    attributes     format_version, dim, width, sparse_optimizer (the rows' layout; absent: adam),
                   row_columns, capacity, num_slots, slots_per_block, world_size, rank,
                   slot_seed, init_seed, init_scale, max_load_factor

The slot of a key is ``mix64(key ^ slot_seed) % S``, then linear probing. An index block of
256 entries fills one 4 KiB page, so a lookup is one page read (two when the probe run
crosses a block end). The slot hash is independent of the owner hash (``mix64(key) >> 52``):
reusing the owner's bits would leave a rank only a fraction of its slots.

HDF5 only describes the file: after creation the hot path reads and writes the datasets by their
file offsets (``dset.id.get_offset()``). Two paths, chosen by ``storage.shard_io``:

- ``pread`` (the default): every read and write of rows, row_meta and index blocks goes through
  the C kernels' I/O pool (hvctr.kernels.diskio): a batch's items sorted, coalesced where they
  share a page, many reads in flight, no readahead (POSIX_FADV_RANDOM), under write-behind written
  pages flushed and dropped behind the write: a table many times the memory the job may use (a
  memory cgroup counts page cache) trains at the device's random-read rate, and its page cache is
  clean and reclaimable. The index is probed over the blocks a batch needs, read by the pool
  (``hv_index_find`` / ``hv_index_claim``): a probe run that crosses a block end reads the next
  block in a second round. Without write-behind (no memory limit: the pages stay) a writer also
  maps the file, and the rows, meta and index blocks the page cache holds (mincore) are copied,
  probed and claimed through the mapping, no system call and no page copied whole for them; not
  on a copy-on-write file system (an overwrite there allocates: a full disk would be a SIGBUS).
- ``mmap`` (the reference the tests compare against, and the path under HVCTR_NATIVE=0): rows
  read with np.memmap in sorted order (one page fault at a time), rows and row_meta written with
  os.pwrite (a write through mmap into a file on a full disk is a SIGBUS, not
an error). h5py's fancy indexing is never used (1-2k rows/s chunked, against 0.7M rows/s by
offset). The file is fully allocated at creation (HDF5 early allocation plus posix_fallocate:
``hvctr.formats.h5alloc``, which the checkpoint's rank files use too),
so a full disk fails then, not in the middle of training. Any h5py or h5dump reads it.

On the mmap path index entries are the exception: they are written through a shared map of the index. New
keys land on random slots, so writing them by pwrite costs one system call per key (about
3 us: 2 s of every 40 in the first epoch of the training benchmark); through the map it is a
store. The map cannot fault for space: every index block was written at creation (the empty
marker), so overwriting it allocates nothing on a file system that overwrites in place (ext4
and tmpfs tested here; xfs, Lustre and GPFS overwrite in place too, untested). Copy-on-write
file systems (btrfs, zfs, bcachefs) allocate on every overwrite: there index entries go by
pwrite as the rows do.
"""

from __future__ import annotations

import errno
import math
import os
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import h5py
import numpy as np

from hvctr.formats import EMPTY_KEY, NUM_BUCKETS, RowLayout, SparseOptimizer, mix64
from hvctr.formats import safefile
from hvctr.formats.h5alloc import create_early, pwrite_all, reserved
from hvctr.formats.space import check_free_space, remedy
from hvctr.kernels import diskio, native
from hvctr.log import get_logger
from hvctr.storage import _probe
from hvctr.storage.position_log import PositionLog, Tag

log = get_logger(__name__)

FORMAT_VERSION = 1
BLOCK_BYTES = 4096
INDEX_DTYPE = np.dtype([("key", "<u8"), ("row", "<i8")])
SLOTS_PER_BLOCK = BLOCK_BYTES // INDEX_DTYPE.itemsize  # 256
_EMPTY_ENTRY = np.array((EMPTY_KEY, -1), dtype=INDEX_DTYPE)  # a free slot, as create() writes it
PENDING_ENTRY_BYTES = 3 * INDEX_DTYPE.itemsize  # a waiting entry: its array of twice the capacity, and its batch
_MERGE_BUFFER_BYTES = 1 << 20
META_DTYPE = np.dtype([("key", "<u8"), ("last_seen", "<i4"), ("generation", "<i4")])
STATE_DTYPE = np.dtype([("n_rows", "<i8"), ("generation", "<i8"), ("pass_index", "<i8"), ("clean", "<i8")])
_SLOT_SALT = np.uint64(0xD1B54A32D192ED03)
SHARD_IO = ("pread", "mmap")
_INDEX_CHUNK = 4096  # keys probed per round of index block reads (at most 16 MiB of blocks in memory)
# New index entries wait in memory until there are about 32 per index block (6 bytes a slot of
# the index: 61 MiB for a shard of 8.3M rows), at most 2M (96 MiB), then go to the file together.
# Each flush reads and writes every block its entries fall in, nearly the whole index: at 8 a
# block a one-pass run of 641k new keys a rank (bench.train, 4M-row shards) flushed 4 times,
# 0.8 s of its 3.0 s of pulls; at 32, once. Their bytes (PENDING_ENTRY_BYTES an entry) stay within
# a quarter of the CPU cache's budget beside the cache (pending_bytes_for), down to 8 a block: a
# small cache is a tight memory (two ranks of 5.7M-row shards in a 256 MiB cgroup with 4 MiB
# caches were OOM-killed at 32 a block, 49 MiB of entries a rank; tests/e2e/test_out_of_core.py).
PENDING_PER_BLOCK = 32
PENDING_PER_BLOCK_MIN = 8
_PENDING_MAX = 1 << 21
# The positions the file's index gave lately, kept in memory (RecentPositions): two generations
# of half-full tables, 64 bytes a kept entry; EmbeddingStore gives them a quarter of its cache's
# bytes beside the cache (recent_positions_for).
RECENT_POSITION_BYTES = 2 * 2 * 16
# What ``Shard.by_cause`` counts for each cause of shard traffic: rows read (read_rows,
# read_range), index blocks read, and the pool's system calls and bytes. A write of rows that
# share pages with other rows reads those pages first: write_calls counts those preads too.
# Beside them, ``seconds``: the wall time spent inside the cause's shard calls (the pool's reads
# and writes, index probes and the CPU work between them), so that a cause's rates can be read.
CAUSE_COUNTERS = ("rows_read", "index_blocks_read", "read_calls", "read_bytes", "write_calls", "write_bytes")


class KeyFilter:
    """A Bloom filter of the keys a shard holds (in memory, about 10 bits a row of capacity): a
    key it says is absent is absent, so the pread path skips the index read of a key seen for the
    first time (most keys of a table's first pass). It never says absent of a stored key: every
    insert adds its keys, and opening a shard adds every key of its row_meta."""

    HASHES = 4
    _SALTS = tuple(np.uint64(0x9E3779B97F4A7C15 * (i + 1) & 0xFFFFFFFFFFFFFFFF) for i in range(HASHES))
    _SALT_ARRAY = np.array(_SALTS, dtype=np.uint64)

    def __init__(self, capacity: int) -> None:
        self.bits = max(int(capacity) * 10, 1 << 16)
        self.table = np.zeros((self.bits + 7) // 8, dtype=np.uint8)

    def _slots(self, keys: np.ndarray) -> list[np.ndarray]:
        return [(mix64(keys ^ salt) % np.uint64(self.bits)).astype(np.int64) for salt in self._SALTS]

    def add(self, keys: np.ndarray) -> None:
        lib = native.lib()
        if lib is not None:  # the same bits, one pass over the keys (numpy's bitwise_or.at is slow)
            k = np.ascontiguousarray(keys, dtype=np.uint64)
            lib.hv_bloom_add(self.table.ctypes.data, self.bits, self._SALT_ARRAY.ctypes.data, self.HASHES,
                             k.ctypes.data, k.size)
            return
        for h in self._slots(keys):
            np.bitwise_or.at(self.table, h >> 3, (1 << (h & 7)).astype(np.uint8))

    def may_hold(self, keys: np.ndarray) -> np.ndarray:
        lib = native.lib()
        if lib is not None:
            k = np.ascontiguousarray(keys, dtype=np.uint64)
            out = np.empty(k.size, dtype=bool)
            lib.hv_bloom_test(self.table.ctypes.data, self.bits, self._SALT_ARRAY.ctypes.data, self.HASHES,
                              k.ctypes.data, k.size, out.ctypes.data)
            return out
        out = np.ones(keys.shape[0], dtype=bool)
        for h in self._slots(keys):
            out &= (self.table[h >> 3] >> (h & 7).astype(np.uint8)) & 1 == 1
        return out


class RecentPositions:
    """Row positions the file's index gave lately (pread path), in memory: a window's push
    finds the rows its warm and its pull looked up, and a key that comes back within a few
    windows is found without its 4 KiB index block read again (issue 26: at a table 10x the
    memory, index blocks were most of the bytes the shard read). A shard's rows never move
    (they are appended; compaction writes a new shard), so a position once found stays right.

    Two generations of at most ``size`` entries: when the newer one is full it becomes the
    older, the older is emptied and refilled; a key found in the older is carried into the newer,
    so keys that keep coming back stay while those of one window age out."""

    def __init__(self, size: int, salt: np.uint64) -> None:
        self.size = max(int(size), 1)
        self.salt = salt
        self.new = self._empty(None)
        self.old: np.ndarray | None = None
        self.n = 0
        self.hits = 0

    def _empty(self, table: np.ndarray | None) -> np.ndarray:
        if table is None:
            table = np.empty(2 * self.size, dtype=INDEX_DTYPE)
        table["key"], table["row"] = EMPTY_KEY, -1
        return table

    def find(self, keys: np.ndarray) -> np.ndarray:
        """Each key's position, -1 where it is not kept; keys found in the older generation move
        into the newer."""
        lib = native.lib()
        pos = _probe.find_values(lib, self.new, keys, self.salt, empty_by_key=True)
        if self.old is not None:
            miss = np.flatnonzero(pos < 0)
            got = _probe.find_values(lib, self.old, keys[miss], self.salt, empty_by_key=True)
            back = miss[got >= 0]
            pos[back] = got[got >= 0]
            self.add(keys[back], pos[back])
        self.hits += int(np.count_nonzero(pos >= 0))
        return pos

    def add(self, keys: np.ndarray, pos: np.ndarray) -> None:
        """Keeps key -> position for keys the newer generation lacks (unique)."""
        n = keys.shape[0]
        if n > self.size:
            keys, pos, n = keys[-self.size:], pos[-self.size:], self.size
        if self.n + n > self.size:
            self.old, self.new = self.new, self._empty(self.old)
            self.n = 0
        if n:
            _probe.claim_slots(native.lib(), self.new, keys, pos, self.salt, empty_by_key=True)
            self.n += n


def slot_seed_of(seed: int) -> int:
    """The slot hash's seed, derived from storage.seed (distinct from the init stream)."""
    return int(mix64(np.uint64(seed & 0xFFFFFFFFFFFFFFFF) ^ _SLOT_SALT))


def num_slots_for(capacity: int, max_load_factor: float) -> int:
    return math.ceil(capacity / max_load_factor / SLOTS_PER_BLOCK) * SLOTS_PER_BLOCK


def pending_capacity(capacity: int, num_slots: int, budget_bytes: int | None = None) -> int:
    """New index entries a pread-path shard keeps in memory before writing them: PENDING_PER_BLOCK
    a block of the index, fewer where their PENDING_ENTRY_BYTES each pass ``budget_bytes`` (None: no
    budget), never under PENDING_PER_BLOCK_MIN a block nor 4096, never over _PENDING_MAX."""
    blocks = num_slots // SLOTS_PER_BLOCK
    want = blocks * PENDING_PER_BLOCK
    if budget_bytes is not None:
        want = max(blocks * PENDING_PER_BLOCK_MIN, min(want, budget_bytes // PENDING_ENTRY_BYTES))
    return min(capacity, _PENDING_MAX, max(want, 4096))


def pending_bytes_for(cache_bytes: int) -> int:
    """The waiting index entries' budget: a quarter of the CPU cache's bytes, as RecentPositions'."""
    return int(cache_bytes) // 4


def memory_bytes(capacity: int, max_load_factor: float, cache_bytes: int = 0) -> int:
    """A pread-path shard's own memory: its key filter (10 bits a row of capacity) and its new
    index entries in waiting (an array of twice their capacity, and the batches they came in),
    and the positions its index gave lately (RecentPositions, sized from the cache's bytes)."""
    pending = pending_capacity(capacity, num_slots_for(capacity, max_load_factor), pending_bytes_for(cache_bytes))
    return ((max(capacity * 10, 1 << 16) + 7) // 8 + pending * PENDING_ENTRY_BYTES
            + recent_positions_for(cache_bytes) * RECENT_POSITION_BYTES)


def recent_positions_for(cache_bytes: int) -> int:
    """The entries of each generation of a store's RecentPositions: a quarter of its cache's
    bytes beside the cache (storage.cpu_cache_bytes), at least 4096: 131k at a 32 MiB cache,
    about two windows' cold keys of a rank at batch 2048, k = 4 (issue 26's 10x run)."""
    return max(int(cache_bytes) // 4 // RECENT_POSITION_BYTES, 4096)


def _reserve_and_clear_index(path: str, index_offset: int, num_slots: int) -> None:
    """Reserves every block of the file (posix_fallocate), then writes the index's empty marker,
    flushed and dropped behind every 1 MiB written: a shard of 33M rows has 660 MB of index, and
    as dirty page cache in a memory cgroup (v1 does not throttle a group's dirty pages) that
    would outgrow a limit before the kernel wrote it back."""
    with reserved(path) as fd:
        empty = np.empty(min(num_slots, 1 << 16), dtype=INDEX_DTYPE)
        empty["key"], empty["row"] = EMPTY_KEY, -1
        for start in range(0, num_slots, empty.shape[0]):
            n = min(empty.shape[0], num_slots - start)
            at = index_offset + start * INDEX_DTYPE.itemsize
            pwrite_all(fd, memoryview(empty[:n]).cast("B"), at)
            diskio.write_behind(fd, path, at, n * INDEX_DTYPE.itemsize)


_COPY_ON_WRITE_FS = frozenset({"btrfs", "zfs", "bcachefs"})


def file_system_type(path: str) -> str:
    """The type of the file system holding ``path`` (the longest mount point above it in
    /proc/self/mounts), "" where that cannot be read."""
    real = os.path.realpath(path)
    best, fstype = "", ""
    try:
        with open("/proc/self/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) < 3:
                    continue
                mnt = parts[1].replace("\\040", " ")
                inside = real == mnt or real.startswith(mnt.rstrip("/") + "/")
                if inside and len(mnt) >= len(best):
                    best, fstype = mnt, parts[2]
    except OSError:
        return ""
    return fstype


def _remove_quietly(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass


def pwrite_runs(fd: int, base: int, item_bytes: int, pos: np.ndarray, data: np.ndarray,
                current: np.ndarray | None = None) -> int:
    """Writes item i of ``data`` at ``base + pos[i] * item_bytes``; pos sorted and unique.

    One pwrite per run of nearby positions: the syscall, not the byte, is what costs here
    (a 16-byte pwrite and a 4 KiB one take about as long, and the kernel writes whole pages
    anyway). With ``current`` (the dataset's memmap), runs less than one 4 KiB page apart
    are merged and the items between them rewritten with what the file already holds, in
    chunks of about 1 MiB so that the merge buffer stays small. Returns the bytes written.
    """
    n = pos.shape[0]
    if n == 0:
        return 0
    data = np.ascontiguousarray(data)
    max_gap = BLOCK_BYTES // item_bytes if current is not None else 0
    span = max(_MERGE_BUFFER_BYTES // item_bytes, 1)  # merged runs never cross these bounds
    brk = np.flatnonzero((np.diff(pos) > max_gap + 1) | (np.diff(pos // span) != 0)) + 1
    starts = np.concatenate(([0], brk))
    ends = np.concatenate((brk, [n]))
    first, lengths = pos[starts], pos[ends - 1] - pos[starts] + 1
    if int(lengths.sum()) == n:  # no gaps: write straight from data
        _write_runs(fd, base, item_bytes, memoryview(data).cast("B"), starts, lengths, first)
        return n * item_bytes
    covered = np.cumsum(lengths)
    chunk = (covered - lengths) // span
    cuts = np.concatenate(([0], np.flatnonzero(np.diff(chunk)) + 1, [starts.shape[0]])).tolist()
    written = 0
    for r0, r1 in zip(cuts[:-1], cuts[1:]):  # one merge buffer per chunk of runs
        f, ln = first[r0:r1], lengths[r0:r1]
        offs = np.cumsum(ln) - ln
        cover = np.arange(int(ln.sum())) - np.repeat(offs, ln) + np.repeat(f, ln)
        buf = np.asarray(current[cover])  # fancy indexing copies: buf is ours to change
        p = pos[starts[r0]:ends[r1 - 1]]
        buf[np.searchsorted(cover, p)] = data[starts[r0]:ends[r1 - 1]]
        _write_runs(fd, base, item_bytes, memoryview(buf).cast("B"), offs, ln, f)
        written += buf.nbytes
    return written


def _write_runs(fd: int, base: int, item_bytes: int, view: memoryview, at: np.ndarray,
                lengths: np.ndarray, first: np.ndarray) -> None:
    for s, length, p in zip(at.tolist(), lengths.tolist(), first.tolist()):
        pwrite_all(fd, view[s * item_bytes:(s + length) * item_bytes], base + p * item_bytes)


def _open_direct(path: str, fd: int) -> int:
    """A second descriptor of ``path`` for the pool's reads, with O_DIRECT: under write-behind (a
    memory limit) a read row's page would be charged to the job's memory cgroup and reclaimed
    again at once, a page-cache insertion, a charge and a reclaim for every cold row; O_DIRECT
    reads it into the pool's own page-aligned buffer. The writes stay buffered (read, changed,
    written, flushed, dropped; the kernel writes back any dirty page of a range before a direct
    read of it). Where the file system refuses O_DIRECT (tmpfs), ``fd`` itself."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return fd
    try:
        return os.open(path, os.O_RDONLY | flag)
    except OSError as e:
        if e.errno in (errno.EINVAL, errno.EOPNOTSUPP):
            return fd
        raise


def strictly_increasing(a: np.ndarray) -> bool:
    return bool(np.all(a[1:] > a[:-1]))


def _pick(value: np.ndarray | int | None, order: np.ndarray) -> np.ndarray | int | None:
    return value[order] if isinstance(value, np.ndarray) else value


class ShardFullError(ValueError):
    """The shard has no room for new rows: raise storage.rows_per_rank."""


class Shard:
    """One rank's HDF5 shard. Create with :meth:`create`, reopen with :meth:`open`.

    - ``lookup(keys) -> int64 row positions`` (-1: absent)
    - ``insert(keys) -> positions`` of new rows (keys absent and unique; their row data is
      written later by ``write_rows``; ShardFullError past ``capacity`` rows)
    - ``read_rows(pos) -> float32 [n, width]``, ``write_rows(pos, keys, rows)``
    - ``read_meta(start, stop)``, ``save_state()``, ``close()``
    Not thread-safe: EmbeddingStore serialises access (``read_rows_detached`` aside).
    """

    def __init__(self, path: str | Path, writable: bool = True, io: str = "pread",
                 io_threads: int = diskio.DEFAULT_THREADS, write_behind: bool = True,
                 recent_positions: int = 0, position_log: bool = False, pending_bytes: int | None = None) -> None:
        self.path = str(path)
        self.write_behind = write_behind  # pread path: writes flushed and their pages dropped
        if io not in SHARD_IO:
            raise ValueError(f"config key 'storage.shard_io': {io!r}; expected one of {', '.join(SHARD_IO)}")
        if io_threads < 1:
            raise ValueError(f"config key 'storage.io_threads': must be >= 1, got {io_threads}")
        if not os.path.isfile(self.path):
            raise ValueError(f"shard file {self.path} does not exist")
        try:
            f = h5py.File(self.path, "r")
        except OSError as e:  # truncated or overwritten; h5py's message may not name the file
            raise ValueError(f"shard file {self.path}: cannot open as HDF5 ({e}); the file is damaged or "
                             f"truncated (a working shard is rebuilt from the checkpoint on --resume)") from None
        with f:
            a = f.attrs
            if int(a.get("format_version", -1)) != FORMAT_VERSION:
                raise ValueError(f"shard file {self.path}: format_version {a.get('format_version')!r}, "
                                 f"this hvctr reads {FORMAT_VERSION}")
            # no attribute: a shard from before row-wise optimisers, Adam's rows
            optimizer = str(a.get("sparse_optimizer", SparseOptimizer.ADAM.value))
            if optimizer not in {o.value for o in SparseOptimizer}:
                raise ValueError(f"shard file {self.path}: sparse_optimizer {optimizer!r} is not one this hvctr "
                                 f"knows ({', '.join(o.value for o in SparseOptimizer)})")
            self.layout = RowLayout(int(a["dim"]), optimizer)
            if int(a["width"]) != self.layout.width:
                raise ValueError(f"shard file {self.path}: rows of width {int(a['width'])}, not {self.layout}'s "
                                 f"{self.layout.width}: the file is damaged")
            self.capacity = int(a["capacity"])
            self.num_slots = int(a["num_slots"])
            self.world_size = int(a["world_size"])
            self.rank = int(a["rank"])
            self.slot_seed = np.uint64(int(a["slot_seed"]))
            self.init_seed = int(a["init_seed"])
            self.init_scale = float(a["init_scale"])
            self.bucket_owner = f["bucket_owner"][...].astype(np.int32)
            offs = {n: f[n].id.get_offset() for n in ("index", "rows", "row_meta", "state")}
            state = f["state"][0]
        if any(o is None for o in offs.values()):
            raise ValueError(f"shard file {self.path}: a dataset has no storage (not an hvctr shard?)")
        self._off = {k: int(v) for k, v in offs.items()}
        self.writable = writable
        self._fd = os.open(self.path, os.O_RDWR if writable else os.O_RDONLY)
        self._read_fd = self._fd  # the pool's reads of rows, meta and index blocks
        # pread needs the C kernels' pool; without them (HVCTR_NATIVE=0) the reference path runs
        self.io = io if io == "mmap" or diskio.available() else "mmap"
        self.io_threads = int(io_threads)
        self.io_stats = diskio.IOStats()
        self.index_blocks_read = 0
        self.filtered_lookups = 0  # keys the key filter knew absent: no index read
        self._index = self._index_keys = self._rows = self._meta = None
        self.index_by_map = False
        self._map: diskio.FileMap | None = None
        if self.io == "pread":
            os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_RANDOM)  # no readahead: reads are rows, not streams
            if write_behind:
                self._read_fd = _open_direct(self.path, self._fd)
            elif writable and file_system_type(self.path) not in _COPY_ON_WRITE_FS:
                # The pages stay: those the page cache holds are copied through a mapping (diskio).
                # Not read-only: mincore reports every page of a file the caller may not write as
                # held (the kernel hides its page cache), and a miss would then fault at depth 1.
                # Not where an overwrite allocates (copy-on-write): a full disk would be a SIGBUS.
                try:
                    self._map = diskio.FileMap(self._fd, self.path, os.fstat(self._fd).st_size, writable)
                except OSError as e:  # a virtual-memory limit (ulimit -v), vm.max_map_count: the pool alone
                    log.warning(f"shard {self.path}: not mapped ({e.strerror}); rows the page cache holds "
                                f"are read by the I/O pool, a page each")
        else:
            # Index entries go through the map where overwriting allocates nothing (module docstring).
            self.index_by_map = writable and file_system_type(self.path) not in _COPY_ON_WRITE_FS
            self._index = np.memmap(self.path, INDEX_DTYPE, "r+" if self.index_by_map else "r", self._off["index"],
                                    (self.num_slots,))
            self._index_keys = self._index["key"]
            self._rows = np.memmap(self.path, np.float32, "r", self._off["rows"], (self.capacity, self.layout.width))
            self._meta = np.memmap(self.path, META_DTYPE, "r", self._off["row_meta"], (self.capacity,))
        self.n_rows = int(state["n_rows"])
        self.generation = int(state["generation"])
        self.pass_index = int(state["pass_index"])
        self.was_clean = bool(state["clean"])  # False: the last writer did not close it
        self.bytes_read = self.bytes_written = 0
        # shard traffic split by what asked for it (``attributed``): {cause: {counter: n}}
        self.by_cause: dict[str, dict[str, int]] = {}
        self._causes: list[str] = []
        self._mark = self._cause_totals()
        self._mark_t = time.perf_counter()
        self.key_filter: KeyFilter | None = None
        self._pending_cap = pending_capacity(self.capacity, self.num_slots, pending_bytes)
        self._pending: np.ndarray | None = None
        self._pending_parts: list[tuple[np.ndarray, np.ndarray]] = []
        self._pending_n = 0
        # index blocks as create() left them, all empty (None: unknown, a file opened from disk):
        # read from nowhere. The first flush of a new shard would read its whole index back.
        self._blank: np.ndarray | None = None
        self.recent: RecentPositions | None = None
        self.position_log: PositionLog | None = None
        self._recalled: list[np.ndarray] = []  # the log's positions of the last two windows recalled
        self.recalled_hits = 0
        if self.io == "pread":
            self.key_filter = KeyFilter(self.capacity)
            if recent_positions:
                self.recent = RecentPositions(recent_positions, self.slot_seed)
                if writable and position_log:
                    self.position_log = PositionLog(self.path, write_behind)
            with self.attributed("open"):
                for start in range(0, self.n_rows, 1 << 20):
                    meta = self.read_meta(start, start + (1 << 20))
                    self.key_filter.add(meta["key"])
                    if writable and not self.was_clean:  # a writer died with index entries still in memory
                        self._reindex(meta["key"], start + np.arange(meta.shape[0], dtype=np.int64))
        if writable:
            self.save_state(clean=False)

    # --- what the traffic is for --------------------------------------------------------

    def _cause_totals(self) -> tuple[int, ...]:
        io = self.io_stats
        return (self.bytes_read // self.layout.row_bytes, self.index_blocks_read, io.read_calls, io.read_bytes,
                io.write_calls, io.write_bytes)

    def _settle(self) -> None:
        """Credits the traffic since the last mark to the cause in force ("other" outside any)."""
        now, t = self._cause_totals(), time.perf_counter()
        if now != self._mark or self._causes:
            acc = self.by_cause.setdefault(self._causes[-1] if self._causes else "other",
                                           {**dict.fromkeys(CAUSE_COUNTERS, 0), "seconds": 0.0})
            for name, a, b in zip(CAUSE_COUNTERS, now, self._mark):
                acc[name] += a - b
            if self._causes:  # time outside every attributed block is not the shard's
                acc["seconds"] += t - self._mark_t
        self._mark, self._mark_t = now, t

    @contextmanager
    def attributed(self, cause: str) -> Iterator[None]:
        """The shard traffic inside the block counts for ``cause`` in ``by_cause`` (an inner
        block's for its own cause). Entered by the one thread that holds the shard (the
        store's lock), like every other call."""
        self._settle()
        self._causes.append(cause)
        try:
            yield
        finally:
            self._settle()
            self._causes.pop()

    # --- creation ----------------------------------------------------------------------

    @classmethod
    def create(cls, path: str | Path, *, dim: int, capacity: int, world_size: int, rank: int,
               optimizer: SparseOptimizer = SparseOptimizer.ADAM, bucket_owner: np.ndarray, seed: int, init_scale: float,
               max_load_factor: float, io: str = "pread", io_threads: int = diskio.DEFAULT_THREADS,
               write_behind: bool = True, recent_positions: int = 0, position_log: bool = False,
               pending_bytes: int | None = None) -> "Shard":
        """Writes an empty shard under a temporary name, allocates it fully, renames it.

        HDF5 writes only the skeleton (attributes, the bucket table, dataset headers: KiBs);
        posix_fallocate then reserves every block and the index gets its empty marker by
        pwrite. So a full disk fails here, in a free-space check or in posix_fallocate, as a
        ValueError naming the file: never inside HDF5 (HDF5 2.0 cannot close a file whose
        write failed for lack of space and crashes at exit), never later in training.
        """
        path = str(path)
        layout = RowLayout(dim, optimizer)
        num_slots = num_slots_for(capacity, max_load_factor)
        bucket_owner = np.asarray(bucket_owner, dtype=np.int32)
        if bucket_owner.shape != (NUM_BUCKETS,):
            raise ValueError(f"bucket table must have {NUM_BUCKETS} entries, got {bucket_owner.shape}")
        tmp = str(safefile.temp_name(path))  # a fresh name, created exclusively: never a planted link
        directory = os.path.dirname(os.path.abspath(path))
        os.makedirs(directory, exist_ok=True)
        need = num_slots * INDEX_DTYPE.itemsize + capacity * (layout.row_bytes + META_DTYPE.itemsize)
        try:
            check_free_space(directory, need)
            with h5py.File(tmp, "x", libver="earliest", track_order=False,
                           alignment_threshold=BLOCK_BYTES, alignment_interval=BLOCK_BYTES) as f:
                a = f.attrs
                a["format_version"] = FORMAT_VERSION
                a["dim"], a["width"], a["capacity"] = dim, layout.width, capacity
                a["sparse_optimizer"] = layout.optimizer.value
                a["num_slots"], a["slots_per_block"] = num_slots, SLOTS_PER_BLOCK
                a["world_size"], a["rank"] = world_size, rank
                a["slot_seed"] = np.uint64(slot_seed_of(seed))
                a["init_seed"], a["init_scale"], a["max_load_factor"] = seed, init_scale, max_load_factor
                a["row_columns"] = layout.columns()
                f.create_dataset("bucket_owner", data=bucket_owner, track_times=False)
                index = create_early(f, "index", (num_slots,), INDEX_DTYPE)
                create_early(f, "rows", (capacity, layout.width), "<f4")
                create_early(f, "row_meta", (capacity,), META_DTYPE)
                create_early(f, "state", data=np.array([(0, 0, 0, 1)], dtype=STATE_DTYPE), fill_time=None)
                index_offset = index.id.get_offset()
            _reserve_and_clear_index(tmp, index_offset, num_slots)
        except OSError as e:
            _remove_quietly(tmp)
            raise ValueError(f"cannot create the shard {path} ({need / 2**20:,.1f} MiB for storage.rows_per_rank = "
                             f"{capacity} rows and their index): {e.strerror or e}; {remedy(e, Path(path).parent)}, "
                             f"point storage.shard_dir at another disk or lower storage.rows_per_rank") from None
        os.replace(tmp, path)
        shard = cls(path, io=io, io_threads=io_threads, write_behind=write_behind, recent_positions=recent_positions,
                    position_log=position_log, pending_bytes=pending_bytes)
        shard._blank = np.ones(-(-num_slots // SLOTS_PER_BLOCK), dtype=bool)  # as _reserve_and_clear_index wrote it
        return shard

    @classmethod
    def open(cls, path: str | Path, writable: bool = True, io: str = "pread",
             io_threads: int = diskio.DEFAULT_THREADS, write_behind: bool = True,
             recent_positions: int = 0, position_log: bool = False, pending_bytes: int | None = None) -> "Shard":
        return cls(path, writable, io, io_threads, write_behind, recent_positions, position_log, pending_bytes)

    # --- index -------------------------------------------------------------------------

    def _home(self, keys: np.ndarray) -> np.ndarray:
        return (mix64(keys ^ self.slot_seed) % np.uint64(self.num_slots)).astype(np.int64)

    def _load(self, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        k = self._index_keys[slots]
        return k, k == EMPTY_KEY

    def _find(self, keys: np.ndarray) -> np.ndarray:
        return _probe.find(keys, self._home(keys), self.num_slots, self._load)

    def lookup(self, keys: np.ndarray) -> np.ndarray:
        """Row position of each key in this shard, -1 where absent (int64 [n])."""
        keys = np.asarray(keys, dtype=np.uint64)
        if self.io == "pread":
            if self._pending_n:  # entries not yet in the file's index
                pos = _probe.find_values(native.lib(), self._pending, keys, self.slot_seed, empty_by_key=True)
            else:
                pos = np.full(keys.shape[0], -1, dtype=np.int64)
            rest = np.flatnonzero(pos < 0)
            rest = rest[self.key_filter.may_hold(keys[rest])]
            self.filtered_lookups += keys.shape[0] - np.count_nonzero(pos >= 0) - rest.shape[0]
            for table in self._recalled:  # where the same window of the last pass found them
                if rest.size:
                    pos[rest] = _probe.find_values(native.lib(), table, keys[rest], self.slot_seed, empty_by_key=True)
                    self.recalled_hits += int(np.count_nonzero(pos[rest] >= 0))
                    rest = rest[pos[rest] < 0]
            if self.recent is not None:
                pos[rest] = self.recent.find(keys[rest])
                rest = rest[pos[rest] < 0]
            pos[rest] = self._probe_blocks(keys[rest])
            if self.recent is not None:
                found = rest[pos[rest] >= 0]
                self.recent.add(keys[found], pos[found])
            return pos
        lib = _probe.native_table(self._index)
        if lib is not None:
            return _probe.find_values(lib, self._index, keys, self.slot_seed, empty_by_key=True)
        slots = self._find(keys)
        pos = np.full(keys.shape[0], -1, dtype=np.int64)
        hit = slots >= 0
        pos[hit] = self._index["row"][slots[hit]]
        return pos

    def remember(self, tag: Tag | None, keys: np.ndarray, pos: np.ndarray) -> None:
        """The positions window ``tag`` looked up or created (-1: none), for the same window
        of the next pass (hvctr.storage.position_log)."""
        if tag is not None and self.position_log is not None:
            with self.attributed("position_log"):
                self.position_log.record(tag, np.asarray(keys, dtype=np.uint64), np.asarray(pos, dtype=np.int64))

    def recall(self, tag: Tag | None) -> int:
        """Keeps in memory what window ``tag``'s predecessor of the last pass remembered, until
        the window after the next recalls (its lookups then read no index block for those keys;
        32 bytes a position); returns how many positions."""
        if tag is None or self.position_log is None:
            return 0
        with self.attributed("position_log"):
            got = self.position_log.recall(tag)
        if got is None:
            return 0
        keys, first = np.unique(got[0], return_index=True)  # a window's warm and pull may both log a key
        table = np.empty(2 * keys.shape[0], dtype=INDEX_DTYPE)
        table["key"], table["row"] = EMPTY_KEY, -1
        _probe.claim_slots(native.lib(), table, keys, got[1][first], self.slot_seed, empty_by_key=True)
        self._recalled = [*self._recalled[-1:], table]
        return keys.shape[0]

    def may_hold(self, keys: np.ndarray) -> np.ndarray:
        """False where the shard certainly does not hold the key (its key filter; pread path),
        True where it may: no file is read."""
        if self.key_filter is None:
            return np.ones(np.shape(keys)[0], dtype=bool)
        return self.key_filter.may_hold(np.asarray(keys, dtype=np.uint64))

    def insert(self, keys: np.ndarray) -> np.ndarray:
        """Adds index entries for new keys (absent, unique); returns their row positions.

        Rows get the next positions in batch order. Their row data is written by the caller
        (write_rows); row_meta gets the key now so that iteration and compaction see it.
        """
        keys = np.asarray(keys, dtype=np.uint64)
        n = keys.shape[0]
        if n == 0:
            return np.zeros(0, dtype=np.int64)
        if self.n_rows + n > self.capacity:
            raise ShardFullError(
                f"shard {self.path} (rank {self.rank}) is full: {self.n_rows} of {self.capacity} rows used "
                f"and {n} new keys to add; raise storage.rows_per_rank (or drop rare keys with "
                f"storage.admit_after / old ones with storage.ttl_passes)")
        pos = self.n_rows + np.arange(n, dtype=np.int64)
        if self.io == "pread":
            # The entries wait in memory and reach the file's index together (flush_index): a
            # 4 KiB block then takes many of them in one write, where one write per new key would
            # rewrite most of the index every window.
            if self._pending_n + n > self._pending_cap:
                self.flush_index()
            if n > self._pending_cap:
                self._probe_blocks(keys, pos)
            else:
                if self._pending is None:
                    self._pending = np.empty(2 * self._pending_cap, dtype=INDEX_DTYPE)
                    self._pending["key"], self._pending["row"] = EMPTY_KEY, -1
                _probe.claim_slots(native.lib(), self._pending, keys, pos, self.slot_seed, empty_by_key=True)
                self._pending_parts.append((keys.copy(), pos))
                self._pending_n += n
            self.key_filter.add(keys)
            self._write_meta(pos, keys)
            self.n_rows += n
            return pos
        self._blank = None  # the index written slot by slot below: no block is known blank after it
        lib = _probe.native_table(self._index) if self.index_by_map else None
        if lib is not None:  # entries stored through the map, in C
            _probe.claim_slots(lib, self._index, keys, pos, self.slot_seed, empty_by_key=True)
            self.bytes_written += n * INDEX_DTYPE.itemsize
            self._write_meta(pos, keys)
            self.n_rows += n
            return pos

        def free(slots: np.ndarray) -> np.ndarray:
            return self._index_keys[slots] == EMPTY_KEY

        def take(slots: np.ndarray, which: np.ndarray) -> None:
            # Written at once (slots ascending): the next probing step reads them through the map.
            entries = np.empty(slots.shape[0], dtype=INDEX_DTYPE)
            entries["key"], entries["row"] = keys[which], pos[which]
            if self.index_by_map:
                self._index[slots] = entries
                self.bytes_written += entries.nbytes
            else:
                self.bytes_written += pwrite_runs(self._fd, self._off["index"], INDEX_DTYPE.itemsize, slots,
                                                  entries, self._index)

        _probe.claim(self._home(keys), self.num_slots, free, take)
        self._write_meta(pos, keys)  # pos ascending: rows are appended
        self.n_rows += n
        return pos

    def _index_blocks(self, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """Index blocks (sorted unique numbers) for the probes: (which of them were read, the
        blocks read as [n_read, SLOTS_PER_BLOCK] entries, each block's address or None). With the
        file mapped, the blocks the page cache holds are probed (and claimed) where they are, in
        the mapping, and only the others are read: a block copied is 4 KiB for one 16-byte entry."""
        if self._map is None:
            return np.ones(blocks.shape[0], dtype=bool), self._read_index_blocks(blocks), None
        read = ~diskio.held(self._map, self._off["index"], BLOCK_BYTES, blocks)
        data = self._read_index_blocks(blocks[read])
        self.index_blocks_read += blocks.shape[0] - data.shape[0]  # looked at, if not copied
        addr = self._map.addr + self._off["index"] + blocks * BLOCK_BYTES
        addr[read] = data.ctypes.data + np.arange(data.shape[0], dtype=np.int64) * BLOCK_BYTES
        return read, data, addr

    def _read_index_blocks(self, blocks: np.ndarray) -> np.ndarray:
        """Index blocks (sorted unique numbers) as [n, SLOTS_PER_BLOCK] entries, read by the pool
        (never through the mapping: _index_blocks gives it only blocks the page cache lacks).
        Blocks no write has touched since create() are filled here, not read."""
        out = np.empty((blocks.shape[0], SLOTS_PER_BLOCK), dtype=INDEX_DTYPE)
        blank = self._blank[blocks] if self._blank is not None else None
        if blank is None or not blank.any():
            diskio.read(self._read_fd, self.path, self._off["index"], BLOCK_BYTES, blocks, out, self.io_threads,
                        self.io_stats)
            self.index_blocks_read += blocks.shape[0]
            return out
        out[blank] = _EMPTY_ENTRY
        written = ~blank
        if written.any():
            part = np.empty((int(np.count_nonzero(written)), SLOTS_PER_BLOCK), dtype=INDEX_DTYPE)
            diskio.read(self._read_fd, self.path, self._off["index"], BLOCK_BYTES, blocks[written], part,
                        self.io_threads, self.io_stats)
            out[written] = part
            self.index_blocks_read += part.shape[0]
        return out

    def _probe_blocks(self, keys: np.ndarray, claim: np.ndarray | None = None) -> np.ndarray:
        """The pread path's index: each key's row position (-1: absent) or, with ``claim`` (row
        positions of keys known absent), stores key -> position in the first empty slot from its
        home and writes the changed blocks back. Keys go in home order, ``_INDEX_CHUNK`` at a time:
        one round reads the blocks their walks start in, a later round the next block of walks
        that cross a block end (claimed blocks are written before a later round reads again)."""
        lib = native.lib()
        n = keys.shape[0]
        result = np.full(n, -1, dtype=np.int64)
        if n == 0:
            return result
        home = self._home(keys)
        order = np.argsort(home, kind="stable")
        for c0 in range(0, n, _INDEX_CHUNK):
            idx = order[c0:c0 + _INDEX_CHUNK]
            k, cur = np.ascontiguousarray(keys[idx]), np.ascontiguousarray(home[idx])
            vals = None if claim is None else np.ascontiguousarray(claim[idx], dtype=np.int64)
            res = np.full(idx.shape[0], -1, dtype=np.int64)
            need = cur // SLOTS_PER_BLOCK
            todo = np.arange(idx.shape[0])
            while todo.size:
                blocks = np.unique(need[todo])
                read, data, addr = self._index_blocks(blocks)
                kt, ct = np.ascontiguousarray(k[todo]), np.ascontiguousarray(cur[todo])
                rt, nt = np.empty(todo.shape[0], dtype=np.int64), np.empty(todo.shape[0], dtype=np.int64)
                at = 0 if addr is None else addr.ctypes.data
                if vals is None:
                    left = lib.hv_index_find(blocks.ctypes.data, blocks.shape[0], data.ctypes.data, SLOTS_PER_BLOCK,
                                             self.num_slots, kt.ctypes.data, kt.shape[0], ct.ctypes.data,
                                             rt.ctypes.data, nt.ctypes.data, at)
                else:
                    vt = np.ascontiguousarray(vals[todo])
                    dirty = np.zeros(blocks.shape[0], dtype=np.int8)
                    left = lib.hv_index_claim(blocks.ctypes.data, blocks.shape[0], data.ctypes.data, SLOTS_PER_BLOCK,
                                              self.num_slots, kt.ctypes.data, vt.ctypes.data, kt.shape[0],
                                              ct.ctypes.data, rt.ctypes.data, nt.ctypes.data, dirty.ctypes.data, at)
                    if self._blank is not None:
                        self._blank[blocks[dirty != 0]] = False
                    changed = np.flatnonzero(dirty[read])  # the blocks claimed in the mapping are written already
                    if changed.size:
                        diskio.write(self._fd, self.path, self._off["index"], BLOCK_BYTES, blocks[read][changed],
                                     data[changed], self.io_threads, self.write_behind, self.io_stats, self._map)
                    self.bytes_written += int(np.count_nonzero(nt < 0)) * INDEX_DTYPE.itemsize
                if left < 0:
                    raise AssertionError(f"shard {self.path}: the index has no free slot for a key")  # load is bounded
                res[todo], cur[todo], need[todo] = rt, ct, nt
                todo = todo[nt >= 0]
            result[idx] = res
        return result

    def _reindex(self, keys: np.ndarray, pos: np.ndarray) -> None:
        """Index entries for rows whose keys the file's index lacks (pread path, after a crash)."""
        missing = np.flatnonzero(self._probe_blocks(keys) < 0)
        if missing.size:
            self._probe_blocks(keys[missing], pos[missing])

    def flush_index(self) -> None:
        """Writes the index entries waiting in memory (pread path) into the file's index."""
        if not self._pending_n:
            return
        keys = np.concatenate([k for k, _ in self._pending_parts])
        pos = np.concatenate([p for _, p in self._pending_parts])
        with self.attributed("index_flush"):
            self._probe_blocks(keys, pos)
        self._pending["key"], self._pending["row"] = EMPTY_KEY, -1
        self._pending_parts, self._pending_n = [], 0

    # --- rows --------------------------------------------------------------------------

    def _io_read(self, dataset: str, item_bytes: int, pos: np.ndarray, out: np.ndarray,
                 stats: diskio.IOStats | None = None) -> None:
        diskio.read(self._read_fd, self.path, self._off[dataset], item_bytes, pos, out, self.io_threads,
                    self.io_stats if stats is None else stats, self._map)

    def _io_write(self, dataset: str, item_bytes: int, pos: np.ndarray, data: np.ndarray) -> int:
        diskio.write(self._fd, self.path, self._off[dataset], item_bytes, pos, data, self.io_threads,
                     self.write_behind, self.io_stats, self._map)
        return pos.shape[0] * item_bytes

    def read_rows(self, pos: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """Rows at positions ``pos`` (any order), read in sorted order (pread: by the pool);
        into ``out`` (float32 [n, width], C order) where given."""
        out = self._read_rows(pos, out, self.io_stats)
        self.bytes_read += out.nbytes
        return out

    def read_rows_detached(self, pos: np.ndarray) -> tuple[np.ndarray, diskio.IOStats]:
        """``read_rows`` for a thread that does not hold the shard: it changes nothing another
        call reads or writes (the pool's counters of this read come back apart), so it may run
        beside any call but ``close``. Rows written meanwhile may read old or new: the caller
        fences them (EmbeddingStore.warm). ``credit_read`` adds the counters to the shard's."""
        stats = diskio.IOStats()
        return self._read_rows(pos, None, stats), stats

    def credit_read(self, stats: diskio.IOStats, row_bytes: int, seconds: float) -> None:
        """Counts a detached read (its pool counters, the rows' bytes, its time) for the cause in
        force (``attributed``), as if it had been read there."""
        for name in stats.__slots__:
            setattr(self.io_stats, name, getattr(self.io_stats, name) + getattr(stats, name))
        self.bytes_read += row_bytes
        if self._causes:
            self._settle()
            self.by_cause[self._causes[-1]]["seconds"] += seconds

    def _read_rows(self, pos: np.ndarray, out: np.ndarray | None, stats: diskio.IOStats) -> np.ndarray:
        pos = np.asarray(pos, dtype=np.int64)
        order = np.argsort(pos, kind="stable")
        if out is None:
            out = np.empty((pos.shape[0], self.layout.width), dtype=np.float32)
        elif out.shape != (pos.shape[0], self.layout.width) or out.dtype != np.float32:
            raise ValueError(f"read_rows: out of shape {out.shape} {out.dtype} for {pos.shape[0]} rows")
        if self.io == "pread":
            sp = pos[order]
            if strictly_increasing(sp):
                rows = np.empty_like(out)
                self._io_read("rows", self.layout.row_bytes, sp, rows, stats)
                out[order] = rows
            else:  # a position asked twice: read it once
                uniq, inv = np.unique(sp, return_inverse=True)
                rows = np.empty((uniq.shape[0], self.layout.width), dtype=np.float32)
                self._io_read("rows", self.layout.row_bytes, uniq, rows, stats)
                out[order] = rows[inv]
        else:
            out[order] = self._rows[pos[order]]
        return out

    def write_rows(self, pos: np.ndarray, keys: np.ndarray, rows: np.ndarray,
                   last_seen: np.ndarray | int | None = None, generation: np.ndarray | int | None = None) -> None:
        """Writes rows at unique positions, with their meta: key, last_seen (default: this
        pass) and generation (default: the current checkpoint generation)."""
        self._require_writable()
        pos = np.asarray(pos, dtype=np.int64)
        if strictly_increasing(pos):  # in file order already (a flush): no copies
            sp, keys = pos, np.asarray(keys, dtype=np.uint64)
            rows = np.ascontiguousarray(rows, dtype=np.float32)
        else:
            order = np.argsort(pos, kind="stable")
            sp = pos[order]
            rows = np.ascontiguousarray(np.asarray(rows, dtype=np.float32)[order])
            keys = np.asarray(keys, dtype=np.uint64)[order]
            last_seen, generation = _pick(last_seen, order), _pick(generation, order)
        if self.io == "pread":
            self.bytes_written += self._io_write("rows", self.layout.row_bytes, sp, rows)
        else:
            self.bytes_written += pwrite_runs(self._fd, self._off["rows"], self.layout.row_bytes, sp, rows, self._rows)
        self._write_meta(sp, keys, last_seen, generation)

    def _write_meta(self, pos: np.ndarray, keys: np.ndarray, last_seen: np.ndarray | int | None = None,
                    generation: np.ndarray | int | None = None) -> None:
        """row_meta records at sorted unique positions."""
        self._require_writable()
        meta = np.empty(pos.shape[0], dtype=META_DTYPE)
        meta["key"] = keys
        meta["last_seen"] = self.pass_index if last_seen is None else last_seen
        meta["generation"] = self.generation if generation is None else generation
        if self.io == "pread":
            self.bytes_written += self._io_write("row_meta", META_DTYPE.itemsize, pos, meta)
        else:
            self.bytes_written += pwrite_runs(self._fd, self._off["row_meta"], META_DTYPE.itemsize, pos, meta,
                                              self._meta)

    def read_meta(self, start: int, stop: int) -> np.ndarray:
        """row_meta of rows [start, stop) (a copy)."""
        stop = min(stop, self.n_rows)
        if self.io == "mmap":
            return np.array(self._meta[start:stop])
        out = np.empty(max(stop - start, 0), dtype=META_DTYPE)
        self._io_read("row_meta", META_DTYPE.itemsize, np.arange(start, stop, dtype=np.int64), out)
        return out

    def read_range(self, start: int, stop: int) -> np.ndarray:
        """Rows [start, stop) as one sequential read (a copy)."""
        stop = min(stop, self.n_rows)
        if self.io == "mmap":
            out = np.array(self._rows[start:stop])
        else:
            out = np.empty((max(stop - start, 0), self.layout.width), dtype=np.float32)
            self._io_read("rows", self.layout.row_bytes, np.arange(start, stop, dtype=np.int64), out)
        self.bytes_read += out.nbytes
        return out

    # --- state -------------------------------------------------------------------------

    def save_state(self, clean: bool = False) -> None:
        self._require_writable()
        if clean:
            self.flush_index()
        state = np.array([(self.n_rows, self.generation, self.pass_index, int(clean))], dtype=STATE_DTYPE)
        pwrite_all(self._fd, memoryview(state).cast("B"), self._off["state"])

    def drop_page_cache(self) -> None:
        """Asks the kernel to drop this file's clean pages (for cold-read benchmarks); the mapping
        is made anew around it (a drop leaves the pages a mapping holds)."""
        os.fsync(self._fd) if self.writable else None
        if self._map is not None:
            self._map.close()
        os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_DONTNEED)
        if self._map is not None:
            self._map = diskio.FileMap(self._fd, self.path, self._map.length, self.writable)

    def sync(self) -> None:
        if self.writable:
            self.flush_index()
        os.fsync(self._fd)

    def file_bytes(self) -> int:
        return os.fstat(self._fd).st_size

    def close(self) -> None:
        if self._fd < 0:
            return
        if self.writable:
            self.save_state(clean=True)  # the index entries waiting in memory first
        self._pending = None
        self._recalled = []
        if self.position_log is not None:
            self.position_log.close()
            self.position_log = None
        # Dropping the arrays unmaps the file (numpy holds the mmap's buffer until then).
        self._index = self._index_keys = self._rows = self._meta = None
        if self._map is not None:
            self._map.close()
            self._map = None
        if self._read_fd != self._fd:
            os.close(self._read_fd)
        os.close(self._fd)
        self._fd = self._read_fd = -1

    def _require_writable(self) -> None:
        if not self.writable:
            raise ValueError(f"shard {self.path} was opened read-only")

    def __enter__(self) -> "Shard":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
