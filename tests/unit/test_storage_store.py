"""EmbeddingStore against a plain in-RAM dense table: caching, eviction and write-back,
admission, TTL compaction, checkpoint deltas and bulk loads. One rank (no MPI)."""

import contextlib
import os
import threading

import numpy as np
import pytest

from hvctr.config import CachePolicy, StorageConfig
from hvctr.formats import RowLayout, init_rows
from hvctr.storage import EmbeddingStore
from hvctr.storage import store as store_module
from hvctr.storage.cache import ENTRY_OVERHEAD_BYTES

DIM = 4
LAYOUT = RowLayout(DIM)
N_KEYS = 2000


def _cfg(cache_rows, **kw):
    kw.setdefault("rows_per_rank", N_KEYS)
    return StorageConfig(dim=DIM, cpu_cache_bytes=cache_rows * (4 * LAYOUT.width + ENTRY_OVERHEAD_BYTES),
                         seed=5, init_scale=0.1, **kw)


def _universe(n=N_KEYS, seed=0):
    return np.random.default_rng(seed).permutation(
        np.unique(np.random.default_rng(seed).integers(0, 2**64 - 2, size=n, dtype=np.uint64)))


def _batches(dist, steps, seed=1, size=150):
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        if dist == "zipf":
            idx = np.minimum(rng.zipf(1.1, size=size) - 1, N_KEYS - 1)
        else:
            idx = rng.integers(0, N_KEYS, size=size)
        yield rng.permutation(np.unique(idx)), rng


@pytest.mark.parametrize("dist", ["uniform", "zipf"])
@pytest.mark.parametrize("cache_rows,policy", [(0, CachePolicy.LFU), (40, CachePolicy.LFU),
                                               (40, CachePolicy.LRU), (N_KEYS, CachePolicy.LFU)])
def test_reads_and_writes_match_dense_reference(tmp_path, dist, cache_rows, policy):
    cfg = _cfg(cache_rows, cache_policy=policy)
    uni = _universe()
    ref = init_rows(uni, LAYOUT, cfg.init_scale, cfg.seed)
    store = EmbeddingStore(cfg, tmp_path / "s.h5")
    touched = []
    for step, (idx, rng) in enumerate(_batches(dist, 60)):
        touched.append(idx)
        if step % 7 == 3:  # warming never changes what a read returns
            store.warm(uni[np.unique(rng.integers(0, N_KEYS, 100))])
        if step == 30:  # close and reopen: everything went to the shard
            store.close()
            store = EmbeddingStore(cfg, tmp_path / "s.h5", create=False)
        rows = store.read(uni[idx])
        np.testing.assert_array_equal(rows, ref[idx])
        new = rows + rng.standard_normal(rows.shape).astype(np.float32)
        store.write(uni[idx], new)
        ref[idx] = new
    stats = store.stats()
    if 0 < cache_rows < N_KEYS:
        assert stats["cache_evictions"] > 0 and stats["writeback_rows"] > 0 and stats["cache_hits"] > 0
    if cache_rows == 0:
        assert stats["writethrough_rows"] > 0
    touched = np.unique(np.concatenate(touched))
    keys, rows = map(np.concatenate, zip(*store.iter_rows(chunk_rows=300)))
    where = {k: i for i, k in enumerate(uni.tolist())}
    assert sorted(keys.tolist()) == sorted(uni[touched].tolist())
    np.testing.assert_array_equal(rows, ref[[where[k] for k in keys.tolist()]])
    np.testing.assert_array_equal(store.read_only(uni), ref)  # untouched keys: init rows
    store.close()


