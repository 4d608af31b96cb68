"""hvctr export's compressed row formats: fbgemm's 8-bit rowwise quantisation (float16 scale and
bias per row), checked against its closed-form error bound and the edge rows."""

import numpy as np

from hvctr.offline.export import dequantize_int8_rowwise, quantize_int8_rowwise


def test_int8_rowwise_round_trip_within_half_a_step():
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((1000, 17)) * rng.uniform(1e-3, 1.0, (1000, 1))).astype(np.float32)
    q, sb = quantize_int8_rowwise(x)
    assert q.dtype == np.uint8 and q.shape == x.shape and sb.dtype == np.float16 and sb.shape == (1000, 2)
    scale, bias = sb[:, 0].astype(np.float32), sb[:, 1].astype(np.float32)
    assert np.array_equal(bias, x.min(axis=1).astype(np.float16).astype(np.float32))  # bias = min, in float16
    y = dequantize_int8_rowwise(q, sb)
    err = np.abs(y - x)
    # half a quantisation step, plus what rounding the bias and scale to float16 moves
    bound = 0.5 * scale + np.abs(bias - x.min(axis=1)) + 255 * np.abs(scale - (x.max(1) - bias) / 255) + 1e-7
    assert np.all(err.max(axis=1) <= bound)
    assert err.max() < 0.01 * np.abs(x).max()
    assert q.min() == 0 and q.max() == 255  # the row's range uses every level


def test_int8_rowwise_edge_rows():
    x = np.array([[0.5] * 5, [0.0] * 5, [-1e-9, 0, 1e-9, 0, 0], [1, 2, 3, 4, 5]], dtype=np.float32)
    q, sb = quantize_int8_rowwise(x)
    y = dequantize_int8_rowwise(q, sb)
    assert np.array_equal(y[:2], x[:2])  # constant rows exactly (scale 1, q 0)
    assert np.all(np.isfinite(y)) and np.abs(y[2] - x[2]).max() < 1e-8
    assert np.abs(y[3] - x[3]).max() <= 4 / 255 / 2 + 1e-3
    q0, sb0 = quantize_int8_rowwise(np.zeros((0, 5), np.float32))
    assert q0.shape == (0, 5) and sb0.shape == (0, 2)
