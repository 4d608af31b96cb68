"""The checkpoint format: a base plus deltas, one HDF5 file per rank per checkpoint, a manifest last.

    <checkpoint dir>/
      ckpt-000004/ rank-00000.h5 rank-00001.h5 manifest.json   base (every row of the table)
      ckpt-000005/ ...                                          delta (rows written since 4)
      ckpt-000006/ ...                                          delta (rows written since 5)

A checkpoint is taken at a window boundary, after the merge. Every rank flushes its cache and
writes the rows it wrote since the previous checkpoint (a delta; every
``checkpoint.compact_every`` checkpoints all its rows: a new base), each with the TTL pass it
was last written in, its dense state (parameters, Adam moments and step: with
``merge.states = params`` the moments differ per rank), its admission counters, the TTL pass
clock and the bucket table (which rank owns which virtual bucket: ``hvctr reshard`` rewrites
it), under a temporary name, then renames the file. The file's space is reserved first
(posix_fallocate, ``hvctr.formats.h5alloc``), so a full disk is a clear error that leaves
nothing behind, never a crash inside HDF5. Rank 0 gathers the files' checksums and writes
manifest.json last (temporary name, rename): the manifest is the completion marker, and
carries the sha256 of its own content (``manifest_sha256``), so a flipped bit that leaves it
valid JSON is caught too. A directory without a manifest, or whose checksums do not match, is
not a checkpoint; resume falls back to the newest complete one and moves the newer ones to
rejected/ (this run will write new ones under their numbers).

The working shard is only a working copy: after a crash it may hold rows written after the
last checkpoint (evictions write back), so resume rebuilds it from the base and the deltas of
the chosen checkpoint's chain. Nothing loaded runs code: HDF5 datasets and JSON, no pickle.

The manifest records the kernel path the run took (``kernels``: ``native``, the C kernels, or
``torch``, under HVCTR_NATIVE=0); loading a checkpoint on the other path logs a warning that
bit-equality with the uninterrupted run is not kept.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from hvctr.formats import default_bucket_owner
from hvctr.log import get_logger
from hvctr.kernels import diskio, native
from hvctr.formats.h5alloc import create_early, pwrite_all, reserved
from hvctr.formats.space import check_free_space

log = get_logger(__name__)

FORMAT_VERSION = 1
_PREFIX = "ckpt-"
_LOAD_CHUNK = 1 << 18  # rows per bulk load when rebuilding a shard


@dataclass
class TrainState:
    """Where training stands at a window boundary; identical on every rank."""

    epoch: int = 0
    batch: int = 0  # next batch index within the epoch
    window: int = 0  # next window number
    step: int = 0  # local steps taken so far (per rank)
    samples: int = 0  # samples trained on, all ranks together


def file_sha256(path: str | Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.h5"


def checkpoint_path(directory: str | Path, seq: int) -> Path:
    """The directory of checkpoint ``seq`` under a checkpoint directory."""
    return Path(directory) / f"{_PREFIX}{seq:06d}"


def rank_file_path(directory: str | Path, seq: int, rank: int) -> Path:
    """Rank ``rank``'s file of checkpoint ``seq``."""
    return checkpoint_path(directory, seq) / _rank_file(rank)


MANIFEST_CHECKSUM = "manifest_sha256"


def _manifest_digest(manifest: dict[str, Any]) -> str:
    body = {k: v for k, v in manifest.items() if k != MANIFEST_CHECKSUM}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def write_manifest(path: Path, manifest: dict[str, Any]) -> dict[str, Any]:
    """Writes ``manifest`` with the sha256 of its own content (temporary name, then rename:
    the manifest is a completion marker); returns what was written."""
    sealed = {**manifest, MANIFEST_CHECKSUM: _manifest_digest(manifest)}
    _write_json(path, sealed)
    return sealed


def read_manifest(path: str | Path) -> dict[str, Any]:
    """A manifest written by write_manifest; ValueError naming the file when it is not JSON or
    does not match its own checksum (manifests from before the checksum have none to check)."""
    try:
        manifest = json.loads(Path(path).read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not JSON ({e}): damaged or half-written") from None
    want = manifest.get(MANIFEST_CHECKSUM) if isinstance(manifest, dict) else None
    if not isinstance(manifest, dict) or (want is not None and want != _manifest_digest(manifest)):
        raise ValueError(f"{path} does not match its own checksum: damaged")
    return manifest


def read_manifests(directory: str | Path) -> list[dict[str, Any]]:
    """Manifests of the complete checkpoints under ``directory``, newest first; a damaged one
    is left out with a warning (its checkpoint is then incomplete)."""
    out = []
    for path in Path(directory).glob(f"{_PREFIX}*/manifest.json"):
        try:
            out.append(read_manifest(path))
        except (OSError, ValueError) as e:
            log.warning(f"ignoring checkpoint manifest {path}: {e}")
    return sorted(out, key=lambda m: m["seq"], reverse=True)


def locate(path: str | Path) -> tuple[Path, int | None]:
    """(checkpoint directory, seq or None for the newest) named by a run directory, a
    checkpoint directory (holding ckpt-NNNNNN/) or one ckpt-NNNNNN directory."""
    p = Path(path)
    if p.name.startswith(_PREFIX) and (p / "manifest.json").is_file():
        return p.parent, _seq_of(p)
    if any(p.glob(f"{_PREFIX}*/manifest.json")):
        return p, None
    if (p / "config.toml").is_file():
        from hvctr.config import load_config

        return Path(load_config(p / "config.toml").checkpoint.dir or p / "checkpoints"), None
    raise ValueError(f"{p}: neither a run directory (config.toml), a checkpoint directory (ckpt-*/manifest.json) "
                     f"nor a complete checkpoint")


def read_bucket_owner(directory: str | Path, manifest: dict[str, Any], rank: int = 0) -> np.ndarray:
    """The bucket table a checkpoint was written under (files before it existed: the default)."""
    with h5py.File(rank_file_path(directory, manifest["seq"], rank), "r") as f:
        if "bucket_owner" in f:
            return f["bucket_owner"][...].astype(np.int32)
    return default_bucket_owner(manifest["world_size"])


def kernel_path_change(manifest: dict[str, Any], where: str | Path = "") -> str | None:
    """What to warn about when ``manifest`` was written on another kernel path (native C kernels
    or the torch path, ``HVCTR_NATIVE=0``) than this process takes; None when the same or unknown
    (a manifest from before the field). Both paths train the same model, but their roundings
    may differ: a resume on the other path is not bit-equal to the uninterrupted run."""
    then, now = manifest.get("kernels"), native.kernel_path()
    if then is None or then == now:
        return None
    how = {"native": "the C kernels", "torch": "the torch path (HVCTR_NATIVE=0)"}
    return (f"checkpoint {where or manifest.get('seq')} was written on {how.get(then, then)}, this run takes "
            f"{how.get(now, now)}: training continues, but bit-equality with the uninterrupted run is not kept")


def _seq_of(path: Path) -> int:
    return int(path.name[len(_PREFIX):])


def _write_json(path: Path, obj: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1, sort_keys=True))
    os.replace(tmp, path)