def test_admission_reads_default_row_until_admitted(tmp_path):
    cfg = _cfg(20, admit_after=3, admit_sketch_slots=1 << 12)
    store = EmbeddingStore(cfg, tmp_path / "s.h5")
    keys = _universe()[:50]
    init = init_rows(keys, LAYOUT, cfg.init_scale, cfg.seed)
    for _ in range(2):  # seen once, twice: not stored, the shared zero row, writes dropped
        assert not store.read(keys).any()
        store.write(keys, np.ones((50, LAYOUT.width), np.float32))
    assert store.shard.n_rows == 0 and store.stats()["dropped_writes"] == 100
    assert not store.read_only(keys).any()  # evaluation reads what training read
    np.testing.assert_array_equal(store.read(keys), init)  # third sight: admitted, init row
    assert store.shard.n_rows == 50
    store.write(keys, init + 1)
    np.testing.assert_array_equal(store.read(keys), init + 1)
    store.close()


def test_ttl_compaction_drops_rows_unseen_for_ttl_passes(tmp_path):
    cfg = _cfg(30, ttl_passes=2)
    store = EmbeddingStore(cfg, tmp_path / "s.h5")
    uni = _universe()
    a, b, c = uni[:100], uni[100:200], uni[200:300]
    rows = {}
    for p, keys in enumerate([(a, b, c), (a, b), (a,)]):  # passes 0, 1, 2
        for k in keys:
            r = store.read(k) + p
            store.write(k, r)
            rows[k.tobytes()] = r
        store.end_pass()
    # Now in pass 3: c was last written in pass 0, b in 1, a in 2. Keep the last 2 passes.
    assert store.compact() == 100
    assert store.shard.n_rows == 200
    keys, _ = map(np.concatenate, zip(*store.iter_rows()))
    assert set(keys.tolist()) == set(a.tolist()) | set(b.tolist())
    np.testing.assert_array_equal(store.read(a), rows[a.tobytes()])
    np.testing.assert_array_equal(store.read(b), rows[b.tobytes()])
    np.testing.assert_array_equal(store.read(c), init_rows(c, LAYOUT, cfg.init_scale, cfg.seed))  # new again
    store.close()


def test_checkpoint_delta_iteration_and_bulk_load(tmp_path):
    cfg = _cfg(25)
    uni = _universe()
    store = EmbeddingStore(cfg, tmp_path / "s.h5")
    base = uni[:300]
    store.write(base, store.read(base) + 1)
    k0, r0 = store.take_checkpoint_delta()
    assert sorted(k0.tolist()) == sorted(base.tolist())
    changed = np.concatenate([uni[50:80], uni[400:420]])  # old rows changed and new rows
    store.write(changed, store.read(changed) * 2)
    k1, r1 = store.take_checkpoint_delta()
    assert sorted(k1.tolist()) == sorted(changed.tolist())
    k2, _ = store.take_checkpoint_delta()
    assert k2.size == 0  # nothing written since
    # A fresh shard loaded with base then delta equals the store, row for row.
    fresh = EmbeddingStore(cfg, tmp_path / "fresh.h5")
    fresh.load_rows(k0, r0)
    fresh.load_rows(k1, r1)
    want_k, want_r = map(np.concatenate, zip(*store.iter_rows()))
    np.testing.assert_array_equal(fresh.read(want_k), want_r)
    assert fresh.take_checkpoint_delta()[0].size == 0  # loaded rows are already checkpointed
    fresh.close()
    store.close()


def test_read_only_inserts_nothing(tmp_path):
    cfg = _cfg(10)
    store = EmbeddingStore(cfg, tmp_path / "s.h5")
    uni = _universe()
    store.write(uni[:20], store.read(uni[:20]) + 3)
    before = store.stats()
    got = store.read_only(uni[:100])
    np.testing.assert_array_equal(got[20:], init_rows(uni[20:100], LAYOUT, cfg.init_scale, cfg.seed))
    np.testing.assert_array_equal(got[:20], init_rows(uni[:20], LAYOUT, cfg.init_scale, cfg.seed) + 3)
    after = store.stats()
    assert store.shard.n_rows == 20
    assert (after["cache_hits"], after["cache_misses"]) == (before["cache_hits"], before["cache_misses"])
    store.close()


