"""A rank's rows in ascending key order, each key once with its newest copy, in bounded memory.

A checkpoint's rank files keep rows in shard order, and a key rewritten by later checkpoints has
a copy in each file of the chain (base, then deltas). ``SortedRows`` is an external merge sort
of those copies:

1. runs: the copies are read in chain order (base first, each file in its order), ``run_rows``
   at a time; each run is sorted by key (stable: a newer copy of a key stays after an older
   one), only the last copy of each key kept, and written to a temporary file (keys in one
   region, values in another, so that counting reads the keys alone);
2. merge: the runs are read back ``block_rows`` at a time each; every step emits the buffered
   entries up to the smallest last-buffered key among runs not yet read to their end (no run
   can hold a smaller key further on), sorted stably in run order, the newest copy of each key
   kept. Vectorised: one sort per step, no per-key Python loop.

When every copy fits in one run nothing is written: the rows are sorted in memory, as export
always did. The result is the same either way: a key's newest copy along the chain, keys
ascending (the order does not depend on the budget, only the memory does).

Memory: about ``budget`` bytes whatever the table's size: a run holds ``budget / 3`` bytes of
entries (8 bytes of key + 4 per value column) beside its sort's order and sorted copy, and the
merge reads ``budget / 4`` bytes of blocks at a time over all runs, at least ``MIN_BLOCK_ROWS``
a run (so the bound holds up to ``budget / (4 * MIN_BLOCK_ROWS * entry bytes)`` runs: 55,000
runs of 4.7M dim-16 copies each at 1 GiB, far beyond any rank's shard). Disk: the temporary
file holds every copy once, (8 + 4 * columns) bytes each, reserved before the first run is
written; it is created exclusively beside the output (hvctr.formats.safefile), flushed and dropped from the page cache
behind each run (no dirty pages pile up in a memory cgroup), and removed when done or on error.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from hvctr.formats import safefile
from hvctr.formats.h5alloc import pwrite_all
from hvctr.formats.space import check_free_space
from hvctr.kernels import diskio

MIN_RUN_ROWS = 256
MIN_BLOCK_ROWS = 64
READ_CHUNK_ROWS = 1 << 16  # copies per read of a source file (its full rows pass through memory)

# parts(chunk_rows) -> every copy, oldest first, as (keys uint64 [n], values float32 [n, c]) chunks
Parts = Callable[[int], Iterator[tuple[np.ndarray, np.ndarray]]]


def newest_sorted(keys: np.ndarray) -> np.ndarray:
    """Indices that sort ``keys`` ascending, keeping of equal keys only the last (in input order)."""
    order = np.argsort(keys, kind="stable")
    sk = keys[order]
    last = np.ones(sk.shape[0], dtype=bool)
    last[:-1] = sk[1:] != sk[:-1]
    return order[last]


def _pread_into(fd: int, out: np.ndarray, offset: int, path: Path) -> None:
    view = memoryview(out).cast("B")
    while view.nbytes:
        n = os.preadv(fd, [view], offset)
        if n <= 0:
            raise OSError(f"{path}: short read at offset {offset}: the sort's temporary file was truncated")
        view, offset = view[n:], offset + n


class SortedRows:
    """The newest copy of every key of ``parts`` (``total`` copies of ``columns`` float32 values),
    keys ascending, within about ``budget`` bytes of memory; see the module docstring.

    ``count`` (distinct keys) and ``batches()`` ((keys, values) chunks in key order); a context
    manager: the temporary file beside ``temp_beside`` (when runs are needed) goes at exit."""

    def __init__(self, parts: Parts, total: int, columns: int, budget: int, temp_beside: Path) -> None:
        self.columns, self.budget = columns, int(budget)
        self.value_bytes = 4 * columns
        self.entry_bytes = 8 + self.value_bytes
        self.run_rows = max(MIN_RUN_ROWS, self.budget // (3 * self.entry_bytes))
        self._fd: int | None = None
        self.path: Path | None = None
        self.runs: list[tuple[int, int]] = []  # (first entry, entries) of each run in the file
        self._memory: tuple[np.ndarray, np.ndarray] | None = None
        try:
            if total <= self.run_rows:
                self._sort_in_memory(parts, total)
            else:
                self._write_runs(parts, total, Path(temp_beside))
                self.count = sum(k.shape[0] for k, _ in self._merge(with_values=False))
        except BaseException:
            self.close()
            raise

    # --- runs --------------------------------------------------------------------------

    def _sort_in_memory(self, parts: Parts, total: int) -> None:
        keys = np.empty(total, dtype=np.uint64)
        values = np.empty((total, self.columns), dtype=np.float32)
        n = 0
        for k, v in parts(min(READ_CHUNK_ROWS, max(total, 1))):
            if n + k.shape[0] > total:
                raise AssertionError(f"more copies than the {total} counted: the checkpoint changed")
            keys[n:n + k.shape[0]], values[n:n + k.shape[0]] = k, v
            n += k.shape[0]
        keep = newest_sorted(keys[:n])
        self._memory = keys[keep], values[keep]
        self.count = int(keep.shape[0])

    def _write_runs(self, parts: Parts, total: int, beside: Path) -> None:
        self.total = total
        check_free_space(str(beside.parent), total * self.entry_bytes)
        self._fd, self.path = safefile.create_temp(beside, readable=True)
        os.posix_fallocate(self._fd, 0, total * self.entry_bytes)
        self._values_at = 8 * total  # keys in [0, 8 total), values after them
        keys = np.empty(self.run_rows, dtype=np.uint64)
        values = np.empty((self.run_rows, self.columns), dtype=np.float32)
        n = written = 0
        for k, v in parts(min(READ_CHUNK_ROWS, self.run_rows)):
            while k.shape[0]:
                take = min(k.shape[0], self.run_rows - n)
                keys[n:n + take], values[n:n + take] = k[:take], v[:take]
                n, k, v = n + take, k[take:], v[take:]
                if n == self.run_rows:
                    written = self._write_run(keys[:n], values[:n], written)
                    n = 0
        if n:
            written = self._write_run(keys[:n], values[:n], written)
        if sum(r[1] for r in self.runs) > total:
            raise AssertionError(f"{self.path}: more copies than the {total} counted: the checkpoint changed")

    def _write_run(self, keys: np.ndarray, values: np.ndarray, first: int) -> int:
        if first + keys.shape[0] > self.total:
            raise AssertionError(f"{self.path}: more copies than the {self.total} counted: the checkpoint changed")
        keep = newest_sorted(keys)
        m = keep.shape[0]
        for at, a in ((8 * first, keys[keep]), (self._values_at + self.value_bytes * first, values[keep])):
            pwrite_all(self._fd, a, at)
            diskio.write_behind(self._fd, str(self.path), at, a.nbytes)  # read back once, in the merge
        self.runs.append((first, m))
        return first + m

    # --- merge -------------------------------------------------------------------------

    def _read(self, run: int, at: int, n: int, with_values: bool) -> tuple[np.ndarray, np.ndarray | None]:
        first = self.runs[run][0] + at
        keys = np.empty(n, dtype=np.uint64)
        _pread_into(self._fd, keys, 8 * first, self.path)
        if not with_values:
            return keys, None
        values = np.empty((n, self.columns), dtype=np.float32)
        _pread_into(self._fd, values, self._values_at + self.value_bytes * first, self.path)
        return keys, values

    def _merge(self, with_values: bool) -> Iterator[tuple[np.ndarray, np.ndarray | None]]:
        k = len(self.runs)
        entry = self.entry_bytes if with_values else 8
        block = max(MIN_BLOCK_ROWS, self.budget // (4 * k * entry))
        loaded = [0] * k  # entries of each run read so far
        bk: list[np.ndarray] = [np.zeros(0, np.uint64)] * k
        bv: list[np.ndarray | None] = [None] * k
        while True:
            for i, (_, length) in enumerate(self.runs):
                if bk[i].shape[0] == 0 and loaded[i] < length:
                    n = min(block, length - loaded[i])
                    bk[i], bv[i] = self._read(i, loaded[i], n, with_values)
                    loaded[i] += n
            live = [i for i in range(k) if bk[i].shape[0]]
            if not live:
                return
            # a run read to its end holds nothing beyond its buffer; any other may hold keys
            # just above its last buffered one: up to the smallest of those, every run is here
            open_ends = [bk[i][-1] for i in live if loaded[i] < self.runs[i][1]]
            parts_k, parts_v = [], []
            for i in live:
                cut = bk[i].shape[0] if not open_ends else int(np.searchsorted(bk[i], min(open_ends), "right"))
                if cut:
                    parts_k.append(bk[i][:cut])
                    bk[i] = bk[i][cut:]
                    if with_values:
                        parts_v.append(bv[i][:cut])
                        bv[i] = bv[i][cut:]
            keys = np.concatenate(parts_k)
            keep = newest_sorted(keys)  # runs in chain order: the newest copy is the last
            yield keys[keep], (np.concatenate(parts_v)[keep] if with_values else None)

    def batches(self) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """(keys ascending, values) chunks: every distinct key once, its newest copy."""
        if self._memory is not None:
            keys, values = self._memory
            for start in range(0, max(keys.shape[0], 1), self.run_rows):
                if keys.shape[0]:
                    yield keys[start:start + self.run_rows], values[start:start + self.run_rows]
            return
        yield from self._merge(with_values=True)

    def close(self) -> None:
        """Closes and removes the temporary file (a no-op when there is none)."""
        self._memory = None
        if self._fd is not None:
            try:
                os.close(self._fd)
            except OSError:
                pass
            self._fd = None
        if self.path is not None:
            safefile.remove_quietly(self.path)

    def __enter__(self) -> "SortedRows":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