class CheckpointWriteError(ValueError):
    """A rank file or manifest could not be written (a full disk): nothing of it is kept (the
    rank file's temporary file, or the checkpoint's directory when its manifest failed)."""


def write_reserved(path: Path, attrs: dict[str, Any], n_rows: int, width: int, parts,
                   arrays: dict[str, np.ndarray]) -> None:
    """Writes a rank file under a temporary name, space reserved first, then renames it.

    Datasets: keys [n], rows [n, width], last_seen [n] from ``parts`` ((keys, rows, last_seen)
    chunks, exactly ``n_rows`` rows in all), and ``arrays`` by name ("dense/param.000", ...).
    HDF5 writes only the skeleton (attributes, headers: KiBs): every dataset is contiguous and
    allocated at creation, posix_fallocate reserves the file, and the data goes in by pwrite.
    So a full disk is an OSError from the free-space check or posix_fallocate, never from
    inside HDF5 (HDF5 2.0 cannot close a file whose write failed for lack of space, and
    crashes at exit). On any error the temporary file is removed and the error re-raised.
    """
    tmp = path.with_name(path.name + ".tmp")
    specs = {"keys": ((n_rows,), np.uint64), "rows": ((n_rows, width), np.float32), "last_seen": ((n_rows,), np.int32),
             **{name: (a.shape, a.dtype) for name, a in arrays.items()}}
    try:
        check_free_space(str(path.parent), sum(int(np.prod(sh)) * np.dtype(dt).itemsize for sh, dt in specs.values()))
        with h5py.File(tmp, "w", libver=("v110", "v110"), track_order=True) as f:
            f.attrs.update(attrs)
            f.create_group("dense", track_order=True)
            offsets = {name: create_early(f, name, sh, dt).id.get_offset() for name, (sh, dt) in specs.items()}
        with reserved(tmp, fsync=True) as fd:
            for name, a in arrays.items():
                if a.size:
                    pwrite_all(fd, a, offsets[name])
            stride = {name: np.dtype(dt).itemsize * int(np.prod(sh[1:])) for name, (sh, dt) in specs.items()}
            n = 0
            for keys, rows, last_seen in parts:
                for name, a in (("keys", keys), ("rows", rows), ("last_seen", last_seen)):
                    at = offsets[name] + n * stride[name]
                    pwrite_all(fd, a.astype(specs[name][1], copy=False), at)
                    # flushed and dropped behind: a checkpoint of a table larger than the job's
                    # memory leaves no dirty pages to a memory cgroup
                    diskio.write_behind(fd, str(tmp), at, a.shape[0] * stride[name])
                n += keys.shape[0]
            assert n == n_rows, f"{n} rows written, {n_rows} counted: the store changed during a checkpoint"
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, path)


class RowWriter:
    """Appends (keys, rows, last_seen) chunks to a rank file's row datasets."""

    def __init__(self, f: h5py.File, width: int) -> None:
        self._kds = f.create_dataset("keys", shape=(0,), maxshape=(None,), dtype=np.uint64,
                                     chunks=(1 << 16,), track_times=False)
        self._rds = f.create_dataset("rows", shape=(0, width), maxshape=(None, width), dtype=np.float32,
                                     chunks=(max(1, (1 << 20) // (4 * width)), width), track_times=False)
        self._sds = f.create_dataset("last_seen", shape=(0,), maxshape=(None,), dtype=np.int32,
                                     chunks=(1 << 16,), track_times=False)
        self.rows = 0

    def append(self, keys: np.ndarray, rows: np.ndarray, last_seen: np.ndarray) -> None:
        n, m = self.rows, self.rows + keys.shape[0]
        for ds in (self._kds, self._rds, self._sds):
            ds.resize(m, axis=0)
        self._kds[n:], self._rds[n:], self._sds[n:] = keys, rows, last_seen
        self.rows = m


def write_rows(f: h5py.File, parts, width: int) -> int:
    """Writes (keys, rows, last_seen) chunks as a rank file's rows; returns the row count."""
    w = RowWriter(f, width)
    for keys, rows, last_seen in parts:
        w.append(keys, rows, last_seen)
    return w.rows