@contextlib.contextmanager
def _warming(store, uni):
    """A prefetch thread warming random keys of ``uni`` until the block ends."""
    stop = threading.Event()

    def prefetch():
        rng = np.random.default_rng(9)
        while not stop.is_set():
            store.warm(uni[np.unique(rng.integers(0, N_KEYS, 300))])

    th = threading.Thread(target=prefetch)
    th.start()
    try:
        yield
    finally:
        stop.set()
        th.join()


def test_warm_in_a_thread_beside_writes(tmp_path):
    cfg = _cfg(60)
    uni = _universe()
    store = EmbeddingStore(cfg, tmp_path / "s.h5")
    ref = init_rows(uni, LAYOUT, cfg.init_scale, cfg.seed)
    store.write(uni, ref)  # every key stored; most rows on the shard only
    with _warming(store, uni):
        for idx, rng in _batches("zipf", 40, seed=4):
            rows = store.read(uni[idx])
            np.testing.assert_array_equal(rows, ref[idx])
            ref[idx] = rows - 1
            store.write(uni[idx], ref[idx])
    assert store.stats()["warmed_rows"] > 0
    np.testing.assert_array_equal(store.read(uni), ref)
    store.close()


def test_user_errors(tmp_path, monkeypatch):
    cfg = _cfg(10, rows_per_rank=100)
    store = EmbeddingStore(cfg, tmp_path / "s.h5")
    uni = _universe()
    monkeypatch.setattr(store_module, "DEBUG_CHECKS", True)  # HVCTR_DEBUG_CHECKS=1
    with pytest.raises(ValueError, match="unique"):
        store.read(np.array([5, 3, 5], dtype=np.uint64))
    monkeypatch.setattr(store_module, "DEBUG_CHECKS", False)  # the default: the exchange's keys are trusted
    with pytest.raises(ValueError, match="unique"):  # checkpoint loads always check
        store.load_rows(np.array([5, 3, 5], dtype=np.uint64), np.zeros((3, LAYOUT.width), np.float32))
    two = EmbeddingStore(cfg, tmp_path / "r1.h5", rank=1, world_size=2)
    with pytest.raises(ValueError, match="belong to other ranks"):
        two.load_rows(uni[:20], np.zeros((20, LAYOUT.width), np.float32))  # about half are rank 0's
    two.close()
    with pytest.raises(ValueError, match="storage.rows_per_rank"):
        store.read(uni[:150])
    store.close()
    with pytest.raises(ValueError, match="dim"):
        EmbeddingStore(StorageConfig(dim=8), tmp_path / "s.h5")
    with pytest.raises(ValueError, match="does not exist"):
        EmbeddingStore(cfg, tmp_path / "none.h5", create=False)


@pytest.mark.parametrize("chunk_rows", [1, 7, 10_000])
def test_flush_writes_every_dirty_row_in_bounded_chunks(tmp_path, monkeypatch, chunk_rows):
    # A flush writes the dirty rows in file order, chunk_rows at a time; a new process's
    # store reads back exactly what was written, and nothing stays dirty.
    monkeypatch.setattr(store_module, "_FLUSH_CHUNK_BYTES", chunk_rows * LAYOUT.row_bytes)
    uni = _universe()
    cfg = _cfg(N_KEYS)
    path = tmp_path / "s.h5"
    with EmbeddingStore(cfg, path, create=True) as store:
        keys = uni[np.random.default_rng(3).permutation(500)]
        rows = store.read(keys)
        rows[:, LAYOUT.model] += np.arange(500, dtype=np.float32)[:, None]
        store.write(keys, rows)
        assert store.cache.dirty_entries().size == 500
        store.flush()
        assert store.cache.dirty_entries().size == 0
        np.testing.assert_array_equal(store.shard.read_rows(store.shard.lookup(keys)), rows)  # on the shard now
    with EmbeddingStore(cfg, path, create=False) as again:
        np.testing.assert_array_equal(again.read(keys), rows)


