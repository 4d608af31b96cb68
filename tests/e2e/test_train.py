"""Whole training jobs under mpirun: exactness of prefetch and resume, sync and k-step modes.

Small data (synthetic, made by data_prep once per session) and a small MLP, so that each job
takes seconds on 2 cores; the rules under test do not depend on size.
"""

from __future__ import annotations

import json
from pathlib import Path

import h5py
import pytest

from tests.e2e.helpers import assert_same_model, kill_after_checkpoint, make_dataset, train


@pytest.fixture(scope="session")
def dataset(tmp_path_factory) -> Path:
    return make_dataset(tmp_path_factory)


def test_kstep_run_reports_and_learns(dataset, tmp_path):
    run = tmp_path / "run"
    r = train(2, run, dataset, "--merge.every_k_steps=4")
    summary = json.loads((run / "summary.json").read_text())
    assert summary["eval"]["auc"] > 0.62, summary["eval"]
    assert 0.5 < summary["eval"]["copc"] < 1.5
    ev = summary["eval"]
    assert ev["calibration"] == pytest.approx(1 / ev["copc"]) and 0 < ev["ne"] < 1
    assert summary["steps"] > 0 and summary["dense_merge_calls"] > 0
    assert (run / "config.toml").is_file() and (run / "logs" / "rank-00001.log").is_file()
    progress = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert any(e["event"] == "progress" for e in progress)
    assert "AUC" in r.stdout and "samples/s" in r.stdout and "NE " in r.stdout
    assert " eta " in r.stdout  # progress lines: time left and the date and time it ends
    # the default threads take every cpu a rank has: no core to spare for pushing behind
    assert "storage.push_behind auto: off (rank 0:" in r.stdout


def test_validation_during_training_is_logged_and_read_only(dataset, tmp_path):
    flags = ["--merge.every_k_steps=4", "--train.max_steps=24", "--storage.cpu_cache_bytes=2e5"]
    # pushing behind: each validation first sends the rows the last push left behind
    r = train(2, tmp_path / "eval", dataset, *flags, "--metrics.eval_every_windows=2", "--storage.push_behind=on")
    train(2, tmp_path / "plain", dataset, *flags)
    assert_same_model(tmp_path / "eval", tmp_path / "plain")  # evaluating changed nothing
    events = [json.loads(line) for line in (tmp_path / "eval" / "metrics.jsonl").read_text().splitlines()]
    evals = [e for e in events if e["event"] == "eval"]
    # windows of 4 steps, every 2nd window: steps 8 and 16, then the final pass at 24
    assert [(e["step"], e["final"]) for e in evals] == [(8, False), (16, False), (24, True)]
    assert all(0.5 < e["auc"] < 1 and e["ne"] > 0 and e["count"] > 0 for e in evals)
    assert r.stdout.count("validation at step") == 3
    plain = [e for e in (json.loads(x) for x in (tmp_path / "plain" / "metrics.jsonl").read_text().splitlines())
             if e["event"] == "eval"]
    assert [(e["step"], e["final"]) for e in plain] == [(24, True)]


@pytest.mark.parametrize("cache_bytes", ["2e5", "1e9"], ids=["cache10pct", "cache100pct"])
def test_prefetch_on_off_bit_equal(dataset, tmp_path, cache_bytes):
    """Prefetch on with storage.pull_ahead and storage.push_behind pulls in the
    prefetch thread the next window's rows no rank holds now, and pushes there the rows the
    next window does not hold, after its pull; with storage.defer_writes in place of
    push_behind, the push writes those rows after the next pull, beside its steps; prefetch
    off pulls and pushes every row at the window's end; prefetch on without pull_ahead pulls
    every row after the push: the same model all four ways."""
    flags = ["--merge.every_k_steps=4", f"--storage.cpu_cache_bytes={cache_bytes}", "--train.max_steps=24"]
    runs = ("on", "defer", "off", "now")
    train(2, tmp_path / "on", dataset, *flags, "--data.prefetch=true", "--storage.push_behind=on")
    train(2, tmp_path / "defer", dataset, *flags, "--data.prefetch=true", "--storage.push_behind=off",
          "--storage.defer_writes=true")
    train(2, tmp_path / "off", dataset, *flags, "--data.prefetch=false", "--storage.defer_writes=true")
    train(2, tmp_path / "now", dataset, *flags, "--data.prefetch=true", "--storage.pull_ahead=false")
    summaries = [json.loads((tmp_path / run / "summary.json").read_text()) for run in runs]
    behind = [s["exchange"].get("push_behind_rows", 0) for s in summaries]
    assert behind[0] > 0 and behind[1:] == [0, 0, 0], behind
    deferred = [s["store"]["deferred_rows"] for s in summaries]
    assert deferred[1] > 0 and deferred[0] == deferred[2] == deferred[3] == 0, deferred
    ahead = [(s["exchange"].get("ahead_rows", 0), s["exchange"].get("ahead_late_rows", 0)) for s in summaries]
    assert all(a > 0 and b > 0 for a, b in ahead[:2]) and ahead[2:] == [(0, 0), (0, 0)], ahead
    for run in runs[1:]:
        assert_same_model(tmp_path / "on", tmp_path / run)


