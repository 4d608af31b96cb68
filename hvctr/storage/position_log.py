"""Where a window's rows were, kept for the same window of the next pass (pread path).

A table many times the memory cannot keep its index in memory: a cold key costs a 4 KiB index
block read for its 16-byte entry, then the read of its row (issue 26: at 16.7 GB in a 1.55 GiB
memory cgroup the warm's index blocks were 27.7M of its 54.6M reads). But a pass over the data
reads it in the same order as the pass before (hvctr reads the data shards in order, every
epoch), so the window starting at batch b of epoch e asks for the rows the window at batch b of
epoch e - 1 asked for, and a shard's rows never move (they are appended; compaction writes a
new shard). The shard therefore writes, for each window, the positions it looked up or created
for the window's keys, one sequential write of 16 bytes a key, and at the same window of the
next pass reads them back in one sequential read into a probe table of its own (Shard.recall,
32 bytes a position, kept until the window after next), which its lookups consult before
RecentPositions and the index: the warm, the pull and the push then find those rows without
their index blocks. Keys the window did not bring last pass (new
keys, keys the cache held then) take the index as before; a data order that changes between
passes only makes the log useless, never wrong (a logged position is a fact of this shard).

Two files beside the shard (``<shard>.positions-0`` and ``-1``), the even epochs' and the odd
ones': epoch e writes one while it reads the other (epoch e - 1's), and truncates it when it starts
(it held epoch e - 2). They are scratch: created empty by the first window a shard logs, removed
when it closes.
A failure to write them (a full disk) turns the log off with a warning: it is a hint, and training
goes on without it.
"""

from __future__ import annotations

import os

import numpy as np

from hvctr.kernels import diskio
from hvctr.log import get_logger

log = get_logger(__name__)

# the index's entries, hvctr.storage.shard.INDEX_DTYPE (not imported: shard.py imports this module)
ENTRY = np.dtype([("key", "<u8"), ("row", "<i8")])

Tag = tuple[int, int]  # (epoch, first batch of the window within it)


class PositionLog:
    """``record(tag, keys, pos)`` as a window looks its rows up; ``recall(tag)``: what the same
    window of the last pass recorded, as (keys, positions), or None."""

    def __init__(self, shard_path: str, write_behind: bool) -> None:
        self.paths = [f"{shard_path}.positions-{i}" for i in (0, 1)]
        self.write_behind = write_behind
        self.fds: list[int] = []  # opened (created empty) by the first record
        self.epoch_of: list[int | None] = [None, None]  # the epoch each file holds
        self.segments: list[dict[int, list[tuple[int, int]]]] = [{}, {}]  # first batch -> (offset, entries)
        self.size = [0, 0]
        self.enabled = True
        self.recorded = self.recalled = 0  # entries written, entries read back
        self._last: Tag | None = None  # the window recalled last: its warm and its pull ask once

    def record(self, tag: Tag, keys: np.ndarray, pos: np.ndarray) -> None:
        """Appends the positions of ``keys`` (those >= 0) to the window ``tag``'s segment."""
        if not self.enabled:
            return
        epoch, first = tag
        f = epoch % 2
        found = pos >= 0
        n = int(np.count_nonzero(found))
        if n == 0:
            return
        try:
            if not self.fds:
                self.fds = [os.open(p, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600) for p in self.paths]
            if self.epoch_of[f] != epoch:  # a new pass: this file held the one before the last
                os.ftruncate(self.fds[f], 0)
                self.epoch_of[f], self.segments[f], self.size[f] = epoch, {}, 0
            entries = np.empty(n, dtype=ENTRY)
            entries["key"], entries["row"] = keys[found], pos[found]
            offset = self.size[f]
            data = memoryview(entries).cast("B")
            done = 0
            while done < data.nbytes:
                done += os.pwrite(self.fds[f], data[done:], offset + done)
            if self.write_behind:  # no dirty pages left to a memory cgroup
                diskio.write_behind(self.fds[f], self.paths[f], offset, data.nbytes)
        except OSError as e:
            self._off(f"writing {self.paths[f]}: {e.strerror or e}")
            return
        self.segments[f].setdefault(first, []).append((offset, n))
        self.size[f] += data.nbytes
        self.recorded += n

    def recall(self, tag: Tag) -> tuple[np.ndarray, np.ndarray] | None:
        """The positions the window at the same first batch of the previous epoch recorded;
        None where there are none, or where this window asked already."""
        epoch, first = tag
        f = (epoch - 1) % 2
        if tag == self._last:
            return None
        self._last = tag
        if not self.enabled or epoch < 1 or self.epoch_of[f] != epoch - 1 or first not in self.segments[f]:
            return None
        parts = []
        try:
            for offset, n in self.segments[f][first]:
                buf = bytearray(n * ENTRY.itemsize)
                got = os.preadv(self.fds[f], [buf], offset)
                if got != len(buf):
                    raise OSError(0, f"{got} of {len(buf)} bytes at offset {offset}: the file was truncated")
                parts.append(np.frombuffer(buf, dtype=ENTRY))
                if self.write_behind:
                    os.posix_fadvise(self.fds[f], offset, len(buf), os.POSIX_FADV_DONTNEED)
        except OSError as e:
            self._off(f"reading {self.paths[f]}: {e.strerror or e}")
            return None
        entries = np.concatenate(parts) if len(parts) > 1 else parts[0]
        self.recalled += entries.shape[0]
        return entries["key"].copy(), entries["row"].copy()

    def _off(self, why: str) -> None:
        self.enabled = False
        log.warning(f"the shard's position log is off from now on ({why}); training goes on, reading "
                    f"index blocks for every cold key (docs/storage.md)")

    def close(self) -> None:
        if not self.fds:
            return
        for fd in self.fds:
            os.close(fd)
        for p in self.paths:
            try:
                os.unlink(p)
            except FileNotFoundError:
                pass
        self.fds = []