def test_a_warm_window_is_read_from_the_shard_once_however_small_the_cache(tmp_path):
    """A window's rows outnumber the cache (issue 26's read amplification): the warm reads at most
    half the cache's entries and holds them; a push of other rows between the warm and the pull
    evicts none of them; the pull reads from the shard only the rest. Each row once, as stored."""
    cache_rows = 64
    cfg = _cfg(cache_rows)
    uni = _universe()
    store = EmbeddingStore(cfg, tmp_path / "s.h5")
    want = np.random.default_rng(3).standard_normal((N_KEYS, LAYOUT.width)).astype(np.float32)
    for start in range(0, N_KEYS, 500):  # every row on the shard, none left in the cache
        store.write(uni[start:start + 500], want[start:start + 500])
    store.close()  # reopened: nothing cached, no position known
    store = EmbeddingStore(cfg, tmp_path / "s.h5", create=False)
    window, other = np.arange(0, 600), np.arange(1000, 1300)

    def reads(cause):
        return store.shard_traffic().get(cause, {}).get("rows_read", 0)

    store.warm(uni[window])
    assert reads("warm") == cache_rows // 2 == store.cache.n_held  # not the 600 the cache cannot keep
    store.write(uni[other], want[other] + 1)  # the push of the window before: 300 rows, 4x the cache
    got = store.read(uni[window])
    np.testing.assert_array_equal(got, want[window])
    assert reads("pull") == window.size - cache_rows // 2  # the held rows were all still there
    if store.shard.recent is not None:  # the pread path: the warm looked up the rest's positions
        assert store.shard_traffic()["pull"]["index_blocks_read"] == 0
        assert store.shard_traffic()["warm"]["index_blocks_read"] > 0
    assert store.cache.n_held == 0  # the pull took them: ordinary entries again
    np.testing.assert_array_equal(store.read(uni[other]), want[other] + 1)


def test_write_behind_follows_the_memory_limit_unless_set(tmp_path, monkeypatch):
    """storage.write_behind = auto flushes and drops the shard's writes only where the job has
    a memory limit (hvctr.memcg.current()); on and off say so whatever the limit. The rows
    are the same either way."""
    from hvctr import memcg
    from hvctr.config import WriteBehind

    keys = np.arange(1, 2001, dtype=np.uint64)
    got = {}
    for tag, setting, limited in (("auto-free", WriteBehind.AUTO, False), ("auto-limited", WriteBehind.AUTO, True),
                                  ("on", WriteBehind.ON, False), ("off", WriteBehind.OFF, True)):
        monkeypatch.setattr(memcg, "current", (lambda: object()) if limited else (lambda: None))
        cfg = StorageConfig(dim=DIM, rows_per_rank=4096, cpu_cache_bytes=1 << 16, write_behind=setting)
        with EmbeddingStore(cfg, tmp_path / f"{tag}.h5") as store:
            assert store.write_behind == store.shard.write_behind == (tag in ("auto-limited", "on")), tag
            store.write(keys, store.read(keys) + 1.0)  # most rows past the small cache: written back
            got[tag] = store.read_only(keys)
    for tag in got:
        np.testing.assert_array_equal(got[tag], got["auto-free"])


def test_a_row_written_while_the_warm_reads_it_is_not_cached_old(tmp_path):
    """warm() reads with the lock released (issue 26): a row the training thread writes back to
    the shard meanwhile may have been read old. Here the write-back lands between the warm's read
    and its insert: the old copy must not reach the cache, and the read sees the new row."""
    cache_rows = 64
    cfg = _cfg(cache_rows)
    uni = _universe()
    store = EmbeddingStore(cfg, tmp_path / "s.h5")
    want = np.random.default_rng(3).standard_normal((N_KEYS, LAYOUT.width)).astype(np.float32)
    for start in range(0, N_KEYS, 500):
        store.write(uni[start:start + 500], want[start:start + 500])
    store.flush()
    store.cache.clear()
    window, other = np.arange(0, 20), np.arange(1000, 1400)
    detached = store.shard.read_rows_detached

    def read_then_train(pos):
        out = detached(pos)  # the rows as they are now ...
        want[window[:10]] += 1  # ... then the training thread pushes half of them and evicts them
        store.write(uni[window[:10]], want[window[:10]])
        store.write(uni[other], want[other])
        assert (store.cache.lookup(uni[window[:10]], "peek") < 0).all()  # written back, not cached
        return out

    store.shard.read_rows_detached = read_then_train
    store.warm(uni[window])
    np.testing.assert_array_equal(store.read(uni[window]), want[window])
    assert store.counters["fenced_warm_rows"] == 10
    assert store.counters["warmed_rows"] == 10  # the other half, unchanged
    store.close()


