"""ShardedTable against an in-RAM dense reference; run under mpirun -np 2 and -np 3.

Every rank can compute every rank's keys (seeded by window and rank), so every rank keeps
the whole reference table: a dense array over a fixed universe of keys, updated by the
merge rule written out plainly (sum the copies in ascending rank, divide by their count).
Caches hold a few percent of the keys, so pulls read the SSD shard and evictions write back.
The store's uniqueness guard (a debug check in training) is on for every test here.
"""

import shutil
import tempfile
import threading

import numpy as np
import pytest
import torch

from hvctr.config import CachePolicy, StorageConfig
from hvctr.formats import default_bucket_owner, owner_of
from hvctr.formats import RowLayout, init_rows
from hvctr.storage import EmbeddingStore, ShardedTable, shard_path
from hvctr.storage import store as store_module
from hvctr.storage.exchange import WindowExchange
from hvctr.storage.cache import ENTRY_OVERHEAD_BYTES

DIM = 4
UNIVERSE = 3000


def _cfg(cache_rows: int, policy: CachePolicy = CachePolicy.LFU) -> StorageConfig:
    width = RowLayout(DIM).width
    return StorageConfig(dim=DIM, rows_per_rank=UNIVERSE, cpu_cache_bytes=cache_rows * (4 * width + ENTRY_OVERHEAD_BYTES),
                         cache_policy=policy, seed=7, init_scale=0.05)


@pytest.fixture(autouse=True)
def debug_checks(monkeypatch):
    """Owners check that the keys the exchange hands them are unique (HVCTR_DEBUG_CHECKS=1)."""
    monkeypatch.setattr(store_module, "DEBUG_CHECKS", True)


@pytest.fixture
def shard_dir(comm):
    d = tempfile.mkdtemp(prefix=f"hvctr-x-r{comm.rank}-")
    yield d
    comm.barrier()
    shutil.rmtree(d, ignore_errors=True)


def _table(comm, shard_dir, cfg, sub="a"):
    owner = default_bucket_owner(comm.size)
    store = EmbeddingStore(cfg, shard_path(f"{shard_dir}/{sub}", comm.rank), comm.rank, comm.size, owner, create=True)
    return ShardedTable(comm, store, owner, "cpu")


def _universe():
    rng = np.random.default_rng(12345)
    return np.unique(rng.integers(0, 2**64 - 2, size=UNIVERSE, dtype=np.uint64, endpoint=False))


def _window_idx(t, r, dist, n=200):
    """Indices (into the universe) rank r touches in window t: unique, in no particular order."""
    rng = np.random.default_rng([t, r, 99])
    if dist == "zipf":
        idx = np.minimum(rng.zipf(1.1, size=n) - 1, UNIVERSE - 1)
    else:
        idx = rng.integers(0, UNIVERSE, size=n)
    return rng.permutation(np.unique(idx))


def _delta(t, r, n, width):
    return np.random.default_rng([t, r, 7]).standard_normal((n, width)).astype(np.float32)


def _reference_merge(ref, contributions):
    """contributions: list over ranks (ascending) of (idx, rows). Sum, then divide by count."""
    total, count = {}, {}
    for idx, rows in contributions:
        for i, row in zip(idx.tolist(), rows):
            total[i] = row.copy() if i not in total else total[i] + row
            count[i] = count.get(i, 0) + 1
    for i in total:
        ref[i] = total[i] / np.float32(count[i])


