"""Free space before a write: the one check data_prep's shard writers and the store's shard files share."""

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
