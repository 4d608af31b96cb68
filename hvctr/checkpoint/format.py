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
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from hvctr.formats import NUM_BUCKETS, default_bucket_owner
from hvctr.log import get_logger
from hvctr.kernels import diskio, native
from hvctr.formats import safefile
from hvctr.formats.h5alloc import create_early, pwrite_all
from hvctr.formats.fields import Exact, OneOf, Opt, field_problem
from hvctr.formats.space import check_free_space
from hvctr.formats.textfile import read_text

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
        manifest = json.loads(read_text(path, "manifest"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not JSON ({e}): damaged or half-written") from None
    want = manifest.get(MANIFEST_CHECKSUM) if isinstance(manifest, dict) else None
    if not isinstance(manifest, dict) or (want is not None and want != _manifest_digest(manifest)):
        raise ValueError(f"{path} does not match its own checksum: damaged")
    return manifest


# What the loaders of a checkpoint use of its manifest (resume and --init-from, export, reshard),
# checked before any of it is (manifest_problem): a resealed manifest with a key missing or of
# another type is damaged, as one that fails its checksum.
MANIFEST_FIELDS = {
    "format_version": int, "seq": int, "kind": OneOf(("base", "delta")), "base_seq": int, "chain": [int],
    "world_size": int, "files": [dict],
    "state": Exact({name: int for name in ("epoch", "batch", "window", "step", "samples")}),
    "kernels": Opt(str), "mode": Opt(str), "train_dir": Opt(str), "init_from": Opt(dict),
    "resharded_from": Opt(dict), "batch_size_per_rank": Opt(int),
}


def manifest_problem(directory: str | Path, manifest: dict[str, Any]) -> str:
    """'' when ``manifest`` (of a checkpoint under ``directory``) holds every key its loaders
    use, of its type (MANIFEST_FIELDS); else what is wrong, naming the file and the key."""
    problem = field_problem(manifest, MANIFEST_FIELDS)
    if not problem:
        return ""
    where = checkpoint_path(directory, manifest["seq"]) / "manifest.json" if type(manifest.get("seq")) is int \
        else Path(directory)
    return f"{where}: {problem}: damaged or not written by hvctr"


def read_manifests(directory: str | Path) -> list[dict[str, Any]]:
    """Manifests of the complete checkpoints under ``directory``, newest first; a damaged one
    is left out with a warning (its checkpoint is then incomplete)."""
    out = []
    for path in Path(directory).glob(f"{_PREFIX}*/manifest.json"):
        try:
            manifest = read_manifest(path)
            problem = plain_file(Path(directory), f"{path.parent.name}/{path.name}")
            seq = manifest.get("seq")
            if not problem and (not path.parent.name[len(_PREFIX):].isdigit() or type(seq) is not int
                                or seq != _seq_of(path.parent)):
                problem = f"its seq {seq!r} is not the number of its directory {path.parent.name}"
            if problem:
                raise ValueError(problem)
            out.append(manifest)
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
    """The bucket table a checkpoint was written under (files before it existed: the default);
    a ValueError naming the file when it is not one of the checkpoint's world size."""
    path = rank_file_path(directory, manifest["seq"], rank)
    with h5py.File(path, "r") as f:
        if "bucket_owner" in f:
            return check_bucket_owner(_small_dataset(f, "bucket_owner"), manifest["world_size"], path)
    return default_bucket_owner(manifest["world_size"])


def check_bucket_owner(table: np.ndarray, world_size: int, where: str | Path) -> np.ndarray:
    """``table`` as int32 when it is a bucket table of ``world_size`` ranks (NUM_BUCKETS owners,
    each in 0..world_size-1), else a ValueError naming ``where``."""
    table = np.asarray(table)
    if table.shape != (NUM_BUCKETS,) or not np.issubdtype(table.dtype, np.integer):
        raise ValueError(f"{where}: bucket table of shape {table.shape} ({table.dtype}), expected {NUM_BUCKETS} "
                         f"integers: damaged or not written by hvctr")
    bad = np.flatnonzero((table < 0) | (table >= world_size))
    if bad.size:
        raise ValueError(f"{where}: bucket table names rank {int(table[bad[0]])} (bucket {int(bad[0])}), the "
                         f"checkpoint has {world_size} ranks (0..{world_size - 1}): damaged or crafted")
    return table.astype(np.int32)


def plain_file(root: Path, name: Any) -> str:
    """'' when ``name`` (a manifest's entry) is a relative path inside ``root`` (no '..', not
    absolute), none of whose parts is a link, naming a regular file; else what it is."""
    parts = Path(name).parts if isinstance(name, str) and name else ()
    if not parts or Path(name).is_absolute() or any(p in ("..", ".") for p in parts):
        return f"{name!r} is not a path inside {root}"
    path = root
    for part in parts:
        path = path / part
        try:
            mode = os.lstat(path).st_mode
        except FileNotFoundError:
            return f"{path} is missing"
        if stat.S_ISLNK(mode):
            return f"{path} is a link: a checkpoint's or an export's files are plain files inside it"
    return "" if stat.S_ISREG(mode) else f"{path} is not a regular file"


def check_datasets(f: h5py.File) -> str:
    """'' when every dataset of an open HDF5 file is stored in it, in full: its declared shape
    then fits the file, so reading it allocates no more than the file's size. Else what is
    wrong: a dataset stored elsewhere (external, virtual), or declaring more than it stores
    (chunks never written, compression): nothing of it has been read."""
    problems: list[str] = []
    total = 0

    def visit(name: str, obj: Any) -> None:
        nonlocal total
        if not isinstance(obj, h5py.Dataset) or problems:
            return
        nbytes = int(np.prod((0,) if obj.shape is None else obj.shape, dtype=object)) * obj.dtype.itemsize
        if obj.is_virtual or obj.external:
            problems.append(f"dataset {name!r} is stored in other files")
        elif obj.id.get_storage_size() < nbytes:
            problems.append(f"dataset {name!r} declares shape {obj.shape} ({nbytes:,} bytes) but stores "
                            f"{obj.id.get_storage_size():,} bytes")
        total += nbytes

    f.visititems(visit)
    size = os.path.getsize(f.filename)
    if not problems and total > size:
        problems.append(f"its datasets declare {total:,} bytes, the file has {size:,}")
    return f"{f.filename}: {problems[0]}: damaged or crafted" if problems else ""


def _small_dataset(f: h5py.File, name: str) -> np.ndarray:
    """A small dataset (the bucket table, ...) read after its declared size is checked."""
    ds = f[name]
    if not isinstance(ds, h5py.Dataset) or ds.size > 1 << 24 or ds.id.get_storage_size() < ds.nbytes:
        raise ValueError(f"{f.filename}: dataset {name!r} is not what hvctr writes: damaged or crafted")
    return ds[...]


def check_rank_file(directory: str | Path, manifest: dict[str, Any], rank: int, verify: bool = True,
                    width: int | None = None) -> tuple[str, int, np.ndarray | None]:
    """Checks rank ``rank``'s file of checkpoint ``manifest`` before anything of it is loaded:
    listed in the manifest under the name the readers open, a plain file inside the checkpoint
    directory, of the listed size and sha256 (``verify``), written for this rank and world size,
    rows of ``width`` columns (when given) that the file holds in full, a valid bucket table.
    Returns (problem or '', its row width, its bucket table or None when it has none)."""
    problem = manifest_problem(directory, manifest)
    if problem:
        return problem, 0, None
    seq, ws = manifest.get("seq"), manifest.get("world_size")
    if type(ws) is not int or ws < 1:
        return f"checkpoint {seq}: world_size {ws!r} is not a number of ranks", 0, None
    name = _rank_file(rank)
    files = manifest.get("files")
    recs = [r for r in files if isinstance(r, dict)] if isinstance(files, list) else []
    where = checkpoint_path(directory, seq) / name
    listed = recs[rank] if len(recs) == ws and isinstance(files, list) and len(files) == ws else None
    if listed is None or listed.get("file") != name:
        return (f"{where} is not listed in its manifest (the manifest lists "
                f"{[r.get('file') for r in recs][:8] if recs else 'no files'} for {ws} ranks)"), 0, None
    problem = plain_file(Path(directory), f"{checkpoint_path('', seq)}/{name}")
    if problem:
        return problem, 0, None
    if verify and (where.stat().st_size != listed.get("bytes") or file_sha256(where) != listed.get("sha256")):
        return f"{where} does not match its checksum in the manifest (truncated or corrupted)", 0, None
    try:
        with h5py.File(where, "r") as f:
            a = f.attrs
            for key, want in (("world_size", ws), ("rank", rank), ("seq", seq)):
                if key in a and int(a[key]) != want:
                    return (f"{where}: written with {key} {int(a[key])}, its manifest says {want} (world size "
                            f"{ws}): damaged or crafted"), 0, None
            problem = check_datasets(f)
            if problem:
                return problem, 0, None
            shapes = {k: f[k].shape for k in ("keys", "rows", "last_seen") if k in f}
            if "keys" not in shapes or "rows" not in shapes:
                return f"{where}: no keys or rows dataset", 0, None
            n = shapes["keys"][0] if len(shapes["keys"]) == 1 else -1
            if n < 0 or len(shapes["rows"]) != 2 or shapes["rows"][0] != n or shapes.get("last_seen", (n,)) != (n,) \
                    or (isinstance(listed.get("rows"), int) and listed["rows"] != n):
                return (f"{where}: datasets of shapes {shapes} (the manifest lists {listed.get('rows')} rows): "
                        f"damaged or crafted"), 0, None
            if width is not None and shapes["rows"][1] != width:
                return f"{where}: rows of width {shapes['rows'][1]}, the chain's are {width}", 0, None
            owner = check_bucket_owner(_small_dataset(f, "bucket_owner"), ws, where) if "bucket_owner" in f else None
    except (OSError, ValueError) as e:
        return f"{where}: {e}" if str(where) not in str(e) else str(e), 0, None
    return "", shapes["rows"][1], owner


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
    """A fresh temporary file, then renamed (hvctr.formats.safefile): never through a link."""
    safefile.write_text(path, json.dumps(obj, indent=1, sort_keys=True))


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
    f = ReservedRankFile(path, attrs, n_rows, width, {name: (a.shape, a.dtype) for name, a in arrays.items()})
    try:
        for name, a in arrays.items():
            f.put(name, a)
        for keys, rows, last_seen in parts:
            f.append(keys, rows, last_seen)
        f.commit()
    except BaseException:
        f.discard()
        raise


def rank_file_bytes(n_rows: int, width: int, arrays: dict[str, tuple[Any, Any]]) -> int:
    """The bytes of data in a rank file of ``n_rows`` rows and ``arrays`` ({name: (shape, dtype)})."""
    specs = {"keys": ((n_rows,), np.uint64), "rows": ((n_rows, width), np.float32),
             "last_seen": ((n_rows,), np.int32), **arrays}
    return sum(int(np.prod(sh)) * np.dtype(dt).itemsize for sh, dt in specs.values())


class ReservedRankFile:
    """One rank file being written (write_reserved; hvctr reshard keeps several open at once).

    Created under a fresh temporary name beside ``path`` (exclusively: never through a planted
    link, hvctr.formats.safefile), its skeleton by HDF5, every block reserved (posix_fallocate),
    then filled by ``put`` (a named array) and ``append`` (row chunks, ``n_rows`` in all) through
    pwrite; ``commit`` renames it to ``path``, ``discard`` removes it. A full disk is an OSError
    here, in the free-space check or posix_fallocate, never inside HDF5."""

    def __init__(self, path: Path, attrs: dict[str, Any], n_rows: int, width: int,
                 arrays: dict[str, tuple[Any, Any]]) -> None:
        self.path, self.n_rows, self.rows = Path(path), n_rows, 0
        self.tmp = safefile.temp_name(self.path)
        self._fd: int | None = None
        self.specs = {"keys": ((n_rows,), np.uint64), "rows": ((n_rows, width), np.float32),
                      "last_seen": ((n_rows,), np.int32),
                      **{name: (tuple(sh), np.dtype(dt)) for name, (sh, dt) in arrays.items()}}
        self.stride = {name: np.dtype(dt).itemsize * int(np.prod(sh[1:])) for name, (sh, dt) in self.specs.items()}
        try:
            check_free_space(str(self.path.parent), rank_file_bytes(n_rows, width, arrays))
            with h5py.File(self.tmp, "x", libver=("v110", "v110"), track_order=True) as f:
                f.attrs.update(attrs)
                f.create_group("dense", track_order=True)
                self.offsets = {name: create_early(f, name, sh, dt).id.get_offset()
                                for name, (sh, dt) in self.specs.items()}
            self._fd = os.open(self.tmp, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
            os.posix_fallocate(self._fd, 0, os.fstat(self._fd).st_size)
        except BaseException:
            self.discard()
            raise

    def put(self, name: str, a: np.ndarray) -> None:
        """The whole array ``name`` (one of the ``arrays`` it was made with)."""
        if a.size:
            pwrite_all(self._fd, np.asarray(a, dtype=self.specs[name][1]), self.offsets[name])

    def append(self, keys: np.ndarray, rows: np.ndarray, last_seen: np.ndarray) -> None:
        """The next chunk of rows."""
        n = keys.shape[0]
        if self.rows + n > self.n_rows:
            raise AssertionError(f"{self.path}: more than the {self.n_rows} rows counted: the source changed")
        for name, a in (("keys", keys), ("rows", rows), ("last_seen", last_seen)):
            at = self.offsets[name] + self.rows * self.stride[name]
            pwrite_all(self._fd, a.astype(self.specs[name][1], copy=False), at)
            # flushed and dropped behind: a checkpoint of a table larger than the job's
            # memory leaves no dirty pages to a memory cgroup
            diskio.write_behind(self._fd, str(self.tmp), at, n * self.stride[name])
        self.rows += n

    def commit(self) -> None:
        """Synced, closed and renamed to its path."""
        assert self.rows == self.n_rows, f"{self.rows} rows written, {self.n_rows} counted: the store changed during a checkpoint"
        os.fsync(self._fd)
        os.close(self._fd)
        self._fd = None
        os.replace(self.tmp, self.path)

    def discard(self) -> None:
        """Closed and removed (nothing of it is left); a no-op once committed or discarded."""
        if self._fd is not None:
            try:
                os.close(self._fd)
            except OSError:
                pass
            self._fd = None
        safefile.remove_quietly(self.tmp)


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
