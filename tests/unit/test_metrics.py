import math

import numpy as np
import pytest
import torch
from sklearn.metrics import log_loss, roc_auc_score

from hvctr.metrics import EvalAccumulator


def _ctr_like(n, seed, base=-2.5, spread=0.8, signal=1.0):
    """Labels drawn from predictions that look like a CTR model's (p mostly 0.02-0.3)."""
    rng = np.random.default_rng(seed)
    z = base + spread * rng.standard_normal(n)
    true_z = z + rng.standard_normal(n) * signal
    y = (rng.random(n) < 1 / (1 + np.exp(-true_z))).astype(np.float32)
    return z, y


def _acc(z, y, chunk=4096, nb=1 << 16, as_probs=False):
    acc = EvalAccumulator(nb)
    for s in range(0, len(z), chunk):
        zt, yt = torch.from_numpy(z[s:s + chunk]), torch.from_numpy(y[s:s + chunk])
        if as_probs:
            acc.add(torch.sigmoid(zt), yt)
        else:
            acc.add_logits(zt.float(), yt)
    return acc


@pytest.mark.parametrize("as_probs", [False, True])
def test_auc_logloss_copc_match_exact_on_ctr_like_predictions(as_probs):
    z, y = _ctr_like(200_000, 0)
    r = _acc(z, y, as_probs=as_probs).result()
    p = 1 / (1 + np.exp(-z.astype(np.float32).astype(np.float64)))
    assert 0.02 < y.mean() < 0.2
    assert abs(r["auc"] - roc_auc_score(y, p)) < 1e-3
    assert r["auc_bin_error"] < 1e-3
    assert r["logloss"] == pytest.approx(log_loss(y, p), rel=1e-6)
    assert r["count"] == len(y)
    assert r["ctr"] == pytest.approx(y.mean())
    assert r["pred_ctr"] == pytest.approx(p.mean(), rel=1e-6)
    assert r["copc"] == pytest.approx(y.mean() / p.mean(), rel=1e-6)  # actual / predicted (Paddle)
    assert r["calibration"] == pytest.approx(p.mean() / y.mean(), rel=1e-6)  # predicted / actual (TorchRec)
    h = -(y.mean() * np.log(y.mean()) + (1 - y.mean()) * np.log(1 - y.mean()))
    assert r["ne"] == pytest.approx(log_loss(y, p) / h, rel=1e-6)


def test_copc_ne_calibration_against_hand_computed_values():
    # 4 rows, labels 1 0 0 0, predictions 0.5 0.1 0.1 0.1:
    #   actual CTR 1/4 = 0.25, predicted CTR 0.8/4 = 0.2
    #   COPC = 0.25 / 0.2 = 1.25 (the model under-predicts), calibration = 0.2 / 0.25 = 0.8
    #   logloss = -(ln 0.5 + 3 ln 0.9) / 4 = (0.693147 + 3 x 0.105361) / 4 = 0.252307
    #   H(0.25) = -(0.25 ln 0.25 + 0.75 ln 0.75) = 0.346574 + 0.215762 = 0.562335
    #   NE = 0.252307 / 0.562335 = 0.448678
    for as_logits in (False, True):
        acc = EvalAccumulator(1024)
        p, y = torch.tensor([0.5, 0.1, 0.1, 0.1], dtype=torch.float64), torch.tensor([1.0, 0.0, 0.0, 0.0])
        if as_logits:
            acc.add_logits(torch.logit(p), y)
        else:
            acc.add(p, y)
        r = acc.result()
        assert r["ctr"] == pytest.approx(0.25) and r["pred_ctr"] == pytest.approx(0.2)
        assert r["copc"] == pytest.approx(1.25)
        assert r["calibration"] == pytest.approx(0.8)
        assert r["logloss"] == pytest.approx(0.252307, abs=1e-6)
        assert r["ne"] == pytest.approx(0.448678, abs=1e-6)
        assert r["auc"] == 1.0


