"""Reads and writes of a file (the SSD shard, checkpoint files) at the device's queue depth (the C kernels' I/O pool).

A table larger than memory is read row by row from the SSD: a window's cold rows and the index
blocks that find them are thousands of random 4 KiB reads. Through a memmap each is a page fault,
one at a time, and each drags in the file's readahead (8 MiB on some disks: a batch of row reads
then fills a memory cgroup with pages nobody asked for). Here a batch of items goes out at once:

- ``read(fd, base, item_bytes, pos, out)``: item i of ``out`` is read from ``base + pos[i] *
  item_bytes``; items in the same or adjacent 4 KiB pages share one pread of their page-aligned
  span; ``threads`` threads keep that many reads in flight: the calling thread and threads of
  a pool started once and kept (each keeping 64 KiB of scratch; up to 255 of them, shared by the
  batches of all a process's threads). The calling thread first does the reads the page cache
  can answer (``RWF_NOWAIT``; not through an ``O_DIRECT`` descriptor) and hands the pool only
  those that would wait on the device.
- ``write(..., data)``: whole pages, read-modify-write by the pool (the kernel never reads a
  partly written page inside a write, where buffered writes to one file serialise); with
  ``behind``, the written span is then flushed to the device and dropped from the page cache,
  so write-back leaves no dirty pages to a memory cgroup (v1 does not throttle a group's dirty
  pages; reclaim would wait for their write-back: the job stalls).
- ``write_behind(fd, offset, length)``: the same flush-and-drop for a sequential write (the
  checkpoint's rank files).
- ``FileMap``: the file mapped shared, given to ``read`` and ``write``: the calling thread first
  copies every run whose pages the page cache holds (``mincore``) straight between the mapping
  and the caller's items, no system call and no whole page copied for them (a 208-byte row costs
  208 bytes, where a pread copies its page and a write's read-modify-write two), and hands the
  pool only the rest. Not with ``behind`` (pages flushed and dropped: a memory cgroup's case),
  where a mapping would keep pages the drop cannot take. A page that leaves the page cache
  between the check and the copy is faulted in (one read at depth 1: right, and rare).

Positions are sorted and unique (callers sort). Every failure is an OSError naming the file.
Where the C kernels are not loaded (HVCTR_NATIVE=0), ``available()`` is False and the shard keeps
its reference path (the memmap).
"""

from __future__ import annotations

import errno
import os

import numpy as np

from hvctr.kernels import native

DEFAULT_THREADS = 32  # the depth where this machine type's disk and a datacenter NVMe's share of it saturate
_WRITE_BEHIND = 1


def available() -> bool:
    """Whether the I/O pool is there (the C kernels are loaded)."""
    return native.lib() is not None


def _check(rc: int, what: str, path: str) -> None:
    if rc < 0:
        code = -int(rc)
        raise OSError(code, f"{what}: {os.strerror(code)}", path)


class IOStats:
    """What a shard's pool did: system calls, bytes moved, items (for the run's metrics)."""

    __slots__ = ("read_calls", "read_bytes", "read_items", "write_calls", "write_bytes", "write_items")

    def __init__(self) -> None:
        for name in self.__slots__:
            setattr(self, name, 0)

    def as_dict(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in self.__slots__}


class FileMap:
    """The first ``length`` bytes of ``fd`` mapped shared (``writable``: read and write), for
    ``read`` and ``write``; ``close()`` unmaps it (before the descriptor is closed, and before a
    page-cache drop, which leaves mapped pages where they are)."""

    def __init__(self, fd: int, path: str, length: int, writable: bool) -> None:
        self.path, self.length, self.writable = path, int(length), bool(writable)
        addr = native.lib().hv_io_map(fd, self.length, int(writable))
        _check(addr, f"mapping {self.length} bytes", path)
        self.addr = int(addr)

    def close(self) -> None:
        if self.addr:
            addr, self.addr = self.addr, 0
            _check(native.lib().hv_io_unmap(addr, self.length), f"unmapping {self.length} bytes", self.path)


