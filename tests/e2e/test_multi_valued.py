"""Multi-valued fields through training: data_prep's version-2 shards, windows over bags, the
pooled gather and backward, checkpoints and resume, evaluation, export and hvctr score.

- One-valued data written as version 2 (every bag one key) trains the model bit for bit as
  the same data in version 1: the bags path is the one-valued path where bags hold one key.
- Multi-hot data (data_prep synth --multi-hot, fields of 0..K keys) learns with sum and mean
  pooling; a run stopped and resumed is bit-identical to one that was not; the export scores
  each row as the trainer predicts it. (A batch of more distinct keys than the working set
  holds is refused by name: tests/unit/test_window.py.)
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import h5py
import numpy as np
import pytest

from hvctr.cli import main
from tests.conftest import VENV_PY
from tests.e2e.helpers import assert_same_model, final_model, train
from tests.e2e.test_export import trainer_predictions

MULTI = "C3=6,C10=3,C21=12"  # the synth fields of 0..K keys (data_prep --multi-valued C3,C10,C21)


def _prep(tsv: Path, out: Path, *flags: str) -> Path:
    subprocess.run([VENV_PY, "-m", "data_prep", "criteo", "--input", str(tsv), "--out", str(out), "--shards", "6",
                    "--valid-fraction", "0.1", *flags], check=True, capture_output=True, timeout=300)
    return out


@pytest.fixture(scope="module")
def multi_hot(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("multi-hot")
    tsv = root / "synth.tsv"
    subprocess.run([VENV_PY, "-m", "data_prep", "synth", "--rows", "24000", "--seed", "5", "--out", str(tsv),
                    "--multi-hot", MULTI], check=True, capture_output=True, timeout=300)
    return _prep(tsv, root / "shards", "--multi-valued", "C3,C10,C21"), tsv


def _eval_auc(run: Path) -> float:
    return json.loads((run / "summary.json").read_text())["eval"]["auc"]


def test_one_valued_data_as_version_2_trains_bit_for_bit_as_version_1(tmp_path):
    tsv = tmp_path / "synth.tsv"
    subprocess.run([VENV_PY, "-m", "data_prep", "synth", "--rows", "12000", "--seed", "4", "--out", str(tsv)],
                   check=True, capture_output=True, timeout=300)
    # C3 as a multi-valued field holds one key where it is not empty (an empty one-valued field
    # has the missing-value key, an empty multi-valued one no key): fill the empty ones
    lines = [ln.split(b"\t") for ln in tsv.read_bytes().splitlines()]
    for cols in lines:
        cols[16] = cols[16] or b"0"
    tsv.write_bytes(b"\n".join(b"\t".join(c) for c in lines) + b"\n")
    v1, v2 = _prep(tsv, tmp_path / "v1"), _prep(tsv, tmp_path / "v2", "--multi-valued", "C3")
    assert json.loads((v2 / "manifest.json").read_text())["format_version"] == 2
    with h5py.File(v2 / "train-00000.h5", "r") as f:
        assert (f["lengths"][...] == 1).all()
    flags = ["--merge.every_k_steps=4", "--model.pooling=mean"]  # mean of one key is that key
    train(2, tmp_path / "run1", v1, *flags)
    train(2, tmp_path / "run2", v2, *flags)
    assert_same_model(tmp_path / "run1", tmp_path / "run2")
    assert _eval_auc(tmp_path / "run1") == _eval_auc(tmp_path / "run2")


def test_multi_hot_learns_resumes_bit_for_bit_and_scores_as_the_trainer(multi_hot, tmp_path):
    data, tsv = multi_hot
    with h5py.File(data / "train-00000.h5", "r") as f:
        lengths = f["lengths"][...]
    assert lengths[:, [2, 9, 20]].max() > 1 and (lengths[:, 20] == 0).any()  # bags of several keys, and empty ones
    pooling = ",".join("mean" if f == 20 else "sum" for f in range(26))  # one field mean-pooled
    flags = ["--merge.every_k_steps=4", f"--model.pooling={pooling}"]
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    train(2, whole, data, *flags)
    assert _eval_auc(whole) > 0.65
    train(2, parts, data, *flags, "--train.max_steps=20")
    train(2, parts, data, *flags, resume=True)
    assert_same_model(whole, parts)
    _, sparse = final_model(whole)
    with h5py.File(data / "train-00000.h5", "r") as f:
        some = f["keys"][:2000]
    assert np.isin(some, np.fromiter(sparse, np.uint64, len(sparse))).all()  # every key of every bag trained

    exp, pred = tmp_path / "export", tmp_path / "pred.txt"
    assert main(["export", "--run-dir", str(whole), "--out", str(exp)]) == 0
    assert json.loads((exp / "manifest.json").read_text())["multi_valued"]["fields"] == [2, 9, 20]
    head = tmp_path / "head.tsv"
    head.write_bytes(b"".join(tsv.read_bytes().splitlines(keepends=True)[-700:]))
    assert main(["score", "--model", str(exp), "--input", str(head), "--out", str(pred)]) == 0
    got = np.loadtxt(pred, dtype=np.float32)
    ref = trainer_predictions(whole, head, 256, tmp_path / "ref.npy")
    assert got.shape == ref.shape == (700,)
    assert np.array_equal(got, ref), f"{np.count_nonzero(got != ref)} rows differ"


def test_sum_and_mean_pooling_train_other_models(multi_hot, tmp_path):
    data, _ = multi_hot
    train(2, tmp_path / "sum", data, "--merge.every_k_steps=4", "--train.max_steps=12")
    train(2, tmp_path / "mean", data, "--merge.every_k_steps=4", "--train.max_steps=12", "--model.pooling=mean")
    a, b = final_model(tmp_path / "sum")[0], final_model(tmp_path / "mean")[0]
    assert any(not np.array_equal(a[k], b[k]) for k in a)



@pytest.mark.parametrize("mode", ["kstep-shared", "sync"])
def test_simulation_equals_mpirun_bit_for_bit_on_bags(multi_hot, tmp_path, mode):
    """3 ranks: the windows over bags, their exchanges (rows left behind by the push, the shared
    rows' every-step sync) and sync mode's gradient push, as hvctr simulate runs them."""
    from tests.e2e.helpers import job_env
    from tests.e2e.test_simulate import SAME, compare, evaluation, simulate

    data, _ = multi_hot
    flags = [*SAME, f"--merge.mode={mode.split('-')[0]}", "--merge.every_k_steps=4", "--model.pooling=mean"]
    if mode == "sync":
        flags[1] = "--train.max_steps=8"
    else:
        flags += ["--merge.shared_rows=64"]
    assert job_env()["OMPI_MCA_coll_tuned_allreduce_algorithm"] == "4"  # the ring order the simulation adds in
    train(3, tmp_path / "mpi", data, *flags, *(["--storage.push_behind=on"] if mode != "sync" else []))
    simulate(3, tmp_path / "sim", data, *flags)
    compare(tmp_path / "mpi", tmp_path / "sim")
    assert evaluation(tmp_path / "mpi") == evaluation(tmp_path / "sim")


def test_plan_measures_the_key_curve_over_every_key_of_every_bag(multi_hot, tmp_path):
    from tests.conftest import REPO
    from tests.e2e.test_plan import hvctr

    data, _ = multi_hot
    args = ["plan", "--map", str(REPO / "slurm/hwmaps/vm-2cpu.toml"), "--ranks-per-node", "2", "--data", str(data),
            "--batch", "256", "--every-k-steps", "4"]
    r = hvctr(*args, "--json")
    assert r.returncode == 0, r.stderr
    f = json.loads(r.stdout)["figures"]
    manifest = json.loads((data / "manifest.json").read_text())
    keys, offsets = [], [np.zeros(1, np.int64)]
    for rec in manifest["shards"]["train"]:
        with h5py.File(data / rec["file"], "r") as h:
            keys.append(h["keys"][...])
            offsets.append(h["offsets"][1:] + offsets[-1][-1])
    keys, offsets = np.concatenate(keys), np.concatenate(offsets)
    assert f["table_keys"] == np.unique(keys).shape[0]
    # windows of 4 x 256 rows, each row's keys: the mean distinct count over the first 16 windows
    want = np.mean([np.unique(keys[offsets[i * 1024]:offsets[(i + 1) * 1024]]).shape[0] for i in range(16)])
    assert f["working_set_rows"] == pytest.approx(want)
    text = hvctr(*args).stdout
    assert f"{keys.size / (offsets.size - 1):.1f} keys a row (multi-valued fields)" in text