def test_position_log_changes_no_value(dataset, tmp_path):
    """Two passes with a small cache: the second pass's windows find the rows the first pass's
    found through the shard's position log (storage.position_log), not their index blocks; the
    model is the one trained without the log."""
    flags = ["--merge.every_k_steps=4", "--storage.cpu_cache_bytes=3e5", "--train.epochs=2"]
    r = train(2, tmp_path / "log", dataset, *flags)
    # out of core (a cache of about 1% of the shard's rows): pushing behind is on, storage.push_behind = auto
    assert "storage.push_behind auto: on (rank 0:" in r.stdout
    train(2, tmp_path / "nolog", dataset, *flags, "--storage.position_log=false")
    stores = [json.loads((tmp_path / run / "summary.json").read_text())["store"] for run in ("log", "nolog")]
    assert stores[0]["recalled_positions"] > 1000 and stores[1]["recalled_positions"] == 0
    traffic = [json.loads((tmp_path / run / "summary.json").read_text())["shard_traffic"] for run in ("log", "nolog")]
    blocks = [sum(t[c]["index_blocks_read"] for c in ("warm", "pull", "push")) for t in traffic]
    assert blocks[0] < 0.6 * blocks[1], blocks  # seen: 14.8k against 47.7k (the first pass reads them all)
    assert_same_model(tmp_path / "log", tmp_path / "nolog")


def test_sync_mode_runs_and_learns(dataset, tmp_path):
    run = tmp_path / "sync"
    train(2, run, dataset, "--merge.mode=sync", "--train.max_steps=40")
    summary = json.loads((run / "summary.json").read_text())
    assert summary["dense_merge_calls"] == summary["steps"]
    assert summary["eval"]["auc"] > 0.6


def test_rowwise_adagrad_learns_and_its_run_resumes_with_it_only(dataset, tmp_path):
    """train.sparse_optimizer = rowwise_adagrad: D + 3 floats a row in the working shards and the
    checkpoints; a resume with another optimiser is refused before anything is written."""
    run = tmp_path / "adagrad"
    flags = ["--train.sparse_optimizer=rowwise_adagrad", "--train.sparse_lr=0.05", "--train.max_steps=32"]
    train(2, run, dataset, *flags)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["eval"]["auc"] > 0.6, summary["eval"]
    ck = sorted((run / "checkpoints").glob("ckpt-*/rank-00000.h5"))[-1]
    with h5py.File(ck, "r") as f:
        assert f["rows"].shape[1] == 8 + 3 and f.attrs["sparse_optimizer"] == "rowwise_adagrad"
    before = sorted(p.name for p in (run / "checkpoints").iterdir())
    r = train(2, run, dataset, "--train.sparse_lr=0.05", "--train.max_steps=48", resume=True, check=False)
    assert r.returncode != 0
    assert "train.sparse_optimizer: 'rowwise_adagrad' -> 'adam'" in r.stdout + r.stderr, (r.stdout + r.stderr)[-3000:]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == before
    train(2, run, dataset, *flags[:2], "--train.max_steps=48", resume=True)
    assert json.loads((run / "summary.json").read_text())["steps"] == 48


@pytest.mark.parametrize("np_", [2, 3])
def test_resume_after_kill_is_bit_equal(dataset, tmp_path, np_):
    # pushing behind: each checkpoint first sends the rows the last push left behind
    flags = ["--merge.every_k_steps=2", "--checkpoint.every_windows=3", "--checkpoint.compact_every=2",
             "--storage.cpu_cache_bytes=3e5", "--train.max_steps=30", "--storage.push_behind=on"]
    train(np_, tmp_path / "whole", dataset, *flags)
    kill_after_checkpoint(flags, np_, tmp_path / "cut", dataset, seq=2)
    train(np_, tmp_path / "cut", dataset, *flags, resume=True)
    assert_same_model(tmp_path / "whole", tmp_path / "cut")


def test_working_shards_go_to_the_maps_ssd_and_leave_with_the_job(dataset, tmp_path):
    """Without storage.shard_dir, each rank's working shard lives on the SSD its hardware map
    names (scratch, rebuilt from the checkpoint by every start) and is removed at exit."""
    nvme = tmp_path / "nvme"
    vm = (Path(__file__).resolve().parents[2] / "slurm/hwmaps/vm-2cpu.toml").read_text()
    assert 'path = "/var/tmp/hvctr"' in vm
    hwmap = tmp_path / "map.toml"
    hwmap.write_text(vm.replace('path = "/var/tmp/hvctr"', f'path = "{nvme}"'))
    run = tmp_path / "run"
    r = train(2, run, dataset, f"--topology.hwmap={hwmap}", "--train.max_steps=8")
    assert f"working shards: {nvme}/hvctr-shards/run-" in r.stdout
    assert (run / "checkpoints").is_dir() and not (run / "shards").exists()
    left = [p for p in nvme.rglob("*") if p.is_file()]
    assert left == [], left
