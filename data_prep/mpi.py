"""Processes of a data_prep job: MPI when launched by mpirun/srun, one plain process otherwise.

This is the only module of data_prep that imports mpi4py. Both classes implement
``hvctr.distributed.protocol.ObjectComm`` (rank, size, broadcast_object, allgather_object,
barrier), the collectives they share with training's communicators. Besides these, workers
report to rank 0 through ``post`` (a non-blocking send) and rank 0 reads them with ``drain``
between its own blocks of work: rank 0 alone writes the manifest and prints progress, and no
rank ever waits for another until a phase ends.
"""

from __future__ import annotations

import os
import sys
from typing import Any

_LAUNCHER_VARS = ("OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK", "PMI_SIZE")
_TAG = 17


def launched_by_mpi() -> bool:
    return "mpi4py.MPI" in sys.modules or any(v in os.environ for v in _LAUNCHER_VARS)


class Comm:
    """One process: every collective is the identity, posts go straight to the inbox."""

    rank: int = 0
    size: int = 1

    def __init__(self) -> None:
        self._inbox: list[Any] = []

    def broadcast_object(self, obj: Any, root: int = 0, name: str = "") -> Any:
        return obj

    def allgather_object(self, obj: Any, name: str = "") -> list[Any]:
        return [obj]

    def barrier(self) -> None:
        pass

    def post(self, msg: Any) -> None:
        self._inbox.append(msg)

    def drain(self) -> list[Any]:
        out, self._inbox = self._inbox, []
        return out

    def flush_posts(self) -> None:
        pass

    def abort(self, code: int) -> None:
        raise SystemExit(code)


class MPIComm(Comm):
    def __init__(self) -> None:
        super().__init__()
        from mpi4py import MPI
        self._mpi = MPI
        self._comm = MPI.COMM_WORLD
        self.rank = self._comm.Get_rank()
        self.size = self._comm.Get_size()
        self._pending: list[Any] = []

    def broadcast_object(self, obj: Any, root: int = 0, name: str = "") -> Any:
        return self._comm.bcast(obj, root=root)  # comm: rank 0's plan / manifest to every process

    def allgather_object(self, obj: Any, name: str = "") -> list[Any]:
        return self._comm.allgather(obj)  # comm: one small object from every process

    def barrier(self) -> None:
        self._comm.Barrier()  # comm: phase boundary

    def post(self, msg: Any) -> None:
        if self.rank == 0:
            self._inbox.append(msg)
            return
        self._pending.append(self._comm.isend(msg, dest=0, tag=_TAG))  # comm: record to rank 0
        self._pending = [r for r in self._pending if not r.Test()]

    def drain(self) -> list[Any]:
        assert self.rank == 0, "only rank 0 reads posts"
        out, self._inbox = self._inbox, []
        status = self._mpi.Status()
        while self._comm.iprobe(source=self._mpi.ANY_SOURCE, tag=_TAG, status=status):  # comm: poll
            out.append(self._comm.recv(source=status.Get_source(), tag=_TAG))  # comm: a posted record
        return out

    def flush_posts(self) -> None:
        for r in self._pending:
            r.wait()  # comm: our posts have been received by rank 0
        self._pending = []

    def abort(self, code: int) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        self._comm.Abort(code)  # comm: an error on one process ends the whole job


def get_comm() -> Comm:
    return MPIComm() if launched_by_mpi() else Comm()
