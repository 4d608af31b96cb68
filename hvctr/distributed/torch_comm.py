"""TorchComm: hvctr.distributed.protocol.Comm over torch.distributed (gloo), beside Horovod's.

``distributed.backend = "torch"`` (or HVCTR_BACKEND=torch in the sbatch scripts). The same
collectives as hvctr.distributed.comm.Comm, with what Horovod gave hvctr done here:

- Start: from what the launcher set. Under mpirun or ``srun --mpi=pmix`` mpi4py gives rank and
  size, and rank 0 sends its host name and a free port to the others (one MPI broadcast, before
  torch.distributed starts); under torchrun, RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT.
- The summation order is hvctr's, not the backend's: a grouped allreduce concatenates a dtype's
  tensors in list order in fusion buffers of HOROVOD_FUSION_THRESHOLD bytes (hvctr's 16 MiB by
  default), cuts each into W blocks (the first ``count % W`` one element longer) and sums block j
  from rank j upwards, ``((x_j + x_{j+1}) + x_{j+2}) + ...``: OpenMPI's ring allreduce
  (coll_tuned_allreduce_algorithm = 4) under Horovod, as hvctr.sim.comm states it. Moved as
  one alltoall of the blocks and one allgather of the sums (a ring's bytes), so the two engines
  train the same model bit for bit where OpenMPI's ring is pinned; buffers of fewer than W
  elements sum in rank order (OpenMPI's recursive doubling there: the evaluation's few sums).
- Threads. Horovod matches collectives by name, so the prefetch thread's cannot pair with the
  main thread's. torch.distributed pairs them in the order a process group sees them: each
  thread has its own group (``main``, ``prefetch``), and the push's rows left behind
  (storage.push_behind), which either thread may send, have theirs (``behind``, entered with
  ``stream("behind")``): within each group every rank issues the same collectives in the same
  order.
- Named-collective checks: before each collective the ranks of its group compare the crc32 of
  its name (one small allreduce of [crc, -crc] with Min): ranks that disagree on the sequence
  fail naming the collective, instead of exchanging each other's data.
- Any dtype moves: alltoall, allgather and broadcast travel as bytes (bfloat16 rows included).
- GPUs: where every rank has CUDA, NCCL and a GPU of its own (no more ranks on a host than it
  has GPUs: NCCL refuses two ranks on one GPU), the stream groups are ``cpu:gloo,cuda:nccl``: a
  collective of tensors on one GPU runs over NCCL on that GPU (the dense merge of a model on the
  GPU), host tensors over gloo (the sparse rows, which live in the host cache, and the small
  checks), so only the main thread ever runs NCCL. The sums are hvctr's ring order either way
  (the blocks are added here, elementwise, in the same order: IEEE float addition gives the same
  bits on the GPU and the CPU). Otherwise, or with HVCTR_NCCL=0, GPU tensors are staged through
  host memory (gloo only).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
import threading
import zlib
from typing import Any, Callable, ContextManager, Iterator, Sequence, TypeVar

import numpy as np
import torch
import torch.distributed as dist

from hvctr.distributed.watchdog import CollectiveWatchdog
from hvctr.distributed.payload import decode_object as _decode, encode_object as _encode
from hvctr.distributed.world import agree_on, fusion_chunks, fusion_threshold_bytes, ring_blocks

T = TypeVar("T")

STREAMS = ("main", "prefetch", "behind")  # a process group each: the collectives of one thread, or of a push left behind


CPU = torch.device("cpu")


def nccl_usable(ranks_on_host: int, environ=os.environ) -> bool:
    """Whether this rank can move its CUDA tensors over NCCL: CUDA and NCCL are there, the host
    has a GPU for each of its ranks, and HVCTR_NCCL is not 0."""
    return (environ.get("HVCTR_NCCL", "1") != "0" and dist.is_nccl_available() and torch.cuda.is_available()
            and torch.cuda.device_count() >= ranks_on_host)


def _on(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    return tensor.detach().to(device).contiguous()


def _as_bytes(tensor: torch.Tensor, device: torch.device = CPU) -> torch.Tensor:
    """[rows, ...] of any dtype as uint8 [rows, row bytes] on ``device`` (a view where contiguous)."""
    t = _on(tensor, device)
    rows = t.shape[0] if t.dim() else 1
    width = int(np.prod(t.shape[1:], dtype=np.int64)) * t.element_size() if t.dim() else t.element_size()
    return (t.reshape(rows, -1).view(torch.uint8) if t.numel()
            else torch.zeros(rows, width, dtype=torch.uint8, device=device))


def _from_bytes(b: torch.Tensor, like: torch.Tensor, rows: int) -> torch.Tensor:
    flat = b.reshape(-1).view(like.dtype)
    return flat.reshape(rows, *like.shape[1:]) if like.dim() else flat.reshape(like.shape)


class TorchComm:
    """hvctr.distributed.protocol.Comm over torch.distributed: made by ``init_torch_comm``."""

    rank: int
    size: int
    local_rank: int
    local_size: int
    num_nodes: int
    node: int  # index of this rank's node, 0 .. num_nodes-1
    node_ranks: list[list[int]]  # ranks of each node, ascending
    watchdog: CollectiveWatchdog | None
    nccl: bool  # CUDA tensors move over NCCL on their GPU (else staged through host memory)

    def __init__(self, rank: int, size: int, node_ranks: list[list[int]], groups: dict[str, Any],
                 node_group: Any, leader_group: Any, watchdog: CollectiveWatchdog | None,
                 fusion_bytes: int, nccl: bool = False) -> None:
        self.rank, self.size = rank, size
        self.node_ranks = node_ranks
        self.node = next(i for i, g in enumerate(node_ranks) if rank in g)
        self.num_nodes = len(node_ranks)
        self.local_rank = node_ranks[self.node].index(rank)
        self.local_size = len(node_ranks[self.node])
        self.watchdog = watchdog
        self._groups = groups
        self._node_set, self._leader_set = node_group, leader_group
        self._fusion_bytes = fusion_bytes
        self.nccl = nccl
        self._local = threading.local()

    def _device_for(self, tensors: Sequence[torch.Tensor]) -> torch.device:
        """Where a collective of ``tensors`` runs: their GPU when NCCL is on and one GPU holds
        them (host tensors among them are moved to it), else the host (Horovod Comm's rule)."""
        gpus = {t.device for t in tensors if t.device.type == "cuda"}
        return next(iter(gpus)) if self.nccl and len(gpus) == 1 else CPU

    def __repr__(self) -> str:
        gpu = "over NCCL" if self.nccl else "staged through host memory"
        return f"TorchComm(rank={self.rank}, size={self.size}, nodes={self.num_nodes}, GPU tensors {gpu})"

    # --- which process group -------------------------------------------------------------

    @contextlib.contextmanager
    def stream(self, name: str) -> Iterator[None]:
        """The collectives inside go to stream ``name``'s group, whatever thread issues them."""
        if name not in STREAMS:
            raise ValueError(f"unknown collective stream {name!r}: one of {STREAMS}")
        before = getattr(self._local, "stream", None)
        self._local.stream = name
        try:
            yield
        finally:
            self._local.stream = before

    def _group(self) -> Any:
        name = getattr(self._local, "stream", None)
        if name is None:
            name = "main" if threading.current_thread() is threading.main_thread() else "prefetch"
        return self._groups[name]

    def _waiting(self, name: str) -> ContextManager[None]:
        return self.watchdog.waiting(name) if self.watchdog is not None else contextlib.nullcontext()

    def _check_name(self, name: str, group: Any) -> None:
        """Every rank of ``group`` is at the collective ``name`` (crc32), or all fail naming it."""
        crc = zlib.crc32(name.encode())
        t = torch.tensor([crc, -crc], dtype=torch.int64)
        # comm: allreduce (Min) of the collective's name hash: the named-collective check
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
        if int(t[0]) != crc or int(t[1]) != -crc:
            raise RuntimeError(f"collective {name!r} on rank {self.rank}: another rank of its group is at a "
                               f"different collective (the ranks disagree on the sequence of collectives)")

    # --- reductions ----------------------------------------------------------------------

    def _ring_sum(self, flat: torch.Tensor, group: Any, n: int, me: int) -> torch.Tensor:
        """The sum over the group's n ranks of equal-length 1-D ``flat``, block j summed from
        the group's j-th rank upwards (see the module docstring)."""
        count = flat.numel()
        if n == 1:
            return flat.clone()
        if count < n:  # rank order
            parts = [torch.empty_like(flat) for _ in range(n)]
            # comm: allgather of a few elements, summed in rank order here
            dist.all_gather(parts, flat, group=group)
            acc = parts[0].clone()
            for p in parts[1:]:
                acc += p
            return acc
        sizes = ring_blocks(count, n)
        early = sizes[0]
        recv = torch.empty(n * sizes[me], dtype=flat.dtype, device=flat.device)
        # comm: alltoall of the fusion buffer's blocks: block j to the group's rank j
        dist.all_to_all_single(recv, flat, output_split_sizes=[sizes[me]] * n, input_split_sizes=sizes, group=group)
        blocks = recv.view(n, sizes[me])
        acc = blocks[me].clone()
        for m in range(1, n):
            acc += blocks[(me + m) % n]
        padded = torch.zeros(early, dtype=flat.dtype, device=flat.device)
        padded[:sizes[me]] = acc
        gathered = [torch.empty(early, dtype=flat.dtype, device=flat.device) for _ in range(n)]
        # comm: allgather of the summed blocks
        dist.all_gather(gathered, padded, group=group)
        return torch.cat([g[:s] for g, s in zip(gathered, sizes)])

    def _sum_lists(self, tensors: Sequence[torch.Tensor], name: str, group: Any, n: int, me: int) -> list[torch.Tensor]:
        device = self._device_for(tensors)
        host = [_on(t, device) for t in tensors]
        out: list[torch.Tensor | None] = [None] * len(host)
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i, t in enumerate(host):
            by_dtype.setdefault(t.dtype, []).append(i)
        with self._waiting(name):
            self._check_name(name, group)
            for idxs in by_dtype.values():
                for chunk in fusion_chunks([(i, host[i].numel() * host[i].element_size()) for i in idxs],
                                           self._fusion_bytes):
                    summed = self._ring_sum(torch.cat([host[i].reshape(-1) for i in chunk]), group, n, me)
                    pos = 0
                    for i in chunk:
                        k = host[i].numel()
                        out[i] = summed[pos:pos + k].reshape(host[i].shape)
                        pos += k
        return [o.to(t.device) for o, t in zip(out, tensors)]  # type: ignore[union-attr]

    def allreduce_sum(self, tensors: Sequence[torch.Tensor], name: str) -> list[torch.Tensor]:
        """Elementwise sums over ranks of a list of tensors, in hvctr's ring order."""
        if not tensors:
            return []
        return self._sum_lists(tensors, name, self._group(), self.size, self.rank)

    def allreduce_avg(self, tensors: Sequence[torch.Tensor], name: str) -> list[torch.Tensor]:
        return [t / self.size for t in self.allreduce_sum(tensors, name)]

    def allreduce_sum_hierarchical(self, tensors: Sequence[torch.Tensor], name: str) -> list[torch.Tensor]:
        """Horovod Comm's three steps (node sums, the leaders' sum, the leader's result carried to
        the node by adding zeros), each a ring over that step's ranks."""
        tensors = list(tensors)
        if not tensors:
            return []
        if self.num_nodes == 1 or self.size == self.num_nodes:
            return self.allreduce_sum(tensors, name)
        # comm: intra-node ring sum over this rank's node group
        partial = self._sum_lists(tensors, f"{name}.intra", self._node_set, self.local_size, self.local_rank)
        leader = self.local_rank == 0
        if leader:
            # comm: inter-node ring sum among node leaders only
            partial = self._sum_lists(partial, f"{name}.inter", self._leader_set, self.num_nodes, self.node)
        contrib = partial if leader else [torch.zeros_like(t) for t in partial]
        # comm: intra-node ring sum that carries the leader's result to the node
        return self._sum_lists(contrib, f"{name}.bcast", self._node_set, self.local_size, self.local_rank)

    def _int_reduce(self, values: Sequence[int], op: Any, name: str) -> list[int]:
        t = torch.tensor(list(values), dtype=torch.int64)
        group = self._group()
        with self._waiting(name):
            self._check_name(name, group)
            # comm: allreduce (Min or Max) of a few int64 scalars
            dist.all_reduce(t, op=op, group=group)
        return t.tolist()

    def allreduce_min_int(self, values: Sequence[int], name: str) -> list[int]:
        return self._int_reduce(values, dist.ReduceOp.MIN, name)

    def allreduce_max_int(self, values: Sequence[int], name: str) -> list[int]:
        return self._int_reduce(values, dist.ReduceOp.MAX, name)

    # --- exchanges -----------------------------------------------------------------------

    def alltoall(self, tensor: torch.Tensor, splits: Sequence[int] | torch.Tensor,
                 name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows ``[sum(splits[:r]), sum(splits[:r+1]))`` to rank r; returns the rows received
        (by source rank) and how many came from each rank (int64 [size])."""
        splits = torch.as_tensor(splits, dtype=torch.int64).reshape(-1)
        if splits.numel() != self.size:
            raise ValueError(f"alltoall {name}: {splits.numel()} splits for {self.size} ranks")
        if int(splits.sum()) != tensor.shape[0]:
            raise ValueError(f"alltoall {name}: splits sum to {int(splits.sum())}, tensor has {tensor.shape[0]} rows")
        group = self._group()
        data = _as_bytes(tensor, self._device_for([tensor]))
        received = torch.empty(self.size, dtype=torch.int64)
        with self._waiting(name):
            self._check_name(name, group)
            # comm: alltoall of the row counts, then of the rows (as bytes)
            dist.all_to_all_single(received, splits.clone(), group=group)
            out = torch.empty(int(received.sum()), data.shape[1], dtype=torch.uint8, device=data.device)
            dist.all_to_all_single(out, data, output_split_sizes=received.tolist(), input_split_sizes=splits.tolist(),
                                   group=group)
        return _from_bytes(out, tensor, int(received.sum())).to(tensor.device), received

    def _allgather_rows(self, data: torch.Tensor, name: str) -> tuple[torch.Tensor, list[int]]:
        """Every rank's uint8 [rows, w] (w alike, rows may differ) in rank order, and each one's rows."""
        group = self._group()
        with self._waiting(name):
            self._check_name(name, group)
            counts = [torch.empty(1, dtype=torch.int64) for _ in range(self.size)]
            # comm: allgather of the row counts, then of the rows padded to the longest (as bytes)
            dist.all_gather(counts, torch.tensor([data.shape[0]], dtype=torch.int64), group=group)
            n = [int(c) for c in counts]
            padded = torch.zeros(max(n), data.shape[1], dtype=torch.uint8, device=data.device)
            padded[:data.shape[0]] = data
            parts = [torch.empty_like(padded) for _ in range(self.size)]
            dist.all_gather(parts, padded, group=group)
        return torch.cat([p[:k] for p, k in zip(parts, n)]), n

    def allgather(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        """Concatenation along dim 0 of every rank's tensor, in rank order (lengths may differ)."""
        out, n = self._allgather_rows(_as_bytes(tensor, self._device_for([tensor])), name)  # comm: allgather (counts, then rows)
        return _from_bytes(out, tensor, sum(n)).to(tensor.device)

    def broadcast(self, tensor: torch.Tensor, root: int, name: str) -> torch.Tensor:
        group = self._group()
        data = _as_bytes(tensor, self._device_for([tensor])).clone()
        with self._waiting(name):
            self._check_name(name, group)
            # comm: broadcast of one tensor from root (as bytes)
            dist.broadcast(data, src=root, group=group)
        return _from_bytes(data, tensor, tensor.shape[0] if tensor.dim() else 1).to(tensor.device)

    def broadcast_object(self, obj: Any, root: int, name: str) -> Any:
        """A small JSON-serialisable object from ``root`` (JSON, not pickle: nothing received runs code)."""
        group = self._group()
        payload = _encode(obj) if self.rank == root else torch.zeros(0, dtype=torch.uint8)
        n = torch.tensor([payload.numel()], dtype=torch.int64)
        with self._waiting(name):
            self._check_name(name, group)
            # comm: broadcast of the payload length, then of the payload
            dist.broadcast(n, src=root, group=group)
            buf = payload if self.rank == root else torch.zeros(int(n[0]), dtype=torch.uint8)
            if int(n[0]):
                dist.broadcast(buf, src=root, group=group)
        return _decode(buf)

    def allgather_object(self, obj: Any, name: str) -> list[Any]:
        """Every rank's small JSON-serialisable object, in rank order."""
        data, n = self._allgather_rows(_encode(obj).reshape(-1, 1), name)  # comm: allgather (lengths, then payloads)
        return [_decode(p.reshape(-1)) for p in torch.split(data, n)]

    def agree(self, fn: Callable[[], T], name: str) -> T:
        """``fn()`` on every rank; a ValueError on any makes every rank raise AgreedError."""
        return agree_on(self, fn, name)  # comm: allgather of every rank's error

    def barrier(self) -> None:
        group = self._group()
        with self._waiting("barrier"):
            self._check_name("barrier", group)
            # comm: barrier: an allreduce of a host tensor, so gloo carries it whatever NCCL the
            # group has (NCCL's barrier guesses a GPU from the rank, not this rank's own)
            dist.all_reduce(torch.zeros(1), group=group)

    def shutdown(self) -> None:
        if self.watchdog is not None:
            self.watchdog.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def rendezvous(environ=os.environ) -> tuple[int, int, str]:
    """(rank, size, init_method) from the launcher: torchrun's variables where set, else MPI's
    world (mpirun, srun --mpi=pmix) and an address of rank 0 with a free port, sent to the
    others: HVCTR_MASTER_ADDR where set, the loopback where every rank is on one host, else the
    address rank 0's host name resolves to (gloo connects the ranks by their host names' addresses
    too, or through GLOO_SOCKET_IFNAME's interface)."""
    if all(k in environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
        return int(environ["RANK"]), int(environ["WORLD_SIZE"]), "env://"
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    # comm: mpi4py allgather of host names (once, before torch.distributed starts)
    hosts = world.allgather(socket.gethostname())
    where: tuple[str, int] | str | None = None
    if rank == 0:
        addr = environ.get("HVCTR_MASTER_ADDR", "")
        if not addr and all(h == hosts[0] for h in hosts):
            addr = "127.0.0.1"  # one machine: the loopback, whatever the host name resolves to
        problem = ""
        if not addr:
            try:
                addr = socket.gethostbyname(hosts[0])
                if addr.startswith("127."):
                    problem = f"rank 0's host name {hosts[0]!r} resolves to the loopback {addr}"
            except OSError as e:
                problem = f"rank 0's host name {hosts[0]!r} does not resolve ({e})"
        where = ((addr, _free_port()) if not problem else
                 f"distributed.backend = torch on {len(set(hosts))} hosts: {problem}; set HVCTR_MASTER_ADDR to an "
                 f"address of rank 0's node the other nodes reach (and GLOO_SOCKET_IFNAME to the interface gloo "
                 f"should use)")
    # comm: mpi4py broadcast of rank 0's address (once, before torch.distributed starts)
    where = world.bcast(where, root=0)
    if isinstance(where, str):
        raise ValueError(where)
    host, port = where
    return rank, size, f"tcp://{host}:{port}"


def _node_grouping(size: int, ranks_per_virtual_node: int, hosts: list[str]) -> list[list[int]]:
    if ranks_per_virtual_node > 0:
        if size % ranks_per_virtual_node:
            raise ValueError(f"config key 'topology.ranks_per_virtual_node': {ranks_per_virtual_node} does not "
                             f"divide the world size {size}")
        keys: list[Any] = [r // ranks_per_virtual_node for r in range(size)]
    else:
        keys = list(hosts)
    groups: dict[Any, list[int]] = {}
    for r, k in enumerate(keys):
        groups.setdefault(k, []).append(r)
    return sorted(groups.values(), key=lambda g: g[0])


def init_torch_comm(ranks_per_virtual_node: int = 0, stall_timeout_s: float = 0.0, program: str = "hvctr"
                    ) -> TorchComm:
    """Starts torch.distributed (gloo, and NCCL for CUDA tensors where every rank can: see the
    module docstring) with a process group for each stream and, on several nodes of several
    ranks, one for each node and one for the node leaders."""
    if dist.is_initialized():
        raise RuntimeError("init_torch_comm called twice in one process")
    rank, size, method = rendezvous()
    # torch's own timeout stays above hvctr's watchdog, which names the collective first
    timeout = datetime.timedelta(seconds=max(1800.0, 2 * stall_timeout_s))
    dist.init_process_group("gloo", init_method=method, rank=rank, world_size=size, timeout=timeout)
    hosts: list[Any] = [None] * size
    # comm: allgather of host names (once, at start): the nodes, and how many ranks share a host's GPUs
    dist.all_gather_object(hosts, socket.gethostname())
    usable = torch.tensor([int(nccl_usable(hosts.count(hosts[rank])))], dtype=torch.int64)
    # comm: allreduce (Min) of whether each rank can use NCCL: every rank's groups take the same backends
    dist.all_reduce(usable, op=dist.ReduceOp.MIN)
    backend = "cpu:gloo,cuda:nccl" if int(usable[0]) else "gloo"
    everyone = list(range(size))
    groups = {s: dist.new_group(everyone, backend=backend, timeout=timeout) for s in STREAMS}
    nodes = _node_grouping(size, ranks_per_virtual_node, hosts)
    node_group = leader_group = None
    if 1 < len(nodes) < size:  # every rank creates every group, in the same order
        node_groups = [dist.new_group(g, backend=backend, timeout=timeout) for g in nodes]
        leaders = dist.new_group([g[0] for g in nodes], backend=backend, timeout=timeout)
        node = next(i for i, g in enumerate(nodes) if rank in g)
        node_group = node_groups[node]
        leader_group = leaders if rank == nodes[node][0] else None
    return TorchComm(rank, size, nodes, groups, node_group, leader_group,
                     CollectiveWatchdog(rank, stall_timeout_s, program) if stall_timeout_s > 0 else None,
                     fusion_threshold_bytes(), nccl="nccl" in backend)
