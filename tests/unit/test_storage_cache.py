"""The CPU row cache: budget, lookups under churn, dirty victims, pinning, the two policies."""

import contextlib

import numpy as np
import pytest

from hvctr.config import CachePolicy
from hvctr.kernels import native
from hvctr.storage.cache import ENTRY_OVERHEAD_BYTES, RowCache, entries_for_budget

W = 8


def _keys(n, seed=0):
    return np.unique(np.random.default_rng(seed).integers(0, 2**64 - 2, size=n, dtype=np.uint64))


@pytest.mark.parametrize("budget", [0, 100, 10_000, 1_000_000])
def test_arrays_fit_the_byte_budget(budget):
    c = RowCache(W, budget)
    assert c.nbytes <= budget
    assert c.capacity == entries_for_budget(W, budget) == budget // (4 * W + ENTRY_OVERHEAD_BYTES)


def _probing(path):
    """The C probe and row copies (hv_probe_find, hv_probe_claim, hv_take_rows, hv_put_rows) or numpy's."""
    return native.disabled() if path == "numpy" else contextlib.nullcontext()


@pytest.mark.parametrize("path", ["native", "numpy"])
def test_lookups_match_a_dict_under_insert_and_evict_churn(path):
    # Many evictions leave tombstones and force table rebuilds; lookups must stay exact.
    with _probing(path):
        _churn()


def _churn(steps=300, cache=None, seed=1, model=None):
    """Random lookups and inserts checked against a dict; returns the cache and the dict."""
    c = cache or RowCache(W, 300 * (4 * W + ENTRY_OVERHEAD_BYTES), CachePolicy.LRU)
    rng = np.random.default_rng(seed)
    universe = _keys(5000)
    model = {} if model is None else model  # key -> row value marker, for keys the cache holds
    for step in range(steps):
        batch = np.unique(rng.choice(universe, size=rng.integers(1, 120)))
        ent = c.lookup(batch)
        present = ent >= 0
        for k, e in zip(batch[present].tolist(), ent[present].tolist()):
            assert c.rows[e, 0] == model[k]
        for k in batch[~present].tolist():
            assert k not in model
        miss = batch[~present]
        vals = rng.standard_normal(miss.size).astype(np.float32)
        rows = np.repeat(vals[:, None], W, axis=1)
        n_in, (vk, vp, vr) = c.insert(miss, rows, np.arange(miss.size), dirty=False)
        assert n_in == miss.size and vk.size == 0  # clean victims are not returned
        held = set(c.keys[c.keys != np.iinfo(np.uint64).max].tolist())
        model = {k: v for k, v in model.items() if k in held}
        model.update(zip(miss.tolist(), vals.tolist()))
        assert set(model) == held and len(held) <= c.capacity
    assert c.evictions > 0
    return c, model


def test_the_c_and_numpy_probes_read_each_others_tables():
    # A table filled (with tombstones) by one path answers the other path's lookups, and the rows
    # come back the same through take(); inserts by the C path after numpy's stay findable.
    c = RowCache(W, 300 * (4 * W + ENTRY_OVERHEAD_BYTES), CachePolicy.LRU)
    with native.disabled():
        _, model = _churn(120, c)
    _churn(120, c, seed=2, model=model)
    probe = np.concatenate([_keys(3000, seed=7), c.keys[c.keys != np.iinfo(np.uint64).max]])
    c_ent = c.lookup(probe, "peek")
    with native.disabled():
        np_ent = c.lookup(probe, "peek")
        np_rows = np.zeros((probe.size, W), np.float32)
        c.take(np_ent, np_rows)
    np.testing.assert_array_equal(c_ent, np_ent)
    assert (c_ent >= 0).sum() == c.size
    rows = np.zeros((probe.size, W), np.float32)
    c.take(c_ent, rows)
    np.testing.assert_array_equal(rows, np_rows)


@pytest.mark.parametrize("path", ["native", "numpy"])
def test_put_writes_the_hits_and_skips_the_misses(path):
    c = RowCache(W, 50 * (4 * W + ENTRY_OVERHEAD_BYTES))
    keys = _keys(20)
    c.insert(keys, np.zeros((20, W), np.float32), np.arange(20), dirty=False)
    ent = c.lookup(np.concatenate([keys[:5], _keys(3, seed=9)]), "pin")
    assert (ent[:5] >= 0).all() and (ent[5:] < 0).all()
    new = np.arange(8 * W, dtype=np.float32).reshape(8, W)
    with _probing(path):
        c.put(ent, new)
    np.testing.assert_array_equal(c.rows[ent[:5]], new[:5])
    assert c.dirty[ent[:5]].all() and c.dirty.sum() == 5


