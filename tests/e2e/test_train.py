"""Whole training jobs under mpirun: exactness of prefetch and resume, sync and k-step modes.

Small data (synthetic, made by data_prep once per session) and a small MLP, so that each job
takes seconds on 2 cores; the rules under test do not depend on size.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import h5py
import numpy as np
import pytest

from tests.conftest import VENV_PY, mpi_env

SMALL = ["--model.hidden=32,16", "--storage.dim=8", "--data.batch_size_per_rank=256",
         "--storage.rows_per_rank=200000", "--metrics.log_every_steps=10",
         "--train.dense_lr=0.01", "--train.sparse_lr=0.01"]


@pytest.fixture(scope="session")
def dataset(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("data")
    tsv = root / "synth.tsv"
    subprocess.run([VENV_PY, "-m", "data_prep", "synth", "--rows", "30000", "--seed", "3", "--out", str(tsv)],
                   check=True, capture_output=True, timeout=300)
    subprocess.run([VENV_PY, "-m", "data_prep", "criteo", "--input", str(tsv), "--out", str(root / "shards"),
                    "--shards", "6", "--valid-fraction", "0.1"], check=True, capture_output=True, timeout=300)
    return root / "shards"


def train(np_: int, run_dir: Path, data: Path, *flags: str, resume: bool = False, check: bool = True,
          timeout: int = 300) -> subprocess.CompletedProcess:
    cmd = ["mpirun", "-np", str(np_), "--bind-to", "none", VENV_PY, "-m", "mpi4py", "-m", "hvctr", "train",
           f"--data.train_dir={data}", f"--train.run_dir={run_dir}", *SMALL, *flags]
    if resume:
        cmd.append("--resume")
    r = subprocess.run(cmd, env=mpi_env(OMPI_MCA_coll_tuned_use_dynamic_rules="1",
                                        OMPI_MCA_coll_tuned_allreduce_algorithm="4"),
                       capture_output=True, text=True, timeout=timeout)
    if check and r.returncode != 0:
        raise AssertionError(f"training failed ({r.returncode}):\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}")
    return r


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


def test_kstep_run_reports_and_learns(dataset, tmp_path):
    run = tmp_path / "run"
    r = train(2, run, dataset, "--merge.every_k_steps=4")
    summary = json.loads((run / "summary.json").read_text())
    assert summary["eval"]["auc"] > 0.62, summary["eval"]
    assert 0.5 < summary["eval"]["copc"] < 1.5
    assert summary["steps"] > 0 and summary["dense_merge_calls"] > 0
    assert (run / "config.toml").is_file() and (run / "logs" / "rank-00001.log").is_file()
    progress = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert any(e["event"] == "progress" for e in progress)
    assert "AUC" in r.stdout and "samples/s" in r.stdout


@pytest.mark.parametrize("cache_bytes", ["2e5", "1e9"], ids=["cache10pct", "cache100pct"])
def test_prefetch_on_off_bit_equal(dataset, tmp_path, cache_bytes):
    flags = ["--merge.every_k_steps=4", f"--storage.cpu_cache_bytes={cache_bytes}", "--train.max_steps=24"]
    train(2, tmp_path / "on", dataset, *flags, "--data.prefetch=true")
    train(2, tmp_path / "off", dataset, *flags, "--data.prefetch=false")
    assert_same_model(tmp_path / "on", tmp_path / "off")


def test_sync_mode_runs_and_learns(dataset, tmp_path):
    run = tmp_path / "sync"
    train(2, run, dataset, "--merge.mode=sync", "--train.max_steps=40")
    summary = json.loads((run / "summary.json").read_text())
    assert summary["dense_merge_calls"] == summary["steps"]
    assert summary["eval"]["auc"] > 0.6


def _kill_after_checkpoint(cmd_flags: list[str], np_: int, run: Path, data: Path, seq: int) -> None:
    cmd = ["mpirun", "-np", str(np_), "--bind-to", "none", VENV_PY, "-m", "mpi4py", "-m", "hvctr", "train",
           f"--data.train_dir={data}", f"--train.run_dir={run}", *SMALL, *cmd_flags]
    p = subprocess.Popen(cmd, env=mpi_env(OMPI_MCA_coll_tuned_use_dynamic_rules="1",
                                          OMPI_MCA_coll_tuned_allreduce_algorithm="4"),
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    marker = run / "checkpoints" / f"ckpt-{seq:06d}" / "manifest.json"
    deadline = time.monotonic() + 240
    while not marker.exists() and p.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    os.killpg(p.pid, signal.SIGKILL)
    p.wait(timeout=60)
    assert marker.exists(), "the job ended before the checkpoint to kill after"


@pytest.mark.parametrize("np_", [2, 3])
def test_resume_after_kill_is_bit_equal(dataset, tmp_path, np_):
    flags = ["--merge.every_k_steps=2", "--checkpoint.every_windows=3", "--checkpoint.compact_every=2",
             "--storage.cpu_cache_bytes=3e5", "--train.max_steps=30"]
    train(np_, tmp_path / "whole", dataset, *flags)
    _kill_after_checkpoint(flags, np_, tmp_path / "cut", dataset, seq=2)
    train(np_, tmp_path / "cut", dataset, *flags, resume=True)
    assert_same_model(tmp_path / "whole", tmp_path / "cut")
