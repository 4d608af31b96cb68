"""A complete checkpoint read without ranks: verification and each rank's final rows.

A checkpoint is a chain: a base (every row of a rank) and deltas (rows written since the
previous checkpoint). A key's value is its newest one along the chain. ``rows(rank)`` streams
the base in chunks, leaving out the keys a delta rewrote, then the deltas' rows (each key
once, its newest copy): memory holds the deltas' keys, never the base.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import h5py
import numpy as np

from hvctr.checkpoint.format import (_PREFIX, _seq_of, check_rank_file, checkpoint_path, locate, manifest_problem,
                                     rank_file_path, read_bucket_owner, read_manifests)
from hvctr.formats import default_bucket_owner
from hvctr.log import get_logger

log = get_logger(__name__)

CHUNK_ROWS = 1 << 18


def _last_occurrence(keys: np.ndarray) -> np.ndarray:
    """Indices of the last occurrence of each distinct key (ascending key order)."""
    _, first_in_reversed = np.unique(keys[::-1], return_index=True)
    return keys.shape[0] - 1 - first_in_reversed


class CheckpointReader:
    """The checkpoint ``path`` names (run directory, checkpoint directory: the newest complete
    one; or one ckpt-NNNNNN directory), its files verified against the manifest's checksums.

    Every file it opens is checked first (hvctr.checkpoint.format.check_rank_file): listed,
    a plain file inside the directory, its checksum, its world size, its datasets' shapes
    against its size; and the bucket tables agree. A newer checkpoint that fails is skipped
    with a warning naming it and why (export and reshard then use an older one)."""

    def __init__(self, path: str | Path, verify: bool = True) -> None:
        self.dir, seq = locate(path)
        manifests = read_manifests(self.dir)
        self.by_seq = {m["seq"]: m for m in manifests}
        candidates = [m for m in manifests if seq is None or m["seq"] == seq]
        problems = []
        for m in candidates:
            problem = self._check(m, verify)
            if not problem:
                self.manifest = m
                break
            problems.append(f"checkpoint {m['seq']}: {problem}")
        else:
            raise ValueError(f"{path}: no complete checkpoint" + (f" ({'; '.join(problems)})" if problems else ""))
        if seq is None:  # the newest asked for: say what was passed over on the way
            unfinished = sorted(_seq_of(p) for p in self.dir.glob(f"{_PREFIX}*") if p.name[len(_PREFIX):].isdigit()
                                and _seq_of(p) > self.seq and _seq_of(p) not in self.by_seq)
            problems += [f"checkpoint {s}: {checkpoint_path(self.dir, s)} has no readable manifest (not complete)"
                         for s in unfinished]
        for problem in problems:
            log.warning(f"{self.dir}: skipped {problem}; using checkpoint {self.seq}")

    def _check(self, m: dict[str, Any], verify: bool) -> str:
        problem = manifest_problem(self.dir, m)  # every key a reader uses, of its type
        if problem:
            return problem
        ws, chain = m.get("world_size"), m.get("chain")
        if type(ws) is not int or ws < 1:
            return f"world_size {ws!r} is not a number of ranks"
        if not (isinstance(chain, list) and chain and all(type(s) is int for s in chain) and chain[-1] == m["seq"]
                and all(a < b for a, b in zip(chain, chain[1:]))):
            return f"its chain {chain!r} is not a list of checkpoints ending in it"
        width, owner = None, None
        for seq in chain:
            member = self.by_seq.get(seq)
            if member is None:
                return f"checkpoint {seq} of its chain has no manifest"
            if member.get("world_size") != ws:
                return f"checkpoint {seq} of its chain was written by {member.get('world_size')!r} ranks, it by {ws}"
            for rank in range(ws):
                problem, width, table = check_rank_file(self.dir, member, rank, verify, width)
                if problem:
                    return problem
                table = default_bucket_owner(ws) if table is None else table
                if owner is None:
                    owner = table
                elif not np.array_equal(owner, table):
                    return (f"{rank_file_path(self.dir, seq, rank)}: its bucket table differs from rank 0's of "
                            f"checkpoint {chain[0]}: damaged or crafted")
        return ""

    @property
    def seq(self) -> int:
        return self.manifest["seq"]

    @property
    def world_size(self) -> int:
        return self.manifest["world_size"]

    @property
    def path(self) -> Path:
        return checkpoint_path(self.dir, self.seq)

    def rank_path(self, rank: int, seq: int | None = None) -> Path:
        return rank_file_path(self.dir, self.seq if seq is None else seq, rank)

    def bucket_owner(self) -> np.ndarray:
        return read_bucket_owner(self.dir, self.manifest, 0)

    def dense(self, rank: int) -> dict[str, np.ndarray]:
        with h5py.File(self.rank_path(rank), "r") as f:
            return {name: ds[...] for name, ds in f["dense"].items()}

    def admission(self, rank: int) -> np.ndarray | None:
        with h5py.File(self.rank_path(rank), "r") as f:
            return f["admission"][...] if "admission" in f else None

    def pass_index(self, rank: int) -> int:
        with h5py.File(self.rank_path(rank), "r") as f:
            return int(f.attrs.get("pass_index", 0))

    def width(self) -> int:
        with h5py.File(self.rank_path(0), "r") as f:
            return int(f["rows"].shape[1])

    def row_attrs(self) -> dict[str, str]:
        """What the rank files say of their rows (train.sparse_optimizer, the columns): a reshard
        copies it; a checkpoint from before row-wise optimisers says nothing (Adam's rows)."""
        with h5py.File(self.rank_path(0), "r") as f:
            return {name: str(f.attrs[name]) for name in ("sparse_optimizer", "row_columns") if name in f.attrs}

    def copies(self, rank: int, columns: slice = slice(None),
               chunk_rows: int = CHUNK_ROWS) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """(keys, rows[:, columns]) of every copy of ``rank``'s rows along the chain: the base's,
        then each delta's, each file in its order, ``chunk_rows`` at a time. A key rewritten by a
        delta comes again there: its newest copy is its last (hvctr.offline.keysort keeps it)."""
        for seq in self.manifest["chain"]:
            with h5py.File(self.rank_path(rank, seq), "r") as f:
                kds, rds = f["keys"], f["rows"]
                for start in range(0, kds.shape[0], chunk_rows):
                    yield kds[start:start + chunk_rows], rds[start:start + chunk_rows][:, columns]

    def copy_count(self, rank: int) -> int:
        """How many copies ``copies(rank)`` yields (the rows of every file of the chain)."""
        total = 0
        for seq in self.manifest["chain"]:
            with h5py.File(self.rank_path(rank, seq), "r") as f:
                total += int(f["keys"].shape[0])
        return total

    def rows(self, rank: int, chunk_rows: int = CHUNK_ROWS) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """(keys, rows, last_seen) of every row of ``rank``, each key once with its newest value."""
        base, *deltas = self.manifest["chain"]
        parts = [_read_all(self.rank_path(rank, seq)) for seq in deltas]
        if parts:
            keys = np.concatenate([p[0] for p in parts])
            newest = _last_occurrence(keys)
            d_keys, d_rows, d_seen = keys[newest], np.concatenate([p[1] for p in parts])[newest], \
                np.concatenate([p[2] for p in parts])[newest]
        else:
            d_keys = np.zeros(0, np.uint64)
        with h5py.File(self.rank_path(rank, base), "r") as f:
            kds, rds = f["keys"], f["rows"]
            sds = f["last_seen"] if "last_seen" in f else None
            for start in range(0, kds.shape[0], chunk_rows):
                keys = kds[start:start + chunk_rows]
                keep = ~np.isin(keys, d_keys, assume_unique=True) if d_keys.size else np.ones(keys.shape, bool)
                seen = sds[start:start + chunk_rows] if sds is not None else np.zeros(keys.shape, np.int32)
                if keep.any():
                    yield keys[keep], rds[start:start + chunk_rows][keep], seen[keep]
        for start in range(0, d_keys.shape[0], chunk_rows):
            stop = start + chunk_rows
            yield d_keys[start:stop], d_rows[start:stop], d_seen[start:stop]


def _read_all(path: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    with h5py.File(path, "r") as f:
        keys, rows = f["keys"][...], f["rows"][...]
        seen = f["last_seen"][...] if "last_seen" in f else np.zeros(keys.shape, np.int32)
    return keys, rows, seen
