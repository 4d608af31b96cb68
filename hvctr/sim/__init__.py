"""In-process simulation of W ranks: ``hvctr simulate --ranks W --config C``.

Every simulated rank is a thread that runs the unmodified runtime (``hvctr.train.Trainer``:
its windows, local steps, dense merger, sparse owner merge, Adam state handling, checkpoints
and evaluation) over a ``ThreadComm``, which implements ``hvctr.distributed.comm.Comm``'s collectives
for threads of one process. The ranks run strictly in turn (one holds the baton, the others
wait in a collective), so a run differs from ``mpirun -np W hvctr train`` only in speed.

``hvctr.sim.comm`` (ThreadWorld, ThreadComm) imports neither Horovod nor mpi4py.
"""
