"""Writing where someone may have planted a link: nothing is followed, nothing removed that hvctr did not make.

Every file hvctr writes goes through here (the store's shard files and the checkpoint's rank
files, the run directory's JSON and TOML files, export and score outputs):

- a file is written under a fresh temporary name in its own directory
  (``<name>.<random>.tmp``), created with O_CREAT | O_EXCL | O_NOFOLLOW (HDF5 writers: mode
  "x", which is the same), so no link or file planted at any name is ever opened; then
  renamed over the target (``os.replace`` renames over a link, never through it);
- a file appended to (metrics.jsonl, a rank's log) is opened with O_NOFOLLOW and must be a
  regular file: a planted link is refused, naming it (``PlantedPathError``);
- a directory hvctr makes (a checkpoint's ``ckpt-NNNNNN``) is made by ``mkdir``, which never
  follows a link; one that exists is checked with ``lstat``: a link or non-directory is refused;
- a temporary directory (an export's ``X.tmp``) carries a marker file: a leftover at its name
  is removed only when it is a real directory holding the marker (a crashed run's), anything
  else is refused and named, never removed.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import shutil
import stat
from pathlib import Path
from typing import IO, Iterator

TEMP_DIR_MARKER = ".hvctr-temporary"  # in a temporary directory hvctr made, and only there


class PlantedPathError(ValueError):
    """A path hvctr writes is a link (or not what hvctr would make) it did not create: refused."""


def _describe(path: Path) -> str:
    try:
        st = os.lstat(path)
    except OSError:
        return "in the way"
    if stat.S_ISLNK(st.st_mode):
        try:
            return f"a symbolic link (to {os.readlink(path)})"
        except OSError:
            return "a symbolic link"
    if stat.S_ISDIR(st.st_mode):
        return "a directory"
    return "a regular file" if stat.S_ISREG(st.st_mode) else "not a regular file"


def temp_name(path: str | os.PathLike[str]) -> Path:
    """A fresh name beside ``path`` for its temporary file (nothing is created)."""
    path = Path(path)
    return path.with_name(f"{path.name}.{secrets.token_hex(6)}.tmp")


def create_temp(path: str | os.PathLike[str], mode: int = 0o644, readable: bool = False) -> tuple[int, Path]:
    """(descriptor open for writing, and reading where ``readable``, name) of a new temporary
    file beside ``path``, created exclusively (O_EXCL | O_NOFOLLOW): never a planted file or link."""
    access = os.O_RDWR if readable else os.O_WRONLY
    for _ in range(100):
        tmp = temp_name(path)
        try:
            fd = os.open(tmp, access | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
        except FileExistsError:
            continue
        return fd, tmp
    raise OSError(errno.EEXIST, f"no free temporary name beside {path}")


def remove_quietly(path: str | os.PathLike[str]) -> None:
    """Removes ``path`` (a temporary file this process created); nothing when it is gone."""
    with contextlib.suppress(OSError):
        os.unlink(path)


def _sync_dir(directory: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@contextlib.contextmanager
def replacing(path: str | os.PathLike[str], mode: str = "w", fsync: bool = False,
              **open_kw) -> Iterator[IO]:
    """A file object on a new temporary file beside ``path``; renamed over ``path`` when the
    block ends without error, removed when it raises (the error goes on; an OSError names
    ``path``)."""
    path = Path(path)
    try:
        fd, tmp = create_temp(path)
    except OSError as e:
        raise _named(e, path) from None
    try:
        with os.fdopen(fd, mode, **open_kw) as f:
            yield f
            f.flush()
            if fsync:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:  # a write or the flush at close (a full disk): named by the target
        remove_quietly(tmp)
        raise _named(e, path) from None
    except BaseException:
        remove_quietly(tmp)
        raise


def _named(e: OSError, path: Path) -> OSError:
    """``e`` as the same kind of OSError whose filename is ``path`` (not the temporary name, or
    none: a failed write() or close() names no file)."""
    return OSError(e.errno, e.strerror or str(e), str(path)) if e.errno else e


@contextlib.contextmanager
def replacing_path(path: str | os.PathLike[str]) -> Iterator[Path]:
    """A fresh temporary name beside ``path`` for a writer that creates the file itself, and
    must create it exclusively (h5py mode "x"); renamed over ``path`` when the block ends,
    removed when it raises (the error goes on)."""
    path = Path(path)
    tmp = temp_name(path)
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        remove_quietly(tmp)
        raise


def write_bytes(path: str | os.PathLike[str], data: bytes, fsync: bool = False) -> None:
    """``data`` at ``path``: a new temporary file, then renamed; never half-written, never
    through a link. An OSError leaves nothing of it."""
    with replacing(path, "wb", fsync=fsync) as f:
        f.write(data)


def write_text(path: str | os.PathLike[str], text: str, fsync: bool = False) -> None:
    write_bytes(path, text.encode("utf-8"), fsync=fsync)


def open_append(path: str | os.PathLike[str], mode: str = "a", **open_kw) -> IO:
    """``path`` opened for appending (created when missing), never through a link: a link, or
    anything but a regular file, at ``path`` is a PlantedPathError naming it."""
    path = Path(path)
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise PlantedPathError(f"{path} is {_describe(path)}: hvctr does not write through links; "
                                   f"remove it (or choose another directory)") from None
        if e.errno == errno.ENXIO:  # a FIFO no one reads: it would have waited for a reader
            raise PlantedPathError(f"{path} is not a regular file (a FIFO): hvctr appends only to its own "
                                   f"files; remove it (or choose another directory)") from None
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise PlantedPathError(f"{path} is not a regular file: hvctr appends only to its own files; "
                                   f"remove it (or choose another directory)")
        os.set_blocking(fd, True)
        return os.fdopen(fd, mode, **open_kw)
    except BaseException:
        os.close(fd)
        raise


def check_dir(path: str | os.PathLike[str]) -> bool:
    """True when ``path`` is a real directory, False when nothing is there; a link or anything
    else at ``path`` is a PlantedPathError naming it."""
    path = Path(path)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    if not stat.S_ISDIR(st.st_mode):
        raise PlantedPathError(f"{path} is {_describe(path)}, not a directory hvctr made: it is left as it is; "
                               f"remove it (or choose another directory)")
    return True


def make_dir(path: str | os.PathLike[str], parents: bool = True) -> Path:
    """``path`` as a directory (its missing parents too, where ``parents``), never a link:
    ``mkdir`` does not follow one, and one that exists is checked (``check_dir``)."""
    path = Path(path)
    if check_dir(path):
        return path
    if parents:
        os.makedirs(path.parent, exist_ok=True)
    try:
        os.mkdir(path)
    except FileExistsError:
        check_dir(path)  # made meanwhile: fine if a real directory, refused if not
    return path


def make_temp_dir(path: str | os.PathLike[str], what: str) -> Path:
    """A new temporary directory ``path`` (e.g. an export's ``X.tmp``), marked as hvctr's.

    A leftover there is removed only when it is a real directory with the marker (a crashed
    run of ``what`` left it); anything else there is a PlantedPathError naming it, and stays."""
    path = Path(path)
    if os.path.lexists(path):
        if not _is_marked(path):
            raise PlantedPathError(f"{path} exists ({_describe(path)}) and was not made by {what}: it is "
                                   f"left as it is; move it away (or choose another name)")
        shutil.rmtree(path)
    try:
        os.mkdir(path)
    except FileExistsError:
        raise PlantedPathError(f"{path} appeared while {what} started ({_describe(path)}): it is left as it "
                               f"is; move it away (or choose another name)") from None
    try:
        os.close(os.open(path / TEMP_DIR_MARKER, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644))
    except OSError:
        with contextlib.suppress(OSError):
            os.rmdir(path)  # just made, empty: not left unmarked
        raise
    return path


def _is_marked(path: Path) -> bool:
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode) and stat.S_ISREG(os.lstat(path / TEMP_DIR_MARKER).st_mode)
    except OSError:
        return False


def publish_temp_dir(tmp: str | os.PathLike[str], final: str | os.PathLike[str]) -> None:
    """Renames the temporary directory ``tmp`` (made by make_temp_dir) to ``final``, which must
    not exist (not even as a link), its marker removed first."""
    tmp, final = Path(tmp), Path(final)
    if os.path.lexists(final):
        raise FileExistsError(errno.EEXIST, f"{final} exists ({_describe(final)})", str(final))
    os.unlink(tmp / TEMP_DIR_MARKER)
    _sync_dir(tmp)
    os.rename(tmp, final)


def remove_temp_dir(tmp: str | os.PathLike[str]) -> None:
    """Removes a temporary directory this process made (make_temp_dir); never follows a link."""
    tmp = Path(tmp)
    with contextlib.suppress(OSError):
        if stat.S_ISDIR(os.lstat(tmp).st_mode):
            shutil.rmtree(tmp)