def test_deferred_writes_beside_reads_of_other_keys_and_a_warm_thread(tmp_path):
    """A window's rows the next window does not hold are written by a thread of their own after
    the next window's rows are read, a warm thread waiting for them (storage.defer_writes):
    every read returns what was written last, and the deferred write looks up no position."""
    cfg = _cfg(60)
    uni = _universe()
    store = EmbeddingStore(cfg, tmp_path / "s.h5")
    ref = init_rows(uni, LAYOUT, cfg.init_scale, cfg.seed)
    store.write(uni, ref)
    lookup = store.shard.lookup

    def lookup_not_deferred(keys):  # the deferred write takes the places defer_write looked up
        assert not threading.current_thread().name.startswith("hvctr-deferred-write"), "a deferred write looked up"
        return lookup(keys)

    store.shard.lookup = lookup_not_deferred
    with _warming(store, uni):
        windows = [idx for idx, _ in _batches("zipf", 41, seed=4, size=300)]
        for now, after in zip(windows, windows[1:]):
            later = np.setdiff1d(now, after)  # written after the next window's read
            ref[now] = store.read(uni[now], deferred_ok=False) + 1
            held = np.intersect1d(now, after)
            store.write(uni[held], ref[held])
            store.defer_write(uni[later], ref[later])
            np.testing.assert_array_equal(store.read(uni[after], deferred_ok=True), ref[after])
            store.start_deferred()  # beside the next window's steps
    assert store.stats()["deferred_rows"] > 0 and store.stats()["warmed_rows"] > 0
    np.testing.assert_array_equal(store.read(uni), ref)  # a plain read waits for the last of them
    store.defer_write(uni[:5], ref[:5] + 2)  # held, never started: the checkpoint's flush writes it
    ref[:5] += 2
    keys, rows = map(np.concatenate, zip(*store.iter_rows()))
    np.testing.assert_array_equal(rows[np.argsort(keys)], ref[np.argsort(uni)])
    store.close()


