"""The synthetic generator: format, determinism, the model it claims, its scores."""

from __future__ import annotations

import numpy as np
import pytest
from sklearn.metrics import roc_auc_score

from data_prep import synth

from hvctr import formats
from hvctr.formats.lines import RowFormat, parse_block


@pytest.fixture(scope="module")
def model() -> synth.Model:
    return synth.build_model(5)


def test_tsv_parses_back_to_what_was_drawn(model):
    labels, ints, dmiss, hexv, cmiss, p = synth.sample_chunk(model, 0, 3000)
    blk = parse_block(synth.format_tsv(labels, ints, dmiss, hexv, cmiss), RowFormat.tsv())
    assert not blk.bad and blk.num_lines == 3000
    np.testing.assert_array_equal(blk.labels, labels)
    want = np.where(dmiss, 0.0, np.log1p(np.maximum(ints, 0))).astype(np.float32)
    np.testing.assert_array_equal(blk.dense, want)
    keys = formats.hex_keys(np.arange(26, dtype=np.uint64)[None, :], hexv.astype(np.uint64))
    keys[cmiss] = np.broadcast_to(formats.MISSING_KEYS, keys.shape)[cmiss]
    np.testing.assert_array_equal(blk.keys, keys)
    assert (ints[:, 1] < 0).any() and dmiss.any() and cmiss.any()  # I2 negatives, missing values
    truth = np.array(synth.format_truth(p).decode().split(), dtype=np.float64)
    np.testing.assert_allclose(truth, p, atol=6e-10)


def test_seeded_and_streaming(tmp_path):
    a, c, d = (tmp_path / n for n in "acd")
    synth.generate(40_000, 3, str(a), str(tmp_path / "a.truth"))
    synth.generate(20_000, 3, str(c))
    synth.generate(20_000, 4, str(d))
    # the same seed gives the same rows, and N rows are the first N of a longer file
    assert a.read_bytes().startswith(c.read_bytes()) and len(c.read_bytes()) > 0
    assert c.read_bytes() != d.read_bytes()
    assert (tmp_path / "a.truth").read_text().count("\n") == 40_000
    assert not list(tmp_path.glob("*.tmp"))


def test_model_is_what_the_docstring_says(model):
    assert model.vocab.min() >= 10 and model.vocab.max() > 5_000_000  # tens to millions
    ids, ints, dmiss, z = synth._draw(model, synth.rng_for(5, 0, stream=9), 200_000)
    p = synth._sigmoid(model.bias + model.scale * z)
    assert abs(p.mean() - 0.25) < 0.01
    assert abs(synth.expected_auc(p) - 0.80) < 0.01
    for f in (2, 15):  # multi-million vocabularies: power-law ranks, slope about -a
        counts = np.sort(np.bincount(ids[ids[:, f] >= 0, f]))[::-1]
        r = np.arange(30, 300)
        slope = np.polyfit(np.log(r + model.zipf_q[f]), np.log(counts[r]), 1)[0]
        assert abs(slope + model.zipf_a[f]) < 0.25
    assert abs(dmiss.mean(axis=0) - model.dense_missing).max() < 0.01
    assert np.quantile(ints[~dmiss], 0.999) > 100 * max(np.median(ints[~dmiss]), 1)  # heavy tail


def test_expected_auc_is_the_pairwise_definition():
    rng = np.random.default_rng(0)
    p = rng.uniform(0.01, 0.99, 300)
    num = sum(p[i] * (1 - p[j]) * (1.0 if p[i] > p[j] else 0.5 if p[i] == p[j] else 0.0)
              for i in range(300) for j in range(300) if i != j)
    den = sum(p[i] * (1 - p[j]) for i in range(300) for j in range(300) if i != j)
    assert synth.expected_auc(p) == pytest.approx(num / den, abs=1e-12)


def test_streaming_scores_match_exact(model):
    scores, ps, ys = synth.Scores(), [], []
    for chunk in range(6):
        labels, _, _, _, _, p = synth.sample_chunk(model, chunk, 20_000)
        scores.add(p, labels)
        ps.append(p)
        ys.append(labels)
    p, y = np.concatenate(ps), np.concatenate(ys)
    r = scores.result()
    assert r["realised_auc"] == pytest.approx(roc_auc_score(y, p), abs=1e-3)
    assert r["expected_auc"] == pytest.approx(synth.expected_auc(p), abs=1e-3)
    assert r["realised_logloss"] == pytest.approx(-np.mean(y * np.log(p) + (1 - y) * np.log(1 - p)), rel=1e-9)
    assert r["realised_positive_rate"] == pytest.approx(y.mean())
