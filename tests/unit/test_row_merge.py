"""merge.sparse_rule: what an owner keeps of a row that c ranks moved (hvctr.storage.row_merge)."""

import numpy as np
import pytest

from hvctr.config import SparseRule
from hvctr.formats import RowLayout
from hvctr.storage.row_merge import merged_rows

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
