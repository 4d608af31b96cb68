"""What a communicator is, as types: the protocols the three communicators implement.

- ``ObjectComm``: rank, size and the collectives on small objects (broadcast, allgather,
  barrier). data_prep's processes (``data_prep.mpi.Comm`` and ``MPIComm``) implement it.
- ``Comm``: ObjectComm plus the node grouping and the tensor collectives training uses.
  ``hvctr.distributed.comm.Comm`` (Horovod), ``hvctr.distributed.torch_comm.TorchComm``
  (torch.distributed) and ``hvctr.sim.comm.ThreadComm`` (simulated ranks, one thread each)
  implement it.

Code that is handed a communicator names one of these in its type hints (``comm: Comm``), never
a concrete class, so the same code runs under Horovod, in the simulation and in tests' fakes.
tests/unit/test_comm_protocol.py holds the three classes to these signatures.

Light on purpose: no torch, Horovod or mpi4py at import (data_prep imports this module).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, ContextManager, Protocol, Sequence, TypeVar, runtime_checkable

if TYPE_CHECKING:
    import torch

    from hvctr.distributed.watchdog import CollectiveWatchdog

T = TypeVar("T")

__all__ = ["ObjectComm", "Comm"]


@runtime_checkable
class ObjectComm(Protocol):
    """Ranks ``0 .. size-1`` and collectives on small objects (every rank calls each one, in
    the same order; ``name`` tells collectives apart where the implementation matches by name)."""

    rank: int
    size: int

    def broadcast_object(self, obj: Any, root: int, name: str) -> Any:
        """Rank ``root``'s ``obj`` on every rank."""
        ...

    def allgather_object(self, obj: Any, name: str) -> list[Any]:
        """Every rank's ``obj``, as a list in rank order."""
        ...

    def barrier(self) -> None:
        """Returns once every rank has called it."""
        ...


@runtime_checkable
class Comm(ObjectComm, Protocol):
    """ObjectComm with the node grouping and the tensor collectives (hvctr.distributed.comm)."""

    local_rank: int
    local_size: int
    num_nodes: int
    node: int  # index of this rank's node, 0 .. num_nodes-1
    node_ranks: list[list[int]]  # ranks of each node, ascending
    watchdog: CollectiveWatchdog | None

    def allreduce_sum(self, tensors: Sequence[torch.Tensor], name: str) -> list[torch.Tensor]: ...

    def allreduce_avg(self, tensors: Sequence[torch.Tensor], name: str) -> list[torch.Tensor]: ...

    def allreduce_sum_hierarchical(self, tensors: Sequence[torch.Tensor], name: str) -> list[torch.Tensor]: ...

    def allreduce_min_int(self, values: Sequence[int], name: str) -> list[int]: ...

    def allreduce_max_int(self, values: Sequence[int], name: str) -> list[int]: ...

    def alltoall(self, tensor: torch.Tensor, splits: Sequence[int] | torch.Tensor,
                 name: str) -> tuple[torch.Tensor, torch.Tensor]: ...

    def allgather(self, tensor: torch.Tensor, name: str) -> torch.Tensor: ...

    def broadcast(self, tensor: torch.Tensor, root: int, name: str) -> torch.Tensor: ...

    def agree(self, fn: Callable[[], T], name: str) -> T: ...

    def stream(self, name: str) -> ContextManager[None]:
        """Collectives inside go to stream ``name`` ("behind": a push's rows left behind, which
        either thread may send), whatever thread issues them. Horovod matches by name and the
        simulation by rank order: theirs does nothing; torch.distributed's picks a process group."""
        ...

    def shutdown(self) -> None: ...
