"""Training data as the runtime reads it: the data directory's manifest (``manifest``, which
data_prep reads too), the shard reader (``reader``: batches and row ranges of a rank's shards,
checksums, verification stamps) and its layout as intervals (``layout``: which rows of each shard
an epoch's batches hold, for a position carried across ``hvctr reshard``)."""
