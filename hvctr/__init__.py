"""hvctr: terabyte-scale CTR training as HPC batch jobs.

Each MPI rank owns one shard of the embedding table on SSD (HDF5), a CPU cache of hot rows
and a working set of the rows its next k batches touch; ranks train locally and merge the
model (parameters and Adam states) every k steps through Horovod.

Packages: ``hvctr.dist`` (the only one that talks MPI/Horovod), ``hvctr.storage`` (the
tiers), ``hvctr.models``, ``hvctr.train``, ``hvctr.topo`` (hardware maps and placement).
"""

__version__ = "0.1.0"
