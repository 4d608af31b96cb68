"""Out of core: a shard over 10x the cache budget, filled and read back in a child process
whose anonymous memory (RssAnon) stays within the budget plus a stated overhead.

The child measures RssAnon two ways: /proc/self/status sampled by a thread every half
millisecond and after every store call (a sampled peak), and tracemalloc, which sees every
numpy allocation, for the exact peak of what Python and numpy allocate beyond the baseline.
The shard is read through np.memmap: those pages are file-backed (RssFile), reclaimable, and
not part of the budget.
"""

import json
import subprocess
import textwrap

from tests.conftest import VENV_PY

BUDGET = 4 << 20
# Stated overhead beyond the cache budget: one call's transients (keys, rows and their copies
# for the cache, the shard and write-back, sort permutations; about 1 KiB per key for these
# 112-byte rows) for calls of 16k keys, the 1 MiB write-merge buffer, and the allocator's
# slack. docs/storage.md quotes it.
OVERHEAD = 16 << 20

CHILD = textwrap.dedent("""
    import json, sys, threading, time, tracemalloc
    import numpy as np
    from hvctr.config import StorageConfig
    from hvctr.storage.store import EmbeddingStore

    def rss_anon():
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024

    peak = [0]
    stop = threading.Event()
    def sampler():
        while not stop.is_set():
            peak[0] = max(peak[0], rss_anon())
            time.sleep(0.0005)

    path, budget, n_rows = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    cfg = StorageConfig(dim=8, rows_per_rank=n_rows, cpu_cache_bytes=budget, seed=3)
    keys = np.unique(np.random.default_rng(0).integers(0, 2**64 - 2, size=n_rows + 1000, dtype=np.uint64))[:n_rows]
    np.random.default_rng(1).shuffle(keys)
    def expected(k):  # a row that names its key: column j holds (key mod 10007) + j
        return (k % np.uint64(10007)).astype(np.float32)[:, None] + np.arange(28, dtype=np.float32)

    order = np.random.default_rng(2).permutation(n_rows)
    base = rss_anon()
    tracemalloc.start()
    t = threading.Thread(target=sampler, daemon=True)
    t.start()
    store = EmbeddingStore(cfg, path, create=True)
    batch = 16384
    for s in range(0, n_rows, batch):  # fill: every row passes through the cache to the shard
        k = keys[s:s + batch]
        store.write(k, expected(k))
        peak[0] = max(peak[0], rss_anon())
    store.flush()
    bad = 0
    for s in range(0, n_rows, batch):  # read back in random order: mostly cache misses
        k = keys[order[s:s + batch]]
        bad += int(np.count_nonzero(store.read(k) != expected(k)))
        peak[0] = max(peak[0], rss_anon())
    stats = store.stats()
    store.close()
    stop.set(); t.join()
    _, traced_peak = tracemalloc.get_traced_memory()
    print(json.dumps({"base": base, "peak": peak[0], "traced_peak": traced_peak, "bad": bad,
                      "shard_bytes": stats["shard_capacity_rows"] * 28 * 4, "cache_bytes": stats["cache_bytes"],
                      "misses": stats["cache_misses"], "writeback_rows": stats["writeback_rows"]}))
""")


def test_shard_ten_times_the_cache_within_budget(tmp_path):
    n_rows = 400_000  # 112-byte rows: 45 MB of rows, 11x the 4 MiB budget (plus index and meta)
    out = subprocess.run([VENV_PY, "-c", CHILD, str(tmp_path / "big.h5"), str(BUDGET), str(n_rows)],
                         capture_output=True, text=True, cwd=tmp_path, timeout=300)  # the installed hvctr
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["bad"] == 0
    assert r["shard_bytes"] >= 10 * BUDGET and r["cache_bytes"] <= BUDGET
    assert r["misses"] > n_rows * 0.9 and r["writeback_rows"] >= n_rows
    assert r["peak"] - r["base"] <= BUDGET + OVERHEAD, r
    assert r["traced_peak"] <= BUDGET + OVERHEAD, r
