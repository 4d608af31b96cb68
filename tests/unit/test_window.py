import numpy as np
import pytest

from hvctr.kernels import native as _native
from hvctr.train.window import build_window, fitting_prefix, index_keys


def _brute_prefix(keys, max_rows):
    best = 0
    for n in range(1, keys.shape[0] + 1):
        if np.unique(keys[:n]).size <= max_rows:
            best = n
    return best


@pytest.fixture(params=["native", "numpy"])
def path(request):
    if request.param == "numpy":
        with _native.disabled():
            yield request.param
    else:
        assert _native.lib() is not None, "the C kernels are built at install time"
        yield request.param


def test_index_keys_first_occurrence(path):
    rng = np.random.default_rng(2)
    keys = rng.integers(0, 50, size=(3, 8, 4)).astype(np.uint64) << np.uint64(40)
    idx = index_keys(keys)
    flat = keys.reshape(-1)
    assert np.array_equal(idx.uniq[idx.inverse], flat)
    assert np.array_equal(flat[idx.first], idx.uniq)
    assert np.all(np.diff(idx.first) > 0) and idx.uniq.size == np.unique(flat).size
    # the first occurrence really is the first
    for j, f in enumerate(idx.first):
        assert np.flatnonzero(flat == idx.uniq[j])[0] == f


def test_fitting_prefix_matches_brute_force(path):
    rng = np.random.default_rng(0)
    keys = rng.zipf(1.3, size=(8, 64, 26)).astype(np.uint64)
    idx = index_keys(keys)
    for max_rows in (0, 50, 300, 800, 1500, 10**6):
        assert fitting_prefix(idx, 8, max_rows) == _brute_prefix(keys, max_rows), max_rows


@pytest.mark.parametrize("n", [3, 2, 1])
def test_window_positions_index_sorted_unique_keys(path, n):
    rng = np.random.default_rng(1)
    keys = rng.integers(0, 2**63, size=(3, 16, 4), dtype=np.uint64)
    keys[1, :, 0] = keys[0, :, 0]  # shared keys across batches
    keys[2, :3, 1] = keys[0, :3, 2]
    w = build_window(5, 0, 10, np.zeros((n, 16), np.float32), np.zeros((n, 16, 13), np.float32), keys.shape,
                     index_keys(keys))
    assert np.array_equal(w.unique_keys, np.unique(keys[:n]))  # sorted, and only the first n batches'
    assert np.array_equal(w.unique_keys[w.positions], keys[:n])
    assert w.num_batches == n and w.first_batch == 10


def test_a_routed_window_lays_its_working_set_out_by_owner():
    """Routed, the working set is grouped by owner (sorted within each), positions follow it,
    and the routing's order is the identity: a pull's rows arrive as the working set."""
    from hvctr.formats import default_bucket_owner, owner_of
    from hvctr.storage.routing import route

    rng = np.random.default_rng(7)
    keys = rng.integers(0, 2**63, size=(4, 64, 5), dtype=np.uint64)
    keys[1, :, 0] = keys[0, :, 0]
    table = default_bucket_owner(3)
    w = build_window(0, 0, 0, np.zeros((3, 64), np.float32), np.zeros((3, 64, 13), np.float32), keys.shape,
                     index_keys(keys), route=lambda k: route(k, table, 3))
    assert np.array_equal(w.unique_keys[w.positions], keys[:3])
    owner = owner_of(w.unique_keys, table)
    assert np.all(np.diff(owner) >= 0)
    for r in range(3):
        mine = w.unique_keys[owner == r]
        assert np.all(mine[1:] > mine[:-1])
    assert w.routing.in_order and np.array_equal(w.routing.order, np.arange(w.unique_keys.size))
    sorted_routing = route(np.unique(keys[:3]), table, 3)  # the messages of the sorted layout
    assert np.array_equal(w.routing.keys_by_owner, sorted_routing.keys_by_owner)
    assert w.routing.splits == sorted_routing.splits
