"""``hvctr reshard --checkpoint C --world-size W2 --out DIR``: a checkpoint for another number of ranks.

    hvctr reshard --checkpoint runs/a --world-size 3 --out runs/b/checkpoints
    mpirun -np 3 ... hvctr train --config runs/a/config.toml --train.run_dir=runs/b --resume

A key's owner is ``bucket_owner[bucket(key)]`` over 4096 virtual buckets (hvctr.formats), so a
new world size needs a new bucket table, not a rehash of every key. The new table moves as
few buckets as it can: every rank ends with 4096 // W2 buckets (or one more), and a bucket
stays with its owner while that owner is below its share. Each new rank file then holds the
rows (with their optimiser state and TTL pass) of the buckets it owns, read rank by rank from
the source chain (base plus deltas, the newest value of each key): twice, a first pass counts
each new rank's rows, so every new file is written as the trainer's are (its space reserved
first, then filled by pwrite: a full disk is one error naming the file, and nothing is kept).

The result is one base checkpoint with the source's number: its manifest is written last,
so a half-written one is no checkpoint. Per new rank r:
- dense state (parameters, Adam moments and step): source rank r's, rank 0's for new ranks;
- admission counts: the element-wise maximum of the sketches of the source ranks whose
  buckets it receives (a count-min sketch over-counts, never under-counts: a key keeps at
  least its count);
- TTL pass clock: the source's; the bucket table: the new one, in every file.
Training state: the same epoch and window; the batch position within the epoch is scaled by
W / W2 (for a run that keeps its rows per rank), and ``resharded_from.epoch_rows`` records the
samples the epoch had trained (from the batch size the checkpoint records), which the resumed
run takes in its own batches (hvctr.train.feed.TrainData.resharded_position), a fixed global
batch included. Rank r of W2 reads the data shards s with s % W2 == r: the rest of that epoch
is not the rest of the same samples; docs/checkpoints.md says what it trains twice and leaves
out (hvctr.data.layout counts it), and a reshard at an epoch boundary is exact.
"""

from __future__ import annotations

import argparse
import contextlib
import os
from pathlib import Path
from typing import Any

import numpy as np

from hvctr.checkpoint.format import (FORMAT_VERSION, ReservedRankFile, _rank_file, checkpoint_path, file_sha256,
                                    rank_file_bytes, read_manifests, write_manifest)
from hvctr.formats import safefile
from hvctr.formats.space import check_free_space, remedy
from hvctr.formats import NUM_BUCKETS, owner_of
from hvctr.offline.reader import CheckpointReader


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", required=True,
                   help="a run directory, a checkpoint directory (its newest complete checkpoint) or one ckpt-NNNNNN")
    p.add_argument("--world-size", type=int, required=True, help="the number of ranks to resume on")
    p.add_argument("--out", required=True,
                   help="checkpoint directory to write (e.g. NEW_RUN/checkpoints); must hold no checkpoint")


def run(args: argparse.Namespace, overrides: list[str]) -> int:
    if overrides:
        raise ValueError(f"hvctr reshard takes no config overrides, got {overrides}")
    m = reshard(args.checkpoint, args.world_size, args.out)
    r = m["resharded_from"]
    print(f"hvctr reshard: checkpoint {m['seq']} from {r['world_size']} to {m['world_size']} ranks -> {args.out}: "
          f"{r['buckets_moved']} of {NUM_BUCKETS} buckets and {r['rows_moved']:,} of {r['rows']:,} rows moved")
    return 0


