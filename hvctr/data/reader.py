"""Training data: fixed-size batches from the HDF5 shards that ``python -m data_prep`` writes.

A data directory holds ``manifest.json`` and, per split ("train", "valid"), S shard files
``<split>-<s:05d>.h5`` with ``labels`` float32 [N], ``dense`` float32 [N, 13], ``keys`` uint64
[N, 26]; data with multi-valued fields (format version 2) holds ``lengths`` uint16 [N, 26],
``offsets`` int64 [N + 1] and flat ``keys``, and its batches' keys are hvctr.data.bags.Bags. Rank r of W reads the shards s with s % W == r, in shard order, as one stream of rows
cut into batches of ``batch_size``; the last partial batch is not trained on.

    >>> reader = ShardReader("data/criteo", "train", rank=0, world_size=2, batch_size=4096)
    >>> steps = reader.num_batches                 # the trainer agrees on min over ranks
    >>> labels, dense, keys = reader.read_rows(0, 8 * 4096)   # a window of 8 batches
    >>> labels.shape, dense.shape, keys.shape      # (32768,) (32768, 13) (32768, 26)

Reads are large contiguous slices (``read_bytes`` at a time, across shard boundaries), never
per row; ``read_rows(lo, hi)`` reads any row range of the stream (a window, evaluation's short
last batch). ``verify=True`` checks every opened shard
against the manifest's sha256 checksums first; ``reader.verify(skip=stamp)`` leaves out the
shards a verification stamp vouches for (``read_stamp``, ``write_stamp``: data.verify = stamp,
hvctr.train.feed). Problems (no manifest, an unfinished data_prep run, a
missing or corrupt shard, more ranks than shards) are a ValueError that names the path.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Iterator, Mapping, NamedTuple

import h5py
import numpy as np

from hvctr.formats import safefile
from hvctr.data.bags import Bags
from hvctr.data.manifest import load_manifest, manifest_digest
from hvctr.formats import MULTI_VALUED_VERSION, NUM_DENSE, NUM_FIELDS, SAMPLE_BYTES, SPLITS


class Batch(NamedTuple):
    labels: np.ndarray  # float32 [B]
    dense: np.ndarray  # float32 [B, 13]
    keys: np.ndarray | Bags  # uint64 [B, 26]; multi-valued data (format version 2): Bags of uint64 keys


def dataset_checksum(dset: h5py.Dataset, rows_per_read: int = 1 << 18) -> str:
    """sha256 of a dataset's contents in C order (what the manifest records), read in slices."""
    h = hashlib.sha256()
    for a in range(0, dset.shape[0], rows_per_read):
        h.update(np.ascontiguousarray(dset[a:a + rows_per_read]))
    return "sha256:" + h.hexdigest()


# --- verification stamps ----------------------------------------------------------------
#
# A full check hashes every dataset of a shard (the whole data set is read). Once it passed, a
# stamp records each shard file's size, mtime and inode with the digest of the manifest it was
# checked against; a later start (a requeue) re-hashes only files whose record differs (or all
# of them, when the manifest changed). Beside the manifest: STAMP_NAME; where the data
# directory is read-only, in the run directory (RUN_STAMP_NAME, naming the data directory).

STAMP_NAME = "manifest.verified.json"
RUN_STAMP_NAME = "data-verified.json"
_STAMP_FORMAT = "hvctr-data-verified"


def file_identity(path: str) -> dict[str, int]:
    """What a stamp records of a file: a change of any of these means check it again."""
    st = os.stat(path)
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ino": st.st_ino}


def _stamp_candidates(data_dir: str, run_dir: str | Path | None) -> list[Path]:
    out = [Path(data_dir) / STAMP_NAME]
    if run_dir is not None:
        out.append(Path(run_dir) / RUN_STAMP_NAME)
    return out


