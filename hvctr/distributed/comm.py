"""Comm: rank, size and the collectives hvctr uses, over Horovod (MPI or Gloo controller).

Rank and size are asked of Horovod, never read from the environment: mpirun sets
OMPI_COMM_WORLD_*, ``srun --mpi=pmix`` sets only PMIX_RANK and SLURM_PROCID.

Collectives take an explicit ``name``. Horovod matches operations across ranks by name, so
a collective issued by the prefetch thread can never pair with one of the main thread's, and
two ranks that disagree on the sequence of collectives fail loudly instead of mixing data.

Node grouping: ranks sharing a host form a node (or, for tests on one machine, groups of
``ranks_per_virtual_node`` consecutive ranks). The grouping becomes two Horovod process sets
at init: this rank's node, and the node leaders (local rank 0 of every node). They carry the
hierarchical dense merge: reduce inside the node, cross the network once per node.

Devices: one grouped allreduce takes tensors on one device. A group that mixes devices (the
dense model on a GPU and the control flags on the host) goes to the GPU when Horovod was
built with NCCL (HOROVOD_GPU_OPERATIONS=NCCL), else through host memory; each result comes
back on its tensor's own device (``_staged``).
"""

from __future__ import annotations

import contextlib
import os
import socket
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Sequence, TypeVar

import torch

import horovod.torch as hvd

from hvctr.distributed.payload import decode_object as _decode, encode_object as _encode
from hvctr.distributed.watchdog import CollectiveWatchdog
from hvctr.distributed.world import FUSION_THRESHOLD_BYTES, agree_on, world_rank  # noqa: F401 (world_rank: callers import it here)

T = TypeVar("T")


def _gpu_collectives() -> bool:
    """Whether Horovod takes CUDA tensors itself (built with NCCL)."""
    try:
        return bool(hvd.nccl_built())
    except (AttributeError, RuntimeError, ValueError):
        return False


def _staged(tensors: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.device] | None]:
    """The tensors on the one device Horovod reduces them on, and their own devices (None:
    nothing moved). All on the host: as they are. Else the GPU, when NCCL is built and one GPU
    holds them; otherwise the host."""
    devices = [t.device for t in tensors]
    if all(d.type == "cpu" for d in devices):
        return list(tensors), None
    gpus = {d for d in devices if d.type == "cuda"}
    target = next(iter(gpus)) if len(gpus) == 1 and _gpu_collectives() else torch.device("cpu")
    if all(d == target for d in devices):
        return list(tensors), None
    return [t.to(target) for t in tensors], devices


def _unstaged(tensors: Sequence[torch.Tensor], devices: list[torch.device] | None) -> list[torch.Tensor]:
    return list(tensors) if devices is None else [t.to(d) for t, d in zip(tensors, devices)]


