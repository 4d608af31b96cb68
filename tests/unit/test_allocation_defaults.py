"""Defaults inside an allocation, as functions of their inputs: threads per unbound rank,
where working shards go, the shard size from the data manifest (storage.rows_per_rank = 0),
the verification stamp. tests/e2e/test_allocation.py runs them in a faked Slurm job."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

from data_prep.criteo import Job, run_job
from data_prep.mpi import Comm
from data_prep.synth import generate
from hvctr.config import load_config
from hvctr.formats import NUM_BUCKETS
from hvctr.topo.bind import default_threads, launcher_local_size
from hvctr.data.reader import STAMP_NAME, ShardReader, read_stamp, write_stamp
from hvctr.train.preflight import SHARD_HEADROOM, check_memory, size_shard
from hvctr.rundir import working_shard_place


@pytest.mark.parametrize("allowed,env,host,want", [
    (128, {"OMPI_COMM_WORLD_LOCAL_SIZE": "8"}, 1, 16),  # mpirun: 8 ranks share the node
    (128, {"SLURM_NTASKS_PER_NODE": "8"}, 1, 16),
    (128, {"SLURM_STEP_TASKS_PER_NODE": "8(x2),4", "SLURM_NODEID": "2"}, 1, 32),  # this node runs 4
    (128, {"SLURM_NTASKS_PER_NODE": "8", "SLURM_CPUS_PER_TASK": "4"}, 1, 4),  # at most cpus-per-task
    (16, {"SLURM_NTASKS_PER_NODE": "8", "SLURM_CPUS_PER_TASK": "16"}, 1, 16),  # srun bound the rank: its own
    (2, {"OMPI_COMM_WORLD_LOCAL_SIZE": "3"}, 1, 1),  # oversubscribed: at least 1
    (8, {}, 4, 2),  # no launcher variable: the ranks on this host
])
def test_threads_are_the_ranks_share_of_its_cpus(allowed, env, host, want):
    n, why = default_threads(allowed, env, host)
    assert n == want and f"{allowed} cpus" in why


@pytest.mark.parametrize("env,want", [
    ({"OMPI_COMM_WORLD_LOCAL_SIZE": "2", "SLURM_NTASKS_PER_NODE": "8"}, (2, "OMPI_COMM_WORLD_LOCAL_SIZE")),  # mpirun wins
    ({"SLURM_STEP_TASKS_PER_NODE": "8(x2),4", "SLURM_NODEID": "1"}, (8, "SLURM_STEP_TASKS_PER_NODE")),  # srun
    ({"SLURM_TASKS_PER_NODE": "3,2", "SLURM_NODEID": "1"}, (2, "SLURM_STEP_TASKS_PER_NODE")),
    ({}, (0, "")),  # no launcher says: the caller decides (host names, or 1)
])
def test_ranks_on_this_node_from_the_launcher(env, want):
    assert launcher_local_size(env) == want


def test_memory_check_counts_the_nodes_ranks_under_srun(tmp_path):
    """srun --mpi=pmix sets no OMPI_COMM_WORLD_LOCAL_SIZE: the node's ranks come from Slurm's
    tasks per node, not 1 (4 caches of 1.5 GB on a 4 GiB node do not fit, one does)."""
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       8000000 kB\nMemAvailable:   4194304 kB\n")
    cfg = load_config(overrides=["--storage.cpu_cache_bytes=1500000000"])
    check_memory(cfg, env={}, meminfo=str(meminfo), cgroup="")
    with pytest.raises(ValueError, match=r"x 4 rank\(s\) on this node"):
        check_memory(cfg, env={"SLURM_STEP_TASKS_PER_NODE": "4(x2)", "SLURM_NODEID": "1"}, meminfo=str(meminfo),
                     cgroup="")


def test_working_shards_prefer_node_local_scratch(tmp_path):
    cfg = load_config()
    run = tmp_path / "run"
    other_fs = Path("/dev/shm")
    if not other_fs.is_dir() or other_fs.stat().st_dev == tmp_path.stat().st_dev:
        pytest.skip("no second file system (/dev/shm) to stand for node-local scratch")
    where, src, scratch = working_shard_place(cfg, run, env={"SLURM_TMPDIR": str(other_fs), "TMPDIR": "/x"})
    assert where.parent == other_fs / "hvctr-shards" and where.name.startswith("run-") and scratch
    assert src.startswith("$SLURM_TMPDIR")
    assert working_shard_place(cfg, run, env={"TMPDIR": str(other_fs)})[1].startswith("$TMPDIR")
    # scratch on the run directory's own file system gains nothing: the run directory
    assert working_shard_place(cfg, run, env={"SLURM_TMPDIR": str(tmp_path)}) == (run / "shards", "the run directory",
                                                                                   False)
    # the map's SSD and storage.shard_dir come first
    assert working_shard_place(cfg, run, "/nvme1", env={"SLURM_TMPDIR": str(other_fs)})[1] == "the hardware map's SSD"
    mine = load_config(None, [f"--storage.shard_dir={tmp_path / 'mine'}"])
    assert working_shard_place(mine, run, "/nvme1", env={"SLURM_TMPDIR": str(other_fs)}) == (
        tmp_path / "mine", "storage.shard_dir", False)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("alloc")
    generate(4000, seed=5, out=str(root / "in.tsv"))
    assert run_job(Comm(), Job((str(root / "in.tsv"),), str(root / "out"), 4, valid_fraction=0.2)) == 0
    return root / "out"


def _fullest(keys: int, world: int) -> int:
    return -(-keys * -(-NUM_BUCKETS // world) // NUM_BUCKETS)


@pytest.mark.parametrize("world", [1, 3, 8])
def test_rows_per_rank_zero_is_sized_from_the_manifest(data_dir, world):
    distinct = json.loads((data_dir / "manifest.json").read_text())["totals"]["distinct_keys_estimate_total"]
    cfg = load_config(None, [f"--data.train_dir={data_dir}"])
    assert cfg.storage.rows_per_rank == 0  # the default
    sized, note = size_shard(cfg, world)
    assert sized.storage.rows_per_rank == max(4096, math.ceil(_fullest(distinct, world) * SHARD_HEADROOM))
    assert note.startswith(f"shard size: storage.rows_per_rank = {sized.storage.rows_per_rank:,} (0: sized")
    # explicit values are kept, and there is nothing to say about them
    explicit = load_config(None, [f"--data.train_dir={data_dir}", "--storage.rows_per_rank=999999"])
    assert size_shard(explicit, world) == (explicit, "")


def test_a_shard_the_table_would_fill_fails_before_training_with_the_size(data_dir):
    distinct = json.loads((data_dir / "manifest.json").read_text())["totals"]["distinct_keys_estimate_total"]
    small = load_config(None, [f"--data.train_dir={data_dir}", "--storage.rows_per_rank=1000"])
    want = size_shard(load_config(None, [f"--data.train_dir={data_dir}"]), 1)[0].storage.rows_per_rank
    with pytest.raises(ValueError, match=rf"storage.rows_per_rank.*{distinct:,}.*set storage.rows_per_rank = {want}"):
        size_shard(small, 1)
    # not every key reaches the table: late admission, or a run that stops early
    size_shard(load_config(None, [f"--data.train_dir={data_dir}", "--storage.rows_per_rank=1000",
                                  "--storage.admit_after=3"]), 1)
    size_shard(load_config(None, [f"--data.train_dir={data_dir}", "--storage.rows_per_rank=1000",
                                  "--train.max_steps=2"]), 1)
    # hvctr eval (check=False) never fails on it
    assert size_shard(small, 1, check=False)[0].storage.rows_per_rank == 1000


def test_stamp_skips_unchanged_files_and_rechecks_changed_ones(data_dir, tmp_path):
    (data_dir / STAMP_NAME).unlink(missing_ok=True)
    assert read_stamp(str(data_dir)) == ({}, "")
    with ShardReader(str(data_dir), "train", 0, 1, 16) as r:
        good, hashed = r.verify()
        assert hashed == 4 and sorted(good) == sorted(os.path.basename(p) for p in r.paths)
        path, note = write_stamp(str(data_dir), good)
        assert path == str(data_dir / STAMP_NAME) and note == ""
        assert not [p for p in data_dir.iterdir() if p.name.endswith(".tmp")]
        stamp, where = read_stamp(str(data_dir))
        assert stamp == good and where == path
        assert r.verify(skip=stamp) == (good, 0)
        st = os.stat(r.paths[1])
        os.utime(r.paths[1], ns=(st.st_atime_ns, st.st_mtime_ns + 1))
        again, hashed = r.verify(skip=stamp)
        assert hashed == 1 and again[os.path.basename(r.paths[1])]["mtime_ns"] == st.st_mtime_ns + 1
    # another manifest (data_prep run again): the stamp no longer applies
    m = data_dir / "manifest.json"
    text = m.read_text()
    try:
        m.write_text(text + " ")
        assert read_stamp(str(data_dir)) == ({}, "")
    finally:
        m.write_text(text)
    (data_dir / STAMP_NAME).unlink()


def test_unwritable_data_dir_keeps_the_stamp_in_the_run_dir(data_dir, tmp_path):
    (data_dir / STAMP_NAME).mkdir()  # a directory where the stamp goes: the rename fails, as on a read-only fs
    try:
        path, note = write_stamp(str(data_dir), {"train-00000.h5": {"size": 1, "mtime_ns": 2, "ino": 3}}, tmp_path)
        assert path == str(tmp_path / "data-verified.json") and "keeping it in the run directory" in note
        assert read_stamp(str(data_dir), tmp_path)[1] == path
        assert read_stamp(str(data_dir))[0] == {}
        path, note = write_stamp(str(data_dir), {})
        assert path == "" and "verifies in full again" in note
    finally:
        (data_dir / STAMP_NAME).rmdir()
