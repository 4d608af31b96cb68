import numpy as np

from hvctr.train.window import build_window, fitting_prefix


def _brute_prefix(keys, max_rows):
    best = 0
    for n in range(1, keys.shape[0] + 1):
        if np.unique(keys[:n]).size <= max_rows:
            best = n
    return best


def test_fitting_prefix_matches_brute_force():
    rng = np.random.default_rng(0)
    keys = rng.zipf(1.3, size=(8, 64, 26)).astype(np.uint64)
    for max_rows in (0, 50, 300, 800, 1500, 10**6):
        assert fitting_prefix(keys, max_rows) == _brute_prefix(keys, max_rows), max_rows


def test_window_positions_index_unique_keys():
    rng = np.random.default_rng(1)
    keys = rng.integers(0, 2**63, size=(3, 16, 4), dtype=np.uint64)
    keys[1, :, 0] = keys[0, :, 0]  # shared keys across batches
    w = build_window(5, 0, 10, np.zeros((3, 16), np.float32), np.zeros((3, 16, 13), np.float32), keys)
    assert np.all(np.diff(w.unique_keys.astype(np.float64)) > 0)
    assert np.array_equal(w.unique_keys[w.positions], keys)
    assert w.num_batches == 3 and w.first_batch == 10
