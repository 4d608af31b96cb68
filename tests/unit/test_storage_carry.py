"""What a checkpoint must carry for the TTL clock: rows' last pass and the pass index.

A store rebuilt from iter_rows(with_last_seen=True) and set_pass_index compacts exactly as
the original: the same rows are dropped, the same rows kept, bit for bit.
"""

import numpy as np

from hvctr.config import StorageConfig
from hvctr.storage import EmbeddingStore


def _cfg(**kw):
    return StorageConfig(dim=4, rows_per_rank=4096, cpu_cache_bytes=20_000, seed=7, **kw)


def _rows_by_key(store):
    parts = list(store.iter_rows())
    keys = np.concatenate([k for k, _ in parts])
    rows = np.concatenate([r for _, r in parts])
    order = np.argsort(keys)
    return keys[order], rows[order]


def test_rebuilt_store_compacts_like_the_original(tmp_path):
    cfg = _cfg(ttl_passes=1)
    keys = np.arange(1, 3001, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    a = EmbeddingStore(cfg, tmp_path / "a.h5", create=True)
    a.write(np.unique(keys), np.ones((3000, a.layout.width), np.float32))  # pass 0: every key
    a.end_pass()
    later = np.unique(keys[::3])
    a.write(later, np.full((later.size, a.layout.width), 2.0, np.float32))  # pass 1: a third
    a.end_pass()
    assert a.pass_index == 2

    b = EmbeddingStore(cfg, tmp_path / "b.h5", create=True)
    for k, r, seen in a.iter_rows(chunk_rows=500, with_last_seen=True):
        assert seen.dtype == np.int32 and set(np.unique(seen)) <= {0, 1}
        b.load_rows(k, r, seen)
    b.set_pass_index(a.pass_index)

    assert a.compact() == b.compact() == 3000 - later.size
    ka, ra = _rows_by_key(a)
    kb, rb = _rows_by_key(b)
    assert np.array_equal(ka, later) and np.array_equal(kb, later)
    assert np.array_equal(ra, rb)
    a.close()
    b.close()


def test_load_without_last_seen_takes_the_current_pass(tmp_path):
    s = EmbeddingStore(_cfg(ttl_passes=1), tmp_path / "s.h5", create=True)
    s.set_pass_index(5)
    k = np.array([3, 9], dtype=np.uint64)
    s.load_rows(k, np.zeros((2, s.layout.width), np.float32))
    (_, _, seen), = list(s.iter_rows(with_last_seen=True))
    assert seen.tolist() == [5, 5]
    s.close()