@pytest.mark.parametrize("cache_rows", [0, 40])
def test_a_write_given_the_reads_positions_looks_none_up(tmp_path, cache_rows):
    """An owner's push writes the rows its pull read (read_placed, then write / defer_write with
    the positions): no index lookup for any key the read found or created, the same rows as
    plain writes, and positions of an older epoch (the shard compacted between) are not used."""
    cfg = _cfg(cache_rows, ttl_passes=2, admit_after=2)
    stores = [EmbeddingStore(cfg, tmp_path / f"{name}.h5") for name in ("placed", "plain")]
    placed_store, plain_store = stores
    lookups = []
    lookup = placed_store.shard.lookup
    placed_store.shard.lookup = lambda keys: (lookups.append(keys.shape[0]), lookup(keys))[1]
    uni = _universe()
    for (idx, _), (nxt, _) in zip(_batches("zipf", 30, seed=7, size=300), _batches("zipf", 30, seed=8, size=300)):
        keys = uni[idx]
        rows, placed = placed_store.read_placed(keys)
        ref = plain_store.read(keys)
        np.testing.assert_array_equal(rows, ref)
        assert placed.pos.shape == keys.shape
        stored = placed.pos >= 0  # admit_after = 2: a key read once is not stored, its position -1
        np.testing.assert_array_equal(placed.pos[stored], lookup(keys[stored]))
        lookups.clear()
        held = np.isin(idx, nxt)  # as _store_merged splits a push: now, and deferred to the next pull
        placed_store.write(keys[held], rows[held] + 1, placed.take(np.flatnonzero(held)))
        placed_store.defer_write(keys[~held], rows[~held] + 1, placed.take(np.flatnonzero(~held)))
        placed_store.start_deferred()
        plain_store.write(keys, ref + 1)
        # only the keys the read did not store are looked up (their rows are dropped again)
        assert sum(lookups) <= int(np.count_nonzero(~stored))
    np.testing.assert_array_equal(placed_store.read(uni, count=False), plain_store.read(uni, count=False))
    keys = uni[:50]
    _, placed = placed_store.read_placed(keys)
    placed_store.end_pass(), placed_store.end_pass(), placed_store.end_pass()
    assert placed_store.compact() > 0  # rows move: the positions read before are stale
    lookup = placed_store.shard.lookup  # a new shard file
    placed_store.shard.lookup = lambda keys: (lookups.append(keys.shape[0]), lookup(keys))[1]
    lookups.clear()
    placed_store.write(keys, np.zeros((50, LAYOUT.width), np.float32), placed)
    assert sum(lookups) == 50
    np.testing.assert_array_equal(placed_store.read(keys, count=False), np.zeros((50, LAYOUT.width), np.float32))
    for store in stores:
        store.close()


def test_a_failed_deferred_write_is_raised_where_its_rows_are_waited_for(tmp_path):
    store = EmbeddingStore(_cfg(0), tmp_path / "s.h5")
    keys = _universe()[:10]
    store.defer_write(keys, np.zeros((10, LAYOUT.width), np.float32))
    store.shard.write_rows = None  # the thread's write fails (no cache: every row goes to the shard)
    store.start_deferred()
    with pytest.raises(RuntimeError, match=r"rank 0: writing a window's rows to .*s\.h5 after the next window's "
                                           r"pull failed"):
        store.read(keys)


@pytest.mark.parametrize("warm", [True, False])
def test_a_pass_finds_the_rows_its_windows_found_last_pass_without_index_blocks(tmp_path, warm):
    """The position log (hvctr.storage.position_log): epoch 1's window at batch b warms and reads
    the rows epoch 0's window at batch b created, through no index block, and the rows are the
    same as without the log; the log's files go with the shard."""
    windows = [_universe(2000, seed=s) for s in range(6)]  # 6 windows of 2k keys; two generations of 4k recent positions

    def run(with_log):
        store = EmbeddingStore(_cfg(50, rows_per_rank=20_000, position_log=with_log), tmp_path / f"s{with_log}.h5")
        got = []
        for epoch in range(2):
            for b, keys in enumerate(windows):
                tag = (epoch, 10 * b)
                blocks = store.shard.index_blocks_read
                if warm:  # else the read recalls them (data.prefetch = false)
                    store.warm(keys, tag=tag)
                rows = store.read(keys, tag=tag)
                store.write(keys, rows + 1)
                if epoch == 1:
                    got.append((rows, store.shard.index_blocks_read - blocks))
        stats, logs = store.stats(), store.shard.position_log
        paths = list(logs.paths) if logs else []
        store.close()
        assert not any(os.path.exists(p) for p in paths)  # removed with the shard
        return got, stats, paths

    with_log, stats, paths = run(True)
    without, stats0, _ = run(False)
    assert len(paths) == 2 and stats["recalled_positions"] == 6 * 2000 and stats0["recalled_positions"] == 0
    for (rows, blocks), (rows0, blocks0) in zip(with_log, without):
        np.testing.assert_array_equal(rows, rows0)  # a hint: the same rows
        assert blocks == 0
    # without the log the 4 windows whose index entries reached the file read nearly all of its 98
    # blocks each (the last 2 windows' entries are still waiting in memory)
    assert [b for _, b in without][:4] == [98] * 4