def plan_buckets(old: np.ndarray, world_size: int) -> np.ndarray:
    """A bucket table for ``world_size`` ranks that moves the fewest buckets from ``old``."""
    if not 1 <= world_size <= NUM_BUCKETS:
        raise ValueError(f"--world-size must be in 1..{NUM_BUCKETS}, got {world_size}")
    share = np.full(world_size, NUM_BUCKETS // world_size)
    share[: NUM_BUCKETS % world_size] += 1
    new = np.full(NUM_BUCKETS, -1, dtype=np.int64)
    for rank in range(min(int(old.max()) + 1, world_size)):  # one step per rank, not per bucket
        new[np.flatnonzero(old == rank)[: share[rank]]] = rank
    room = share - np.bincount(new[new >= 0], minlength=world_size)
    new[new < 0] = np.repeat(np.arange(world_size), room)  # the rest, in bucket order, to ranks with room
    return new.astype(np.int32)


def reshard(source: str | Path, world_size: int, out: str | Path) -> dict[str, Any]:
    """Writes the resharded checkpoint under ``out``; returns its manifest."""
    reader = CheckpointReader(source)
    out = Path(out)
    if out.is_dir() and read_manifests(out):
        raise ValueError(f"--out {out} already holds checkpoints: choose an empty directory")
    old = reader.bucket_owner()
    new = plan_buckets(old, world_size)
    width = reader.width()
    counts = _count_rows(reader, new, world_size)  # a first pass: each file's space is reserved up front
    states = [_rank_state(reader, r, world_size, old, new) for r in range(world_size)]
    ckdir = checkpoint_path(out, reader.seq)
    # --out may be a link to a directory (a larger disk); the checkpoint's own directory, which
    # hvctr makes, may not: a link planted there is refused (safefile.check_dir)
    made = ([] if os.path.isdir(out) else [out]) + ([] if safefile.check_dir(ckdir) else [ckdir])
    safefile.make_dir(ckdir)
    files: list[ReservedRankFile] = []
    committed: list[Path] = []
    current = ckdir
    try:
        # every new rank file is written as the trainer's are (space reserved, then pwrite):
        # a full disk is one error naming the file, before any row is written
        check_free_space(str(ckdir), sum(rank_file_bytes(int(counts[r]), width, specs)
                                         for r, (_, specs, _) in enumerate(states)))
        for r, (attrs, specs, arrays) in enumerate(states):
            current = ckdir / _rank_file(r)
            files.append(ReservedRankFile(current, attrs, int(counts[r]), width, specs))
            for name, a in arrays.items():
                files[-1].put(name, a)
        current = ckdir
        rows, moved = _move_rows(reader, new, files)
        records = []
        for f in files:
            current = f.path
            f.commit()
            committed.append(f.path)
            records.append({"file": f.path.name, "sha256": file_sha256(f.path), "bytes": f.path.stat().st_size,
                            "rows": f.rows})
        manifest = _manifest(reader, world_size, records, {
            "checkpoint": str(reader.path.resolve()), "seq": reader.seq, "world_size": reader.world_size,
            "buckets_moved": int(np.count_nonzero(old != new)), "rows": rows, "rows_moved": moved})
        current = ckdir / "manifest.json"
        return write_manifest(ckdir / "manifest.json", manifest)  # the completion marker, last
    except BaseException as e:
        for f in files:
            f.discard()
        for path in committed:
            safefile.remove_quietly(path)
        for d in reversed(made):  # only what this command made, and only when empty
            with contextlib.suppress(OSError):
                os.rmdir(d)
        if isinstance(e, OSError):  # a full disk: one message naming the file, nothing kept
            raise ValueError(f"cannot write {current}: {e.strerror or e}; nothing of the resharded checkpoint "
                             f"was kept: {remedy(e, out)}, or choose another --out") from None
        raise


def _count_rows(reader: CheckpointReader, new: np.ndarray, world_size: int) -> np.ndarray:
    """Rows each new rank receives (a pass over the source's rows)."""
    counts = np.zeros(world_size, np.int64)
    for src_rank in range(reader.world_size):
        for keys, _, _ in reader.rows(src_rank):
            counts += np.bincount(owner_of(keys, new), minlength=world_size)
    return counts


def _move_rows(reader: CheckpointReader, new: np.ndarray, writers: list[ReservedRankFile]) -> tuple[int, int]:
    """Every source row to the writer of its new owner; returns (rows, rows that changed rank)."""
    rows = moved = 0
    for src_rank in range(reader.world_size):
        for keys, values, seen in reader.rows(src_rank):
            dest = owner_of(keys, new)
            order = np.argsort(dest, kind="stable")
            bounds = np.searchsorted(dest[order], np.arange(len(writers) + 1))
            for r in np.flatnonzero(np.diff(bounds)):  # one append per destination rank
                sel = order[bounds[r]:bounds[r + 1]]
                writers[r].append(keys[sel], values[sel], seen[sel])
            rows += keys.shape[0]
            moved += int(np.count_nonzero(dest != src_rank))
    return rows, moved


def _rank_state(reader: CheckpointReader, rank: int, world_size: int, old: np.ndarray,
                new: np.ndarray) -> tuple[dict[str, Any], dict[str, tuple], dict[str, np.ndarray]]:
    """New rank ``rank``'s file attributes and arrays besides its rows: (attrs, {name: (shape,
    dtype)}, {name: array})."""
    attrs = {"format_version": FORMAT_VERSION, "seq": reader.seq, "kind": "base", "rank": rank,
             "world_size": world_size, "pass_index": reader.pass_index(0), **reader.row_attrs()}
    arrays = {f"dense/{name}": t for name, t in reader.dense(rank if rank < reader.world_size else 0).items()}
    sources = np.unique(old[new == rank])  # the source ranks whose buckets this rank receives
    sketches = [s for s in (reader.admission(int(o)) for o in sources) if s is not None]
    if sketches:
        arrays["admission"] = np.maximum.reduce(sketches)
    arrays["bucket_owner"] = np.asarray(new, dtype=np.int32)
    return attrs, {name: (a.shape, a.dtype) for name, a in arrays.items()}, arrays


def _manifest(reader: CheckpointReader, world_size: int, files: list[dict], origin: dict) -> dict[str, Any]:
    m = dict(reader.manifest)
    state = dict(m["state"])
    per_rank = m.get("batch_size_per_rank")
    if type(per_rank) is int:  # the epoch's position in samples: the resumed run takes it in its own batches
        origin = {**origin, "batch_size_per_rank": per_rank,
                  "epoch_rows": state["batch"] * per_rank * reader.world_size}
    state["batch"] = state["batch"] * reader.world_size // world_size  # the same per-rank batch assumed
    m.update({"format_version": FORMAT_VERSION, "kind": "base", "base_seq": m["seq"], "chain": [m["seq"]],
              "world_size": world_size, "state": state, "files": files, "resharded_from": origin})
    return m
