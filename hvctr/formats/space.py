"""Free space before a write (the one check data_prep's shard writers and the store's shard files
share), and what to do when a write failed (``remedy``: free space, or a read-only disk, ...)."""

from __future__ import annotations

import errno
import os


def check_free_space(directory: str, need: int) -> None:
    """OSError(ENOSPC) when the file system of ``directory`` has fewer than ``need`` bytes free."""
    st = os.statvfs(directory)
    free = st.f_bavail * st.f_frsize
    if free < need:
        raise OSError(errno.ENOSPC, f"no space left on device: {free / 2**20:,.1f} MiB free, "
                                    f"{need / 2**20:,.1f} MiB needed")


def remedy(e: OSError, place: str | os.PathLike[str]) -> str:
    """What a person can do about a write under ``place`` that failed with ``e``, by its kind:
    a full disk wants space freed, a read-only or forbidden one does not."""
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"free space in {place}"
    if e.errno == errno.EROFS:
        return f"{place} is on a read-only file system (remounted read-only after a disk error?): make it writable"
    if e.errno in (errno.EACCES, errno.EPERM):
        return f"this user may not write in {place}: give it write permission"
    return f"check the disk under {place} ({errno.errorcode.get(e.errno, e.errno)})"