@pytest.mark.parametrize("dist", ["uniform", "zipf"])
@pytest.mark.parametrize("how", ["keys", "exchange", "prefetch", "pull_ahead", "push_behind"])
def test_pulls_and_pushes_match_dense_reference(comm, shard_dir, dist, how):
    """how: plain keys (every call sends them); a WindowExchange the pull sends the keys of (and
    the push sends rows only); one the warm sent them of, before window t-1's push (the pull
    sends no keys, and reads the rows after that push); the same where the warm also answers
    the rows window t does not hold (storage.pull_ahead: the pull answers the rest); the same where
    window t's push sends at once only the rows window t+1 holds, and the rest after t+1's pull,
    before t+2's warm, as the prefetch thread does (storage.push_behind)."""
    cfg = _cfg(cache_rows=60)
    table = _table(comm, shard_dir, cfg)
    table.pull_ahead = how in ("pull_ahead", "push_behind")
    table.push_behind = how == "push_behind"
    layout, uni = RowLayout(DIM), _universe()
    ref = init_rows(uni, layout, cfg.init_scale, cfg.seed)
    windows = 8
    warmed = None
    for t in range(windows):
        mine = _window_idx(t, comm.rank, dist)
        x = {"keys": uni[mine], "exchange": table.exchange(uni[mine]), "prefetch": warmed, "pull_ahead": warmed,
             "push_behind": warmed}[how]
        if x is None:  # the first window: no warm ran
            x = table.exchange(uni[mine])
        rows = table.pull(x, name=f"t.p{t}")
        assert rows.dtype == torch.float32 and rows.shape == (mine.size, layout.width)
        np.testing.assert_array_equal(rows.numpy(), ref[mine])
        if how != "keys":
            assert x.asked is not None  # the owners kept the request: the push sends rows only
        if how != "keys" and how != "exchange" and t + 1 < windows:  # warm window t+1 before window t's push lands
            table.settle_push()  # window t-1's rows left behind, before the warm (the prefetch thread)
            warmed = table.warm(table.exchange(uni[_window_idx(t + 1, comm.rank, dist)]), name=f"t.w{t + 1}")
        ahead = warmed if how == "push_behind" and t + 1 < windows else None
        table.push(x, rows + torch.from_numpy(_delta(t, comm.rank, mine.size, layout.width)), name=f"t.u{t}",
                   ahead=ahead)
        contributions = []
        for r in range(comm.size):
            idx = _window_idx(t, r, dist)
            contributions.append((idx, ref[idx] + _delta(t, r, idx.size, layout.width)))
        _reference_merge(ref, contributions)
    stats = table.store.stats()
    assert stats["cache_evictions"] > 0 and stats["writeback_rows"] > 0 and stats["shard_bytes_read"] > 0
    ahead = table.stats()
    if how in ("pull_ahead", "push_behind"):  # both halves answered something: the rows window t held, and the rest
        assert ahead["ahead_rows"] > 0 and ahead["ahead_late_rows"] > 0
    else:
        assert "ahead_calls" not in ahead
    if how == "push_behind":  # rows went both ways: with the push, and behind it
        assert ahead["push_behind_calls"] == windows - 1 and ahead["push_behind_rows"] > 0
        assert ahead["ahead_behind_rows"] > 0
    else:
        assert "push_behind_calls" not in ahead
    # Every row this rank owns, read back from its shard after a flush, equals the reference.
    owned_ref = {}
    touched = np.unique(np.concatenate([_window_idx(t, r, dist) for t in range(windows) for r in range(comm.size)]))
    mine_owned = touched[owner_of(uni[touched], table.bucket_owner) == comm.rank]
    for k, i in zip(uni[mine_owned].tolist(), mine_owned.tolist()):
        owned_ref[k] = i
    keys, rows = map(np.concatenate, zip(*table.store.iter_rows(chunk_rows=500)))
    assert sorted(keys.tolist()) == sorted(owned_ref)
    np.testing.assert_array_equal(rows, ref[[owned_ref[k] for k in keys.tolist()]])
    table.store.close()