def read_stamp(data_dir: str, run_dir: str | Path | None = None) -> tuple[dict[str, dict[str, int]], str]:
    """({shard file name: identity when it last passed}, the stamp's path) for the current
    manifest; ({}, "") when there is none, it is unreadable or it belongs to another manifest."""
    try:
        digest = manifest_digest(data_dir)
    except OSError:
        return {}, ""
    where = str(Path(data_dir).resolve())
    for path in _stamp_candidates(data_dir, run_dir):
        try:
            stamp = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if (isinstance(stamp, dict) and stamp.get("format") == _STAMP_FORMAT
                and stamp.get("manifest") == digest and stamp.get("data_dir") in (where, None)
                and isinstance(stamp.get("files"), dict)):
            return stamp["files"], str(path)
    return {}, ""


def write_stamp(data_dir: str, files: Mapping[str, Mapping[str, int]], run_dir: str | Path | None = None
                ) -> tuple[str, str]:
    """Writes the stamp (a temporary file, then rename) beside the manifest, or where the data
    directory is read-only, in ``run_dir``. Returns (path written or "", a note or "")."""
    body = {"format": _STAMP_FORMAT, "manifest": manifest_digest(data_dir),
            "data_dir": str(Path(data_dir).resolve()), "files": {k: dict(v) for k, v in sorted(files.items())}}
    note = ""
    for path in _stamp_candidates(data_dir, run_dir):
        try:  # a fresh temporary file, then renamed: never through a planted link
            safefile.write_text(path, json.dumps(body, indent=1))
            return str(path), note
        except OSError as e:
            note = (f"cannot write the verification stamp {path} ({e.strerror or e}): "
                    + ("keeping it in the run directory" if run_dir is not None and path.parent != Path(run_dir)
                       else "the next start verifies in full again"))
    return "", note


