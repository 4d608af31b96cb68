"""merge.sparse_rule: what an owner keeps of a row that c ranks moved (hvctr.storage.row_merge)."""

import numpy as np
import pytest

from hvctr.config import SparseRule
from hvctr.formats import RowLayout
from hvctr.storage.row_merge import contributor_spread, merged_rows

LAYOUT = RowLayout(2)  # model columns 0..2, then m, v, step


def rows(model, rest=7.0):
    r = np.full((len(model), LAYOUT.width), rest, dtype=np.float32)
    r[:, LAYOUT.model] = np.asarray(model, dtype=np.float32)[:, None]
    return r


@pytest.mark.parametrize("rule,hot", [(SparseRule.AVERAGE, 1.5), (SparseRule.SUM, 1 + 4 * 0.5),
                                      (SparseRule.SQRT, 1 + 2 * 0.5)])
def test_hot_keys_scale_the_mean_move_rare_keys_keep_it(rule, hot):
    old = rows([1.0, 1.0])
    mean = rows([1.5, 1.5])  # both keys' copies moved by 0.5 on average
    count = np.array([4, 1])  # a hot key (4 contributors) and a rare one (1)
    out = merged_rows(rule, LAYOUT, old, mean.copy(), count)
    assert np.allclose(out[0, LAYOUT.model], hot)
    assert np.array_equal(out[1], rows([1.5])[0])  # one contributor: its row as sent, bit for bit
    assert np.array_equal(out[:, LAYOUT.model.stop:], mean[:, LAYOUT.model.stop:])  # m, v, step: averaged


def test_average_needs_no_old_rows():
    mean = rows([2.0])
    assert merged_rows(SparseRule.AVERAGE, LAYOUT, None, mean, np.array([3])) is mean


def window_rows(model, steps):
    """Rows with the model columns ``model`` and the step column ``steps`` (m, v zero)."""
    r = np.zeros((len(model), LAYOUT.width), dtype=np.float32)
    r[:, LAYOUT.model] = np.asarray(model, dtype=np.float32)[:, None]
    r[:, LAYOUT.step] = steps
    return r


def matched(copies_model, copies_steps, k):
    """One key merged by the matched rule from its contributors' copies (old: 0, step 0)."""
    copies = window_rows(copies_model, copies_steps)
    old = window_rows([0.0], [0.0])
    count = np.array([len(copies)])
    inverse = np.zeros(len(copies), dtype=np.int64)
    spread = contributor_spread(copies, inverse, old, count, LAYOUT)
    mean = copies.mean(axis=0, keepdims=True)
    return float(merged_rows(SparseRule.MATCHED, LAYOUT, old, mean, count, spread, k)[0, 0])


def test_matched_gives_a_tail_key_the_steps_sync_would_take():
    # 4 ranks touched the key once each (step 0 -> 1), all moved +1: sync would have taken the
    # expected distinct steps of 4 touches on 8 steps, 8 (1 - (7/8)^4) = 3.31, each +1
    assert matched([1.0] * 4, [1.0] * 4, k=8) == pytest.approx(8 * (1 - (7 / 8) ** 4), rel=1e-5)
    # in a one-step window the 4 touches are one sync step: the mean move
    assert matched([1.0] * 4, [1.0] * 4, k=1) == pytest.approx(1.0)


def test_matched_scales_a_hot_key_by_its_noise():
    # 4 ranks touched it at all 8 steps: sync takes about as many steps as each contributor
    assert matched([2.0] * 4, [8.0] * 4, k=8) == pytest.approx(2.0)  # agreeing moves: the mean
    # moves that disagree: r = mean square 4 / mean^2 1 = 4 <= 4 touches a step, f = sqrt(4)
    assert matched([2.0, -2.0, 2.0, 2.0], [8.0] * 4, k=8) == pytest.approx(2 * 1.0)


def test_matched_keeps_a_single_contributor_bit_for_bit():
    old = window_rows([0.25], [3.0])
    mean = window_rows([0.75], [5.0])
    spread = contributor_spread(mean, np.zeros(1, np.int64), old, np.array([1]), LAYOUT)
    out = merged_rows(SparseRule.MATCHED, LAYOUT, old, mean.copy(), np.array([1]), spread, 8)
    assert np.array_equal(out, mean)


def test_contributor_spread_is_the_mean_squared_move():
    rng = np.random.default_rng(0)
    old = rng.normal(size=(3, LAYOUT.width)).astype(np.float32)
    inverse = np.array([0, 2, 0, 1, 2, 2])
    copies = rng.normal(size=(6, LAYOUT.width)).astype(np.float32)
    count = np.bincount(inverse)
    want = [np.mean([np.sum((copies[j, LAYOUT.model] - old[i, LAYOUT.model]) ** 2)
                     for j in np.flatnonzero(inverse == i)]) for i in range(3)]
    assert np.allclose(contributor_spread(copies, inverse, old, count, LAYOUT), want, rtol=1e-5)


def test_matched_needs_the_spread():
    with pytest.raises(ValueError, match="spread"):
        merged_rows(SparseRule.MATCHED, LAYOUT, window_rows([0.0], [0.0]), window_rows([1.0], [1.0]), np.array([2]))


ADAGRAD = RowLayout(2, "rowwise_adagrad")  # model columns 0..2, the accumulator, the step


def adagrad_rows(model, acc, step):
    r = np.empty((len(model), ADAGRAD.width), dtype=np.float32)
    r[:, ADAGRAD.model] = np.asarray(model, dtype=np.float32)[:, None]
    r[:, ADAGRAD.v] = np.asarray(acc, dtype=np.float32)[:, None]
    r[:, ADAGRAD.step] = step
    return r


def test_sum_adds_up_rowwise_adagrads_accumulator_increments_too():
    old = adagrad_rows([1.0, 1.0], [2.0, 2.0], [5.0, 5.0])
    mean = adagrad_rows([1.5, 1.5], [3.0, 3.0], [13.0, 13.0])  # each copy took 8 steps, its accumulator +1
    out = merged_rows(SparseRule.SUM, ADAGRAD, old, mean.copy(), np.array([4, 1]))
    assert np.allclose(out[0, ADAGRAD.model], 1 + 4 * 0.5)
    assert out[0, ADAGRAD.v.start] == 2 + 4 * 1.0  # the four contributors' increments, summed
    assert out[0, ADAGRAD.step] == 13.0  # the step column: averaged, as under every rule
    assert np.array_equal(out[1], mean[1])  # one contributor: its row as sent, bit for bit
    average = merged_rows(SparseRule.AVERAGE, ADAGRAD, old, mean.copy(), np.array([4, 1]))
    assert np.array_equal(average, mean)  # the mean of everything, the accumulator too


@pytest.mark.parametrize("optimizer", ["adam", "rowwise_adam"])
def test_sum_leaves_adams_second_moments_averaged(optimizer):
    lay = RowLayout(2, optimizer)
    old = np.full((1, lay.width), 1.0, dtype=np.float32)
    mean = np.full((1, lay.width), 2.0, dtype=np.float32)
    out = merged_rows(SparseRule.SUM, lay, old, mean.copy(), np.array([3]))
    assert np.allclose(out[0, lay.model], 1 + 3 * 1.0)
    assert np.array_equal(out[0, lay.states], mean[0, lay.states])  # Adam's estimates, not sums
