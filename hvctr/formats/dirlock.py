"""One job per directory: an exclusive ``flock`` on a lock file in it, naming its holder.

The core of hvctr train's run directory lock (``hvctr.rundir.RunLock``) and of data_prep's
output directory lock; here, in the leaf every side may import. The holder (the job's first
process) takes an exclusive ``flock`` on ``<dir>/<name>`` and writes its host, pid, command
and start time into it; it keeps the lock until ``release()`` or the end of the process (the
kernel drops it when the process dies, however it dies). A second job fails at once, naming
the holder from the file. A lock file that still names a holder when the lock is free was left
by a job that never released it (killed, or its node lost): reported as stale (``stale``) and
taken over. flock works across the nodes of NFS (v4, and v3 with lockd) and Lustre mounted with
``flock``; on a file system without it, flock fails and the error says so.

``in_place()`` tells whether the lock file this job holds is still at its path, in the
directory it was taken in (not deleted, moved or replaced since): a job can then stop rather
than write on into deleted files.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
from pathlib import Path
from typing import Any


def pid_alive(pid: int) -> bool:
    """Whether a process of this pid exists on this host (one of another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def describe_holder(holder: dict[str, Any] | None) -> str:
    if not holder:
        return "a job that has not yet written its name into the lock file"
    what = f"host {holder.get('host')} pid {holder.get('pid')}"
    if holder.get("started"):
        what += f" (since {holder['started']}, {holder.get('command', 'hvctr')})"
    return what


class DirLock:
    """An exclusive flock on ``<directory>/<name>``: ``acquire()``, held until ``release()`` or
    the end of the process. ``key``: how errors name the directory's setting (``config key
    'train.run_dir'``, ``--out``); ``option``: the setting itself, in advice (``train.run_dir``);
    ``kind``: the directory's name in errors (``run directory``). ``stale``: the note on a stale
    lock taken over ("" when there was none)."""

    def __init__(self, directory: str | Path, name: str, command: str, key: str, option: str,
                 kind: str = "directory") -> None:
        self.directory = Path(directory)
        self.path = self.directory / name
        self.command, self.key, self.option, self.kind = command, key, option, kind
        self.stale = ""
        self._fd: int | None = None
        self._dir_id: tuple[int, int] | None = None  # (st_dev, st_ino) of the directory when taken

    def acquire(self) -> "DirLock":
        """ValueError naming the holder when another job holds the directory, or naming the path
        when the directory cannot hold a lock file. Creates the directory when missing."""
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
        except OSError as e:
            raise ValueError(f"{self.key}: cannot create the {self.kind}'s lock file {self.path}: "
                             f"{e.strerror or e}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = read_holder(fd)
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise ValueError(f"{self.directory} is in use by another job: {held_by(holder)} holds "
                                 f"{self.path}; wait for that job to end (or stop it), or choose another "
                                 f"{self.option}") from None
            raise ValueError(f"cannot lock {self.path} ({e.strerror or e}): the file system of "
                             f"{self.directory} does not support flock; put {self.option} on one that does") from None
        prior = read_holder(fd)
        if prior:
            self.stale = (f"{self.path}: stale lock of {describe_holder(prior)}, a job that ended without "
                          f"releasing it (killed, or its node lost): taken over")
        holder = {"host": socket.gethostname(), "pid": os.getpid(), "command": self.command,
                  "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        try:
            write_holder(fd, holder)
        except OSError as e:
            os.close(fd)
            raise ValueError(f"{self.key}: cannot write the lock file {self.path}: {e.strerror or e}") from None
        self._fd = fd
        try:
            st = os.stat(self.directory)
            self._dir_id = (st.st_dev, st.st_ino)
        except OSError:
            self._dir_id = None  # checked by the lock file alone
        return self

    @property
    def held(self) -> bool:
        return self._fd is not None

    def in_place(self) -> bool:
        """Whether the lock file held is still at its path and the directory the one it was
        taken in (False: deleted, moved or replaced since, or the lock file removed). Two stats
        and an fstat. True when not held."""
        if self._fd is None:
            return True
        try:
            held = os.fstat(self._fd)
            at_path = os.lstat(self.path)
            where = os.stat(self.directory)
        except OSError:
            return False
        return (held.st_nlink > 0 and (at_path.st_dev, at_path.st_ino) == (held.st_dev, held.st_ino)
                and (self._dir_id is None or (where.st_dev, where.st_ino) == self._dir_id))

    def release(self) -> None:
        """Empties the file (a file naming a holder while unlocked is a stale lock) and unlocks."""
        if self._fd is None:
            return
        try:
            os.ftruncate(self._fd, 0)
        except OSError:
            pass  # a full or gone disk: the next job reports a stale lock, which is true enough
        os.close(self._fd)
        self._fd = None


def held_by(holder: dict[str, Any] | None) -> str:
    what = describe_holder(holder)
    if holder and holder.get("host") == socket.gethostname() and isinstance(holder.get("pid"), int) \
            and not pid_alive(holder["pid"]):
        what += (" -- that process is gone, but a process it started still holds the lock "
                 "(find it with: fuser -v <lock file>)")
    return what


def read_holder(fd: int) -> dict[str, Any] | None:
    try:
        raw = os.pread(fd, 4096, 0)
    except OSError:
        return None
    if not raw.strip():
        return None
    try:
        holder = json.loads(raw)
    except ValueError:
        holder = None
    return holder if isinstance(holder, dict) else {"host": "?", "pid": "?"}


def write_holder(fd: int, holder: dict[str, Any]) -> None:
    data = (json.dumps(holder, sort_keys=True) + "\n").encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, data, 0)
    os.fsync(fd)
