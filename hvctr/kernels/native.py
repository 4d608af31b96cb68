"""The sparse path's hot loops in C: lazy Adam on rows in place, the batch's unique positions,
the gather of its rows and the sum of its gradients per row; the window's unique keys; and the
exchange's packing of rows into messages and merging of the copies an owner receives.

Why C: in torch, lazy Adam on the ~24k rows a batch of 4096 x 26 touches is a gather of the
rows, a dozen elementwise ops on strided column views and a scatter back (about 5 ms on one
core, measured by ``python -m bench.sparse``); one pass per row, prefetching rows ahead,
takes about 1.2 ms, and the whole sparse path about 5% of the MLP step.

The source is ``hv_kernels.c`` beside this file, with ``hv_row.h`` (the row layout, generated
from hvctr.formats). setup.py builds them at install time (``pip install .``, ``pip install -e
.``, ``make setup``) into the plain shared library ``_hv_kernels*.so`` here, which ``lib()``
loads with ctypes (which releases the GIL): nothing is compiled at run time. Before binding
anything the loader checks the library against the sources beside it (a stale build after an
edit) and its row layout against ``hvctr.formats.RowLayout``. A missing, damaged or stale
library is an error (``NativeKernelsError``); ``HVCTR_NATIVE=0`` runs the torch/numpy paths on
purpose (``lib()`` is then None and callers take them).

Every kernel walks its inputs in order on one thread: results do not depend on timing.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import importlib.machinery
import os
import struct
import threading
from pathlib import Path

from hvctr.log import get_logger
from hvctr.formats import C_LAYOUTS, EMPTY_KEY, RowLayout

log = get_logger(__name__)

HERE = Path(__file__).resolve().parent
SOURCES = ("hv_kernels.c", "hv_row.h")  # setup.py hashes them the same way
LIB_NAME = "_hv_kernels"
OFF_HINT = "set HVCTR_NATIVE=0 to run the slower torch path on purpose"
REBUILD_HINT = "rebuild hvctr (pip install . / pip install -e . / make setup, with a C compiler present)"

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_error: str | None = None
_disabled = 0


class NativeKernelsError(RuntimeError):
    """The C kernels are not there, do not load, or do not match their sources."""


def source_sha256(directory: Path = HERE) -> str | None:
    """sha256 of hv_kernels.c, a NUL, hv_row.h in ``directory`` (None where they are absent)."""
    h = hashlib.sha256()
    for i, name in enumerate(SOURCES):
        path = directory / name
        if not path.is_file():
            return None
        h.update(b"\0" if i else b"")
        h.update(path.read_bytes())
    return h.hexdigest()


def library_path() -> Path | None:
    """The built library beside this file, or None where there is none."""
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = HERE / f"{LIB_NAME}{suffix}"
        if path.is_file():
            return path
    return None


def _declare(lib: ctypes.CDLL) -> None:
    """ctypes signatures of hv_kernels.c (tests/unit/test_native_build.py checks them against its
    prototypes)."""
    i64, u64, ptr, f32, f64 = ctypes.c_int64, ctypes.c_uint64, ctypes.c_void_p, ctypes.c_float, ctypes.c_double
    sigs = {
        "hv_source_sha256": ([], ctypes.c_char_p),
        "hv_row_layout": ([i64, i64, ptr], None),
        "hv_empty_key": ([], ctypes.c_uint64),
        "hv_sparse_adam": ([ptr, i64, ptr, i64, ptr, i64, f64, f64, f64, f32], None),
        "hv_sparse_rowwise_adam": ([ptr, i64, ptr, i64, ptr, i64, f64, f64, f64, f32], None),
        "hv_sparse_rowwise_adagrad": ([ptr, i64, ptr, i64, ptr, i64, f64, f32], None),
        "hv_sum_rows": ([ptr, i64, ptr, i64, ptr], None),
        "hv_gather_rows": ([ptr, i64, ptr, i64, i64, ptr], None),
        "hv_batch_unique": ([ptr, i64, i64, ptr, ptr, ptr, ptr], i64),
        "hv_unique_u64": ([ptr, i64, ptr, i64, i64, ptr, ptr, ptr], i64),
        "hv_kth_smallest_u64": ([ptr, i64, i64, ptr], u64),
        "hv_pack_rows": ([ptr, ptr, i64, ptr, i64, i64, ptr], None),
        "hv_merge_messages": ([ptr, i64, i64, i64, ptr, i64, ctypes.c_int32, ptr, ptr, ptr], i64),
        "hv_probe_find": ([ptr, i64, ptr, i64, u64, i64, ptr], None),
        "hv_probe_claim": ([ptr, i64, ptr, ptr, i64, u64, i64, ptr], i64),
        "hv_take_rows": ([ptr, i64, ptr, i64, ptr], None),
        "hv_bloom_add": ([ptr, i64, ptr, i64, ptr, i64], None),
        "hv_bloom_test": ([ptr, i64, ptr, i64, ptr, i64, ptr], None),
        "hv_put_rows": ([ptr, i64, ptr, i64, ptr], None),
        "hv_init_rows": ([ptr, i64, u64, i64, i64, f64, ptr], None),
        "hv_gather_split": ([ptr, i64, ptr, i64, i64, ptr, ptr], None),
        "hv_sum_rows_ld": ([ptr, i64, ptr, i64, ptr, i64], None),
        "hv_gather_pooled": ([ptr, i64, ptr, ptr, i64, i64, ptr, i64, ptr, ptr], None),
        "hv_sum_pooled_ld": ([ptr, ptr, i64, i64, ptr, ptr, i64, ptr, i64], None),
        "hv_io_read": ([i64, i64, i64, ptr, i64, ptr, i64, i64, ptr, i64, i64], i64),
        "hv_io_write": ([i64, i64, i64, ptr, i64, ptr, i64, i64, ptr, i64, i64], i64),
        "hv_io_map": ([i64, i64, i64], i64),
        "hv_io_unmap": ([i64, i64], i64),
        "hv_io_write_behind": ([i64, i64, i64], i64),
        "hv_index_find": ([ptr, i64, ptr, i64, i64, ptr, i64, ptr, ptr, ptr, ptr], i64),
        "hv_index_claim": ([ptr, i64, ptr, i64, i64, ptr, ptr, i64, ptr, ptr, ptr, ptr, ptr], i64),
        "hv_io_held": ([i64, i64, i64, i64, ptr, i64, ptr], i64),
    }
    for name, (argtypes, restype) in sigs.items():
        f = getattr(lib, name)
        f.argtypes, f.restype = argtypes, restype


def _check(lib: ctypes.CDLL, path: Path) -> None:
    """The library was built from the sources beside it, with hvctr.formats' row layout."""
    built = lib.hv_source_sha256().decode()
    here = source_sha256(path.parent)
    if here is not None and built != here:
        raise NativeKernelsError(f"{path} was built from other sources than the {' and '.join(SOURCES)} beside it "
                                 f"(a stale build): {REBUILD_HINT}, or {OFF_HINT}")
    out = (ctypes.c_int64 * 4)()
    for kind, optimizer in enumerate(C_LAYOUTS):
        for dim in (1, 4, 16, 127):
            layout = RowLayout(dim, optimizer)
            lib.hv_row_layout(kind, layout.model_width, out)
            want = [layout.m.start, layout.v.start, layout.step, layout.width]
            if list(out) != want:
                raise NativeKernelsError(
                    f"{path}: the {optimizer.value} row layout it was compiled with ({list(out)} for dim {dim}) is "
                    f"not hvctr.formats.RowLayout's ({want}): regenerate hvctr/kernels/hv_row.h from "
                    f"hvctr.formats.c_header() and {REBUILD_HINT}, or {OFF_HINT}")
    if lib.hv_empty_key() != int(EMPTY_KEY):
        raise NativeKernelsError(f"{path}: HV_EMPTY_KEY differs from hvctr.formats.EMPTY_KEY: {REBUILD_HINT}")


