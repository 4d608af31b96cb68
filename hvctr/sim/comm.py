"""ThreadComm: ``hvctr.distributed.comm.Comm``'s collectives for W simulated ranks, one thread each.

    world = ThreadWorld(4)
    comms = [ThreadComm(world, r) for r in range(4)]   # one per simulated rank's thread
    # in rank r's thread: world.enter(r); ... comms[r].allreduce_sum([t], name="x") ...; world.finish(r)

Every collective is a rendezvous: the i-th collective of every rank pairs with the i-th of
every other (their kinds and names must agree, as Horovod matches operations by name; a
mismatch fails the simulation naming both ranks). The last rank to arrive computes the
result for all, so what a rank receives does not depend on thread timing.

Summation order. ``reduce_order = "ring"`` (the default) adds floats in the order OpenMPI's
ring allreduce (``coll_tuned_allreduce_algorithm = 4``, what the equality tests pin) adds them
for a Horovod grouped allreduce: the group's tensors of one dtype are concatenated in list
order (Horovod's fusion buffer, up to ``HOROVOD_FUSION_THRESHOLD`` bytes, hvctr's 16 MiB by default:
hvctr.distributed.world.FUSION_THRESHOLD_BYTES),
the buffer is cut into W blocks (the first ``count % W`` one element longer), and block j is
summed from rank j upwards: ``((x_j + x_{j+1}) + x_{j+2}) + ...`` (ranks mod W). Buffers of
fewer than W elements (OpenMPI switches to recursive doubling there; only the few-element
reductions of evaluation sums) and ``reduce_order = "rank"`` sum in ascending rank order.
With 2 ranks both orders give the same bits (addition commutes). The hierarchical allreduce
is simulated as its three steps (node sums, leaders' sum, the leader's result carried to the
node by adding zeros), each a ring over that step's ranks. Integer reductions are exact.

The baton. Ranks run strictly in turn: a rank runs only while it holds the baton, and hands
it on when it waits in a collective or ends; the baton goes to the lowest rank that is not
waiting (deterministic, and one rank computes at a time, so each may use all the cores).
A rank that raises aborts the simulation: every other rank's next wait raises
``SimulationAborted``, and ``ThreadWorld.error`` names the rank and its exception. Ranks that
wait for each other forever (a rank ended while others wait in a collective, or ranks that
disagree on the collectives) fail the simulation at once, naming the collective.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Sequence, TypeVar

import torch

from hvctr.distributed.world import agree_on, fusion_chunks, fusion_threshold_bytes, ring_blocks

T = TypeVar("T")

REDUCE_ORDERS = ("ring", "rank")


class SimulationAborted(RuntimeError):
    """Raised in a simulated rank's thread because another simulated rank failed."""


@dataclass
class _Slot:
    seq: int
    kind: str
    name: str
    first: int  # the rank that opened it
    values: list[Any]
    arrived: int = 0
    results: list[Any] | None = None


