"""A window's routing, computed once: what the exchange computed per call before, and the
store's uniqueness guard, now a debug check."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from hvctr.config import StorageConfig
from hvctr.formats import default_bucket_owner, owner_of
from hvctr.optim import batch_unique
from hvctr.storage import EmbeddingStore
from hvctr.storage import store as store_module
from hvctr.storage.exchange import ShardedTable
from hvctr.storage.routing import route
from hvctr.train.window import build_window, index_keys


def _keys(n, seed=0):
    return np.unique(np.random.default_rng(seed).integers(0, 2**64 - 2, size=n, dtype=np.uint64))


def _reference(keys, bucket_owner, world_size):
    """The routing as ShardedTable._route computed it on every call before."""
    owner = owner_of(keys, bucket_owner)
    order = np.argsort(owner, kind="stable")
    return owner, order, np.bincount(owner, minlength=world_size).tolist()


@pytest.mark.parametrize("world_size", [1, 2, 3, 7])
def test_route_equals_owner_of_and_a_stable_argsort(world_size):
    keys = np.random.default_rng(1).permutation(_keys(5000))
    table = default_bucket_owner(world_size)
    r = route(keys, table, world_size)
    owner, order, splits = _reference(keys, table, world_size)
    np.testing.assert_array_equal(r.owner, owner)
    np.testing.assert_array_equal(r.order, order)
    assert r.order.dtype == np.int64 and r.splits == splits and r.world_size == world_size
    np.testing.assert_array_equal(r.keys_by_owner, keys[order])


def test_subset_routes_the_chosen_keys_without_hashing_again():
    keys, table = _keys(3000, seed=2), default_bucket_owner(4)
    r = route(keys, table, 4)
    pick = np.flatnonzero(np.random.default_rng(3).random(keys.size) < 0.3)
    sub = r.subset(pick)
    owner, order, splits = _reference(keys[pick], table, 4)
    np.testing.assert_array_equal(sub.keys, keys[pick])
    np.testing.assert_array_equal(sub.order, order)
    assert sub.splits == splits
    assert r.subset(np.arange(keys.size)) is r


@pytest.mark.parametrize("n", [3, 1])
def test_window_carries_its_routing_and_batch_unique(n):
    rng = np.random.default_rng(4)
    keys = rng.integers(0, 2**63, size=(3, 32, 5), dtype=np.uint64)
    keys[1, :, 0] = keys[0, :, 0]
    table = default_bucket_owner(3)
    w = build_window(0, 0, 0, np.zeros((n, 32), np.float32), np.zeros((n, 32, 13), np.float32), keys,
                     index_keys(keys), route=lambda k: route(k, table, 3))
    owner, order, splits = _reference(w.unique_keys, table, 3)
    assert w.routing.keys is w.unique_keys and w.exchange_keys is w.exchange and w.exchange.routing is w.routing
    assert w.exchange.asked is None  # nothing sent yet: warm or the pull fills it
    np.testing.assert_array_equal(w.routing.order, order)
    assert w.routing.splits == splits
    assert len(w.batch_unique) == n
    for i in range(n):
        uniq, inverse = batch_unique(torch.from_numpy(w.positions[i]))
        assert torch.equal(w.batch_unique[i][0], uniq) and torch.equal(w.batch_unique[i][1], inverse)
    plain = build_window(0, 0, 0, np.zeros((n, 32), np.float32), np.zeros((n, 32, 13), np.float32), keys,
                         index_keys(keys))
    assert plain.routing is None and plain.exchange is None and plain.exchange_keys is plain.unique_keys


@pytest.fixture
def table(tmp_path):
    store = EmbeddingStore(StorageConfig(dim=4, rows_per_rank=1000), tmp_path / "s.h5")
    yield ShardedTable(SimpleNamespace(rank=0, size=1), store, default_bucket_owner(1))
    store.close()


def test_plain_keys_are_checked_trusted_ones_only_under_debug_checks(table, monkeypatch):
    dup = np.array([9, 4, 9], dtype=np.uint64)
    with pytest.raises(ValueError, match="unique"):
        table.route(dup)
    monkeypatch.setattr(store_module, "DEBUG_CHECKS", False)
    assert len(table.route(dup, trusted=True)) == 3  # a window's keys: no hash pass
    monkeypatch.setattr(store_module, "DEBUG_CHECKS", True)
    with pytest.raises(ValueError, match="unique"):
        table.route(dup, trusted=True)


def test_owner_side_guard_runs_only_under_debug_checks(table, monkeypatch):
    dup = np.array([9, 4, 9], dtype=np.uint64)
    monkeypatch.setattr(store_module, "DEBUG_CHECKS", True)
    for call in (lambda: table.store.read(dup), lambda: table.store.warm(dup),
                 lambda: table.store.write(dup, np.zeros((3, table.width), np.float32))):
        with pytest.raises(ValueError, match="unique"):
            call()
    monkeypatch.setattr(store_module, "DEBUG_CHECKS", False)
    table.store.warm(dup)  # trusted: no check (the exchange never hands over duplicates)


def test_a_routing_for_another_world_size_is_refused(table):
    with pytest.raises(ValueError, match="2 ranks"):
        table.pull(route(_keys(10), default_bucket_owner(2), 2), name="x")