class ShardReader:
    """One split of a data_prep directory, as this rank's stream of fixed-size batches."""

    def __init__(self, data_dir: str, split: str, rank: int, world_size: int, batch_size: int,
                 verify: bool = False, read_bytes: int = 32 << 20) -> None:
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.data_dir, self.split, self.rank, self.world_size = data_dir, split, rank, world_size
        self.batch_size = batch_size
        self.manifest = load_manifest(data_dir)
        # format version 2: some fields hold 0..n keys a row (Bags); version 1: one key a field
        self.multi_valued = self.manifest.get("format_version") == MULTI_VALUED_VERSION
        records = self.manifest["shards"][split]
        if world_size > len(records):
            raise ValueError(f"{data_dir}: {len(records)} shards per split, fewer than {world_size} ranks: "
                             f"rank {rank} would read nothing; rerun data_prep with --shards >= {world_size}")
        self.shards = list(range(rank, len(records), world_size))
        self.records = [records[s] for s in self.shards]
        self.paths = [os.path.join(data_dir, r["file"]) for r in self.records]
        self._files = [self._open(p, r) for p, r in zip(self.paths, self.records)]
        self.shard_rows = np.array([r["rows"] for r in self.records], dtype=np.int64)
        self._starts = np.concatenate([[0], np.cumsum(self.shard_rows)])
        self.rows_per_read = max(batch_size, (read_bytes // SAMPLE_BYTES) // batch_size * batch_size)
        if verify:
            self.verify()

    @property
    def rows(self) -> int:
        """Rows in this rank's shards."""
        return int(self._starts[-1])

    @property
    def num_batches(self) -> int:
        """Full batches in this rank's shards (the partial last one is not counted)."""
        return self.rows // self.batch_size

    def _open(self, path: str, record: dict) -> h5py.File:
        if not os.path.isfile(path):
            raise ValueError(f"{path}: shard file missing (listed in {self.data_dir}/manifest.json)")
        try:
            f = h5py.File(path, "r")
        except OSError as e:  # truncated, overwritten, not HDF5: h5py's message may omit the name
            raise ValueError(f"{path}: cannot open the shard as HDF5 ({e}); the file is damaged or truncated: "
                             f"run data_prep again for {self.data_dir}") from None
        shapes = {"labels": (record["rows"],), "dense": (record["rows"], NUM_DENSE),
                  "keys": (record["rows"], NUM_FIELDS)}
        if self.multi_valued:
            shapes.update(lengths=(record["rows"], NUM_FIELDS), offsets=(record["rows"] + 1,),
                          keys=(record.get("keys", -1),))
        for name, shape in shapes.items():
            if name not in f or f[name].shape != shape:
                f.close()
                raise ValueError(f"{path}: dataset {name!r} missing or not of shape {shape} as the manifest says")
        return f

    def verify(self, skip: Mapping[str, Mapping[str, int]] | None = None) -> tuple[dict[str, dict[str, int]], int]:
        """Checks every dataset of this rank's shards against the manifest's checksums, except
        the files whose identity (``file_identity``) equals their record in ``skip`` (a stamp).

        Returns ({file name: identity} of the files now known good, files hashed). A file
        that changed while it was hashed is checked but not recorded."""
        good: dict[str, dict[str, int]] = {}
        hashed = 0
        for path, f, rec in zip(self.paths, self._files, self.records):
            before = file_identity(path)
            if skip is not None and dict(skip.get(rec["file"], {})) == before:
                good[rec["file"]] = before
                continue
            hashed += 1
            self._verify_file(path, f, rec)
            if file_identity(path) == before:
                good[rec["file"]] = before
        return good, hashed

    @staticmethod
    def _verify_file(path: str, f: h5py.File, rec: dict) -> None:
        for name, want in rec["checksums"].items():
            try:
                got = dataset_checksum(f[name])
            except OSError as e:  # a damaged chunk or header: HDF5 cannot read it back
                raise ValueError(f"{path}: dataset {name!r} cannot be read ({e}): the file is damaged") from None
            if got != want:
                raise ValueError(f"{path}: dataset {name!r} does not match its checksum in "
                                 f"manifest.json ({got} != {want}): the file is corrupt or from another run")

    def _spans(self, lo: int, hi: int) -> Iterator[tuple[int, int, int, slice]]:
        """(shard index, first row, end row in that shard, destination slice) of each non-empty
        part of rows [lo, hi) of the stream: one per shard it crosses."""
        i = int(np.searchsorted(self._starts, lo, side="right")) - 1
        pos = lo
        while pos < hi:
            a = int(pos - self._starts[i])
            b = int(min(hi, self._starts[i + 1]) - self._starts[i])
            if b > a:
                yield i, a, b, np.s_[pos - lo:pos - lo + (b - a)]
            pos += b - a
            i += 1

    def read_rows(self, lo: int, hi: int) -> Batch:
        """Rows [lo, hi) of this rank's stream (labels, dense, keys): one slice read per dataset
        per shard it crosses. Multi-valued data: each shard's row offsets say which slice of its
        keys the rows hold, and the keys come back as Bags."""
        if not 0 <= lo <= hi <= self.rows:
            raise ValueError(f"row range [{lo}, {hi}) is outside [0, {self.rows}]")
        labels, dense = np.empty(hi - lo, np.float32), np.empty((hi - lo, NUM_DENSE), np.float32)
        fixed = {"labels": labels, "dense": dense}
        if self.multi_valued:
            fixed["lengths"] = np.empty((hi - lo, NUM_FIELDS), np.uint16)
        else:
            fixed["keys"] = np.empty((hi - lo, NUM_FIELDS), np.uint64)
        flat: list[np.ndarray] = []
        for i, a, b, dest in self._spans(lo, hi):
            f = self._files[i]
            for name, arr in fixed.items():
                f[name].read_direct(arr, source_sel=np.s_[a:b], dest_sel=dest)
            if self.multi_valued:
                ka, kb = (int(x) for x in f["offsets"][a:b + 1][[0, -1]])
                got = fixed["lengths"][dest].sum(dtype=np.int64)
                if kb - ka != got or not 0 <= ka <= kb <= f["keys"].shape[0]:
                    raise ValueError(f"{self.paths[i]}: rows [{a}, {b}) hold keys [{ka}, {kb}) by 'offsets', "
                                     f"{got} by 'lengths': the file is damaged or was not written by data_prep")
                flat.append(f["keys"][ka:kb])
        if not self.multi_valued:
            return Batch(labels, dense, fixed["keys"])
        return Batch(labels, dense, Bags(np.concatenate(flat) if flat else np.zeros(0, np.uint64), fixed["lengths"]))

    def close(self) -> None:
        for f in self._files:
            f.close()
        self._files = []

    def __enter__(self) -> "ShardReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