def test_warm_then_pull_equals_cold_pull(comm, shard_dir):
    cfg = _cfg(cache_rows=40)
    warm_t, cold_t = _table(comm, shard_dir, cfg, "warm"), _table(comm, shard_dir, cfg, "cold")
    uni = _universe()
    for t in range(4):  # the same history on both tables
        idx = _window_idx(t, comm.rank, "uniform")
        for tab, tag in ((warm_t, "a"), (cold_t, "b")):
            rows = tab.pull(uni[idx], name=f"h.{tag}.p{t}")
            tab.push(uni[idx], rows * 1.5 + 0.25, name=f"h.{tag}.u{t}")
    nxt = uni[_window_idx(2, comm.rank, "uniform")]  # rows that were evicted to the shard since
    before = warm_t.store.stats()["warmed_rows"]
    warm_t.warm(nxt, name="h.warm")
    assert warm_t.store.stats()["warmed_rows"] > before
    hits_before = warm_t.store.stats()["cache_hits"]
    got_warm = warm_t.pull(nxt, name="h.a.final")
    got_cold = cold_t.pull(nxt, name="h.b.final")
    assert torch.equal(got_warm, got_cold)
    # the request the warm kept answers the same pull without sending the keys again
    x = warm_t.warm(nxt, name="h.warm2")
    got_asked = warm_t.pull(x, name="h.a.asked")
    assert torch.equal(got_asked, got_cold)
    remote_keys = int((owner_of(nxt, warm_t.bucket_owner) != comm.rank).sum())
    assert warm_t.last["op"] == cold_t.last["op"] == "pull"
    assert cold_t.last["bytes_sent"] - warm_t.last["bytes_sent"] == 8 * remote_keys  # rows only
    # and the push of the same window: rows without their keys, the same stored rows
    warm_t.push(x, got_asked * 0.5, name="h.a.push")
    cold_t.push(nxt, got_cold * 0.5, name="h.b.push")
    assert warm_t.last["op"] == cold_t.last["op"] == "push"
    assert cold_t.last["bytes_sent"] - warm_t.last["bytes_sent"] == 8 * remote_keys
    assert torch.equal(warm_t.pull(nxt, name="h.a.after"), cold_t.pull(nxt, name="h.b.after"))
    assert warm_t.store.stats()["cache_hits"] - hits_before > 0
    warm_t.store.close()
    cold_t.store.close()


def test_pull_after_push_sees_the_push(comm, shard_dir):
    table = _table(comm, shard_dir, _cfg(cache_rows=0))  # no cache: every write lands on the shard
    uni = _universe()[:50]
    def keys_of(r):  # ranks 0 and 2 send the same keys: copies are averaged
        return uni[r % 2::2] if comm.size > 1 else uni

    keys = keys_of(comm.rank)
    rows = table.pull(keys, name="s.p0")
    table.push(keys, torch.full_like(rows, float(comm.rank + 1)), name="s.u0")
    got = table.pull(uni, name="s.p1")
    senders = [set(keys_of(r).tolist()) for r in range(comm.size)]
    for k, row in zip(uni.tolist(), got.numpy()):
        sent = [r + 1 for r in range(comm.size) if k in senders[r]]
        expect = np.float32(sum(np.float32(v) for v in sent)) / np.float32(len(sent))
        assert np.all(row == expect), (k, row, sent)
    table.store.close()


def test_push_gradients_sums_over_ranks_and_applies(comm, shard_dir):
    cfg = _cfg(cache_rows=30)
    table = _table(comm, shard_dir, cfg)
    layout, uni = RowLayout(DIM), _universe()[:400]
    ref = init_rows(uni, layout, cfg.init_scale, cfg.seed)
    lr = np.float32(0.1)

    def apply_fn(rows, grads):
        out = rows.clone()
        out[:, layout.model] -= lr * grads
        out[:, layout.step] += 1
        return out

    for t in range(3):
        idx = np.random.default_rng([t, comm.rank]).permutation(400)[:150]
        got = table.pull(uni[idx], name=f"g.p{t}")
        np.testing.assert_array_equal(got.numpy(), ref[idx])
        grads = np.random.default_rng([t, comm.rank, 1]).standard_normal((150, layout.model_width)).astype(np.float32)
        table.push_gradients(uni[idx], torch.from_numpy(grads), apply_fn, name=f"g.u{t}")
        total = {}
        for r in range(comm.size):
            ridx = np.random.default_rng([t, r]).permutation(400)[:150]
            rg = np.random.default_rng([t, r, 1]).standard_normal((150, layout.model_width)).astype(np.float32)
            for i, g in zip(ridx.tolist(), rg):
                total[i] = g.copy() if i not in total else total[i] + g
        for i, g in total.items():
            ref[i, layout.model] -= lr * (g / np.float32(comm.size))
            ref[i, layout.step] += 1
    np.testing.assert_array_equal(table.pull(uni, name="g.final").numpy(), ref)
    table.store.close()


