"""Training data as the runtime reads it: the data directory's manifest (``manifest``, which
data_prep reads too) and the shard reader (``reader``: batches and row ranges of a rank's shards,
checksums, verification stamps)."""
