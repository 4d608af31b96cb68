import json

import numpy as np
import pytest
import torch

from bench import baseline
from bench.baseline import Split, map_keys, run_ceiling, run_plain
from hvctr.formats import mix64


def _synthetic(n, seed, fields=4, vocab=50):
    """Labels from a hidden logistic model of per-key effects: a learnable, known-signal set."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab, (n, fields))
    effect = np.random.default_rng(99).standard_normal((fields, vocab)) * 1.5
    z = effect[np.arange(fields), ids].sum(1) - 1.5
    labels = (rng.random(n) < 1 / (1 + np.exp(-z))).astype(np.float32)
    keys = mix64((np.arange(fields, dtype=np.uint64) << np.uint64(56)) ^ ids.astype(np.uint64))
    dense = np.log1p(rng.integers(0, 20, (n, 13))).astype(np.float32)
    return Split(labels, dense, keys), z


def test_map_keys_gives_train_keys_their_own_rows_and_unseen_keys_one_shared_row():
    train = np.array([[5, 9], [9, 7]], dtype=np.uint64)
    valid = np.array([[7, 100], [1, 5]], dtype=np.uint64)
    rows, t_idx, (v_idx,) = map_keys(train, valid)
    assert rows == 4  # 3 distinct training keys + the shared row of unseen keys
    uniq = np.array([5, 7, 9], dtype=np.uint64)
    assert np.array_equal(uniq[t_idx], train)
    assert v_idx.tolist() == [[1, 3], [3, 0]]


def test_map_keys_gives_np_uniques_rows():
    rng = np.random.default_rng(3)
    train = mix64(rng.integers(0, 5000, (3000, 26)).astype(np.uint64))
    valid = mix64(rng.integers(0, 6000, (500, 26)).astype(np.uint64))
    rows, t_idx, (v_idx,) = map_keys(train, valid)
    uniq, inverse = np.unique(train, return_inverse=True)
    assert rows == uniq.size + 1
    assert np.array_equal(t_idx, inverse.reshape(train.shape))
    pos = np.minimum(np.searchsorted(uniq, valid), uniq.size - 1)
    assert np.array_equal(v_idx, np.where(uniq[pos] == valid, pos, uniq.size))


def test_plain_baseline_learns_the_signal():
    train, _ = _synthetic(40_000, 0)
    valid, z = _synthetic(8_000, 1)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        r = run_plain(train, valid, dim=4, hidden=(32,), batch_size=512, lr=1e-2)
    finally:
        torch.set_num_threads(threads)
    from sklearn.metrics import roc_auc_score
    best = roc_auc_score(valid.labels, z)
    assert r["steps"] == 40_000 // 512 and r["train_samples"] == r["steps"] * 512
    assert r["samples_per_s"] > 0 and r["valid_count"] == 8_000
    assert r["valid_auc"] > best - 0.03, (r["valid_auc"], best)
    assert 0.5 < r["valid_copc"] < 2.0


def test_ceiling_runs_processes_at_once_and_reports_json(tmp_path, capsys):
    r = run_ceiling(2, in_features=16, hidden=(8,), batch_size=64, steps=3)
    assert r["processes"] == 2 and len(r["per_process_samples_per_s"]) == 2
    assert r["samples_per_s"] > 0
    out = tmp_path / "b.jsonl"
    assert baseline.main(["--runs", "ceiling1", "--in-features", "16", "--hidden", "8", "--batch-size", "64",
                          "--ceiling-steps", "2", "--threads", "1", "--out", str(out)]) == 0
    line = json.loads(out.read_text().strip())
    assert line["system"] == "mlp_ceiling" and line["processes"] == 1
    assert json.loads(capsys.readouterr().out.strip()) == line


def test_bad_runs_are_a_clear_error(capsys):
    assert baseline.main(["--runs", "plain,bogus"]) == 2
    assert "bogus" in capsys.readouterr().err
    assert baseline.main(["--runs", "plain"]) == 2
    assert "--data" in capsys.readouterr().err


def test_plain_baseline_on_a_data_prep_directory(tmp_path):
    from data_prep.criteo import Job, run_job
    from data_prep.mpi import Comm
    from data_prep.synth import generate
    generate(6000, seed=5, out=str(tmp_path / "in.tsv"))
    assert run_job(Comm(), Job((str(tmp_path / "in.tsv"),), str(tmp_path / "data"), 3, valid_fraction=0.25)) == 0
    train = baseline.load_split(str(tmp_path / "data"), "train")
    valid = baseline.load_split(str(tmp_path / "data"), "valid")
    assert len(train.labels) + len(valid.labels) == 6000 and train.keys.shape[1] == 26
    out = tmp_path / "plain.jsonl"
    assert baseline.main(["--data", str(tmp_path / "data"), "--runs", "plain", "--batch-size", "256", "--dim", "4",
                          "--hidden", "16", "--threads", "1", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["system"] == "plain_pytorch" and r["steps"] == len(train.labels) // 256
    assert r["valid_count"] == len(valid.labels) and 0 <= r["valid_auc"] <= 1


def test_floor_runs_the_mlp_with_its_input_gradient(tmp_path):
    r = run_ceiling(2, in_features=16 + 13, hidden=(8,), batch_size=64, steps=3, input_grad=True)
    assert r["system"] == "mlp_floor" and r["processes"] == 2 and r["samples_per_s"] > 0
    out = tmp_path / "f.jsonl"
    assert baseline.main(["--runs", "floor1", "--in-features", "29", "--hidden", "8", "--batch-size", "64",
                          "--ceiling-steps", "2", "--threads", "1", "--out", str(out)]) == 0
    assert json.loads(out.read_text().strip())["system"] == "mlp_floor"


def test_torchrec_absent_is_skipped_with_a_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(baseline, "torchrec_missing", lambda: "torchrec not importable (test)")
    out = tmp_path / "t.jsonl"
    assert baseline.main(["--data", str(tmp_path / "none"), "--runs", "torchrec", "--out", str(out)]) == 0
    line = json.loads(out.read_text().strip())
    assert line == {"system": "torchrec", "skipped": "torchrec not importable (test)"}
    assert "torchrec skipped: torchrec not importable (test)" in capsys.readouterr().err


def test_torchrec_peer_learns_the_signal():
    if baseline.torchrec_missing():
        pytest.skip(baseline.torchrec_missing())
    train, _ = _synthetic(40_000, 0)
    valid, z = _synthetic(8_000, 1)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        r = baseline.run_torchrec(train, valid, dim=4, hidden=(32,), batch_size=512, lr=1e-2, sparse_lr=0.1)
    finally:
        torch.set_num_threads(threads)
    from sklearn.metrics import roc_auc_score
    assert r["system"] == "torchrec" and r["sparse_optimizer"] == "fused rowwise_adagrad"
    assert r["steps"] == 40_000 // 512 and r["valid_count"] == 8_000
    assert r["valid_auc"] > roc_auc_score(valid.labels, z) - 0.03, r["valid_auc"]


def test_feature_major_lays_bags_out_field_by_field():
    """A KeyedJaggedTensor's values: field 0's bags of every row, then field 1's, ...; the same
    keys as the row-major Bags, each bag's keys in order."""
    from bench.baseline import feature_major
    from hvctr.data.bags import Bags

    rng = np.random.default_rng(0)
    lengths = rng.integers(0, 4, size=(10, 3)).astype(np.uint16)
    bags = Bags(np.arange(int(lengths.sum())), lengths)
    off = bags.bag_offsets()
    values, fm_lengths = feature_major(bags, slice(2, 7))
    want = [v for f in range(3) for r in range(2, 7) for v in bags.values[off[r * 3 + f]:off[r * 3 + f + 1]]]
    assert values.tolist() == want
    assert fm_lengths.tolist() == lengths[2:7].T.reshape(-1).tolist()
    plain = rng.integers(0, 100, size=(6, 3))
    values, fm_lengths = feature_major(plain, slice(1, 4))
    assert values.tolist() == plain[1:4].T.reshape(-1).tolist() and (fm_lengths == 1).all()