def _truncated(path: Path) -> str | None:
    """Why ``path`` is not a whole ELF file, or None (dlopen of a truncated library can kill the
    process with SIGBUS instead of failing)."""
    data = path.read_bytes()
    if data[:4] != b"\x7fELF":
        return "not an ELF file"
    if data[4] != 2 or data[5] != 1:  # other than 64-bit little-endian: leave it to dlopen
        return None
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    if len(data) < 0x40 or shoff + shentsize * shnum > len(data):
        return f"truncated: {len(data)} bytes, its section table ends at {shoff + shentsize * shnum}"
    return None


def _load() -> ctypes.CDLL:
    path = library_path()
    if path is None:
        raise NativeKernelsError(f"hvctr's C kernels are not built (no {LIB_NAME}*.so in {HERE}): {REBUILD_HINT}, "
                                 f"or {OFF_HINT}")
    damage = _truncated(path)
    if damage:
        raise NativeKernelsError(f"{path} cannot be loaded ({damage}): {REBUILD_HINT}, or {OFF_HINT}")
    try:
        lib = ctypes.CDLL(str(path))
        _declare(lib)
    except (OSError, AttributeError) as e:  # not a library (damaged), or one without our symbols
        raise NativeKernelsError(f"{path} cannot be loaded ({e}): {REBUILD_HINT}, or {OFF_HINT}") from None
    _check(lib, path)
    log.debug("sparse kernels: %s", path)
    return lib


def enabled() -> bool:
    """Whether the C kernels are meant to run: not HVCTR_NATIVE=0, not inside ``disabled()``."""
    return not _disabled and os.environ.get("HVCTR_NATIVE", "1") != "0"


def lib() -> ctypes.CDLL | None:
    """The C kernels (loaded on first call, never compiled); None under HVCTR_NATIVE=0 or within
    ``disabled()``, where callers take their torch/numpy path. NativeKernelsError where the
    library is missing, damaged or stale."""
    global _lib, _error
    if not enabled():
        return None
    if _lib is not None:
        return _lib
    with _lock:
        if _lib is None:
            if _error is not None:
                raise NativeKernelsError(_error)
            try:
                _lib = _load()
            except NativeKernelsError as e:
                _error = str(e)
                raise
    return _lib


def kernel_path() -> str:
    """"native" or "torch": the path the sparse kernels take now (recorded in checkpoints, whose
    resume on the other path is not bit-equal to the uninterrupted run). Raises as ``lib()``."""
    return "native" if lib() is not None else "torch"


def _reset() -> None:
    """Forget the loaded library or the load error (tests)."""
    global _lib, _error
    with _lock:
        _lib, _error = None, None


@contextlib.contextmanager
def disabled():
    """Within the block lib() is None: the torch path runs (tests compare it with the kernels)."""
    global _disabled
    _disabled += 1
    try:
        yield
    finally:
        _disabled -= 1
