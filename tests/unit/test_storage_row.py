"""Row layout and counter-based init: a pure function of (key, seed), checked in plain ints."""

import numpy as np
import pytest

from hvctr.formats import RowLayout, default_row, init_rows
from hvctr.kernels import init_rows as c_init_rows
from hvctr.kernels import native

M64 = (1 << 64) - 1


def _mix(z: int) -> int:  # splitmix64's finaliser, written with Python ints
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def _init_value(key: int, col: int, scale: float, seed: int) -> np.float32:
    s = _mix(seed ^ 0x6A09E667F3BCC909)
    bits = _mix((_mix(key ^ s) + (col + 1) * 0x9E3779B97F4A7C15) & M64) >> 40
    return np.float32((bits / 2**23 - 1.0) * scale)


def test_layout_columns():
    lay = RowLayout(16)
    assert lay.width == 52 and lay.row_bytes == 208
    cols = np.arange(lay.width)
    assert list(cols[lay.w]) == list(range(16)) and lay.w1 == 16
    assert list(cols[lay.model]) == list(range(17))
    assert list(cols[lay.m]) == list(range(17, 34)) and list(cols[lay.v]) == list(range(34, 51))
    assert lay.step == 51
    with pytest.raises(ValueError, match="dimension"):
        RowLayout(0)


@pytest.mark.parametrize("path", ["c", "numpy"])
def test_init_matches_the_formula_in_plain_integers(path):
    lay = RowLayout(3)
    keys = np.array([0, 1, 2**63, 2**64 - 2, 0x0123456789ABCDEF], dtype=np.uint64)
    if path == "c" and native.lib() is None:
        pytest.skip("no C kernels (HVCTR_NATIVE=0)")
    rows = (c_init_rows if path == "c" else init_rows)(keys, lay, 0.05, seed=2024)
    for r, k in enumerate(keys.tolist()):
        for c in range(lay.model_width):
            assert rows[r, c] == _init_value(k, c, 0.05, 2024), (k, c)
    assert rows.dtype == np.float32 and rows.shape == (5, lay.width)
    assert np.all(rows[:, lay.model_width:] == 0)  # m, v, step


def test_init_depends_on_key_and_seed_only():
    lay = RowLayout(8)
    keys = np.random.default_rng(0).integers(0, 2**64 - 1, size=1000, dtype=np.uint64)
    a = init_rows(keys, lay, 0.01, 7)
    perm = np.random.default_rng(1).permutation(1000)
    np.testing.assert_array_equal(init_rows(keys[perm], lay, 0.01, 7), a[perm])  # order, batch
    np.testing.assert_array_equal(init_rows(keys[:10], lay, 0.01, 7), a[:10])
    assert not np.array_equal(init_rows(keys, lay, 0.01, 8), a)
    w = a[:, lay.model]
    assert w.min() >= -0.01 and w.max() < 0.01
    assert abs(float(w.mean())) < 1e-3 and 0.005 < float(w.std()) < 0.0065  # uniform: 0.01/sqrt(3)


@pytest.mark.parametrize("dim", [1, 16, 127])
def test_init_in_c_has_numpys_bits(dim):
    """hvctr.kernels.init_rows (hv_init_rows: the store's new rows) against the numpy formula,
    bit for bit."""
    if native.lib() is None:
        pytest.skip("no C kernels (HVCTR_NATIVE=0)")
    lay = RowLayout(dim)
    keys = np.random.default_rng(dim).integers(0, 2**64 - 1, size=3000, dtype=np.uint64, endpoint=True)
    for scale, seed in ((0.01, 0), (1e-4, 12345), (3.0, -7)):
        assert c_init_rows(keys, lay, scale, seed).tobytes() == init_rows(keys, lay, scale, seed).tobytes(), (scale, seed)
    with native.disabled():  # the kernels off: the numpy reference itself
        assert c_init_rows(keys, lay, 0.01, 0).tobytes() == init_rows(keys, lay, 0.01, 0).tobytes()


def test_default_row_is_zero_and_read_only():
    row = default_row(RowLayout(4))
    assert row.shape == (16,) and not row.any()
    with pytest.raises(ValueError):
        row[0] = 1
