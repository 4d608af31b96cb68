"""Crafted exports and checkpoints: the checks bind what is loaded (issue 28, items 6-8).

A manifest carries the sha256 of its own content, but anyone can reseal it: so the manifest's
self-checksum proves nothing against a crafted file. What is loaded must be what is checked:
every file a reader opens is listed in the manifest, inside the directory (no ``..``, no
absolute path, no link) and checksummed; the datasets' declared shapes fit their file before
anything is allocated; world size and bucket table agree across the files. Also: the keys that
define the trained model cannot be overridden at export, and a damaged newest checkpoint that
export or reshard skip is named.

The run directory is built with the library's own writers (write_reserved, write_manifest,
write_toml): a 2-rank checkpoint of a tiny model, no training job.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import h5py
import numpy as np
import pytest

from hvctr.checkpoint.format import (file_sha256, rank_file_path, read_bucket_owner, read_manifest,
                                     write_manifest, write_reserved)
from hvctr.checkpoint.manager import CheckpointManager
from hvctr.config import from_dict, write_toml
from hvctr.formats import RowLayout, default_bucket_owner, owner_of
from hvctr.models import build_model
from hvctr.offline.export import export
from hvctr.offline.reader import CheckpointReader
from hvctr.offline.reshard import reshard
from hvctr.offline.score import ExportedModel

DIM = 2
LAYOUT = RowLayout(DIM)
STATE = {"epoch": 0, "batch": 4, "window": 2, "step": 4, "samples": 256}


@pytest.fixture(autouse=True)
def _propagate(monkeypatch):
    """hvctr's logger stops at its own handlers once a CLI test set it up: let caplog see it."""
    monkeypatch.setattr(logging.getLogger("hvctr"), "propagate", True)


def _config():
    return from_dict({"storage": {"dim": DIM, "rows_per_rank": 1000, "seed": 7, "init_scale": 0.05},
                      "model": {"hidden": [4]}, "data": {"batch_size_per_rank": 32}})


def _dense() -> dict[str, np.ndarray]:
    model = build_model(_config().model, DIM, seed=1)
    out = {f"param.{i:03d}": p.detach().numpy().copy() for i, (_, p) in enumerate(model.named_parameters())}
    out["adam_step"] = np.array([4.0], np.float32)
    return out


