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
    w = build_window(5, 0, 10, np.zeros((n, 16), np.float32), np.zeros((n, 16, 13), np.float32), keys,
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
    w = build_window(0, 0, 0, np.zeros((3, 64), np.float32), np.zeros((3, 64, 13), np.float32), keys,
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


class _OneRank:
    rank = 0

    def allreduce_min_int(self, values, name):
        return list(values)


class _Reader:
    def read(self, first, count):
        return (np.zeros((count, 4), np.float32), np.zeros((count, 4, 13), np.float32),
                np.arange(first * 8, (first + count) * 8, dtype=np.int64).reshape(count, 4, 2))


def _lengths(schedule, start=(0, 0, 0)):
    from hvctr.train.prefetch import WindowSource

    src = WindowSource(lambda epoch: _Reader(), schedule, _OneRank(), None, start, prefetch=False, timeout_s=10)
    out = []
    while (w := src.next()) is not None:
        out.append(len(w.labels))
    return out


def test_k_warmup_grows_the_windows_from_one_step_to_k():
    from hvctr.train.prefetch import Schedule

    s = Schedule(batches_per_epoch=40, epochs=1, every_k_steps=8, max_working_set_rows=10**9, max_steps=0,
                 k_warmup_steps=16)
    assert [s.window_steps(n) for n in (0, 1, 2, 3, 5, 8, 12, 15, 16, 100)] == [1, 1, 1, 2, 3, 4, 6, 8, 8, 8]
    assert _lengths(s) == [1, 1, 1, 2, 3, 4, 6, 8, 8, 6]  # 40 steps: the last window ends the epoch
    # a run resumed after window 4 (8 steps) takes the windows the uninterrupted run took
    assert _lengths(s, start=(0, 8, 5)) == [4, 6, 8, 8, 6]
    off = Schedule(batches_per_epoch=40, epochs=1, every_k_steps=8, max_working_set_rows=10**9, max_steps=0)
    assert _lengths(off) == [8] * 5 and off.window_steps(0) == 8
    from hvctr.config import load_config

    with pytest.raises(ValueError, match="merge.k_warmup_steps"):
        load_config(None, ["--merge.k_warmup_steps=-1"])


# --- multi-valued fields: windows over bags ----------------------------------------------

def _bag_batches(rng, n: int, b: int, f: int, max_len: int, vocab: int):
    from hvctr.data.bags import Bags

    lengths = rng.integers(0, max_len + 1, size=(n * b, f)).astype(np.uint16)
    return Bags(rng.zipf(1.3, size=int(lengths.sum())).astype(np.uint64) % np.uint64(vocab), lengths)


def test_bag_windows_fit_and_number_every_key_of_every_bag(path):
    rng = np.random.default_rng(11)
    bags = _bag_batches(rng, 6, 32, 5, 7, 4000)
    idx = index_keys(bags, 6)
    per_batch = [bags.rows_slice(i * 32, (i + 1) * 32).values for i in range(6)]
    assert np.array_equal(idx.batch_ends, np.cumsum([v.size for v in per_batch]))
    for max_rows in (0, 40, 200, 500, 10**6):
        want = max((n for n in range(7) if np.unique(np.concatenate(per_batch[:n] or [[]])).size <= max_rows),
                   default=0)
        assert fitting_prefix(idx, 6, max_rows) == want, max_rows
    n = 4
    w = build_window(0, 0, 0, np.zeros((n, 32), np.float32), np.zeros((n, 32, 13), np.float32), bags, idx)
    assert w.multi_valued and len(w.bags) == n
    assert np.array_equal(w.unique_keys, np.unique(np.concatenate(per_batch[:n])))
    for i, (pos, off) in enumerate(w.bags):
        assert np.array_equal(w.unique_keys[pos], per_batch[i])  # every key of the batch's bags, in order
        lengths = bags.lengths[i * 32:(i + 1) * 32].reshape(-1)
        assert np.array_equal(np.diff(off), lengths) and off[0] == 0
        uniq, inverse = w.batch_unique[i]
        assert np.array_equal(uniq.numpy()[inverse.numpy()], pos)


def test_a_batch_of_more_distinct_keys_than_the_working_set_is_refused_by_name():
    from hvctr.distributed.world import AgreedError
    from hvctr.train.prefetch import Schedule, WindowSource

    rng = np.random.default_rng(12)
    bags = _bag_batches(rng, 4, 16, 3, 30, 10**6)  # about 16 x 3 x 15 keys a batch, nearly all distinct

    class Reader:
        def read(self, first, count):
            return (np.zeros((count, 16), np.float32), np.zeros((count, 16, 13), np.float32),
                    bags.rows_slice(first * 16, (first + count) * 16))

    s = Schedule(batches_per_epoch=4, epochs=1, every_k_steps=2, max_working_set_rows=16 * 3, max_steps=0)
    src = WindowSource(lambda epoch: Reader(), s, _OneRank(), None, (0, 0, 0), prefetch=False, timeout_s=10)
    with pytest.raises(AgreedError, match=r"storage.max_working_set_rows = 48: raise it"):
        src.next()