def held(mapped: FileMap, base: int, item_bytes: int, pos: np.ndarray) -> np.ndarray:
    """Whether every page of each item (at ``base + pos[i] * item_bytes``, ``pos`` sorted) is in
    the page cache and inside the mapping: where a caller may look at the item in place."""
    pos = np.ascontiguousarray(pos, dtype=np.int64)
    out = np.zeros(pos.shape[0], dtype=np.int8)
    if pos.shape[0]:
        rc = native.lib().hv_io_held(mapped.addr, mapped.length, base, item_bytes, pos.ctypes.data, pos.shape[0],
                                     out.ctypes.data)
        _check(rc, f"asking the page cache for {pos.shape[0]} items of {item_bytes} bytes", mapped.path)
    return out.view(bool)


def _map_args(mapped: FileMap | None, write: bool = False) -> tuple[int, int]:
    """The mapping for a batch: none where there is none, it is closed, or a write meets a
    read-only mapping (the pool then writes)."""
    usable = mapped is not None and mapped.addr and (mapped.writable or not write)
    return (mapped.addr, mapped.length) if usable else (0, 0)


def read(fd: int, path: str, base: int, item_bytes: int, pos: np.ndarray, out: np.ndarray, threads: int,
         stats: IOStats | None = None, mapped: FileMap | None = None) -> None:
    """Fills ``out`` (C-contiguous, ``len(pos) * item_bytes`` bytes) with the items at ``pos``
    (through ``mapped`` where the page cache holds them)."""
    pos = np.ascontiguousarray(pos, dtype=np.int64)
    if pos.shape[0] == 0:
        return
    if not out.flags.c_contiguous or out.nbytes != pos.shape[0] * item_bytes:
        raise ValueError(f"read: a buffer of {out.nbytes} bytes for {pos.shape[0]} items of {item_bytes}")
    st = np.zeros(3, dtype=np.int64)
    rc = native.lib().hv_io_read(fd, base, item_bytes, pos.ctypes.data, pos.shape[0], out.ctypes.data, threads, 0,
                                 st.ctypes.data, *_map_args(mapped))
    if rc == -errno.EIO:
        raise OSError(errno.EIO, f"a read past the end of the file (position {int(pos[-1])} of items of "
                                 f"{item_bytes} bytes from offset {base}): the file is truncated", path)
    _check(rc, f"reading {pos.shape[0]} items of {item_bytes} bytes", path)
    if stats is not None:
        stats.read_calls += int(st[2])
        stats.read_bytes += int(st[1])
        stats.read_items += pos.shape[0]


def write(fd: int, path: str, base: int, item_bytes: int, pos: np.ndarray, data: np.ndarray, threads: int,
          behind: bool, stats: IOStats | None = None, mapped: FileMap | None = None) -> None:
    """Writes item i of ``data`` at ``base + pos[i] * item_bytes``; ``behind``: flush and drop after
    (``mapped`` is then not used)."""
    pos = np.ascontiguousarray(pos, dtype=np.int64)
    if pos.shape[0] == 0:
        return
    data = np.ascontiguousarray(data)
    if data.nbytes != pos.shape[0] * item_bytes:
        raise ValueError(f"write: {data.nbytes} bytes for {pos.shape[0]} items of {item_bytes}")
    st = np.zeros(3, dtype=np.int64)
    rc = native.lib().hv_io_write(fd, base, item_bytes, pos.ctypes.data, pos.shape[0], data.ctypes.data, threads,
                                  _WRITE_BEHIND if behind else 0, st.ctypes.data, *_map_args(mapped, write=True))
    _check(rc, f"writing {pos.shape[0]} items of {item_bytes} bytes", path)
    if stats is not None:
        stats.write_calls += int(st[2])
        stats.write_bytes += int(st[1])
        stats.write_items += pos.shape[0]


def write_behind(fd: int, path: str, offset: int, length: int) -> None:
    """Flushes ``[offset, offset + length)`` to the device and drops it from the page cache."""
    lib = native.lib()
    if lib is None or length <= 0:
        return
    _check(lib.hv_io_write_behind(fd, offset, length), f"flushing {length} bytes at offset {offset}", path)
