"""hvctr.data.reader.ShardReader on a real data_prep output: the rank's stream, batches, resume, checks."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import h5py
import numpy as np
import pytest

from data_prep.criteo import Job, run_job
from data_prep.mpi import Comm
from data_prep.synth import generate
from hvctr.data.reader import ShardReader, load_manifest

SHARDS = 5


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("data")
    generate(5000, seed=11, out=str(root / "in.tsv"))
    assert run_job(Comm(), Job((str(root / "in.tsv"),), str(root / "out"), SHARDS, valid_fraction=0.2)) == 0
    return root / "out"


def rank_stream(data_dir: Path, split: str, rank: int, world: int) -> dict[str, np.ndarray]:
    """What rank r of W must see: its shards s % W == r in order, read plainly."""
    m = json.loads((data_dir / "manifest.json").read_text())
    parts = {"labels": [], "dense": [], "keys": []}
    for s in range(rank, SHARDS, world):
        with h5py.File(data_dir / m["shards"][split][s]["file"], "r") as f:
            for k in parts:
                parts[k].append(f[k][...])
    return {k: np.concatenate(v) for k, v in parts.items()}


def batches(r, start=0, stop=None):
    """Batches start .. stop-1 of a reader, as the trainer cuts them from its row stream."""
    stop = r.num_batches if stop is None else stop
    return [r.read_rows(b * r.batch_size, (b + 1) * r.batch_size) for b in range(start, stop)]


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("batch", [1, 7, 333])
def test_batches_are_the_ranks_shards_in_order(data_dir, world, batch):
    for rank in range(world):
        want = rank_stream(data_dir, "train", rank, world)
        with ShardReader(str(data_dir), "train", rank, world, batch, read_bytes=5000) as r:
            assert r.shards == list(range(rank, SHARDS, world))
            assert r.rows == len(want["labels"]) and r.num_batches == r.rows // batch
            got = batches(r)
        assert len(got) == r.num_batches
        for k, i in (("labels", 0), ("dense", 1), ("keys", 2)):
            np.testing.assert_array_equal(np.concatenate([b[i] for b in got]), want[k][:len(got) * batch])
        b = got[0]
        assert b.labels.dtype == np.float32 and b.dense.dtype == np.float32 and b.keys.dtype == np.uint64
        assert b.labels.shape == (batch,) and b.dense.shape == (batch, 13) and b.keys.shape == (batch, 26)


def test_resume_from_a_batch_index_and_row_ranges(data_dir):
    r = ShardReader(str(data_dir), "valid", 1, 2, 50)
    full = batches(r)
    tail = batches(r, start=5)
    assert len(tail) == len(full) - 5
    for a, b in zip(full[5:], tail):
        np.testing.assert_array_equal(a.keys, b.keys)
    np.testing.assert_array_equal(batches(r, start=3, stop=4)[0].dense, full[3].dense)
    want = rank_stream(data_dir, "valid", 1, 2)
    lo, hi = 17, r.rows  # the short last rows, across shard boundaries
    np.testing.assert_array_equal(r.read_rows(lo, hi).keys, want["keys"][lo:hi])
    with pytest.raises(ValueError, match="outside"):
        batches(r, start=0, stop=r.num_batches + 1)
    with pytest.raises(ValueError, match="outside"):
        r.read_rows(0, r.rows + 1)


def test_verify_names_the_corrupt_file(tmp_path, data_dir):
    d = tmp_path / "copy"
    shutil.copytree(data_dir, d)
    ShardReader(str(d), "train", 0, 1, 10, verify=True)  # intact: passes
    victim = d / "train-00002.h5"
    with h5py.File(victim, "r+") as f:
        f["keys"][3, 4] ^= np.uint64(1)
    ShardReader(str(d), "train", 1, 2, 10, verify=True)  # rank 1 of 2 does not open shard 2
    with pytest.raises(ValueError, match=f"{victim}: dataset 'keys' does not match its checksum"):
        ShardReader(str(d), "train", 0, 2, 10, verify=True)


def test_clear_errors(tmp_path, data_dir):
    with pytest.raises(ValueError, match=f"{tmp_path / 'manifest.json'}: no data_prep manifest"):
        ShardReader(str(tmp_path), "train", 0, 1, 10)
    d = tmp_path / "copy"
    shutil.copytree(data_dir, d)
    (d / "valid-00004.h5").unlink()
    ShardReader(str(d), "train", 0, 1, 10)
    with pytest.raises(ValueError, match=f"{d / 'valid-00004.h5'}: shard file missing"):
        ShardReader(str(d), "valid", 0, 1, 10)
    with pytest.raises(ValueError, match="fewer than 6 ranks"):
        ShardReader(str(d), "train", 0, 6, 10)
    with pytest.raises(ValueError, match="split must be"):
        ShardReader(str(d), "test", 0, 1, 10)
    m = json.loads((d / "manifest.json").read_text())
    m["state"] = "in_progress"
    (d / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ValueError, match="has not finished"):
        load_manifest(str(d))
