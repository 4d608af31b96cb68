"""Allocate early, then pwrite: how the store's shard files and the checkpoint's rank files are written.

HDF5 writes only the skeleton of the file (attributes, dataset headers: KiBs). Every dataset
that carries data is contiguous and allocated at creation (``create_early``: its storage,
and so its file offset, exist at once); ``reserved`` then reserves every block of the file
(posix_fallocate) and hands out a descriptor the data goes in through, by ``pwrite_all`` at
the datasets' offsets. So a full disk is an OSError from posix_fallocate (or the free-space
check before it, ``hvctr.formats.space``), never a failed write inside HDF5 (HDF5 2.0 cannot
close a file whose write failed for lack of space and crashes at exit), and never later.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Iterator

import h5py
import numpy as np


def early_dcpl() -> h5py.h5p.PropDCID:
    """A dataset creation property list whose storage is allocated when the dataset is created."""
    dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
    dcpl.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)  # storage (and a file offset) exist at once
    return dcpl


def create_early(group: h5py.Group, name: str, shape: Any = None, dtype: Any = None, *,
                 data: Any = None, fill_time: str | None = "never") -> h5py.Dataset:
    """A contiguous dataset allocated at creation (``dset.id.get_offset()`` is its file offset).

    ``fill_time = "never"``: HDF5 writes nothing into it (the data comes by pwrite); None keeps
    HDF5's default (for a small dataset created with its ``data``)."""
    kw = {} if fill_time is None else {"fill_time": fill_time}
    return group.create_dataset(name, shape=shape, dtype=dtype, data=data, dcpl=early_dcpl(),
                                track_times=False, **kw)


def pwrite_all(fd: int, data: memoryview | np.ndarray, offset: int) -> None:
    """Writes all of ``data`` (bytes of a memoryview, or an array's, C order) at ``offset``."""
    view = data if isinstance(data, memoryview) else memoryview(np.ascontiguousarray(data)).cast("B")
    while view.nbytes:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


@contextlib.contextmanager
def reserved(path: str | os.PathLike[str], fsync: bool = False) -> Iterator[int]:
    """Opens ``path`` read-write, reserves every block of it (posix_fallocate over its size)
    and yields the descriptor; closes it at the end (after an fsync where ``fsync``)."""
    fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)  # never a link planted meanwhile
    try:
        os.posix_fallocate(fd, 0, os.fstat(fd).st_size)
        yield fd
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)
