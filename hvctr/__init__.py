"""hvctr: terabyte-scale CTR training as HPC batch jobs.

Each MPI rank owns one shard of the embedding table on SSD (HDF5), a CPU cache of hot rows
and a working set of the rows its next k batches touch; ranks train locally and merge the
model (parameters and Adam states) every k steps through Horovod.

Packages, lowest layer first (docs/architecture.md draws them; each imports only lower layers):
``hvctr.formats`` (the data, key and row formats: the leaf) and ``hvctr.log``; ``hvctr.config``
(the schema and what it resolves to at W ranks), ``hvctr.kernels`` (C hot loops), ``hvctr.data``
(the data shards and their manifest), ``hvctr.metrics``; ``hvctr.distributed`` (the only one that
talks MPI/Horovod), ``hvctr.models``, ``hvctr.optim``, ``hvctr.rundir``, ``hvctr.topo``;
``hvctr.storage`` (the tiers and the exchange), ``hvctr.checkpoint``; ``hvctr.plan``;
``hvctr.train`` (the window loop); ``hvctr.sim`` (W ranks in one process), ``hvctr.offline``,
``hvctr.sweep``; ``hvctr.cli``. The benchmarks are the separate ``bench`` package.
"""

__version__ = "0.1.0"