def test_dirty_victims_carry_their_latest_rows_and_pins_hold():
    c = RowCache(W, 100 * (4 * W + ENTRY_OVERHEAD_BYTES))
    keys = _keys(300)
    first = keys[:100]
    c.lookup(first)
    c.insert(first, np.zeros((100, W), np.float32), np.arange(100), dirty=True)
    ent = c.lookup(first[:10], "pin")
    c.update(ent, np.full((10, W), 7.0, np.float32))
    # Op with 10 pinned hits: room for 90 more at most, the pinned ones stay.
    more = keys[100:200]
    c.lookup(np.concatenate([first[:10], more]))
    n_in, (vk, vp, vr) = c.insert(more, np.ones((100, W), np.float32), 1000 + np.arange(100), dirty=False)
    assert n_in == 90
    assert np.all(c.lookup(first[:10], "peek") >= 0)
    assert set(vk.tolist()) <= set(first[10:].tolist()) and vk.size == 90
    np.testing.assert_array_equal(vr, 0.0)
    np.testing.assert_array_equal(np.sort(vp), np.sort(np.searchsorted(first, vk)))


def test_zero_capacity_cache_holds_nothing():
    c = RowCache(W, 0)
    keys = _keys(10)
    assert np.all(c.lookup(keys) == -1)
    n_in, victims = c.insert(keys, np.zeros((keys.size, W), np.float32), np.arange(keys.size), True)
    assert n_in == 0 and victims[0].size == 0


def _zipf_hit_rate(policy, cache_frac, n_keys=20_000, batches=400, batch=256, seed=3):
    rng = np.random.default_rng(seed)
    p = 1.0 / np.arange(1, n_keys + 1) ** 1.1
    cdf = np.cumsum(p / p.sum())
    keys = _keys(3 * n_keys, seed=4)[:n_keys]
    rows = np.zeros((batch, W), np.float32)
    c = RowCache(W, int(cache_frac * n_keys) * (4 * W + ENTRY_OVERHEAD_BYTES), policy)
    for i in range(batches):
        if i == batches // 4:  # count after a warm-up
            c.hits = c.misses = 0
        b = np.unique(keys[np.minimum(np.searchsorted(cdf, rng.random(batch)), n_keys - 1)])
        miss = b[c.lookup(b) < 0]
        c.insert(miss, rows[:miss.size], np.zeros(miss.size, np.int64), False)
    return c.hits / (c.hits + c.misses)


def test_lfu_keeps_hot_keys_better_than_lru_on_zipf():
    # The default (LFU with aging) is chosen by this comparison; see BENCHMARKS.md.
    for frac in (0.01, 0.05):
        lfu, lru = _zipf_hit_rate(CachePolicy.LFU, frac), _zipf_hit_rate(CachePolicy.LRU, frac)
        assert lfu > lru, (frac, lfu, lru)


def _survivors_after_traffic_moves(aging_lookups):
    c = RowCache(W, 80 * (4 * W + ENTRY_OVERHEAD_BYTES), CachePolicy.LFU, aging_lookups=aging_lookups)
    keys = _keys(400)
    old, new, fresh = keys[:40], keys[40:80], keys[80:90]
    for batch, times in ((old, 60), (new, 20), (fresh, 1)):  # the hot set moves from old to new
        for _ in range(times):
            miss = batch[c.lookup(batch) < 0]
            c.insert(miss, np.zeros((miss.size, W), np.float32), np.zeros(miss.size, np.int64), False)
    return np.count_nonzero(c.lookup(old, "peek") >= 0), np.count_nonzero(c.lookup(new, "peek") >= 0)


def test_lfu_aging_lets_yesterdays_hot_keys_go():
    old_kept, new_kept = _survivors_after_traffic_moves(aging_lookups=200)
    assert new_kept == 40 and old_kept == 30  # the 10 fresh keys displaced old ones only
    old_kept, new_kept = _survivors_after_traffic_moves(aging_lookups=1 << 30)  # no aging
    assert new_kept == 30 and old_kept == 40  # stale counts win: the current hot set suffers


@pytest.mark.parametrize("policy", [CachePolicy.LFU, CachePolicy.LRU])
def test_victims_among_equals_are_the_lowest_shard_positions_in_file_order(policy):
    """Rows that came in one operation tie on (count, tick): the eviction takes the lowest
    shard positions among them, so that consecutive write-back batches write consecutive pages
    (an arbitrary pick wrote each page once for every batch that took one of its rows)."""
    c = RowCache(W, 512 * (4 * W + ENTRY_OVERHEAD_BYTES), policy=policy)
    assert c.capacity == 512
    keys = _keys(600, seed=1)[:512]
    pos = np.random.default_rng(2).permutation(10_000)[:512].astype(np.int64)
    c.lookup(keys, "access")
    c.insert(keys, np.ones((512, W), np.float32), pos, True)
    fresh = _keys(100, seed=3)
    c.lookup(fresh, "access")  # the next operation
    n, (vk, vpos, vrows) = c.insert(fresh, np.zeros((100, W), np.float32), np.arange(10_000, 10_100), True)
    assert n == 100
    assert np.array_equal(vpos, np.sort(pos)[:100])
    assert np.array_equal(vk, keys[np.argsort(pos)][:100]) and (vrows == 1).all()
