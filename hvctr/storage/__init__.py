"""The embedding table's three tiers on each rank and the exchange of rows between ranks.

Owns: the SSD shard file (shard.py; where a window's rows were, for the same window of the next
pass: position_log.py), the CPU cache (cache.py), one rank's store (store.py: shard + cache +
admission) and the exchange between ranks (exchange.py: ShardedTable; what owners keep of a
row several ranks moved: row_merge.py; the rows a window synchronises every step:
shared_rows.py). The row layout and its init are hvctr.formats'. A key belongs to the rank
``bucket_owner[bucket(key)]`` (hvctr.formats); only that rank ever stores it.

::

    Tier 3  working set of a window, [U, width] on cuda:<local GPU> (or cpu)
              ^                                           |
              | pull: keys --alltoall--> owners           | push: rows --alltoall--> owners,
              |       rows <--alltoall-- owners           |   averaged over the ranks that sent
              |                                           v   them (ascending source rank)
    Tier 2  CPU cache, <= storage.cpu_cache_bytes of anonymous memory, per rank
              hit: the cached row            write: cached row replaced, marked dirty
              miss: read from the shard      new admitted key: init row from the key, dirty
              eviction (LFU with aging or LRU, in batches, never rows of the current
                operation): a dirty victim is written back, a clean one just dropped
              flush (checkpoint, end of pass, close): every dirty row written back
              ^                                           |
              | read: sorted positions, a pool of         | write-back: whole pages by the
              |       pread threads (storage.io_threads;  v   pool, flushed and dropped under
              |       mmap: the reference path)               a memory limit; new index
              |                                               entries batched a block at a time
    Tier 1  SSD shard, one HDF5 file per rank: bucket table, key index (open addressing in
            4 KiB blocks), rows, per-row meta (key, last pass written, checkpoint generation)

    warm (prefetch thread, window t+1): keys --alltoall--> owners: shard -> cache, the rows
      held there until the pull reads them (at most half the cache; the pull reads the rest).
      It answers nothing: window t+1's rows are pulled only after merge(t) pushed, so
      prefetch changes speed, never values.

Unadmitted keys (seen fewer than storage.admit_after times) read a shared zero row and are
never stored; rows not written for storage.ttl_passes passes are dropped by compaction.
"""

from hvctr.storage.cache import RowCache
from hvctr.storage.shard import Shard, ShardFullError
from hvctr.storage.store import EmbeddingStore, shard_path

__all__ = ["EmbeddingStore", "RowCache", "Shard", "ShardFullError", "ShardedTable", "shard_path"]


def __getattr__(name: str):
    # The exchange needs torch; the store and its out-of-core tests do not load it.
    if name == "ShardedTable":
        from hvctr.storage.exchange import ShardedTable

        return ShardedTable
    raise AttributeError(name)
