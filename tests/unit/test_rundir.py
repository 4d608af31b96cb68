"""One job per run directory, and a resume that checks what it resumes (hvctr.rundir).

- The lock: a second job fails at once, naming the holder's host and pid; a lock left by a
  killed job is reported as stale and taken over; a job that ends releases it. Through
  ``hvctr train`` itself: the second job's one error line, exit 2, before any data is read.
- The identity: written at a first start; a resume whose model, data, batch, k or seeds differ
  is refused with every difference listed, and leaves config.toml and identity.json as they
  were (hvctr eval and export keep working); learning rates and log cadence are listed as
  changed.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import socket
import subprocess
import time
from pathlib import Path

import pytest

from data_prep.criteo import Job, run_job
from data_prep.mpi import Comm
from data_prep.synth import generate
from hvctr.config import load_config, write_toml
from hvctr.checkpoint.format import write_manifest
from hvctr.plan.model import shard_bytes
from hvctr.train.preflight import (check_directories, check_identity, check_inputs, check_memory, fit_memory,
                                   first_checkpoint_bytes)
from hvctr.rundir import (IDENTITY_NAME, LOCK_NAME, RunLock, compare_identity, private_scratch_dir, run_identity,
                                write_identity)
from tests.conftest import REPO, VENV_PY, mpi_env

# `python -m hvctr` runs with its cwd outside the checkout, so that it imports the installed hvctr
# (tests/e2e/test_install.py runs these tests against a pip install, whose kernels are built there)

HOLD = ("import sys, time; from hvctr.rundir import RunLock; "
        "lock = RunLock(sys.argv[1]).acquire(); print('held', flush=True); time.sleep(120)")


@pytest.fixture
def holder(tmp_path):
    """A process holding tmp_path/run's lock, as a running job's rank 0 does."""
    run_dir = tmp_path / "run"
    p = subprocess.Popen([VENV_PY, "-c", HOLD, str(run_dir)], cwd=REPO, stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "held"
    yield run_dir, p
    p.kill()
    p.wait()


def test_second_job_fails_at_once_naming_the_holder(holder):
    run_dir, p = holder
    t0 = time.monotonic()
    with pytest.raises(ValueError) as e:
        RunLock(run_dir).acquire()
    assert time.monotonic() - t0 < 1.0
    msg = str(e.value)
    assert f"{run_dir} is in use by another job: host {socket.gethostname()} pid {p.pid}" in msg
    assert str(run_dir / LOCK_NAME) in msg


def test_a_killed_holder_leaves_a_stale_lock_that_is_taken_over(holder):
    run_dir, p = holder
    p.send_signal(signal.SIGKILL)
    p.wait()
    lock = RunLock(run_dir).acquire()
    assert lock.held
    assert f"stale lock of host {socket.gethostname()} pid {p.pid}" in lock.stale
    assert json.loads((run_dir / LOCK_NAME).read_text())["pid"] == os.getpid()
    lock.release()
    assert (run_dir / LOCK_NAME).read_text() == ""  # released: the next job sees no stale lock
    again = RunLock(run_dir).acquire()
    assert again.stale == ""
    again.release()


def test_hvctr_train_on_a_locked_run_directory_is_one_error_before_anything_is_read(holder, tmp_path):
    run_dir, p = holder
    r = subprocess.run([VENV_PY, "-m", "hvctr", "train", f"--train.run_dir={run_dir}",
                        f"--data.train_dir={tmp_path / 'no-data'}"], cwd=tmp_path, env=mpi_env(),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    errors = [line for line in r.stderr.splitlines() if "error" in line]
    assert errors == [f"hvctr train: error: {run_dir} is in use by another job: host {socket.gethostname()} "
                      f"pid {p.pid} (since {json.loads((run_dir / LOCK_NAME).read_text())['started']}, "
                      f"hvctr train) holds {run_dir / LOCK_NAME}; wait for that job to end (or stop it), or "
                      f"choose another train.run_dir"], r.stderr
    assert "Traceback" not in r.stderr
    assert sorted(x.name for x in run_dir.iterdir()) == [LOCK_NAME]


# --- identity --------------------------------------------------------------------------------


def _prep(root: Path, rows: int, shards: int) -> Path:
    root.mkdir(parents=True)
    generate(rows, seed=5, out=str(root / "in.tsv"))
    assert run_job(Comm(), Job((str(root / "in.tsv"),), str(root / "out"), shards, valid_fraction=0.2)) == 0
    return root / "out"


@pytest.fixture(scope="module")
def datasets(tmp_path_factory):
    base = tmp_path_factory.mktemp("identity-data")
    return _prep(base / "a", 3000, 2), _prep(base / "b", 3000, 3)


SMALL = ["--data.batch_size_per_rank=64", "--storage.rows_per_rank=100000", "--model.hidden=8",
         "--storage.dim=4"]


def _cfg(run_dir: Path, data: Path, *flags: str):
    return load_config(None, [f"--train.run_dir={run_dir}", f"--data.train_dir={data}", *SMALL, *flags])


def _started_run(run_dir: Path, data: Path):
    """A run directory as a first start on one rank leaves it once checkpoint 0 is written."""
    cfg, _ = check_inputs(_cfg(run_dir, data), 0, 1, resume=False)
    identity, notes = check_identity(cfg, run_dir, 1, resume=False)
    assert identity is not None and notes == []
    run_dir.mkdir(parents=True, exist_ok=True)
    write_identity(run_dir, identity)
    write_toml(cfg, run_dir / "config.toml")
    (run_dir / "checkpoints" / "ckpt-000000").mkdir(parents=True)
    write_manifest(run_dir / "checkpoints" / "ckpt-000000" / "manifest.json",
                   {"seq": 0, "world_size": 1, "chain": [0], "files": []})
    return cfg


def test_identity_records_config_data_world_size_and_kernel_path(datasets, tmp_path):
    data, _ = datasets
    identity = run_identity(_cfg(tmp_path / "run", data), 3)
    assert identity["config"]["storage"]["dim"] == 4 and identity["world_size"] == 3
    assert identity["kernels"] in ("native", "torch")
    assert identity["data"]["shards"] == 2 and len(identity["data"]["digest"]) == 64


def test_resume_with_other_model_data_or_rules_is_refused_with_every_difference(datasets, tmp_path):
    a, b = datasets
    run_dir = tmp_path / "run"
    _started_run(run_dir, a)
    cases = {
        ("--storage.dim=8", "--model.hidden=16"): ["model.hidden: [8] -> [16]", "storage.dim: 4 -> 8"],
        ("--train.seed=7", "--merge.every_k_steps=8", "--data.batch_size_per_rank=32"):
            ["data.batch_size_per_rank: 64 -> 32", "merge.every_k_steps: 4 -> 8", "train.seed: 1234 -> 7"],
    }
    for flags, want in cases.items():
        cfg, _ = check_inputs(_cfg(run_dir, a, *flags), 0, 1, resume=True)
        with pytest.raises(ValueError) as e:
            check_identity(cfg, run_dir, 1, resume=True)
        assert [line.strip() for line in str(e.value).splitlines()[1:-1]] == want
    cfg, _ = check_inputs(_cfg(run_dir, b), 0, 1, resume=True)
    with pytest.raises(ValueError, match=r"(?s)--resume: this run differs.*data: the training data differ "
                                         r"\(manifest digest .* 2 -> 3 shards;"):
        check_identity(cfg, run_dir, 1, resume=True)


def test_resume_lists_what_may_change(datasets, tmp_path):
    a, _ = datasets
    run_dir = tmp_path / "run"
    _started_run(run_dir, a)
    cfg, _ = check_inputs(_cfg(run_dir, a, "--train.dense_lr=0.5", "--metrics.log_every_steps=3"), 0, 1, resume=True)
    identity, notes = check_identity(cfg, run_dir, 1, resume=True)
    assert identity is None  # the first start's identity stays
    assert [n.strip() for n in notes[1:]] == ["metrics.log_every_steps: 20 -> 3", "train.dense_lr: 0.001 -> 0.5"]
    same, _ = check_inputs(_cfg(run_dir, a), 0, 1, resume=True)
    assert check_identity(same, run_dir, 1, resume=True) == (None, [])


def test_compare_lists_a_key_the_saved_identity_lacks_as_a_change():
    saved = {"config": {"storage": {"dim": 4}}, "data": {"digest": "d"}, "world_size": 2, "kernels": "native"}
    now = {"config": {"storage": {"dim": 4, "new_key": 1}}, "data": {"digest": "d"}, "world_size": 4,
           "kernels": "torch"}
    assert compare_identity(saved, now) == ([], ["kernels: 'native' -> 'torch'", "storage.new_key: '<not recorded>' -> 1",
                                                 "world_size: 2 -> 4"])


def test_a_refused_resume_through_hvctr_train_writes_nothing(datasets, tmp_path):
    a, _ = datasets
    run_dir = tmp_path / "run"
    _started_run(run_dir, a)
    before = {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()}
    r = subprocess.run([VENV_PY, "-m", "hvctr", "train", "--config", str(run_dir / "config.toml"), "--resume",
                        "--storage.dim=8"], cwd=tmp_path, env=mpi_env(), capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "hvctr train: error: --resume: this run differs" in r.stderr and "storage.dim: 4 -> 8" in r.stderr
    assert r.stderr.count("storage.dim: 4 -> 8") == 1 and "Traceback" not in r.stderr
    after = {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()}
    assert after.pop(LOCK_NAME) == b""  # taken and released
    assert after == before and {IDENTITY_NAME, "config.toml"} <= set(after)
    assert sorted(p.name for p in run_dir.iterdir() if p.is_dir()) == ["checkpoints"]  # no logs/, no shards/


# --- the directories a job writes, before Horovod starts ------------------------------------


@pytest.mark.parametrize("where", ["run_dir_is_a_file", "run_dir_under_a_file", "checkpoint_dir_under_a_file",
                                   "shard_dir_is_a_file"])
def test_unusable_directories_are_named_with_their_config_key(datasets, tmp_path, where):
    a, _ = datasets
    blocker = tmp_path / "file"
    blocker.write_text("x")
    run_dir, flags = tmp_path / "run", []
    if where == "run_dir_is_a_file":
        run_dir, want = blocker, f"config key 'train.run_dir': cannot use {blocker} as a directory: {blocker} is a file"
    elif where == "run_dir_under_a_file":
        run_dir, want = blocker / "run", f"config key 'train.run_dir': cannot use {blocker}/run as a directory: " \
                                         f"{blocker} is a file, not a directory"
    elif where == "checkpoint_dir_under_a_file":
        flags, want = [f"--checkpoint.dir={blocker}/ck"], f"config key 'checkpoint.dir': cannot use {blocker}/ck"
    else:
        flags, want = [f"--storage.shard_dir={blocker}"], f"config key 'storage.shard_dir': cannot use {blocker} as"
    cfg = _cfg(run_dir, a, *flags)
    with pytest.raises(ValueError) as e:
        check_directories(cfg, 0, 2, run_dir, env={})
    assert str(e.value).startswith(want), str(e.value)


def test_a_read_only_run_directory_is_named(datasets, tmpfs):
    a, _ = datasets
    ro = tmpfs(1 << 20)
    r = subprocess.run(["mount", "-o", "remount,ro", str(ro)], capture_output=True, text=True)
    if r.returncode:
        pytest.skip(f"cannot remount read-only: {r.stderr.strip()}")
    with pytest.raises(ValueError, match=rf"config key 'train.run_dir': cannot create {ro}/run: "
                                         rf"Read-only file system \(in {ro}\)"):
        check_directories(_cfg(ro / "run", a), 0, 1, ro / "run", env={})


def test_too_little_space_for_the_shard_and_first_checkpoint_is_named(datasets, tmpfs):
    a, _ = datasets
    small = tmpfs(4 << 20)
    cfg = _cfg(small / "run", a, "--storage.rows_per_rank=200000")  # a 16 MiB shard
    with pytest.raises(ValueError) as e:
        check_directories(cfg, 0, 2, small / "run", env={"OMPI_COMM_WORLD_LOCAL_SIZE": "2"})
    msg = str(e.value)
    assert msg.startswith(f"not enough free space on the file system of {small}: 4.0 MiB free, "), msg
    assert "the first checkpoint (2 rank file(s)): " in msg
    assert "2 working shard(s) of 200,000 rows (storage.rows_per_rank)" in msg and f"in {small}/run/shards" in msg
    assert [p for p in small.rglob("*") if p.is_file()] == []  # the write probes leave nothing


def test_room_for_the_shard_but_maybe_not_the_first_checkpoint_is_a_warning(datasets, tmpfs):
    a, _ = datasets
    cfg = _cfg(Path("/unused"), a)
    dense, most = first_checkpoint_bytes(cfg, 1)
    shard = shard_bytes(cfg.storage.rows_per_rank, cfg.storage.dim, cfg.storage.max_load_factor)["total"]
    assert most > dense + (1 << 20)
    disk = tmpfs(shard + dense + (1 << 20) - (shard + dense) % 4096)
    warnings = check_directories(_cfg(disk / "run", a), 0, 1, disk / "run", env={})
    assert len(warnings) == 1 and warnings[0].startswith(
        f"the file system of {disk} may run out of space at the first checkpoint: "), warnings


def test_hvctr_train_with_a_run_directory_under_a_file_stops_before_horovod(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    r = subprocess.run([VENV_PY, "-m", "hvctr", "train", f"--train.run_dir={blocker}/run",
                        f"--data.train_dir={tmp_path}"], cwd=tmp_path, env=mpi_env(),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip() == (f"hvctr train: error: config key 'train.run_dir': cannot use {blocker}/run as a "
                                f"directory: {blocker} is a file, not a directory")


# --- memory: the CPU caches against what the node has --------------------------------------


def test_a_cache_larger_than_available_memory_is_named(datasets, tmp_path):
    a, _ = datasets
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       8000000 kB\nMemAvailable:   4194304 kB\n")  # 4 GiB
    cfg = _cfg(tmp_path / "run", a, "--storage.cpu_cache_bytes=3000000000")
    check_memory(cfg, env={}, meminfo=str(meminfo), cgroup="")  # one rank: 2.8 GiB fit
    with pytest.raises(ValueError, match=r"config key 'storage.cpu_cache_bytes': 3,000,000,000 bytes per rank x 2 "
                                         r"rank\(s\) on this node = 5.59 GiB, but only 4.00 GiB are available "
                                         r"\(MemAvailable in .*meminfo\); set it to at most about 1,610,612,736"):
        check_memory(cfg, env={"OMPI_COMM_WORLD_LOCAL_SIZE": "2"}, meminfo=str(meminfo), cgroup="")
    cg = tmp_path / "cg"  # cgroup v2: 3 GiB, 1 GiB charged of which 0.5 GiB clean page cache
    cg.mkdir()
    (cg / "memory.max").write_text(str(3 << 30))
    (cg / "memory.current").write_text(str(1 << 30))
    (cg / "memory.stat").write_text(f"anon {1 << 29}\nfile {1 << 29}\nfile_dirty 0\n")
    with pytest.raises(ValueError, match=r"only 2.50 GiB are available \(the memory cgroup's limit .*cg/memory.max "
                                         r"less what it holds that cannot be reclaimed"):
        check_memory(cfg, env={}, meminfo=str(meminfo), cgroup=str(cg))
    v1 = tmp_path / "v1"  # cgroup v1 (Slurm's ConstrainRAMSpace on older nodes): page cache counts too
    v1.mkdir()
    (v1 / "memory.limit_in_bytes").write_text(str(2 << 30))
    (v1 / "memory.usage_in_bytes").write_text(str(1 << 30))
    (v1 / "memory.stat").write_text(f"cache {1 << 29}\nrss {1 << 29}\ndirty {1 << 28}\n"
                                    f"total_cache {1 << 29}\ntotal_rss {1 << 29}\ntotal_dirty {1 << 28}\n")
    with pytest.raises(ValueError, match=r"only 1.25 GiB are available \(the memory cgroup's limit .*v1/memory.limit_in_bytes"):
        check_memory(cfg, env={}, meminfo=str(meminfo), cgroup=str(v1))
    small = _cfg(tmp_path / "run", a, "--storage.cpu_cache_bytes=1150000000")  # 1.07 GiB of 1.25: fits, barely
    [note] = check_memory(small, env={}, meminfo=str(meminfo), cgroup=str(v1))
    assert note.startswith("memory: the memory cgroup's limit ") and "leaves 183 MiB per rank beside " \
        "storage.cpu_cache_bytes (1 rank(s) on this node)" in note and "OOM-killed" in note
    assert check_memory(small, env={}, meminfo=str(meminfo), cgroup="") == []  # no cgroup: MemAvailable alone
    # storage.pull_ahead holds another window: off where the memory is short, on where it is not
    assert small.storage.pull_ahead
    run_cfg, notes = fit_memory(small, env={}, meminfo=str(meminfo), cgroup=str(v1))
    assert not run_cfg.storage.pull_ahead and notes[-1].startswith("storage.pull_ahead is off for this run")
    assert notes[0].startswith("memory: the memory cgroup's limit ")
    assert fit_memory(small, env={}, meminfo=str(meminfo), cgroup="") == (small, [])


def test_hvctr_train_with_a_cache_beyond_the_machine_stops_before_horovod(datasets, tmp_path):
    a, _ = datasets
    r = subprocess.run([VENV_PY, "-m", "hvctr", "train", f"--train.run_dir={tmp_path / 'run'}", f"--data.train_dir={a}",
                        *SMALL, "--storage.cpu_cache_bytes=1e15"], cwd=tmp_path, env=mpi_env(),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith("hvctr train: error: config key 'storage.cpu_cache_bytes': 1,000,000,000,000,000 "
                               "bytes per rank x 1 rank(s) on this node"), r.stderr
    assert "Traceback" not in r.stderr and r.stderr.count("\n") == 1


# --- scratch directories under a world-writable place ---------------------------------------


def test_scratch_shard_directories_are_this_users_alone(tmp_path):
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    os.chmod(scratch, 0o1777)  # as /tmp
    mine = private_scratch_dir(scratch / "hvctr-shards" / "run-abc")
    assert stat.S_IMODE(mine.stat().st_mode) == 0o700 and mine.stat().st_uid == os.getuid()
    assert stat.S_IMODE((scratch / "hvctr-shards").stat().st_mode) == 0o1777
    assert private_scratch_dir(mine) == mine  # a requeued start finds it again


@pytest.mark.parametrize("planted", ["symlink", "other_users_dir", "open_dir", "open_shared_dir"])
def test_a_planted_scratch_directory_is_refused(tmp_path, planted):
    shared = tmp_path / "tmp" / "hvctr-shards"
    shared.mkdir(parents=True)
    os.chmod(shared, 0o1777)
    target = shared / "run-abc"
    if planted == "symlink":
        (tmp_path / "elsewhere").mkdir()
        target.symlink_to(tmp_path / "elsewhere")
        want = rf"{target} is a symbolic link \(to {tmp_path / 'elsewhere'}\), not a directory"
    elif planted == "open_shared_dir":
        os.chmod(shared, 0o777)  # writable by all, not sticky: anyone could replace the run's directory
        want = rf"{shared} is not a safe scratch directory \(uid \d+, mode drwxrwxrwx\)"
    else:
        target.mkdir(0o777)
        os.chmod(target, 0o777)
        if planted == "other_users_dir":
            if os.getuid() != 0:
                pytest.skip("chown to another user needs root")
            os.chown(target, 65534, 65534)
        want = rf"{target} is not a safe scratch directory \(uid \d+, mode drwxrwxrwx\): it must be a directory owned"
    with pytest.raises(ValueError, match=want):
        private_scratch_dir(target)
    assert not (tmp_path / "elsewhere").exists() or list((tmp_path / "elsewhere").iterdir()) == []
