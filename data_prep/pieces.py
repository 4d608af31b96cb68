"""Intermediate pieces and the output shards.

Phase 1 (parse) does not know a row's global line index g: a unit does not know how many lines
the units before it hold. It knows the row's line index l inside its piece (a piece: at most
``piece_lines`` consecutive lines of one unit), and g = o + l, where the piece's offset o
becomes known when every unit has reported its line count. So a piece stores its rows grouped
by l mod S (stable, so in line order inside a group): the rows of group r all go to shard
(o + r) mod S, which is the rule ``shard = g mod S``. Phase 2 (assemble) builds each output
shard from one contiguous slice of every piece, in piece order, i.e. in global line order.

Split: the last round(F * L) of all L data lines (g >= cutoff) are validation rows: a temporal
hold-out, as Criteo's logs are in time order. Inside a group the training rows come first.

Multi-valued fields (format version 2): a row holds a variable number of keys. A piece keeps
``lengths`` [rows, 26] and flat ``keys`` in the same group order (each row's keys moved with it)
and the group offsets into the keys (``kgoff``) beside the row offsets (``goff``); a shard keeps
``lengths``, ``offsets`` [rows + 1] and flat ``keys`` (hvctr.formats).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field

import h5py
import numpy as np

from hvctr import formats
from hvctr.formats.lines import Block
from hvctr.formats import NUM_DENSE, NUM_FIELDS, KeySketch
from hvctr.formats.space import check_free_space, remedy


WRITE_ROWS = 1 << 15  # rows a shard writer gathers before one write to its file


def piece_path(work_dir: str, unit: int, k: int) -> str:
    return os.path.join(work_dir, f"u{unit:07d}-p{k:04d}.h5")


def key_index(row_keys: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Where the keys of ``rows`` (in that order) lie in flat keys whose row r holds
    ``row_keys[r]`` keys: each row's range, concatenated (no loop per row)."""
    starts = np.zeros(len(row_keys) + 1, dtype=np.int64)
    np.cumsum(row_keys, out=starts[1:])
    n = row_keys[rows]
    out = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum(n, out=out[1:])
    return np.repeat(starts[rows] - out[:-1], n) + np.arange(out[-1], dtype=np.int64)


@dataclass
class PieceBuilder:
    """Rows of one piece as blocks arrive; ``write`` groups them by line mod S. ``multi``: the
    blocks hold multi-valued fields (lengths and flat keys)."""
    shards: int
    multi: bool = False
    lines: int = 0
    parts: list[Block] = field(default_factory=list)
    bad: list[tuple[int, str]] = field(default_factory=list)

    def add(self, blk: Block) -> None:
        blk.lines += self.lines  # block-local -> piece-local line index
        self.bad += [(self.lines + i, why) for i, why in blk.bad]
        self.parts.append(blk)
        self.lines += blk.num_lines

    def write(self, path: str) -> dict:
        labels = _cat([b.labels for b in self.parts], np.float32, (0,))
        dense = _cat([b.dense for b in self.parts], np.float32, (0, NUM_DENSE))
        keys = _cat([b.keys for b in self.parts], np.uint64, (0,) if self.multi else (0, NUM_FIELDS))
        lines = _cat([b.lines for b in self.parts], np.int64, (0,))
        group = lines % self.shards
        order = np.argsort(group.astype(np.uint16 if self.shards <= 1 << 16 else np.int64), kind="stable")
        goff = np.zeros(self.shards + 1, dtype=np.int64)
        np.cumsum(np.bincount(group, minlength=self.shards), out=goff[1:])
        datasets = {"labels": labels[order], "dense": dense[order]}
        attrs = {"goff": goff}
        if self.multi:  # each row's keys move with it; kgoff: where each group's keys start
            lengths = _cat([b.lengths for b in self.parts], np.uint16, (0, NUM_FIELDS))
            row_keys = lengths.sum(axis=1, dtype=np.int64)
            datasets["lengths"] = lengths[order]
            datasets["keys"] = keys[key_index(row_keys, order)]
            kgoff = np.zeros(self.shards + 1, dtype=np.int64)
            np.cumsum(np.bincount(group, weights=row_keys, minlength=self.shards).astype(np.int64), out=kgoff[1:])
            attrs["kgoff"] = kgoff
        else:
            datasets["keys"] = keys[order]
        tmp = path + ".tmp"
        try:  # the space first: HDF5 cannot always close a file whose write failed for lack of it
            check_free_space(os.path.dirname(path) or ".", sum(a.nbytes for a in datasets.values()) + FILE_OVERHEAD)
            with h5py.File(tmp, "w", libver=formats.HDF5_LIBVER) as f:
                for name, arr in datasets.items():
                    f.create_dataset(name, data=arr, track_times=False)
                f.attrs.update(attrs)
            os.replace(tmp, path)
            nbytes = os.stat(path).st_size  # recorded: a resume redoes a piece of another size (piece_problem)
        except OSError as e:
            if os.path.exists(tmp):
                os.remove(tmp)
            raise write_error(path, e) from None
        missing = np.sum([b.missing for b in self.parts], axis=0) if self.parts else np.zeros(NUM_DENSE + NUM_FIELDS)
        rec = {"lines": self.lines, "rows": int(labels.size), "positives": int(labels.sum()), "bytes": nbytes,
               "missing": [int(x) for x in missing], "bad": [[int(i), why] for i, why in self.bad]}
        if self.multi:
            rec["keys"] = int(datasets["keys"].size)
        return rec