def test_ne_of_predicting_the_base_rate_is_one():
    y = torch.tensor([1.0] * 3 + [0.0] * 7)
    acc = EvalAccumulator(64)
    acc.add(torch.full((10,), 0.3), y)
    r = acc.result()
    assert r["ne"] == pytest.approx(1.0) and r["copc"] == pytest.approx(1.0) and r["calibration"] == pytest.approx(1.0)


def test_auc_with_skewed_predictions_near_zero():
    # Predictions 1e-4 .. 1e-2: uniform buckets in [0, 1] would put almost all in a few buckets.
    z, y = _ctr_like(100_000, 1, base=-6.5, spread=0.9, signal=0.5)
    p = 1 / (1 + np.exp(-z))
    assert np.quantile(p, 0.99) < 0.02 and y.sum() > 50
    r = _acc(z, y).result()
    assert abs(r["auc"] - roc_auc_score(y, p)) < 1e-3


def test_ties_count_half_exactly_like_sklearn():
    rng = np.random.default_rng(2)
    levels = np.array([-3.0, -2.0, -1.0, 0.5])  # few distinct predictions: ties everywhere
    z = levels[rng.integers(0, 4, 50_000)]
    y = (rng.random(50_000) < 0.1 + 0.1 * (z > -1.5)).astype(np.float32)
    r = _acc(z.astype(np.float32), y).result()
    p = 1 / (1 + np.exp(-z.astype(np.float32).astype(np.float64)))
    assert abs(r["auc"] - roc_auc_score(y, p)) < 1e-9
    # All predictions equal: AUC is exactly 0.5.
    assert _acc(np.zeros(1000, np.float32), (np.arange(1000) % 7 == 0).astype(np.float32)).result()["auc"] == 0.5


def test_summed_tensors_equal_one_accumulator_over_all_data():
    z, y = _ctr_like(30_000, 3)
    whole = _acc(z, y).result()
    parts = [_acc(z[i::3], y[i::3]) for i in range(3)]  # three "ranks"
    summed = [sum(ts) for ts in zip(*(a.tensors() for a in parts))]  # what the allreduce computes
    total = EvalAccumulator.from_tensors(summed).result()
    for k in whole:
        assert total[k] == pytest.approx(whole[k], rel=1e-12), k
    parts[0].merge(parts[1])
    parts[0].merge(parts[2])
    assert parts[0].result()["auc"] == pytest.approx(whole["auc"], rel=1e-12)


def test_extreme_and_degenerate_inputs():
    acc = EvalAccumulator(1024)
    acc.add(torch.tensor([0.0, 1.0, 0.5, 1e-30]), torch.tensor([0.0, 1.0, 1.0, 0.0]))
    r = acc.result()
    assert math.isfinite(r["logloss"]) and r["auc"] == 1.0
    only_neg = EvalAccumulator(16)
    only_neg.add_logits(torch.tensor([1.0, 2.0]), torch.tensor([0.0, 0.0]))
    r = only_neg.result()
    assert math.isnan(r["auc"]) and math.isnan(r["calibration"]) and math.isnan(r["ne"])
    assert r["copc"] == 0.0  # no clicks at all: none of the predicted clicks came
    assert math.isnan(EvalAccumulator(16).result()["logloss"])


def test_bad_inputs_are_errors():
    acc = EvalAccumulator(16)
    with pytest.raises(ValueError):
        acc.add(torch.tensor([0.5, 1.5]), torch.tensor([0.0, 1.0]))
    with pytest.raises(ValueError):
        acc.add_logits(torch.tensor([0.5]), torch.tensor([2.0]))
    with pytest.raises(ValueError):
        acc.add_logits(torch.tensor([0.5, 0.1]), torch.tensor([1.0]))
    with pytest.raises(ValueError):
        EvalAccumulator.from_tensors([torch.zeros(3, 4), torch.zeros(4)])