def test_read_only_inserts_nothing_and_warm_runs_beside_push(comm, shard_dir):
    cfg = _cfg(cache_rows=50)
    table = _table(comm, shard_dir, cfg)
    layout, uni = RowLayout(DIM), _universe()
    seen, unseen = uni[:300], uni[2000:2300]
    rows = table.pull(seen, name="r.p0")
    n_rows = table.store.shard.n_rows
    got = table.read_only(np.concatenate([seen, unseen]), name="r.ro")
    np.testing.assert_array_equal(got[300:].numpy(), init_rows(unseen, layout, cfg.init_scale, cfg.seed))
    np.testing.assert_array_equal(got[:300].numpy(), rows.numpy())
    assert table.store.shard.n_rows == n_rows
    # A prefetch thread warms the next keys while the main thread pushes (distinct names).
    nxt = uni[1000:1400]
    th = threading.Thread(target=table.warm, args=(nxt, "r.warm"))
    th.start()
    mine = slice(comm.rank, None, comm.size)  # ranks push disjoint parts: no averaging here
    table.push(seen[mine], rows[mine] + 1, name="r.u0")
    th.join()
    assert table.last["op"] == "push"  # per thread: the warm thread's call does not show here
    expect = rows.numpy().copy()
    expect += 1
    np.testing.assert_array_equal(table.pull(seen, name="r.p1").numpy(), expect)
    stats = table.stats()
    assert stats["pull_calls"] == 2 and stats["warm_calls"] == 1
    assert all(stats[f"pull_{k}"] >= 0 for k in ("exchange_s", "cache_s", "shard_s"))
    if comm.size > 1:
        assert stats["pull_bytes_sent"] > 0 and stats["push_bytes_received"] > 0
    table.store.close()


@pytest.mark.parametrize("warm", [True, False])
@pytest.mark.parametrize("grouped", [True, False])
def test_a_window_exchange_equals_plain_keys_on_every_call(comm, shard_dir, warm, grouped):
    """Windows route their keys once (in the prefetch thread) and send them to their owners once
    (warm, else the pull): the pull and the push of their WindowExchange send no keys. The same
    rows and the same stored state (rows, and the order the store holds them in), bit for bit,
    as routing the plain keys and sending them on every call. grouped: the window's layout
    (its keys in owner order, as build_window lays them out), else the keys' sorted order."""
    cfg = _cfg(cache_rows=50)
    ahead, per_call = _table(comm, shard_dir, cfg, "ahead"), _table(comm, shard_dir, cfg, "per_call")
    uni, width = _universe(), RowLayout(DIM).width
    for t in range(5):
        keys = np.sort(uni[_window_idx(t, comm.rank, "zipf")])  # a window's keys are sorted
        routing = ahead.route(keys, trusted=True)
        if grouped:
            routing = routing.grouped()
            keys = routing.keys
        x = ahead.exchange(keys, trusted=True) if not grouped else WindowExchange(routing)
        if warm:
            assert ahead.warm(x, name=f"ra.w{t}") is x and x.asked is not None
            per_call.warm(keys, name=f"rp.w{t}")
        got_ahead, got_per_call = ahead.pull(x, name=f"ra.p{t}"), per_call.pull(keys, name=f"rp.p{t}")
        assert torch.equal(got_ahead, got_per_call)
        new = got_ahead + torch.from_numpy(_delta(t, comm.rank, keys.size, width))
        ahead.push(x, new, name=f"ra.u{t}")
        per_call.push(keys, new, name=f"rp.u{t}")
        some = np.flatnonzero(np.arange(keys.size) % 3 == 0)  # sync mode's touched rows
        grads = torch.from_numpy(_delta(t, comm.rank, some.size, RowLayout(DIM).model_width))
        ahead.push_gradients(x.routing.subset(some), grads, lambda r, g: r + g.sum(), name=f"ra.g{t}")
        per_call.push_gradients(keys[some], grads, lambda r, g: r + g.sum(), name=f"rp.g{t}")
    for a, b in zip(ahead.store.iter_rows(chunk_rows=500), per_call.store.iter_rows(chunk_rows=500)):
        np.testing.assert_array_equal(a[0], b[0])
        assert a[1].tobytes() == b[1].tobytes()
    ahead.store.close()
    per_call.store.close()