@dataclass
class ThreadWorld:
    """The shared state of W simulated ranks: rendezvous slots, the baton, the first failure."""

    size: int
    node_ranks: list[list[int]] = field(default_factory=list)  # ranks of each node; default: one node
    reduce_order: str = "ring"
    fusion_threshold_bytes: int = -1  # -1: HOROVOD_FUSION_THRESHOLD, else hvctr's default (as the real job)

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"the number of simulated ranks must be >= 1, got {self.size}")
        if self.reduce_order not in REDUCE_ORDERS:
            raise ValueError(f"reduce order must be one of {REDUCE_ORDERS}, got {self.reduce_order!r}")
        if not self.node_ranks:
            self.node_ranks = [list(range(self.size))]
        if sorted(r for g in self.node_ranks for r in g) != list(range(self.size)):
            raise ValueError(f"node grouping {self.node_ranks} does not cover ranks 0..{self.size - 1} once")
        if self.fusion_threshold_bytes < 0:
            self.fusion_threshold_bytes = fusion_threshold_bytes()
        self._cv = threading.Condition()
        self._holder: int | None = 0
        self._seq = [0] * self.size
        self._slots: dict[int, _Slot] = {}
        self._waiting: dict[int, _Slot] = {}  # rank -> the collective it waits in
        self._finished: set[int] = set()
        self._threads: dict[int, int] = {}  # thread ident -> rank
        self.error: tuple[int, BaseException] | None = None  # the first failure: (rank, exception)

    # --- the baton ------------------------------------------------------------------------

    def enter(self, rank: int) -> None:
        """Called first by rank ``rank``'s thread: waits for the baton."""
        with self._cv:
            self._threads[threading.get_ident()] = rank
            self._wait_for_baton(rank)

    def finish(self, rank: int, exc: BaseException | None = None) -> None:
        """Called last by rank ``rank``'s thread (``exc``: what it raised, if anything)."""
        with self._cv:
            self._finished.add(rank)
            self._waiting.pop(rank, None)
            if exc is not None and not isinstance(exc, SimulationAborted):
                self._fail(rank, exc)
            elif self.error is None:
                self._pass_baton(rank)
            self._cv.notify_all()

    def abort(self, exc: BaseException) -> None:
        """Fails the simulation from outside the ranks (the main thread: an interrupt)."""
        with self._cv:
            self._fail(-1, exc)

    def rank_of_thread(self, ident: int | None = None) -> int | None:
        """The simulated rank whose thread this is (None: not a rank's thread)."""
        return self._threads.get(threading.get_ident() if ident is None else ident)

    def _fail(self, rank: int, exc: BaseException) -> None:
        if self.error is None:
            self.error = (rank, exc)
        self._holder = None
        self._cv.notify_all()

    def _check(self) -> None:
        if self.error is not None:
            rank, exc = self.error
            who = f"simulated rank {rank}" if rank >= 0 else "the simulation"
            raise SimulationAborted(f"{who} failed: {exc.__class__.__name__}: {exc}")

    def _pass_baton(self, rank: int) -> None:
        runnable = [r for r in range(self.size) if r not in self._finished and r not in self._waiting]
        if runnable:
            self._holder = runnable[0]
        elif len(self._finished) < self.size:
            waits = "; ".join(f"rank {r} in {s.kind} {s.name!r} (its collective #{s.seq})"
                              for r, s in sorted(self._waiting.items()))
            done = sorted(self._finished)
            self._fail(rank, RuntimeError(
                f"simulated ranks would wait forever: {waits}" + (f"; ranks {done} have ended" if done else "")
                + " (the ranks disagree on the sequence of collectives)"))
        else:
            self._holder = None
        self._cv.notify_all()

    def _wait_for_baton(self, rank: int) -> None:
        while self._holder != rank:
            self._check()
            self._cv.wait(1.0)
        self._check()

    # --- the rendezvous -------------------------------------------------------------------

    def collective(self, rank: int, kind: str, name: str, value: Any,
                   compute: Callable[[list[Any]], list[Any]]) -> Any:
        """Deposits ``value``; when every rank has, ``compute(values in rank order)`` gives the
        result of each rank. Returns rank ``rank``'s result once it holds the baton again."""
        with self._cv:
            self._check()
            seq = self._seq[rank]
            self._seq[rank] += 1
            slot = self._slots.get(seq)
            if slot is None:
                slot = self._slots[seq] = _Slot(seq, kind, name, rank, [None] * self.size)
            elif (slot.kind, slot.name) != (kind, name):
                err = RuntimeError(f"collective mismatch: as its collective #{seq}, rank {slot.first} called "
                                   f"{slot.kind} {slot.name!r}, rank {rank} called {kind} {name!r}")
                self._fail(rank, err)
                raise err
            slot.values[rank] = value
            slot.arrived += 1
            if slot.arrived == self.size:
                del self._slots[seq]
                try:
                    slot.results = compute(slot.values)
                except BaseException as e:
                    self._fail(rank, e)
                    raise
                slot.values = []
                for r in [r for r, s in self._waiting.items() if s is slot]:
                    del self._waiting[r]
            else:
                self._waiting[rank] = slot
            self._pass_baton(rank)
            self._wait_for_baton(rank)
            assert slot.results is not None
            result, slot.results[rank] = slot.results[rank], None
            return result

    # --- float sums in a fixed order --------------------------------------------------------

    def reduce_flat(self, flat: list[torch.Tensor]) -> torch.Tensor:
        """Elementwise sum of equal-length 1-D tensors (one per rank of a group, in rank order),
        in the order ``reduce_order`` says (see the module docstring)."""
        n, count = len(flat), flat[0].numel()
        if self.reduce_order == "rank" or n == 1 or count < n:
            acc = flat[0].clone()
            for x in flat[1:]:
                acc += x
            return acc
        out = torch.empty_like(flat[0])
        lo = 0
        for j, size in enumerate(ring_blocks(count, n)):
            hi = lo + size
            acc = flat[j][lo:hi].clone()
            for m in range(1, n):
                acc += flat[(j + m) % n][lo:hi]
            out[lo:hi] = acc
            lo = hi
        return out

    def sum_lists(self, per_rank: list[list[torch.Tensor]]) -> list[torch.Tensor]:
        """Sums over a group of ranks of lists of tensors, as one Horovod grouped allreduce:
        tensors of a dtype fused in list order, up to the fusion threshold per buffer."""
        n = len(per_rank[0])
        for r, ts in enumerate(per_rank):
            if len(ts) != n or any(a.shape != b.shape or a.dtype != b.dtype for a, b in zip(ts, per_rank[0])):
                raise ValueError(f"allreduce: rank {r}'s tensors {[(tuple(t.shape), t.dtype) for t in ts]} differ "
                                 f"from the first rank's {[(tuple(t.shape), t.dtype) for t in per_rank[0]]}")
        out: list[torch.Tensor | None] = [None] * n
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i, t in enumerate(per_rank[0]):
            by_dtype.setdefault(t.dtype, []).append(i)
        for idxs in by_dtype.values():
            nbytes = [(i, per_rank[0][i].numel() * per_rank[0][i].element_size()) for i in idxs]
            for chunk in fusion_chunks(nbytes, self.fusion_threshold_bytes):
                flat = [torch.cat([ts[i].reshape(-1) for i in chunk]) for ts in per_rank]
                summed = self.reduce_flat(flat)
                pos = 0
                for i in chunk:
                    k = per_rank[0][i].numel()
                    out[i] = summed[pos:pos + k].reshape(per_rank[0][i].shape)
                    pos += k
        return out  # type: ignore[return-value]


