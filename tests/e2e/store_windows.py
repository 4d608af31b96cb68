"""One rank's storage tier driven through training's windows, for tests/e2e/test_out_of_core.py.

    python -m tests.e2e.store_windows --dir DIR --rank R --world 2 --keys N [--passes 2]

No torch and no MPI: the process holds what a rank's storage tier holds (its EmbeddingStore:
an SSD shard read and written through the pread pool, a CPU cache, the key filter and the
index's waiting entries), so that a memory cgroup of 256 MiB can hold two of them with a
table ten times its limit. Each window reads (pull) the rank's rows for a batch of its keys,
moves them (the push's new values, a function of the key and the pass) and writes them back,
as a window does (the warm, the pull, the push); every pass touches each of the rank's N keys
once, in blocks of keys taken in a new order each pass, beside a hot block read every window;
the heap is trimmed after each window, as training does under a memory limit. At the end a
checkpoint's read of every row (flushed first) gives the sha256 of every key and row in the
shard's order, and it prints one JSON line: that digest (equal, bit for bit, inside and outside
a cgroup, on the pread and the mmap path), rows stored, the shard's size and traffic, and its
peak RSS.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import resource
import time
from pathlib import Path

import numpy as np

from hvctr.config import ShardIO, StorageConfig
from hvctr.formats import default_bucket_owner, mix64, owner_of
from hvctr.heap import HeapTrimmer
from hvctr.storage import EmbeddingStore, shard_path

BLOCK = 1 << 14  # candidate keys a block: about BLOCK / W of them this rank's
WINDOW_BLOCKS = 2  # blocks a window: about 16k of a rank's keys at W = 2 (a small window: the
# processes' own memory, not the table, must stay a small part of a 256 MiB limit)


def block_keys(block: int, rank: int, owner: np.ndarray) -> np.ndarray:
    """The keys of candidate block ``block`` that ``rank`` owns (hvctr.formats' bucket owners),
    sorted: the table is made of blocks, so that no process holds all of its keys at once."""
    cand = mix64(np.arange(1 + block * BLOCK, 1 + (block + 1) * BLOCK, dtype=np.uint64))
    return np.sort(cand[owner_of(cand, owner) == rank])  # mix64 of distinct integers: distinct keys


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.e2e.store_windows")
    p.add_argument("--dir", required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--keys", type=int, required=True, help="keys of this rank's table")
    p.add_argument("--passes", type=int, default=2)
    p.add_argument("--cache-bytes", type=int, default=4 << 20)
    p.add_argument("--io", choices=("pread", "mmap"), default="pread",
                   help="storage.shard_io: pread (the pool) or mmap (the reference path)")
    a = p.parse_args(argv)
    owner = default_bucket_owner(a.world)
    blocks = -(-a.keys * a.world // BLOCK)
    cfg = StorageConfig(dim=16, rows_per_rank=int(a.keys * 1.1) + 4096, cpu_cache_bytes=a.cache_bytes,
                        shard_dir=a.dir, shard_io=ShardIO(a.io))
    rng = np.random.default_rng(a.rank)
    hot = block_keys(blocks, a.rank, owner)  # one more block, read every window
    heap = HeapTrimmer(True)  # as training under a memory limit does after each window (storage.heap_trim)
    t0 = time.monotonic()
    with EmbeddingStore(cfg, shard_path(a.dir, a.rank), rank=a.rank, world_size=a.world, create=True) as store:
        width = store.layout.width
        for pass_ in range(a.passes):
            order = rng.permutation(blocks)
            for start in range(0, blocks, WINDOW_BLOCKS):
                win = np.unique(np.concatenate([hot, *(block_keys(b, a.rank, owner)
                                                       for b in order[start:start + WINDOW_BLOCKS])]))
                store.warm(win)
                rows = store.read(win)
                # the push: a move that depends on the key and the pass only (so the result
                # does not depend on the cache, the limit or the order of evictions)
                move = ((win % np.uint64(1009)).astype(np.float32) - 504.0) * np.float32(1e-5 * (pass_ + 1))
                rows[:, : width // 2] += move[:, None]
                store.write(win, rows)
                del rows, win, move
                heap.trim()
            store.end_pass()
        # a checkpoint's read of every row, in the shard's order (sequential: the positions are
        # given out in the order rows are created, the same on both paths): the digest
        expect = hot.size + sum(block_keys(b, a.rank, owner).size for b in range(blocks))
        h, stored = hashlib.sha256(), 0
        for k, rows in store.iter_rows(chunk_rows=1 << 14):
            h.update(k.tobytes())
            h.update(rows.tobytes())
            stored += k.shape[0]
        if stored != expect:
            raise SystemExit(f"rank {a.rank}: {stored} rows stored, expected {expect}")
        traffic = store.shard_traffic()
    shard = Path(shard_path(a.dir, a.rank))
    print(json.dumps({"rank": a.rank, "rows_sha256": h.hexdigest(), "rows": int(stored),
                      "shard_bytes": shard.stat().st_size, "seconds": round(time.monotonic() - t0, 1),
                      "rows_read": int(sum(c["rows_read"] for c in traffic.values())),
                      "write_calls": int(sum(c["write_calls"] for c in traffic.values())),
                      "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
