"""hvctr: terabyte-scale CTR training as HPC batch jobs.

Each MPI rank owns one shard of the embedding table on SSD (HDF5), a CPU cache of hot rows
and a working set of the rows its next k batches touch; ranks train locally and merge the
model (parameters and Adam states) every k steps through Horovod.

Packages (docs/architecture.md draws them): ``hvctr.formats`` (the data, key and row formats:
a leaf), ``hvctr.distributed`` (the only one that talks MPI/Horovod), ``hvctr.storage`` (the tiers
and the exchange), ``hvctr.optim``, ``hvctr.models``, ``hvctr.kernels`` (C hot loops),
``hvctr.train`` (the window loop), ``hvctr.sim`` (W ranks in one process), ``hvctr.topo``,
``hvctr.plan``, ``hvctr.offline``. The benchmarks are the separate ``bench`` package.
"""

__version__ = "0.1.0"