@dataclass
class Comm:
    """hvctr.distributed.protocol.Comm over Horovod: made by ``init_comm``."""

    rank: int
    size: int
    local_rank: int
    local_size: int
    num_nodes: int
    node: int  # index of this rank's node, 0 .. num_nodes-1
    node_ranks: list[list[int]] = field(repr=False)  # ranks of each node, ascending
    _node_set: Any = field(default=None, repr=False)
    _leader_set: Any = field(default=None, repr=False)
    watchdog: CollectiveWatchdog | None = field(default=None, repr=False)  # times every collective below

    def _waiting(self, name: str) -> ContextManager[None]:
        return self.watchdog.waiting(name) if self.watchdog is not None else contextlib.nullcontext()

    # --- reductions -------------------------------------------------------------------

    def allreduce_sum(self, tensors: Sequence[torch.Tensor], name: str) -> list[torch.Tensor]:
        """Elementwise sums over ranks of a list of tensors, in one grouped allreduce. (fp16 on the
        wire is the merger's own cast, merge.compression: no Horovod compressor is used.)"""
        if not tensors:
            return []
        staged, devices = _staged(tensors)
        with self._waiting(name):
            # comm: one grouped allreduce (Sum) of every tensor in the list
            out = hvd.grouped_allreduce(staged, op=hvd.Sum, name=name)
        return _unstaged(out, devices)

    def allreduce_avg(self, tensors: Sequence[torch.Tensor], name: str) -> list[torch.Tensor]:
        """Means over ranks: the sum (one grouped allreduce) divided by the world size."""
        return [t / self.size for t in self.allreduce_sum(tensors, name)]

    def allreduce_sum_hierarchical(self, tensors: Sequence[torch.Tensor], name: str) -> list[torch.Tensor]:
        """Sums over ranks, reducing inside each node first and crossing nodes once per node.

        Three grouped allreduces: the node's sum (intra-node), the leaders' sum of node sums
        (the only traffic between nodes), then the node's sum again where only the leader
        contributes (a broadcast; adding exact zeros keeps the leader's bits).
        """
        tensors = list(tensors)
        if not tensors:  # Horovod's grouped_allreduce fails on an empty group
            return []
        if self.num_nodes == 1 or self.size == self.num_nodes:
            return self.allreduce_sum(tensors, name)
        tensors, devices = _staged(tensors)
        with self._waiting(name):
            # comm: intra-node grouped allreduce (Sum) over this rank's node process set
            partial = hvd.grouped_allreduce(tensors, op=hvd.Sum, name=f"{name}.intra",
                                            process_set=self._node_set)
            leader = self.local_rank == 0
            if leader:
                # comm: inter-node grouped allreduce (Sum) among node leaders only
                partial = hvd.grouped_allreduce(partial, op=hvd.Sum, name=f"{name}.inter",
                                                process_set=self._leader_set)
            contrib = partial if leader else [torch.zeros_like(t) for t in partial]
            # comm: intra-node grouped allreduce (Sum) that carries the leader's result to the node
            out = hvd.grouped_allreduce(contrib, op=hvd.Sum, name=f"{name}.bcast", process_set=self._node_set)
        return _unstaged(out, devices)

    def allreduce_min_int(self, values: Sequence[int], name: str) -> list[int]:
        """Elementwise minimum over ranks of small integers (window lengths, stop flags)."""
        t = torch.tensor(list(values), dtype=torch.int64)
        with self._waiting(name):
            # comm: allreduce (Min) of a few int64 scalars
            return hvd.allreduce(t, op=hvd.Min, name=name).tolist()

    def allreduce_max_int(self, values: Sequence[int], name: str) -> list[int]:
        t = torch.tensor(list(values), dtype=torch.int64)
        with self._waiting(name):
            # comm: allreduce (Max) of a few int64 scalars
            return hvd.allreduce(t, op=hvd.Max, name=name).tolist()

    # --- exchanges --------------------------------------------------------------------

    def alltoall(self, tensor: torch.Tensor, splits: Sequence[int] | torch.Tensor,
                 name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Sends rows ``[sum(splits[:r]), sum(splits[:r+1]))`` of ``tensor`` to rank r.

        Returns the rows received, ordered by source rank, and how many came from each rank
        (an int64 tensor of length size). Rows are slices along dim 0; the other dims travel.
        """
        splits = torch.as_tensor(splits, dtype=torch.int32)  # hvd.alltoall wants int32 splits
        if splits.numel() != self.size:
            raise ValueError(f"alltoall {name}: {splits.numel()} splits for {self.size} ranks")
        if int(splits.sum()) != tensor.shape[0]:
            raise ValueError(f"alltoall {name}: splits sum to {int(splits.sum())}, tensor has {tensor.shape[0]} rows")
        with self._waiting(name):
            # comm: alltoall with per-rank splits
            out, received = hvd.alltoall(tensor.contiguous(), splits=splits, name=name)
        return out, received.to(torch.int64)

    def allgather(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        """Concatenation along dim 0 of every rank's tensor, in rank order (lengths may differ)."""
        with self._waiting(name):
            # comm: allgather
            return hvd.allgather(tensor.contiguous(), name=name)

    def broadcast(self, tensor: torch.Tensor, root: int, name: str) -> torch.Tensor:
        with self._waiting(name):
            # comm: broadcast of one tensor from root
            return hvd.broadcast(tensor.contiguous(), root_rank=root, name=name)

    def broadcast_object(self, obj: Any, root: int, name: str) -> Any:
        """Broadcasts a small JSON-serialisable object (JSON, not pickle: nothing received runs code)."""
        payload = _encode(obj) if self.rank == root else torch.zeros(0, dtype=torch.uint8)
        n = torch.tensor([payload.numel()], dtype=torch.int64)
        with self._waiting(name):
            # comm: broadcast of the payload length, then of the payload
            n = int(hvd.broadcast(n, root_rank=root, name=f"{name}.len")[0])
            buf = payload if self.rank == root else torch.zeros(n, dtype=torch.uint8)
            buf = hvd.broadcast(buf, root_rank=root, name=f"{name}.data")
        return _decode(buf)

    def allgather_object(self, obj: Any, name: str) -> list[Any]:
        """Every rank's small JSON-serialisable object, as a list in rank order."""
        payload = _encode(obj)
        with self._waiting(name):
            # comm: allgather of payload lengths, then of the payloads
            lengths = hvd.allgather(torch.tensor([payload.numel()], dtype=torch.int64), name=f"{name}.len")
            data = hvd.allgather(payload, name=f"{name}.data")
        parts = torch.split(data, lengths.tolist())
        return [_decode(p) for p in parts]

    def agree(self, fn: Callable[[], T], name: str) -> T:
        """``fn()`` on every rank; if it raised ValueError on any, every rank raises AgreedError.

        For a step where one rank's input can fail (its shard file, its disk) while the others
        go on to the next collective: they would wait there for good. Rank 0 reports every
        distinct message once, with the ranks that hit it. ``fn`` must not communicate.
        """
        return agree_on(self, fn, name)  # comm: allgather of every rank's error

    def stream(self, name: str) -> ContextManager[None]:
        """Nothing to choose: Horovod matches collectives by name, whatever thread issues them."""
        return contextlib.nullcontext()

    def barrier(self) -> None:
        with self._waiting("barrier"):
            # comm: barrier
            hvd.barrier()

    def shutdown(self) -> None:
        if self.watchdog is not None:
            self.watchdog.close()
        hvd.shutdown()


def _node_grouping(ranks_per_virtual_node: int) -> list[list[int]]:
    """Ranks grouped by host (or in virtual nodes), nodes ordered by their lowest rank."""
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    size = world.Get_size()
    if ranks_per_virtual_node > 0:
        if size % ranks_per_virtual_node:
            raise ValueError(
                f"config key 'topology.ranks_per_virtual_node': {ranks_per_virtual_node} does not divide "
                f"the world size {size}")
        keys = [r // ranks_per_virtual_node for r in range(size)]
    else:
        # comm: mpi4py allgather of host names (once, before Horovod starts)
        keys = world.allgather(socket.gethostname())
    groups: dict[Any, list[int]] = {}
    for r, k in enumerate(keys):
        groups.setdefault(k, []).append(r)
    return sorted(groups.values(), key=lambda g: g[0])


def stall_warnings(timeout_s: float) -> None:
    """Horovod's stall inspector warns (naming the ranks that did not submit, from processes
    that still run) after min(60 s, half the timeout), before the watchdog ends the job.
    A HOROVOD_STALL_CHECK_TIME_SECONDS already set wins. Call before Horovod starts."""
    if timeout_s > 0:
        os.environ.setdefault("HOROVOD_STALL_CHECK_TIME_SECONDS", str(max(1, min(60, int(timeout_s // 2)))))


def init_comm(ranks_per_virtual_node: int = 0, stall_timeout_s: float = 0.0, program: str = "hvctr") -> Comm:
    """Starts Horovod (once per process) with process sets for the node grouping. With
    ``stall_timeout_s`` > 0 a CollectiveWatchdog ends the job when a collective waits that long
    (``program`` starts its error line)."""
    if hvd.is_initialized():
        raise RuntimeError("init_comm called twice in one process")
    stall_warnings(stall_timeout_s)
    os.environ.setdefault("HOROVOD_FUSION_THRESHOLD", str(FUSION_THRESHOLD_BYTES))  # read by hvd.init
    nodes = _node_grouping(ranks_per_virtual_node)
    process_sets = []
    leader_ranks = [g[0] for g in nodes]
    multi = 1 < len(nodes) < sum(len(g) for g in nodes)
    if multi:
        node_sets = [hvd.ProcessSet(g) for g in nodes]
        leader_set = hvd.ProcessSet(leader_ranks)
        process_sets = node_sets + [leader_set]
    hvd.init(process_sets=process_sets or None)
    rank, size = hvd.rank(), hvd.size()
    node = next(i for i, g in enumerate(nodes) if rank in g)
    return Comm(
        rank=rank,
        size=size,
        local_rank=nodes[node].index(rank),
        local_size=len(nodes[node]),
        num_nodes=len(nodes),
        node=node,
        node_ranks=nodes,
        _node_set=node_sets[node] if multi else None,
        _leader_set=leader_set if multi and rank in leader_ranks else None,
        watchdog=CollectiveWatchdog(rank, stall_timeout_s, program) if stall_timeout_s > 0 else None,
    )