def piece_problem(path: str, rec: dict, shards: int) -> str:
    """What is wrong with the piece file ``path`` against its manifest record ``rec`` ("" when
    nothing): missing, another size than recorded (a record from before sizes were recorded is
    not compared on size), unreadable as HDF5, or datasets and group offsets that do not hold
    the record's rows (and keys: a piece of multi-valued fields records them). Reads the file's
    metadata only, not its rows."""
    try:
        size = os.stat(path).st_size
    except FileNotFoundError:
        return "its file is missing"
    except OSError as e:
        return f"it cannot be read ({e.strerror or e})"
    if "bytes" in rec and size != rec["bytes"]:
        return f"it is {size:,} bytes, {rec['bytes']:,} when it was written (truncated or overwritten)"
    rows = rec["rows"]
    want = {"labels": (rows,), "dense": (rows, NUM_DENSE), "keys": (rows, NUM_FIELDS)}
    if "keys" in rec:
        want.update(lengths=(rows, NUM_FIELDS), keys=(rec["keys"],))
    try:
        with h5py.File(path, "r") as f:
            shapes = {name: f[name].shape for name in want}
            goff = np.asarray(f.attrs["goff"])
            kgoff = np.asarray(f.attrs["kgoff"]) if "keys" in rec else None
    except (OSError, KeyError) as e:
        return f"it is not a readable piece ({e})"
    if shapes != want or goff.shape != (shards + 1,) or int(goff[-1]) != rows:
        return f"its datasets do not hold the {rows:,} rows recorded"
    if kgoff is not None and (kgoff.shape != (shards + 1,) or int(kgoff[-1]) != rec["keys"]):
        return f"its datasets do not hold the {rec['keys']:,} keys recorded"
    return ""


FILE_OVERHEAD = 1 << 20  # HDF5 headers and alignment, generously
ROW_BYTES = 4 + 4 * NUM_DENSE + 8 * NUM_FIELDS  # label, dense, keys: one row of a piece or a shard
# version 2: label, dense, lengths, offset of a row; its keys are 8 bytes each on top
MULTI_ROW_BYTES = 4 + 4 * NUM_DENSE + 2 * NUM_FIELDS + 8
KEY_BYTES = 8


def write_error(path: str, e: OSError) -> ValueError:
    """A write that failed (a full disk) as one message naming the file; nothing of it is left."""
    out = os.path.dirname(os.path.dirname(path)) if "_work" in path else os.path.dirname(path)
    return ValueError(f"cannot write {path}: {e.strerror or e}; nothing of it was kept: {remedy(e, out)}, "
                      f"then run the same data_prep command again (it continues where it stopped)")


def _cat(arrays: list[np.ndarray], dtype, empty_shape) -> np.ndarray:
    return np.concatenate(arrays) if arrays else np.zeros(empty_shape, dtype=dtype)


def piece_shard_counts(offset: int, lines: int, bad: np.ndarray, shards: int,
                       cutoff: int) -> tuple[np.ndarray, np.ndarray]:
    """Training and validation rows that a piece gives to each shard (arrays of length S).

    Lines l in [0, lines) have g = offset + l, shard g mod S; valid when g >= cutoff; the
    piece-local indices in ``bad`` were rejected and count nowhere."""
    c = int(np.clip(cutoff - offset, 0, lines))
    train = _residue_counts(offset, 0, c, shards)
    valid = _residue_counts(offset, c, lines, shards)
    if bad.size:
        s = (offset + bad) % shards
        is_valid = bad >= c
        train -= np.bincount(s[~is_valid], minlength=shards)
        valid -= np.bincount(s[is_valid], minlength=shards)
    return train, valid


