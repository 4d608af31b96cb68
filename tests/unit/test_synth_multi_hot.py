"""data_prep synth --multi-hot: bag sizes, bags that parse back, labels that depend on the bags,
and the same bytes as before without it."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from data_prep import synth
from hvctr import formats
from hvctr.formats.lines import RowFormat, parse_block

SIZES = "C3=5,C7=3,C21=12"
MULTI = (2, 6, 20)


@pytest.fixture(scope="module")
def model() -> synth.Model:
    return synth.build_model(5, multi_hot=synth.parse_multi_hot(SIZES))


def test_sizes_in_both_forms():
    mlperf = "3,2,1,2,6,1,1,1,1,7,3,8,1,6,9,5,1,1,1,12,100,27,10,3,1,1"
    assert synth.parse_multi_hot(mlperf) == tuple(int(x) for x in mlperf.split(","))
    short = synth.parse_multi_hot("C3=20, c21=100")
    assert short[2] == 20 and short[20] == 100 and sum(short) == 24 + 120
    assert synth.parse_multi_hot("") == () and synth.parse_multi_hot(",".join(["1"] * 26)) == ()
    for bad, msg in (("C27=3", "unknown field 'C27'"), ("1,2,3", "3 sizes, want 26"), ("C3=x", "an integer"),
                     ("C3=0", "in 1..65535"), ("C3=70000", "in 1..65535")):
        with pytest.raises(ValueError, match=msg):
            synth.parse_multi_hot(bad)
    with pytest.raises(ValueError, match="--unique-fields"):
        synth.build_model(5, unique_fields=2, multi_hot=synth.parse_multi_hot("C26=4"))


def test_bags_parse_back_to_what_was_drawn(model):
    labels, ints, dmiss, hexv, cmiss, p, bags = synth.sample_rows(model, 0, 3000)
    assert sorted(bags) == list(MULTI)
    blk = parse_block(synth.format_tsv(labels, ints, dmiss, hexv, cmiss, bags), RowFormat.tsv(), MULTI)
    assert not blk.bad and blk.num_lines == 3000
    np.testing.assert_array_equal(blk.labels, labels)
    one = np.ones((3000, formats.NUM_FIELDS), dtype=np.int64)
    for f, (values, counts) in bags.items():
        size = model.multi_hot[f]
        assert values.shape == (3000, size) and counts.min() == 0 and counts.max() == size  # empty and full bags
        one[:, f] = counts
    np.testing.assert_array_equal(blk.lengths, one)
    # the keys, row by row and field by field, from the drawn values
    single = formats.hex_keys(np.arange(26, dtype=np.uint64)[None, :], hexv.astype(np.uint64))
    single[cmiss] = np.broadcast_to(formats.MISSING_KEYS, single.shape)[cmiss]
    at = np.concatenate([[0], np.cumsum(one.ravel())])
    for r in range(0, 3000, 7):
        for f in range(26):
            got = blk.keys[at[r * 26 + f]:at[r * 26 + f + 1]]
            if f in bags:
                values, counts = bags[f]
                want = formats.hex_keys(np.uint64(f), values[r, :counts[r]].astype(np.uint64))
                np.testing.assert_array_equal(got, want)
            else:
                assert got.tolist() == [single[r, f]]


def test_bag_values_follow_the_fields_distribution(model):
    ids, _, _, _, bags = synth._draw_rows(model, synth.rng_for(5, 0, stream=9), 20_000)
    for f in MULTI:
        values, counts = bags[f]
        used = values[np.arange(values.shape[1]) < counts[:, None]]
        assert used.min() >= 0 and used.max() < model.vocab[f]
        # the single draws (not missing) and the bag values: the same distribution
        single = ids[ids[:, f] >= 0, f]
        for k in (0, 1, 5):
            assert abs(np.mean(used == k) - np.mean(single == k)) < 0.02
        assert abs(counts.mean() - model.multi_hot[f] / 2) < 0.1 * model.multi_hot[f]


def test_the_label_model_reads_the_bags_not_the_single_value(model):
    ids, _, _, z, bags = synth._draw_rows(model, synth.rng_for(5, 1, stream=9), 40_000)
    p = synth._sigmoid(model.bias + model.scale * z)
    assert abs(p.mean() - 0.25) < 0.01 and abs(synth.expected_auc(p) - 0.80) < 0.01
    for f in MULTI:
        values, counts = bags[f]
        used = np.arange(values.shape[1]) < np.maximum(counts, 1)[:, None]  # an empty bag: the missing value
        h = synth.mix64(values.astype(np.uint64) ^ model.salts[f])
        w = synth._tail_weight(values) * used
        bag_effect = (synth._value_effects(model, h) * w).sum(axis=1) / used.sum(axis=1)
        h1 = synth.mix64(ids[:, f].astype(np.uint64) ^ model.salts[f])
        single_effect = synth._value_effects(model, h1) * synth._tail_weight(ids[:, f])
        assert np.corrcoef(bag_effect, z)[0, 1] > 0.05
        assert abs(np.corrcoef(single_effect, z)[0, 1]) < 0.03  # drawn, but the bag stands for it


# sha256 of generate(20_000, 5, tsv, truth, **kw) before --multi-hot existed (commit b0f9149): without
# it, the output must not change. The rows follow from numpy's seeded streams and float math (numpy
# pinned in install/constraints.txt); a deliberate change of the generator updates these.
BEFORE = {
    "default": ({}, "609e88dc2c776be728fefef9716c6f80c98e8b999cc4d078272b3b828d1c48cb",
                "8e6a52265a21fb7e7644158364811596d16ed46e00730c4eec528493ec0d5281"),
    "unique": ({"unique_fields": 2}, "0ba2aacedd498d60a126896309247813bb8d26fb076c880d20430c82286a8680",
               "d3633413d7a7023f04d40fa957ba966e72153499f7a2ebc451d00b2fe511066f"),
}


@pytest.mark.parametrize("name", sorted(BEFORE))
def test_without_multi_hot_the_output_is_as_before(tmp_path, name):
    kw, tsv_sha, truth_sha = BEFORE[name]
    synth.generate(20_000, 5, str(tmp_path / "s.tsv"), str(tmp_path / "s.truth"), **kw)
    assert hashlib.sha256((tmp_path / "s.tsv").read_bytes()).hexdigest() == tsv_sha
    assert hashlib.sha256((tmp_path / "s.truth").read_bytes()).hexdigest() == truth_sha
