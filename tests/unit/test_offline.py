"""Offline tools on hand-made checkpoints: the bucket plan, the chain reader, resharding."""

from __future__ import annotations

import json
from pathlib import Path

import h5py
import numpy as np
import pytest

from hvctr.checkpoint.format import file_sha256, rank_file_path, write_rows
from hvctr.formats import NUM_BUCKETS, default_bucket_owner, owner_of
from hvctr.offline.reader import CheckpointReader
from hvctr.offline.reshard import plan_buckets, reshard

WIDTH = 7  # dim 1: w, w1, m (2), v (2), step


@pytest.mark.parametrize("w,w2", [(2, 3), (3, 2), (1, 4), (4, 1), (3, 3), (5, 7), (8, 6)])
def test_plan_is_balanced_and_moves_the_fewest_buckets(w, w2):
    old = default_bucket_owner(w)
    new = plan_buckets(old, w2)
    counts = np.bincount(new, minlength=w2)
    assert counts.sum() == NUM_BUCKETS and counts.max() - counts.min() <= 1
    # the fewest moves: a bucket moves only off a removed rank or off a rank above its share
    kept = sum(min(int(np.count_nonzero(old == r)), int(counts[r])) for r in range(min(w, w2)))
    assert np.count_nonzero(old != new) == NUM_BUCKETS - kept
    assert np.array_equal(plan_buckets(new, w2), new)  # a balanced table stays put


def test_plan_rejects_a_bad_world_size():
    with pytest.raises(ValueError, match="world-size"):
        plan_buckets(default_bucket_owner(2), 0)


def _write_checkpoint(root: Path, seq: int, chain: list[int], world: int, rows_of, state: dict,
                      owner: np.ndarray) -> None:
    """A checkpoint in the trainer's format; rows_of(rank) -> (keys, rows, last_seen)."""
    files = []
    for rank in range(world):
        path = rank_file_path(root, seq, rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        keys, rows, seen = rows_of(rank)
        with h5py.File(path, "w") as f:
            f.attrs.update({"format_version": 1, "seq": seq, "kind": "base" if chain == [seq] else "delta",
                            "rank": rank, "world_size": world, "pass_index": 4})
            write_rows(f, [(keys, rows, seen)], WIDTH)
            g = f.create_group("dense")
            g["param.000"] = np.full(3, rank + 10 * seq, np.float32)
            g["adam_step"] = np.array([seq], np.int64)
            f["admission"] = np.full((4, 1024), rank + 1, np.uint16)
            f["bucket_owner"] = owner
        files.append({"file": path.name, "sha256": file_sha256(path), "bytes": path.stat().st_size,
                      "rows": int(keys.size)})
    manifest = {"format_version": 1, "seq": seq, "kind": "base" if chain == [seq] else "delta",
                "base_seq": chain[0], "chain": chain, "world_size": world, "state": state, "files": files,
                "mode": "kstep", "train_dir": "/data/day1", "init_from": None}
    (root / f"ckpt-{seq:06d}" / "manifest.json").write_text(json.dumps(manifest))


@pytest.fixture()
def chain_dir(tmp_path) -> tuple[Path, dict[int, np.ndarray]]:
    """Two ranks; base 0 with 400 keys, delta 1 rewrites 50 and adds 20, delta 2 rewrites 30.
    Returns the directory and the newest row of every key."""
    owner = default_bucket_owner(2)
    rng = np.random.default_rng(0)
    keys = np.unique(rng.integers(0, 2**63, 470, dtype=np.uint64))[:470]
    expect: dict[int, np.ndarray] = {}
    sets = {0: keys[:400], 1: np.concatenate([keys[:50], keys[400:]]), 2: keys[25:55]}
    state = {"epoch": 0, "batch": 9, "window": 5, "step": 9, "samples": 4608}
    for seq, ks in sets.items():
        rows = rng.random((ks.size, WIDTH), dtype=np.float32)
        seen = np.full(ks.size, seq, np.int32)
        expect.update({int(k): np.concatenate([r, [s]]) for k, r, s in zip(ks, rows, seen)})

        def rows_of(rank, ks=ks, rows=rows, seen=seen):
            mine = owner_of(ks, owner) == rank
            return ks[mine], rows[mine], seen[mine]
        _write_checkpoint(tmp_path, seq, list(range(seq + 1)), 2, rows_of, state, owner)
    return tmp_path, expect


def _all_rows(reader: CheckpointReader) -> dict[int, np.ndarray]:
    out = {}
    for rank in range(reader.world_size):
        for keys, rows, seen in reader.rows(rank, chunk_rows=64):
            for k, r, s in zip(keys.tolist(), rows, seen):
                assert k not in out, "a key twice"
                out[k] = np.concatenate([r, [s]])
    return out


def test_reader_gives_each_key_its_newest_row(chain_dir):
    root, expect = chain_dir
    reader = CheckpointReader(root)
    assert reader.seq == 2 and reader.pass_index(0) == 4
    got = _all_rows(reader)
    assert got.keys() == expect.keys()
    assert all(np.array_equal(got[k], expect[k]) for k in expect)


def test_reader_skips_a_corrupt_checkpoint_and_names_it(chain_dir):
    root, _ = chain_dir
    with open(rank_file_path(root, 2, 1), "r+b") as f:
        f.seek(-4, 2)
        f.write(b"\xff\xfe\xfd\xfc")
    assert CheckpointReader(root).seq == 1  # the newest complete one
    with pytest.raises(ValueError, match="does not match its checksum"):
        CheckpointReader(root / "ckpt-000002")


@pytest.mark.parametrize("w2", [3, 1])
def test_reshard_moves_rows_and_back(chain_dir, tmp_path, w2):
    root, expect = chain_dir
    m = reshard(root, w2, tmp_path / "out")
    assert m["world_size"] == w2 and m["chain"] == [2] and m["kind"] == "base"
    assert m["state"]["batch"] == 9 * 2 // w2 and m["resharded_from"]["world_size"] == 2
    reader = CheckpointReader(tmp_path / "out")
    table = reader.bucket_owner()
    assert np.array_equal(table, plan_buckets(default_bucket_owner(2), w2))
    got = _all_rows(reader)
    assert got.keys() == expect.keys() and all(np.array_equal(got[k], expect[k]) for k in expect)
    for rank in range(w2):
        keys = np.concatenate([k for k, _, _ in reader.rows(rank)])
        assert np.all(owner_of(keys, table) == rank)
        # dense: a source rank's own state; admission: the maximum over the ranks it took buckets from
        assert reader.dense(rank)["param.000"][0] == (rank if rank < 2 else 0) + 20
        sources = np.unique(default_bucket_owner(2)[table == rank])
        assert np.all(reader.admission(rank) == sources.max() + 1)
    back = reshard(tmp_path / "out", 2, tmp_path / "back")
    assert back["world_size"] == 2
    got = _all_rows(CheckpointReader(tmp_path / "back"))
    assert all(np.array_equal(got[k], expect[k]) for k in expect)
    with pytest.raises(ValueError, match="already holds checkpoints"):
        reshard(root, 2, tmp_path / "back")