def _clone_each(shared: Any, size: int) -> list[Any]:
    return [shared] * size


def _encode(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True)  # as Comm: JSON, never pickle


class ThreadComm:
    """One simulated rank's view of a ThreadWorld, with Comm's attributes and methods: it
    implements hvctr.distributed.protocol.Comm."""

    def __init__(self, world: ThreadWorld, rank: int) -> None:
        if not 0 <= rank < world.size:
            raise ValueError(f"rank {rank} is not in [0, {world.size})")
        self.world = world
        self.rank, self.size = rank, world.size
        self.node_ranks = world.node_ranks
        self.num_nodes = len(world.node_ranks)
        self.node = next(i for i, g in enumerate(world.node_ranks) if rank in g)
        self.local_rank = world.node_ranks[self.node].index(rank)
        self.local_size = len(world.node_ranks[self.node])
        self.watchdog = None  # the world itself fails a simulation whose ranks would wait forever

    def __repr__(self) -> str:
        return f"ThreadComm(rank={self.rank}, size={self.size})"

    def _run(self, kind: str, name: str, value: Any, compute: Callable[[list[Any]], list[Any]]) -> Any:
        return self.world.collective(self.rank, kind, name, value, compute)

    # --- reductions -------------------------------------------------------------------

    def allreduce_sum(self, tensors: Sequence[torch.Tensor], name: str) -> list[torch.Tensor]:
        tensors = list(tensors)
        if not tensors:
            return []
        devices = [t.device for t in tensors]
        # comm: simulated grouped allreduce (Sum) of every tensor in the list
        summed = self._run("allreduce_sum", name, [t.detach().cpu() for t in tensors],
                           lambda vals: _clone_each(self.world.sum_lists(vals), self.size))
        return [s.clone().to(d) for s, d in zip(summed, devices)]

    def allreduce_avg(self, tensors: Sequence[torch.Tensor], name: str) -> list[torch.Tensor]:
        return [t / self.size for t in self.allreduce_sum(tensors, name)]

    def allreduce_sum_hierarchical(self, tensors: Sequence[torch.Tensor], name: str) -> list[torch.Tensor]:
        tensors = list(tensors)
        if not tensors:
            return []
        if self.num_nodes == 1 or self.size == self.num_nodes:
            return self.allreduce_sum(tensors, name)
        devices = [t.device for t in tensors]
        world = self.world

        def compute(vals: list[list[torch.Tensor]]) -> list[Any]:
            nodes = world.node_ranks
            partial = [world.sum_lists([vals[r] for r in g]) for g in nodes]  # intra-node
            total = world.sum_lists(partial)  # the leaders' sum of node sums
            zeros = [torch.zeros_like(t) for t in total]
            # the node sum again, where only the leader contributes (zeros elsewhere): a broadcast
            out: list[Any] = [None] * world.size
            for g in nodes:
                res = world.sum_lists([total] + [zeros] * (len(g) - 1))
                for r in g:
                    out[r] = res
            return out

        # comm: simulated hierarchical grouped allreduce (Sum): node, leaders, node again
        summed = self._run("allreduce_sum_hierarchical", name, [t.detach().cpu() for t in tensors], compute)
        return [s.clone().to(d) for s, d in zip(summed, devices)]

    def _int_reduce(self, kind: str, values: Sequence[int], name: str, op: Callable[[list[int]], int]) -> list[int]:
        vals = [int(v) for v in values]

        def compute(all_vals: list[list[int]]) -> list[Any]:
            if any(len(v) != len(vals) for v in all_vals):
                raise ValueError(f"{kind} {name!r}: ranks give {[len(v) for v in all_vals]} values")
            res = [op(list(col)) for col in zip(*all_vals)]
            return [list(res) for _ in all_vals]

        return self._run(kind, name, vals, compute)

    def allreduce_min_int(self, values: Sequence[int], name: str) -> list[int]:
        # comm: simulated allreduce (Min) of a few integers
        return self._int_reduce("allreduce_min_int", values, name, min)

    def allreduce_max_int(self, values: Sequence[int], name: str) -> list[int]:
        # comm: simulated allreduce (Max) of a few integers
        return self._int_reduce("allreduce_max_int", values, name, max)

    # --- exchanges --------------------------------------------------------------------

    def alltoall(self, tensor: torch.Tensor, splits: Sequence[int] | torch.Tensor,
                 name: str) -> tuple[torch.Tensor, torch.Tensor]:
        splits = [int(s) for s in torch.as_tensor(splits, dtype=torch.int64).tolist()]
        if len(splits) != self.size:
            raise ValueError(f"alltoall {name}: {len(splits)} splits for {self.size} ranks")
        if sum(splits) != tensor.shape[0]:
            raise ValueError(f"alltoall {name}: splits sum to {sum(splits)}, tensor has {tensor.shape[0]} rows")
        device = tensor.device

        def compute(vals: list[tuple[torch.Tensor, list[int]]]) -> list[Any]:
            t0 = vals[0][0]
            for r, (t, _) in enumerate(vals):
                if t.dtype != t0.dtype or t.shape[1:] != t0.shape[1:]:
                    raise ValueError(f"alltoall {name!r}: rank {r} sends {t.dtype} rows of shape {tuple(t.shape[1:])}, "
                                     f"rank 0 {t0.dtype} {tuple(t0.shape[1:])}")
            offsets = [[0] + torch.tensor(s).cumsum(0).tolist() for _, s in vals]
            out = []
            for dst in range(self.size):
                parts = [t[offsets[s][dst]:offsets[s][dst + 1]] for s, (t, _) in enumerate(vals)]
                out.append((torch.cat(parts).contiguous(),
                            torch.tensor([sp[dst] for _, sp in vals], dtype=torch.int64)))
            return out

        # comm: simulated alltoall with per-rank splits
        out, received = self._run("alltoall", name, (tensor.detach().cpu().contiguous(), splits), compute)
        return out.to(device), received

    def allgather(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        device = tensor.device

        def compute(vals: list[torch.Tensor]) -> list[Any]:
            for r, t in enumerate(vals):
                if t.dtype != vals[0].dtype or t.shape[1:] != vals[0].shape[1:]:
                    raise ValueError(f"allgather {name!r}: rank {r}'s tensor {t.dtype} {tuple(t.shape)} does not "
                                     f"match rank 0's {vals[0].dtype} {tuple(vals[0].shape)}")
            return _clone_each(torch.cat(vals), self.size)

        # comm: simulated allgather
        return self._run("allgather", name, tensor.detach().cpu().contiguous(), compute).clone().to(device)

    def broadcast(self, tensor: torch.Tensor, root: int, name: str) -> torch.Tensor:
        device = tensor.device
        # comm: simulated broadcast of one tensor from root
        got = self._run("broadcast", name, tensor.detach().cpu(), lambda vals: _clone_each(vals[root], self.size))
        return got.clone().to(device)

    def broadcast_object(self, obj: Any, root: int, name: str) -> Any:
        payload = _encode(obj) if self.rank == root else None
        # comm: simulated broadcast of a JSON payload from root
        text = self._run("broadcast_object", name, payload, lambda vals: _clone_each(vals[root], self.size))
        return json.loads(text)

    def allgather_object(self, obj: Any, name: str) -> list[Any]:
        # comm: simulated allgather of JSON payloads
        texts = self._run("allgather_object", name, _encode(obj), lambda vals: _clone_each(list(vals), self.size))
        return [json.loads(t) for t in texts]

    def agree(self, fn: Callable[[], T], name: str) -> T:
        """As Comm.agree: ``fn()`` on every rank; a ValueError on any makes every rank raise."""
        return agree_on(self, fn, name)  # comm: allgather of every rank's error

    def stream(self, name: str) -> ContextManager[None]:
        """Nothing to choose: a simulated rank's collectives pair in its order, whatever thread."""
        return contextlib.nullcontext()

    def barrier(self) -> None:
        # comm: simulated barrier
        self._run("barrier", "barrier", None, lambda vals: [None] * self.size)

    def shutdown(self) -> None:
        """Nothing to release: the world ends when its last rank finishes."""
