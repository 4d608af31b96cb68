"""data_prep synth's days: the same keys, fresh rows, value effects that drift by --drift."""

from __future__ import annotations

import numpy as np
import pytest

from data_prep import synth
from hvctr.formats import mix64


def _hashes(m: synth.Model, n: int = 20_000) -> np.ndarray:
    ids = np.arange(n, dtype=np.int64)[:, None] % m.vocab[None, :]
    return mix64(ids.astype(np.uint64) ^ m.salts)


def test_day_zero_is_the_plain_model_and_no_drift_keeps_the_effects():
    base = synth.build_model(11)
    assert synth.build_model(11, day=0, drift=0.3) is not base  # cached per (seed, day, drift)
    h = _hashes(base)
    np.testing.assert_array_equal(synth._value_effects(synth.build_model(11, day=0, drift=0.3), h),
                                  synth._value_effects(base, h))
    np.testing.assert_array_equal(synth._value_effects(synth.build_model(11, day=2, drift=0.0), h),
                                  synth._value_effects(base, h))


def test_effects_walk_with_the_drift_and_keep_their_variance():
    drift = 0.3
    h = _hashes(synth.build_model(11))
    e = [synth._value_effects(synth.build_model(11, day=d, drift=drift), h) for d in range(3)]
    for a, b in zip(e, e[1:]):
        corr = np.corrcoef(a.ravel(), b.ravel())[0, 1]
        assert abs(corr - np.sqrt(1 - drift)) < 0.02, corr
        assert abs(b.var() - 1.0) < 0.05
    # two days apart: the correlation compounds
    assert abs(np.corrcoef(e[0].ravel(), e[2].ravel())[0, 1] - (1 - drift)) < 0.02


def test_days_share_keys_and_differ_in_rows():
    m0, m1 = synth.build_model(11, day=0, drift=0.3), synth.build_model(11, day=1, drift=0.3)
    _, _, _, hex0, miss0, p0 = synth.sample_chunk(m0, 0, 5000)
    _, _, _, hex1, miss1, p1 = synth.sample_chunk(m1, 0, 5000)
    assert not np.array_equal(hex0, hex1)  # fresh rows
    # the hot values of a field are the same strings on both days (keys persist)
    for f in (0, 4, 9):
        top0 = {v for v, c in zip(*np.unique(hex0[~miss0[:, f], f], return_counts=True)) if c > 100}
        top1 = {v for v, c in zip(*np.unique(hex1[~miss1[:, f], f], return_counts=True)) if c > 100}
        assert top0 and top0 & top1
    assert abs(p0.mean() - p1.mean()) < 0.03  # each day calibrated to the positive rate


def test_bad_day_or_drift_is_an_error():
    with pytest.raises(ValueError, match="--drift"):
        synth.build_model(11, day=1, drift=1.5)