def write_checkpoint(ckdir: Path, seq: int, world: int, keys: np.ndarray, owner: np.ndarray | None = None,
                     chain: list[int] | None = None) -> dict:
    """Checkpoint ``seq`` as the trainer writes it: each rank's rows of ``keys`` under ``owner``."""
    owner = default_bucket_owner(world) if owner is None else owner
    chain = chain or [seq]
    rng = np.random.default_rng(seq)
    files = []
    for rank in range(world):
        mine = np.sort(keys[owner_of(keys, owner) == rank])
        rows = rng.random((mine.size, LAYOUT.width), dtype=np.float32)
        path = rank_file_path(ckdir, seq, rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        attrs = {"format_version": 1, "seq": seq, "kind": "base" if chain == [seq] else "delta", "rank": rank,
                 "world_size": world, "pass_index": 1}
        arrays = {**{f"dense/{k}": v for k, v in _dense().items()}, "bucket_owner": owner}
        write_reserved(path, attrs, mine.size, LAYOUT.width, [(mine, rows, np.ones(mine.size, np.int32))], arrays)
        files.append({"file": path.name, "sha256": file_sha256(path), "bytes": path.stat().st_size,
                      "rows": int(mine.size)})
    manifest = {"format_version": 1, "seq": seq, "kind": "base" if chain == [seq] else "delta",
                "base_seq": chain[0], "chain": chain, "world_size": world, "state": STATE, "files": files,
                "kernels": "native", "train_dir": "/data/day1", "init_from": None}
    return write_manifest(ckdir / f"ckpt-{seq:06d}" / "manifest.json", manifest)


KEYS = np.unique(np.random.default_rng(0).integers(1, 2**63, 300, dtype=np.uint64))


@pytest.fixture()
def run_dir(tmp_path) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    write_toml(_config(), run / "config.toml")
    write_checkpoint(run / "checkpoints", 0, 2, KEYS)
    return run


@pytest.fixture()
def exported(run_dir, tmp_path) -> Path:
    out = tmp_path / "E"
    export(run_dir, out)
    return out


def reseal(path: Path, edit) -> None:
    """What anyone can do: edit a manifest and seal it again with its own checksum."""
    m = read_manifest(path)
    edit(m)
    m.pop("manifest_sha256", None)
    write_manifest(path, m)


def record(root: Path, name: str) -> dict:
    p = root / name
    return {"file": name, "sha256": file_sha256(p), "bytes": p.stat().st_size}


def rewrite_h5(path: Path, edit) -> None:
    with h5py.File(path, "r+") as f:
        edit(f)


# --- item 6: exports ---------------------------------------------------------------------------


def test_a_good_export_loads(exported):
    model = ExportedModel(exported)
    assert sum(k.size for k in model.keys) == KEYS.size


def test_an_export_file_entry_outside_the_export_is_refused(exported, tmp_path):
    """`../E/sparse/rank-00000.h5` was checked in E while F's swapped file was loaded."""
    crafted = tmp_path / "F"
    shutil.copytree(exported, crafted)
    rewrite_h5(crafted / "sparse/rank-00000.h5", lambda f: f["weights"].__setitem__(slice(None), 9.0))

    def edit(m):
        m["files"][0] = {**m["files"][0], "file": "../E/sparse/rank-00000.h5"}
    reseal(crafted / "manifest.json", edit)
    with pytest.raises(ValueError, match=r"rank-00000\.h5"):
        ExportedModel(crafted)


def test_an_export_that_lists_no_files_is_refused(exported):
    """`"files": []` skipped every check: a damaged dense.h5 scored nan, rc 0."""
    rewrite_h5(exported / "dense.h5", lambda f: f["mlp.0.weight"].__setitem__(slice(None), np.nan))
    reseal(exported / "manifest.json", lambda m: m.update(files=[]))
    with pytest.raises(ValueError, match=r"not listed in .*manifest\.json"):
        ExportedModel(exported)


def test_an_export_file_that_is_a_link_is_refused(exported, tmp_path):
    elsewhere = tmp_path / "elsewhere.h5"
    shutil.copy(exported / "dense.h5", elsewhere)
    (exported / "dense.h5").unlink()
    (exported / "dense.h5").symlink_to(elsewhere)  # the same bytes: its checksum matches
    with pytest.raises(ValueError, match="link"):
        ExportedModel(exported)


def test_an_export_whose_world_size_disagrees_with_its_files_is_refused(exported):
    """`world_size: 1` in a 2-rank export scored half the keys as unseen."""
    def edit(m):
        m["world_size"] = 1
        m["files"] = [f for f in m["files"] if f["file"] != "sparse/rank-00001.h5"]
    reseal(exported / "manifest.json", edit)
    with pytest.raises(ValueError, match="world size|world_size"):
        ExportedModel(exported)


def test_an_export_whose_bucket_table_names_a_rank_it_lacks_is_refused(exported):
    for rank in (0, 1):
        rewrite_h5(exported / f"sparse/rank-{rank:05d}.h5", lambda f: f["bucket_owner"].__setitem__(5, 7))

    def edit(m):
        m["files"] = [record(exported, f["file"]) | {k: v for k, v in f.items() if k not in ("sha256", "bytes")}
                      for f in m["files"]]
    reseal(exported / "manifest.json", edit)
    with pytest.raises(ValueError, match="bucket table.*rank 7"):
        ExportedModel(exported)


def test_export_files_with_different_bucket_tables_are_refused(exported):
    rewrite_h5(exported / "sparse/rank-00001.h5", lambda f: f["bucket_owner"].__setitem__(slice(0, 2), [1, 0]))

    def edit(m):
        m["files"] = [record(exported, f["file"]) | {k: v for k, v in f.items() if k not in ("sha256", "bytes")}
                      for f in m["files"]]
    reseal(exported / "manifest.json", edit)
    with pytest.raises(ValueError, match="bucket table"):
        ExportedModel(exported)


# --- item 6: checkpoints (export, reshard, the trainer's manager) -------------------------------


def test_a_checkpoint_bucket_table_naming_rank_7_is_refused_everywhere(run_dir, tmp_path):
    owner = default_bucket_owner(2)
    owner[5] = 7
    ck = run_dir / "checkpoints"
    shutil.rmtree(ck)
    write_checkpoint(ck, 0, 2, KEYS[owner_of(KEYS, owner) != 7], owner=owner)
    with pytest.raises(ValueError, match="bucket table.*rank 7"):
        export(run_dir, tmp_path / "E")
    with pytest.raises(ValueError, match="bucket table.*rank 7"):
        reshard(ck, 3, tmp_path / "R")
    with pytest.raises(ValueError, match="bucket table.*rank 7"):
        read_bucket_owner(ck, read_manifest(ck / "ckpt-000000" / "manifest.json"), 0)
    assert not (tmp_path / "E").exists() and not (tmp_path / "R").exists()


def test_a_checkpoint_file_entry_outside_its_directory_is_refused(run_dir, tmp_path):
    ck = run_dir / "checkpoints"
    other = tmp_path / "other"
    shutil.copytree(ck, other)
    rewrite_h5(rank_file_path(ck, 0, 0), lambda f: f["rows"].__setitem__(slice(None), 9.0))  # the swapped file

    def edit(m):
        m["files"][0] = {**m["files"][0], "file": "../../../other/ckpt-000000/rank-00000.h5"}
    reseal(ck / "ckpt-000000" / "manifest.json", edit)
    with pytest.raises(ValueError, match=r"rank-00000\.h5"):
        CheckpointReader(ck)
    with pytest.raises(ValueError, match=r"rank-00000\.h5"):
        export(run_dir, tmp_path / "E")
    manager = CheckpointManager(ck, _OneRankOf(0, 2), keep=3, compact_every=4)
    m = read_manifest(ck / "ckpt-000000" / "manifest.json")
    assert "rank-00000.h5" in manager._verify_mine(m, {0: m})


def test_a_checkpoint_that_lists_no_files_is_refused(run_dir, tmp_path):
    ck = run_dir / "checkpoints"
    reseal(ck / "ckpt-000000" / "manifest.json", lambda m: m.update(files=[]))
    with pytest.raises(ValueError, match="not listed"):
        CheckpointReader(ck)
    manager = CheckpointManager(ck, _OneRankOf(1, 2), keep=3, compact_every=4)
    m = read_manifest(ck / "ckpt-000000" / "manifest.json")
    assert "not listed" in manager._verify_mine(m, {0: m})


def test_a_checkpoint_whose_world_size_disagrees_with_its_files_is_refused(run_dir, tmp_path):
    ck = run_dir / "checkpoints"

    def edit(m):
        m["world_size"] = 1
        m["files"] = m["files"][:1]
    reseal(ck / "ckpt-000000" / "manifest.json", edit)
    with pytest.raises(ValueError, match="world size|world_size"):
        export(run_dir, tmp_path / "E")


def test_a_small_file_declaring_2e8_rows_is_refused_before_anything_is_allocated(run_dir, tmp_path):
    """A few KB of HDF5 whose datasets declare 2e8 rows (never written: the fill value):
    reading them would allocate 8 GB. Refused from the declared shapes, nothing read."""
    ck = run_dir / "checkpoints"
    write_checkpoint(ck, 1, 2, KEYS[:50], chain=[0, 1])  # a delta: the reader loads it whole
    path = rank_file_path(ck, 1, 0)
    n = 200_000_000
    with h5py.File(path, "r+") as f:
        for name in ("keys", "rows", "last_seen"):
            del f[name]
        f.create_dataset("keys", shape=(n,), dtype=np.uint64, chunks=(1 << 16,))
        f.create_dataset("rows", shape=(n, LAYOUT.width), dtype=np.float32, chunks=(1 << 14, LAYOUT.width))
        f.create_dataset("last_seen", shape=(n,), dtype=np.int32, chunks=(1 << 16,))
    assert path.stat().st_size < 4 << 20

    def edit(m):
        m["files"][0] = {**m["files"][0], "sha256": file_sha256(path), "bytes": path.stat().st_size}
    reseal(ck / "ckpt-000001" / "manifest.json", edit)
    with pytest.raises(ValueError, match="declares|declared"):
        CheckpointReader(ck / "ckpt-000001")
    manager = CheckpointManager(ck, _OneRankOf(0, 2), keep=3, compact_every=4)
    m1 = read_manifest(ck / "ckpt-000001" / "manifest.json")
    m0 = read_manifest(ck / "ckpt-000000" / "manifest.json")
    assert "declare" in manager._verify_mine(m1, {0: m0, 1: m1})


class _OneRankOf:
    """The comm of rank ``rank`` of ``size`` (only rank and size are read by _verify_mine)."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size


# --- item 7: export keeps the trained model's keys -----------------------------------------------


@pytest.mark.parametrize("flag,key,held", [("--storage.seed=99", "storage.seed", "7"),
                                           ("--storage.admit_after=3", "storage.admit_after", "0"),
                                           ("--storage.init_scale=0.5", "storage.init_scale", "0.05"),
                                           ("--model.hidden=8", "model.hidden", "4")])
def test_export_refuses_overrides_of_the_keys_that_define_the_model(run_dir, tmp_path, flag, key, held):
    with pytest.raises(ValueError, match=rf"{key}.*{held}") as e:
        export(run_dir, tmp_path / "E", overrides=[flag])
    assert "cannot be overridden" in str(e.value)
    assert not (tmp_path / "E").exists()


def test_export_takes_an_override_that_changes_nothing_of_the_model(run_dir, tmp_path):
    m = export(run_dir, tmp_path / "E", overrides=["--storage.seed=7", "--data.batch_size_per_rank=64"])
    assert m["unseen_keys"]["seed"] == 7 and m["batch_size"] == 64


# --- item 8: a skipped newest checkpoint is named -------------------------------------------------


def test_export_and_reshard_say_which_checkpoint_they_skipped_and_why(run_dir, tmp_path, caplog):
    ck = run_dir / "checkpoints"
    write_checkpoint(ck, 1, 2, KEYS)
    with open(rank_file_path(ck, 1, 1), "r+b") as f:
        f.seek(-4, 2)
        f.write(b"\xff\xfe\xfd\xfc")
    caplog.set_level(logging.WARNING, logger="hvctr")
    m = export(run_dir, tmp_path / "E")
    assert m["source"]["seq"] == 0
    assert "skipped checkpoint 1" in caplog.text and "rank-00001.h5" in caplog.text
    assert "checksum" in caplog.text and "checkpoint 0" in caplog.text
    caplog.clear()
    assert reshard(ck, 3, tmp_path / "R")["seq"] == 0
    assert "skipped checkpoint 1" in caplog.text and "rank-00001.h5" in caplog.text
