"""Defaults inside a Slurm allocation, under a faked one: the job's environment variables set
on a real `hvctr train` process (nothing of hvctr replaced).

- torch threads of an unbound rank: the cpus it may use / the ranks sharing them on the node
  (SLURM_NTASKS_PER_NODE here), at most SLURM_CPUS_PER_TASK, logged by rank 0;
- working shards on node-local scratch ($SLURM_TMPDIR, on another file system than the run
  directory), logged, and gone when the job ends;
- data verification once per data set: a full check writes a stamp beside the manifest, a
  requeued start hashes nothing, a shard whose mtime changed is hashed again, a read-only data
  directory keeps its stamp in the run directory.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from tests.conftest import VENV_PY, mount_tmpfs, unmount
from tests.e2e.helpers import SMALL, make_dataset

FLAGS = [*SMALL, "--train.max_steps=4", "--merge.every_k_steps=2"]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    # a copy: this module writes stamps beside the manifest and must not touch the shared data set
    src = make_dataset(tmp_path_factory)
    dst = tmp_path_factory.mktemp("alloc-data") / "shards"
    shutil.copytree(src, dst)
    (dst / "manifest.verified.json").unlink(missing_ok=True)
    return dst


def slurm_env(**extra: str) -> dict[str, str]:
    """This process's environment without any launcher's variables, plus a faked allocation."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "OMPI_", "PMIX_", "MPI_LOCAL")) and k != "TMPDIR"}
    env.update(SLURM_JOB_ID="4242", SLURM_JOB_NAME="hvctr-train", SLURM_NODEID="0", SLURM_PROCID="0",
               SLURM_LOCALID="0", SLURM_CPU_BIND_TYPE="none", **extra)
    return env


def hvctr_train(run: Path, data: Path, env: dict[str, str], *flags: str) -> subprocess.CompletedProcess:
    r = subprocess.run([VENV_PY, "-m", "hvctr", "train", f"--data.train_dir={data}", f"--train.run_dir={run}",
                        *FLAGS, *flags], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
    return r


@pytest.fixture
def node_scratch(tmp_path):
    """A directory on another file system than tmp_path: /dev/shm, else a tmpfs mounted here."""
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK) and shm.stat().st_dev != tmp_path.stat().st_dev:
        d = Path(tempfile.mkdtemp(prefix="hvctr-test-", dir=shm))
        yield d
        shutil.rmtree(d, ignore_errors=True)
    else:
        d = mount_tmpfs(tmp_path / "scratch", 256 << 20)
        yield d
        unmount(d)


def test_threads_and_scratch_in_an_allocation(dataset, tmp_path, node_scratch):
    cpus = len(os.sched_getaffinity(0))
    run = tmp_path / "run"
    env = slurm_env(SLURM_NTASKS_PER_NODE="2", SLURM_CPUS_PER_TASK="1", SLURM_TMPDIR=str(node_scratch))
    r = hvctr_train(run, dataset, env)
    want = f"torch threads: 1 on rank 0, from {cpus} cpus in the affinity mask / 2 ranks sharing them (SLURM_NTASKS_PER_NODE)"
    assert want in r.stdout, r.stdout[-3000:]
    assert f"working shards: {node_scratch}/hvctr-shards/run-" in r.stdout
    assert "$SLURM_TMPDIR (node-local scratch)" in r.stdout and "removed at exit" in r.stdout
    assert not (run / "shards").exists() and (run / "checkpoints").is_dir()
    assert [p for p in node_scratch.rglob("*") if p.is_file()] == []  # removed with the job

    # A mask no larger than SLURM_CPUS_PER_TASK is the rank's own (srun bound it): all of it
    r = hvctr_train(tmp_path / "one", dataset, slurm_env(SLURM_NTASKS_PER_NODE="1", SLURM_CPUS_PER_TASK="64"))
    assert (f"torch threads: {cpus} on rank 0, from {cpus} cpus in the rank's own affinity mask "
            f"(SLURM_CPUS_PER_TASK=64)") in r.stdout
    # train.threads still wins; without scratch the run directory holds the shards
    r = hvctr_train(tmp_path / "explicit", dataset, slurm_env(SLURM_NTASKS_PER_NODE="2"), "--train.threads=2")
    assert "torch threads: 2 on rank 0, from train.threads" in r.stdout
    assert f"working shards: {tmp_path / 'explicit' / 'shards'} (rank 0; from the run directory" in r.stdout


def _checked(out: str) -> str:
    m = re.search(r"data: .*\(data\.verify = \w+\)", out)
    assert m, out[-3000:]
    return m.group(0)


def test_data_verified_once_per_data_set(dataset, tmp_path):
    env = slurm_env(SLURM_NTASKS_PER_NODE="1")
    stamp = dataset / "manifest.verified.json"
    stamp.unlink(missing_ok=True)
    line = _checked(hvctr_train(tmp_path / "a", dataset, env).stdout)
    assert "6 of 6 train shard files checked" in line and "no stamp yet" in line and str(stamp) in line
    assert stamp.is_file() and not list(dataset.glob("*.tmp"))

    # a requeued start (same run directory, --resume) hashes nothing
    r = hvctr_train(tmp_path / "a", dataset, env, "--train.max_steps=6", "--resume")
    assert "6 train shard files unchanged since the verification stamp" in _checked(r.stdout)

    # a shard whose mtime changed is hashed again, alone
    shard = dataset / "train-00002.h5"
    st = shard.stat()
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    line = _checked(hvctr_train(tmp_path / "b", dataset, env).stdout)
    assert "1 of 6 train shard files checked" in line and "changed since the stamp" in line

    # data.verify = full: every start hashes all; off: none
    assert "6 train shard files checked" in _checked(hvctr_train(tmp_path / "c", dataset, env, "--data.verify=full").stdout)
    assert "data: " not in hvctr_train(tmp_path / "d", dataset, env, "--data.verify=off").stdout


def test_read_only_data_keeps_the_stamp_in_the_run_directory(dataset, tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    src = tmp_path / "rw"
    shutil.copytree(dataset, src)
    (src / "manifest.verified.json").unlink(missing_ok=True)
    if subprocess.run(["mount", "--bind", str(src), str(ro)], capture_output=True).returncode != 0:
        pytest.skip("cannot bind-mount (needs root) to make a read-only data directory")
    try:
        if subprocess.run(["mount", "-o", "remount,ro,bind", str(ro)], capture_output=True).returncode != 0:
            pytest.skip("cannot remount read-only")
        env = slurm_env(SLURM_NTASKS_PER_NODE="1")
        run = tmp_path / "run"
        r = hvctr_train(run, ro, env)
        assert "cannot write the verification stamp" in r.stdout + r.stderr
        assert "keeping it in the run directory" in r.stdout + r.stderr
        assert str(run / "data-verified.json") in _checked(r.stdout)
        r = hvctr_train(run, ro, env, "--train.max_steps=6", "--resume")
        assert f"unchanged since the verification stamp {run / 'data-verified.json'}" in _checked(r.stdout)
    finally:
        unmount(ro)