@pytest.mark.parametrize("how", ["keys", "exchange"])
def test_matched_rule_merges_as_row_merge_does(comm, shard_dir, how):
    """merge.sparse_rule = matched through the exchange (rows sent with their keys, or rows only
    by the owner's kept request) stores what row_merge computes from every rank's copies."""
    from hvctr.config import SparseRule
    from hvctr.storage.row_merge import contributor_spread, merged_rows
    cfg = _cfg(cache_rows=60)
    owner = default_bucket_owner(comm.size)
    store = EmbeddingStore(cfg, shard_path(f"{shard_dir}/m", comm.rank), comm.rank, comm.size, owner, create=True)
    table = ShardedTable(comm, store, owner, "cpu", SparseRule.MATCHED)
    layout, uni = RowLayout(DIM), _universe()
    ref = init_rows(uni, layout, cfg.init_scale, cfg.seed)
    steps = 4
    for t in range(3):
        mine = _window_idx(t, comm.rank, "zipf")
        x = uni[mine] if how == "keys" else table.exchange(uni[mine])
        rows = table.pull(x, name=f"m.p{t}")
        copies = []
        for r in range(comm.size):  # every rank's copies: a move, and 1 or 2 local steps counted
            idx = _window_idx(t, r, "zipf")
            c = ref[idx] + 0.01 * _delta(t, r, idx.size, layout.width)
            c[:, layout.step] = ref[idx, layout.step] + 1 + (idx % 2)
            copies.append((idx, c))
        if how == "exchange":
            assert x.pulled is not None  # the owner's rows as pulled, kept for the push
            before = store.shard_traffic().get("push", {}).get("rows_read", 0)
        table.push(x, torch.from_numpy(copies[comm.rank][1]), name=f"m.u{t}", steps=steps)
        if how == "exchange":  # not read again from the store (60 cache rows: they would come from the shard)
            assert x.pulled is None and store.shard_traffic().get("push", {}).get("rows_read", 0) == before
        allidx = np.concatenate([i for i, _ in copies])
        allrows = np.concatenate([c for _, c in copies])
        uniq, inverse = np.unique(allidx, return_inverse=True)
        count = np.bincount(inverse)
        mean = np.zeros((uniq.size, layout.width), np.float32)
        np.add.at(mean, inverse, allrows)
        mean /= count[:, None].astype(np.float32)
        old = ref[uniq]
        spread = contributor_spread(allrows, inverse, old, count, layout)
        ref[uniq] = merged_rows(SparseRule.MATCHED, layout, old, mean, count, spread, steps)
    final = table.pull(uni, name="m.final").numpy()
    np.testing.assert_allclose(final, ref, rtol=2e-5, atol=1e-7)
    assert not np.allclose(final[:, layout.model], init_rows(uni, layout, cfg.init_scale, cfg.seed)[:, layout.model])
    store.close()
