"""Whole training jobs for the e2e tests: a small data set, jobs under mpirun, model comparison.

Small data (synthetic, made by data_prep once per test session) and a small MLP, so that each
job takes seconds on 2 cores; the rules under test do not depend on size.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import h5py
import numpy as np

from tests.conftest import REPO, VENV_PY, mpi_env

SMALL = ["--model.hidden=32,16", "--storage.dim=8", "--data.batch_size_per_rank=256",
         "--storage.rows_per_rank=200000", "--metrics.log_every_steps=10",
         "--train.dense_lr=0.01", "--train.sparse_lr=0.01"]


def make_dataset(tmp_path_factory) -> Path:
    """The session's data set (30k synthetic rows, 6 shards, 10% validation), built once.

    Shared by every e2e module: tests that damage data copy it first.
    """
    root = tmp_path_factory.getbasetemp() / "e2e-train-data"
    shards = root / "shards"
    if (shards / "manifest.json").is_file() and json.loads((shards / "manifest.json").read_text())["state"] == "complete":
        return shards
    root.mkdir(exist_ok=True)
    tsv = root / "synth.tsv"
    subprocess.run([VENV_PY, "-m", "data_prep", "synth", "--rows", "30000", "--seed", "3", "--out", str(tsv)],
                   check=True, capture_output=True, timeout=300)
    subprocess.run([VENV_PY, "-m", "data_prep", "criteo", "--input", str(tsv), "--out", str(shards),
                    "--shards", "6", "--valid-fraction", "0.1"], check=True, capture_output=True, timeout=300)
    return shards


def copy_checkout(dest: Path) -> Path:
    """The checkout's files as a clean clone would have them plus uncommitted work: tracked and
    untracked-not-ignored files (no .venv, no built library)."""
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                           capture_output=True, text=True, check=True).stdout
    for rel in filter(None, files.split("\0")):
        src = REPO / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    return dest


def job_env() -> dict[str, str]:
    # OpenMPI's allreduce algorithm pinned: its choice varies with message size, and bit-equal
    # comparisons need the same summation order in both runs.
    return mpi_env(OMPI_MCA_coll_tuned_use_dynamic_rules="1", OMPI_MCA_coll_tuned_allreduce_algorithm="4")


def train_cmd(np_: int, run_dir: Path, data: Path, *flags: str, resume: bool = False) -> list[str]:
    cmd = ["mpirun", "-np", str(np_), "--bind-to", "none", VENV_PY, "-m", "mpi4py", "-m", "hvctr", "train",
           f"--data.train_dir={data}", f"--train.run_dir={run_dir}", *SMALL, *flags]
    return cmd + ["--resume"] if resume else cmd


def train(np_: int, run_dir: Path, data: Path, *flags: str, resume: bool = False, check: bool = True,
          timeout: int = 300) -> subprocess.CompletedProcess:
    r = subprocess.run(train_cmd(np_, run_dir, data, *flags, resume=resume), env=job_env(),
                       capture_output=True, text=True, timeout=timeout)
    if check and r.returncode != 0:
        raise AssertionError(f"training failed ({r.returncode}):\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}")
    return r


def launch(np_: int, run_dir: Path, data: Path, *flags: str, resume: bool = False,
           log: Path | None = None) -> subprocess.Popen:
    """A job in its own process group (so a test can signal all of it); output to ``log``."""
    out = open(log, "w") if log else subprocess.DEVNULL
    try:
        return subprocess.Popen(train_cmd(np_, run_dir, data, *flags, resume=resume), env=job_env(),
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    finally:
        if log:
            out.close()


def session_pids(session: int) -> list[int]:
    """Every process of a session: mpirun (the leader, started with start_new_session) and its
    ranks, which OpenMPI puts in process groups of their own (so killpg reaches mpirun only)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if int(fields[3]) == session:
                pids.append(int(entry))
    return pids


def signal_job(p: subprocess.Popen, sig: int) -> None:
    """Sends ``sig`` to mpirun and to every rank of a job started by ``launch``."""
    for pid in session_pids(p.pid):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def kill_after_checkpoint(cmd_flags: list[str], np_: int, run: Path, data: Path, seq: int) -> None:
    """Runs a job and SIGKILLs all of it once checkpoint ``seq`` is complete."""
    p = launch(np_, run, data, *cmd_flags)
    marker = run / "checkpoints" / f"ckpt-{seq:06d}" / "manifest.json"
    deadline = time.monotonic() + 240
    while not marker.exists() and p.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    signal_job(p, signal.SIGKILL)
    p.wait(timeout=60)
    assert marker.exists(), "the job ended before the checkpoint to kill after"


def final_model(run_dir: Path) -> tuple[dict[str, np.ndarray], dict[int, np.ndarray]]:
    """Dense tensors of rank 0 and every sparse row (key -> row) of the newest checkpoint."""
    ck = run_dir / "checkpoints"
    manifests = sorted((json.loads(p.read_text()) for p in ck.glob("ckpt-*/manifest.json")), key=lambda m: m["seq"])
    last = manifests[-1]
    keys_parts, rows_parts = [], []
    for seq in last["chain"]:
        for rec in next(m for m in manifests if m["seq"] == seq)["files"]:
            with h5py.File(ck / f"ckpt-{seq:06d}" / rec["file"], "r") as f:
                keys_parts.append(f["keys"][...])
                rows_parts.append(f["rows"][...])
    keys, rows = np.concatenate(keys_parts), np.concatenate(rows_parts)
    # later chain members win: take each key's last occurrence
    _, last_idx = np.unique(keys[::-1], return_index=True)
    idx = keys.size - 1 - last_idx
    sparse = dict(zip(keys[idx].tolist(), rows[idx]))
    with h5py.File(ck / f"ckpt-{last['seq']:06d}" / "rank-00000.h5", "r") as f:
        dense = {k: v[...] for k, v in f["dense"].items()}
    return dense, sparse


def assert_same_model(a: Path, b: Path) -> None:
    da, sa = final_model(a)
    db, sb = final_model(b)
    assert da.keys() == db.keys()
    for k in da:
        assert np.array_equal(da[k], db[k]), f"dense tensor {k} differs"
    assert sa.keys() == sb.keys()
    keys = sorted(sa)
    assert np.array_equal(np.stack([sa[k] for k in keys]), np.stack([sb[k] for k in keys])), "sparse rows differ"