def _residue_counts(offset: int, lo: int, hi: int, shards: int) -> np.ndarray:
    """For each s: how many l in [lo, hi) have (offset + l) mod S == s."""
    s = np.arange(shards, dtype=np.int64)
    first = lo + (s - (offset + lo)) % shards
    return np.maximum(0, (hi - first + shards - 1) // shards)


class ShardWriter:
    """One output shard of known size, written front to back; checksums as it goes.

    ``keys``: None for version 1 (26 keys a row); the shard's total keys for version 2 (rows
    of multi-valued fields: ``write`` then takes flat keys and each row's ``lengths``)."""

    def __init__(self, path: str, rows: int, split: str, shard: int, shards: int, keys: int | None = None) -> None:
        self.path, self.rows, self.split, self.shard = path, rows, split, shard
        self.keys = keys
        self.tmp = path + ".tmp"
        self.file = h5py.File(self.tmp, "w", libver=formats.HDF5_LIBVER)
        f = self.file
        if keys is None:
            self.dsets = {
                "labels": f.create_dataset("labels", (rows,), np.float32, track_times=False),
                "dense": f.create_dataset("dense", (rows, NUM_DENSE), np.float32, track_times=False),
                "keys": f.create_dataset("keys", (rows, NUM_FIELDS), np.uint64, track_times=False),
            }
        else:
            self.dsets = {
                "labels": f.create_dataset("labels", (rows,), np.float32, track_times=False),
                "dense": f.create_dataset("dense", (rows, NUM_DENSE), np.float32, track_times=False),
                "lengths": f.create_dataset("lengths", (rows, NUM_FIELDS), np.uint16, track_times=False),
                "offsets": f.create_dataset("offsets", (rows + 1,), np.int64, track_times=False),
                "keys": f.create_dataset("keys", (keys,), np.uint64, track_times=False),
            }
        version = formats.FORMAT_VERSION if keys is None else formats.MULTI_VALUED_VERSION
        f.attrs.update({"format": formats.FORMAT, "format_version": version,
                        "split": split, "shard": shard, "num_shards": shards, "rows": rows})
        self.hash = {name: hashlib.sha256() for name in (formats.DATASETS if keys is None
                                                          else formats.MULTI_VALUED_DATASETS)}
        self.sketch = KeySketch()
        self.pos = 0
        self.key_pos = 0
        self.positives = 0
        self.pending: list[tuple[np.ndarray, ...]] = []
        self.pending_rows = 0
        if keys is not None:  # offsets[0]; each flush writes the offsets of its rows' ends
            first = np.zeros(1, dtype=np.int64)
            self.dsets["offsets"][0:1] = first
            self.hash["offsets"].update(first)

    def write(self, labels: np.ndarray, dense: np.ndarray, keys: np.ndarray, lengths: np.ndarray | None = None) -> None:
        """Appends rows; they reach the file in slices of at least WRITE_ROWS (a slice of a
        piece is often small, and each h5py call costs about as much as 10k rows' copy)."""
        if len(labels):
            self.pending.append((labels, dense, keys) if lengths is None else (labels, dense, keys, lengths))
            self.pending_rows += len(labels)
        if self.pending_rows >= WRITE_ROWS:
            self._flush()

    def _flush(self) -> None:
        if not self.pending:
            return
        arrays = [np.concatenate(a) for a in zip(*self.pending)]
        self.pending, self.pending_rows = [], 0
        labels, dense, keys = arrays[:3]
        end = self.pos + len(labels)
        assert end <= self.rows, f"{self.path}: more rows than planned"
        if self.keys is None:
            for name, arr in (("labels", labels), ("dense", dense), ("keys", keys)):
                self.dsets[name][self.pos:end] = arr
                self.hash[name].update(arr)
            self.sketch.update(keys)
        else:
            lengths = arrays[3]
            key_end = self.key_pos + len(keys)
            assert key_end <= self.keys, f"{self.path}: more keys than planned"
            offsets = self.key_pos + np.cumsum(lengths.sum(axis=1, dtype=np.int64))
            for name, arr, a, b in (("labels", labels, self.pos, end), ("dense", dense, self.pos, end),
                                    ("lengths", lengths, self.pos, end), ("offsets", offsets, self.pos + 1, end + 1),
                                    ("keys", keys, self.key_pos, key_end)):
                self.dsets[name][a:b] = arr
                self.hash[name].update(arr)
            fields = np.tile(np.arange(NUM_FIELDS, dtype=np.int64), len(labels))
            self.sketch.update_fields(keys, np.repeat(fields, lengths.ravel()))
            self.key_pos = key_end
        self.positives += int(labels.sum())
        self.pos = end

    def close(self) -> dict:
        """Completes the file (renamed into place) and returns its manifest record."""
        self._flush()
        assert self.pos == self.rows, f"{self.path}: {self.pos} rows written of {self.rows}"
        assert self.keys is None or self.key_pos == self.keys, f"{self.path}: {self.key_pos} keys of {self.keys}"
        self.file.create_dataset("key_sketch", data=self.sketch.registers, track_times=False)
        self.hash["key_sketch"].update(self.sketch.registers)
        self.file.close()
        os.replace(self.tmp, self.path)
        rec = {"split": self.split, "shard": self.shard, "file": os.path.basename(self.path),
               "rows": self.rows, "positives": self.positives}
        if self.keys is not None:
            rec["keys"] = self.keys
        rec["checksums"] = {k: "sha256:" + h.hexdigest() for k, h in self.hash.items()}
        return rec

    def abandon(self) -> None:
        self.file.close()
        if os.path.exists(self.tmp):
            os.remove(self.tmp)
