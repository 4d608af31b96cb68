"""hvctr export within a memory budget (hvctr.offline.keysort): a budget so small that every rank's
rows are sorted in many runs through a temporary file gives the same export, byte for byte, as the
in-memory sort; each key holds its newest copy along a chain of a base and two deltas; the sort's
temporary file is gone after it, also when the source fails midway.

The run is made by hand in the trainer's checkpoint format (write_reserved): 2 ranks, dim 4.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import h5py
import numpy as np
import pytest

from hvctr.checkpoint.format import FORMAT_VERSION, file_sha256, write_manifest, write_reserved
from hvctr.config import Config, replace, write_toml
from hvctr.formats import RowLayout, default_bucket_owner, owner_of
from hvctr.offline import export as export_mod
from hvctr.offline.keysort import MIN_RUN_ROWS, SortedRows
from hvctr.offline.reader import CheckpointReader

DIM = 4
WORLD = 2
TINY = 16 << 10  # bytes: runs of MIN_RUN_ROWS copies, merge blocks of MIN_BLOCK_ROWS


def make_chain(root: Path) -> tuple[Path, dict[int, np.ndarray]]:
    """A run directory whose checkpoint 2 chains base 0 (30,000 keys) and deltas 1 and 2 (each
    rewrites 6,000 keys, some of them both, and adds 2,000 new ones). Returns it and each key's
    newest row."""
    from hvctr.models import build_model

    run = root / "run"
    run.mkdir(parents=True)
    cfg = replace(Config(), storage={"dim": DIM}, model={"hidden": [8]}, data={"batch_size_per_rank": 64})
    write_toml(cfg, run / "config.toml")
    layout = RowLayout(DIM)
    rng = np.random.default_rng(7)
    keys = np.unique(rng.integers(1, 2**64 - 2, 40_000, dtype=np.uint64))
    rng.shuffle(keys)  # shard order, not key order
    owner = default_bucket_owner(WORLD)
    params = {f"dense/param.{i:03d}": p.detach().numpy().copy()
              for i, (_, p) in enumerate(build_model(cfg.model, DIM).named_parameters())}
    sets = {0: keys[:30_000], 1: np.concatenate([keys[1000:7000], keys[30_000:32_000]]),
            2: np.concatenate([keys[33_000:35_000], keys[5000:11_000]])}
    newest: dict[int, np.ndarray] = {}
    for seq, ks in sets.items():
        ckdir = run / "checkpoints" / f"ckpt-{seq:06d}"
        ckdir.mkdir(parents=True)
        table = rng.standard_normal((ks.size, layout.width)).astype(np.float32)
        newest.update(zip(ks.tolist(), table))
        files = []
        for rank in range(WORLD):
            mine = owner_of(ks, owner) == rank
            path = ckdir / f"rank-{rank:05d}.h5"
            attrs = {"format_version": FORMAT_VERSION, "seq": seq, "kind": "base" if seq == 0 else "delta",
                     "rank": rank, "world_size": WORLD, "pass_index": 0}
            write_reserved(path, attrs, int(mine.sum()), layout.width,
                           [(ks[mine], table[mine], np.zeros(int(mine.sum()), np.int32))],
                           {**params, "bucket_owner": owner})
            files.append({"file": path.name, "sha256": file_sha256(path), "bytes": path.stat().st_size,
                          "rows": int(mine.sum())})
        write_manifest(ckdir / "manifest.json", {
            "format_version": FORMAT_VERSION, "seq": seq, "kind": "base" if seq == 0 else "delta", "base_seq": 0,
            "chain": list(range(seq + 1)), "world_size": WORLD, "files": files, "train_dir": "/data",
            "init_from": None, "state": {"epoch": 0, "batch": 4, "window": 1, "step": 4, "samples": 256}})
    return run, newest


@pytest.fixture(scope="module")
def chain(tmp_path_factory) -> tuple[Path, dict[int, np.ndarray]]:
    return make_chain(tmp_path_factory.mktemp("chain"))


def _digests(export_dir: Path) -> dict[str, str]:
    return {str(p.relative_to(export_dir)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(export_dir.rglob("*")) if p.is_file()}


def test_the_sort_takes_many_runs_and_keeps_each_keys_newest_copy(chain, tmp_path):
    run, newest = chain
    reader = CheckpointReader(run)
    layout = RowLayout(DIM)
    for rank in range(WORLD):
        total = reader.copy_count(rank)
        parts = lambda n, rank=rank: reader.copies(rank, layout.model, n)  # noqa: E731
        with SortedRows(parts, total, layout.model_width, TINY, tmp_path / f"r{rank}") as rows:
            assert len(rows.runs) >= total // MIN_RUN_ROWS >= 15  # many runs, not one
            assert rows.path is not None and rows.path.exists()
            got = list(rows.batches())
        assert not rows.path.exists()  # removed at exit
        keys = np.concatenate([k for k, _ in got])
        values = np.concatenate([v for _, v in got])
        every = np.array(sorted(newest), dtype=np.uint64)
        want = every[owner_of(every, reader.bucket_owner()) == rank]
        assert rows.count == keys.size == want.size and np.array_equal(keys, want)
        assert np.array_equal(values, np.stack([newest[k][layout.model] for k in want.tolist()]))
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("rows", ["fp32", "fp16", "int8"])
def test_a_tiny_budget_exports_the_same_bytes_as_the_in_memory_sort(chain, tmp_path, rows):
    run, newest = chain
    whole = export_mod.export(run, tmp_path / "memory", rows=rows)  # every rank in one run, in memory
    tiny = export_mod.export(run, tmp_path / "runs", rows=rows, memory_bytes=TINY)
    assert whole == tiny
    assert _digests(tmp_path / "memory") == _digests(tmp_path / "runs")
    assert sorted(p.name for p in (tmp_path / "runs" / "sparse").iterdir()) == ["rank-00000.h5", "rank-00001.h5"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["memory", "runs"]  # no temporary file or directory left
    # and what both hold is what the chain reader gives each key, sorted as export always did
    reader = CheckpointReader(run)
    for rank in range(WORLD):
        parts = list(reader.rows(rank))
        keys = np.concatenate([k for k, _, _ in parts])
        order = np.argsort(keys, kind="stable")
        weights = np.concatenate([r for _, r, _ in parts])[order][:, :DIM + 1]
        with h5py.File(tmp_path / "runs" / "sparse" / f"rank-{rank:05d}.h5", "r") as f:
            assert np.array_equal(f["keys"][...], keys[order])
            if rows == "fp32":
                assert np.array_equal(f["weights"][...], weights)
            elif rows == "fp16":
                assert np.array_equal(f["weights"][...], weights.astype(np.float16))
            else:
                q, sb = export_mod.quantize_int8_rowwise(weights)
                assert np.array_equal(f["weights"][...], q) and np.array_equal(f["scale_bias"][...], sb)
    assert whole["rows"] == len(newest)


def test_a_source_that_fails_midway_leaves_no_temporary_file(chain, tmp_path):
    run, _ = chain
    reader = CheckpointReader(run)
    layout = RowLayout(DIM)

    def parts(n):
        for i, part in enumerate(reader.copies(0, layout.model, n)):
            if i == 5:
                raise OSError(5, "Input/output error", str(reader.rank_path(0)))
            yield part

    with pytest.raises(OSError, match="Input/output error"):
        SortedRows(parts, reader.copy_count(0), layout.model_width, TINY, tmp_path / "r0")
    assert not list(tmp_path.iterdir())


def test_memory_mib_below_one_is_refused(chain, tmp_path, capsys):
    from hvctr import cli

    run, _ = chain
    assert cli.main(["export", "--run-dir", str(run), "--out", str(tmp_path / "E"), "--memory-mib", "0"]) != 0
    assert "--memory-mib 0: must be at least 1" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())
