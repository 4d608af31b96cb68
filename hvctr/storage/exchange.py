"""ShardedTable: a window's rows between their owners' stores and this rank's working set.

Every call is collective: all ranks call it with the same ``name`` (Horovod pairs operations
by name), each with its own unique keys, possibly none. Keys go to their owners
(``bucket_owner[bucket(key)]``) in one alltoall; owners answer from their EmbeddingStore.
Exchanges run on host tensors (a CPU build of Horovod serves GPU runs); only the result of
a pull moves to ``device``.

Merge rules (docs/merging.md), applied by each owner to the copies it gets:

- ``push``: each key's rows are summed in ascending source rank, then divided by the number
  of ranks that sent the key; all columns (w, w1, m, v, step) merge together.
- ``push_gradients`` (merge.mode = sync): gradients summed in ascending source rank,
  divided by the world size, then ``apply_fn(rows, grads) -> rows`` and the result stored.

``warm`` may run in a prefetch thread while the main thread runs other collectives: give it
names no other collective uses. It routes keys and answers nothing (prefetch warms, it never
answers), so the values a later ``pull`` returns do not depend on it.

A training window's exchanges share one ``WindowExchange``: the Routing of its keys
(hvctr.storage.routing, computed once in the prefetch thread: warm, pull and push all send
along it) and, once the keys went to their owners (in the warm, else in the pull), what this
rank was asked as owner (``Asked``: the distinct keys and where each received key is among
them). With it the pull sends no keys, only the rows back (one alltoall instead of two, off
the critical path after a merge), and the push sends rows only, which the owner merges by
the request it kept, without deduplicating keys again: the same sums in the same order, and
the same keys in the same order to the store, as a push that sends its keys. Every rank
passes a WindowExchange of the same keys to warm, pull and push, or none does: what a
collective sends is decided by it.

A push given the next window's exchange (``ahead``, its keys already sent to their owners by
the warm) writes at once only the rows that window holds, as an owner; the rest it hands to
the store (``EmbeddingStore.defer_write``), which writes them on a thread of their own from
the end of that window's pull, while it trains: the window's end then waits for the rows the
next window reads alone (the lookahead of Bagpipe, arXiv 2202.12429). A row is stored with
the same value either way: every reader of the deferred rows but that pull waits for them.

A warm may also answer ahead (``pull_ahead``, storage.pull_ahead): each owner answers at once,
in the prefetch thread, the rows of the next window that no rank holds in the window now
training (keys outside the request of the window warmed before it): nothing writes them before that
window's pull (the push writes only the rows the training window holds), so they have the
values the pull would read. That window's pull then reads and sends only the rows both windows
hold, after the push: the other half of Bagpipe's lookahead. Each holder learns which of its
rows came early from one alltoall of a byte a key; the rows themselves in a second.

The push may leave rows behind (``push_behind``, storage.push_behind, with pull_ahead): in the
same alltoall of bytes, each owner tells each holder which keys of the window training now
the next window holds on some rank (it knows both requests). A push given that next window
sends at once only those rows, which the next pull reads; the rest wait in ``settle_push``,
which the prefetch thread runs before its next warm, while the next window trains, and every
other reader runs first (validation, checkpoints, a pass's end). Each owner merges each part
by its part of the request: a key's copies are all in one part, in the same order, so every
row gets the same sums as from one push.

Plain unique keys or a Routing work too (tests, benchmarks, evaluation): ``route(keys)``
builds their Routing, checking that they are unique; each call then sends its keys.
"""

from __future__ import annotations

import functools
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator

import numpy as np
import torch

from hvctr.config import SparseRule
from hvctr.kernels import native as _native
from hvctr.kernels import hash_table_bits, unique_in_order
from hvctr.storage import routing as _routing
from hvctr.storage import store as _store
from hvctr.storage.routing import Routing
from hvctr.storage.row_merge import contributor_spread, merged_rows
from hvctr.storage.shared_rows import SharedRows, choose_owned
from hvctr.storage.store import EmbeddingStore, RowPositions, as_keys, require_unique

if TYPE_CHECKING:
    from hvctr.distributed.protocol import Comm

ApplyFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
Keys = Routing | np.ndarray  # a routing, or unique keys to route on the call
_KEY_COLS = 2  # a uint64 key travels as two float32 columns (bits only, no arithmetic)


def _pack(keys: np.ndarray, values: np.ndarray, order: np.ndarray) -> torch.Tensor:
    """One float32 message row per key, ``[key (8 bytes) | values]``, rows in ``order`` (one
    alltoall, not two)."""
    n, c = order.shape[0], values.shape[1]
    msg = np.empty((n, _KEY_COLS + c), dtype=np.float32)
    lib = _native.lib()
    if lib is not None and values.dtype == np.float32 and values.flags.c_contiguous:
        keys, order = np.ascontiguousarray(keys, np.uint64), np.ascontiguousarray(order, np.int64)
        lib.hv_pack_rows(keys.ctypes.data, order.ctypes.data, n, values.ctypes.data, c, c, msg.ctypes.data)
    else:
        msg[:, :_KEY_COLS] = keys[order].view(np.float32).reshape(n, _KEY_COLS)
        msg[:, _KEY_COLS:] = values[order]
    return torch.from_numpy(msg)


def _unpack(msg: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    a = msg.numpy()
    keys = np.ascontiguousarray(a[:, :_KEY_COLS]).view(np.uint64).reshape(a.shape[0])
    return keys, a[:, _KEY_COLS:]


def merge_by_key(keys: np.ndarray, values: np.ndarray, splits: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Sums the values of equal keys in ascending source rank: (unique keys, sums, counts).

    ``keys``/``values`` are the concatenation of what each source rank sent, in rank order,
    ``splits[s]`` rows from rank s; a rank sends a key at most once. The first copy of a key
    is assigned, later ones added, so a single copy passes through bit for bit. The numpy
    reference of merge_messages (keys sorted here, in order of first occurrence there).
    """
    uniq, inv = np.unique(keys, return_inverse=True)
    acc = np.empty((uniq.shape[0], values.shape[1]), dtype=np.float32)
    count = np.zeros(uniq.shape[0], dtype=np.int64)
    bounds = np.concatenate(([0], np.cumsum(splits))).tolist()
    for s in range(len(splits)):  # one vectorised step per source rank: this loop fixes the order
        i, x = inv[bounds[s]:bounds[s + 1]], values[bounds[s]:bounds[s + 1]]
        first = count[i] == 0
        acc[i[first]] = x[first]
        acc[i[~first]] += x[~first]
        count[i] += 1
    return uniq, acc, count


def merge_messages(msg: torch.Tensor, splits: list[int], divide: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """merge_by_key over received messages (``[key | values]`` rows, ``splits[s]`` from rank
    s): (keys in order of first occurrence, sums, counts); ``divide``: sums divided by the
    counts (the average over the ranks that sent each key). One pass in C, else numpy."""
    a = msg.numpy()
    n, c = a.shape[0], a.shape[1] - _KEY_COLS
    if not _merges_natively(n, a.flags.c_contiguous):
        uniq, acc, count = merge_by_key(*_unpack(msg), np.asarray(splits))
        return uniq, (acc / count.astype(np.float32)[:, None] if divide else acc), count
    lib = _native.lib()
    bits = hash_table_bits(n)
    table = np.full(1 << bits, -1, dtype=np.int32)
    uniq = np.empty(n, dtype=np.uint64)
    acc = np.empty((n, c), dtype=np.float32)
    count = np.empty(n, dtype=np.int64)
    k = lib.hv_merge_messages(a.ctypes.data, n, c + _KEY_COLS, c, table.ctypes.data, bits, int(divide),
                              uniq.ctypes.data, acc.ctypes.data, count.ctypes.data)
    return uniq[:k], acc[:k], count[:k]


@dataclass(frozen=True)
class Asked:
    """The keys other ranks asked this rank for as their owner, as an owner answers them: how
    many came from each rank, the distinct keys (read once) and where each asked key is among
    them (``uniq[inverse]`` is the keys as received), and where each distinct key first came
    (``first``, increasing)."""
    received: list[int]
    uniq: np.ndarray
    inverse: np.ndarray
    first: np.ndarray


@dataclass
class WindowExchange:
    """One window's exchanges with the owners, shared by its warm, pull and push: the routing of
    its keys and, once they were sent (by warm, else by the first pull), what this rank was
    asked as their owner. ShardedTable fills ``asked``; with it, pull and push send no keys.
    ``pulled``: the rows this rank answered the pull with as an owner (``asked.uniq``'s), kept
    for the push where merge.sparse_rule reads them (matched), so they are not read again.
    ``shared``: the rows its steps synchronise (merge.shared_rows, hvctr.storage.shared_rows),
    chosen by the pull. ``tag``: (epoch, first batch) of a training window, under which owners log
    where its rows were for the same window of the next pass (hvctr.storage.position_log).
    ``ahead``: what its warm answered ahead of the pull (storage.pull_ahead), and what is left.
    ``split``: which of its rows the next window holds (push_behind), set by that window's warm.
    ``placed``: where this rank's store found the rows it answered the pull with as an owner
    (``asked.uniq``'s; -1 where not yet read): the push writes them there without looking them up."""
    routing: Routing
    asked: Asked | None = None
    pulled: np.ndarray | None = None
    placed: RowPositions | None = None
    shared: SharedRows | None = None
    tag: tuple[int, int] | None = None
    ahead: "PulledAhead | None" = None
    split: "PushSplit | None" = None


@dataclass
class PulledAhead:
    """What a warm answered ahead of its window's pull (ShardedTable.pull_ahead), and what that
    pull still answers. As the owner: ``owned``, the rows of ``asked.uniq`` (those answered
    filled in; None where nothing reads them again: merge.sparse_rule average, no shared rows),
    ``late`` (indices into ``asked.uniq``, ascending: the keys the window before holds, read
    at the pull), ``late_entries`` (the request's entries of those keys, in message order) and
    ``late_splits`` (how many of them each rank asked). As a holder: ``rows``, the working set
    with the rows received filled in, ``late_at`` (where the rest go, in the order they come)
    and ``late_counts`` (how many each owner sends)."""
    owned: np.ndarray | None
    late: np.ndarray
    late_entries: np.ndarray
    late_splits: list[int]
    rows: np.ndarray
    late_at: np.ndarray
    late_counts: list[int]


@dataclass(frozen=True)
class PushSplit:
    """Which rows of a window its push sends at once (storage.push_behind): the rows the next
    window (``following``) holds on some rank, which its pull reads after the push. As a holder:
    ``now_sent``, a flag per key this rank sent, in the order sent; as the owner: ``now_key``, a
    flag per distinct key asked (``asked.uniq``)."""
    now_sent: np.ndarray
    now_key: np.ndarray
    following: WindowExchange


@dataclass(frozen=True)
class _PendingPush:
    """The rows a push left behind: this rank's rows of the keys the next window does not hold
    (``msg``, in the order sent, ``splits`` a rank) and, as the owner, the keys they are
    (``keep``, a flag per ``window.asked.uniq``)."""
    window: WindowExchange
    msg: np.ndarray
    splits: list[int]
    keep: np.ndarray
    name: str
    steps: int


Exchange = WindowExchange | Keys  # what warm, pull and push take


def merge_asked(values: np.ndarray, asked: Asked, divide: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """merge_messages for rows that come without their keys, in the order the owner received the
    keys it keeps in ``asked`` (``asked.received[s]`` rows from rank s): (asked.uniq, sums in
    ascending source rank, counts), the first copy assigned and later ones added, divided by
    the counts (where above 1) with ``divide``. The same floats as merge_messages, keys in its
    order: of first occurrence (C), sorted (its numpy fallback)."""
    k, (n, c) = asked.uniq.shape[0], values.shape
    lib = _native.lib()
    if lib is not None and n and values.dtype == np.float32 and values.flags.c_contiguous:
        # the first copies assigned, the others added in message order (ascending source rank)
        # in one pass in C; the first copies are added too, to a spare row k, never read
        acc = np.empty((k + 1, c), dtype=np.float32)
        first = np.ascontiguousarray(asked.first, dtype=np.int64)
        lib.hv_take_rows(values.ctypes.data, c, first.ctypes.data, k, acc.ctypes.data)
        acc[k] = 0
        inverse = np.array(asked.inverse, dtype=np.int64)
        inverse[first] = k
        lib.hv_sum_rows(inverse.ctypes.data, n, values.ctypes.data, c, acc.ctypes.data)
        acc = acc[:k]
        count = np.bincount(asked.inverse, minlength=k).astype(np.int64, copy=False)
    else:
        acc = np.empty((k, c), dtype=np.float32)
        count = np.zeros(k, dtype=np.int64)
        bounds = np.concatenate(([0], np.cumsum(asked.received))).tolist()
        for s in range(len(asked.received)):  # one vectorised step per source rank: this loop fixes the order
            if bounds[s] == bounds[s + 1]:
                continue
            i, x = asked.inverse[bounds[s]:bounds[s + 1]], values[bounds[s]:bounds[s + 1]]
            first = count[i] == 0
            acc[i[first]] = x[first]
            acc[i[~first]] += x[~first]
            count[i] += 1
    if divide:  # x / 1 is x: only shared keys divide, as in C
        np.divide(acc, count.astype(np.float32)[:, None], out=acc, where=(count > 1)[:, None])
    uniq = asked.uniq
    if not _merges_natively(values.shape[0], True):
        order = np.argsort(uniq, kind="stable")
        uniq, acc, count = uniq[order], acc[order], count[order]
    return uniq, acc, count


def sub_asked(asked: Asked, keep: np.ndarray) -> tuple[Asked, np.ndarray]:
    """The part of a request whose distinct keys ``keep`` flags (a bool per ``asked.uniq``), as
    the owner receives it when each holder sends only those keys' entries (in the same order):
    (that Asked, the kept keys' indices into ``asked.uniq``, ascending). Its keys keep their
    order of first arrival, and each key its copies in message order: merge_asked of a part
    gives each of its rows the floats merge_asked of the whole gives it."""
    idx = np.flatnonzero(keep)
    entry = keep[asked.inverse]
    source = np.repeat(np.arange(len(asked.received)), asked.received)
    received = np.bincount(source[entry], minlength=len(asked.received)).tolist()
    remap = np.full(asked.uniq.shape[0], -1, dtype=np.int64)
    remap[idx] = np.arange(idx.size, dtype=np.int64)
    position = np.cumsum(entry) - 1  # each kept entry's place in the part
    return Asked(received, asked.uniq[idx], remap[asked.inverse[entry]], position[asked.first[idx]]), idx


def _by_rank(a: np.ndarray, counts_a: list[int], b: np.ndarray, counts_b: list[int]) -> np.ndarray:
    """One message from two, rank by rank: rank s's part of ``a``, then its part of ``b``."""
    parts_a = np.split(a, np.cumsum(counts_a)[:-1])
    parts_b = np.split(b, np.cumsum(counts_b)[:-1])
    return np.concatenate([p for pair in zip(parts_a, parts_b) for p in pair])


def _from_ranks(msg: np.ndarray, counts_a: list[int], counts_b: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """_by_rank undone: (the ``a`` entries, the ``b`` entries) of a message laid out by it."""
    is_a = np.repeat(np.tile([True, False], len(counts_a)), np.column_stack([counts_a, counts_b]).ravel())
    return msg[is_a], msg[~is_a]


def take_rows(values: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """``values[idx]`` (float32 rows; ``idx`` in range, e.g. an owner's answer laid out by its
    request's inverse): one memcpy a row in C, about 4x numpy's fancy indexing."""
    lib = _native.lib()
    if lib is None or values.dtype != np.float32 or values.ndim != 2 or not values.flags.c_contiguous:
        return values[idx]
    idx = np.ascontiguousarray(idx, dtype=np.int64)
    out = np.empty((idx.shape[0], values.shape[1]), dtype=np.float32)
    lib.hv_take_rows(values.ctypes.data, values.shape[1], idx.ctypes.data, idx.shape[0], out.ctypes.data)
    return out


def put_rows(values: np.ndarray, idx: np.ndarray, rows: np.ndarray) -> None:
    """``values[idx] = rows`` (float32 rows, ``idx`` in range; e.g. where the rows of a reply go in
    a working set): one memcpy a row in C, as take_rows reads them; about 2x numpy's fancy
    assignment for 300k rows of 52 floats (python -m bench.host_kernels)."""
    lib = _native.lib()
    if (lib is None or values.dtype != np.float32 or values.ndim != 2 or not values.flags.c_contiguous
            or rows.dtype != np.float32 or not rows.flags.c_contiguous or rows.shape != (idx.shape[0], values.shape[1])):
        values[idx] = rows
        return
    idx = np.ascontiguousarray(idx, dtype=np.int64)
    lib.hv_put_rows(values.ctypes.data, values.shape[1], idx.ctypes.data, idx.shape[0], rows.ctypes.data)


def held_by(keys: np.ndarray, held: np.ndarray) -> np.ndarray:
    """Whether each of ``keys`` is among ``held`` (both unique uint64): one pass of
    unique_in_order over both, ``held`` first (its keys keep their places)."""
    if held.size == 0:
        return np.zeros(keys.shape[0], dtype=bool)
    _, _, inverse = unique_in_order(np.concatenate((held, keys)), distinct=held.size + keys.shape[0])
    return inverse[held.size:] < held.size


def _merges_natively(n: int, contiguous: bool) -> bool:
    """Whether merge_messages merges ``n`` message rows in C (else numpy, keys sorted)."""
    return _native.lib() is not None and 0 < n < (1 << 30) and contiguous


class ShardedTable:
    """The distributed table seen from one rank: ``pull``, ``push``, ``warm``,
    ``push_gradients``, ``read_only``; timing and byte counters in ``stats()`` / ``last``."""

    def __init__(self, comm: "Comm", store: EmbeddingStore, bucket_owner: np.ndarray,
                 device: torch.device | str = "cpu", sparse_rule: SparseRule = SparseRule.AVERAGE,
                 defer_writes: bool = False, shared_rows: int = 0, pull_ahead: bool = False,
                 push_behind: bool = False) -> None:
        """``defer_writes`` (storage.defer_writes): a push given the next window's exchange writes
        the rows that window does not hold after its pull (the module docstring). Off where the
        store admits keys by count (storage.admit_after > 1): the pull's counts would come
        between a deferred row's push and its write. ``shared_rows`` (merge.shared_rows): a pull of
        a WindowExchange chooses at most that many rows its steps synchronise (``shared``).
        ``pull_ahead`` (storage.pull_ahead): a warm of a WindowExchange also answers the rows the
        window before it does not hold (the module docstring). Off where the store admits keys
        by count (a read's counts would come before the push's admission checks) or drops rows
        at a pass's end (storage.ttl_passes: a row read ahead may be dropped before its pull).
        ``push_behind`` (storage.push_behind, with pull_ahead): a push given the next window's
        exchange sends the rows that window does not hold later, in ``settle_push``."""
        self.comm, self.store = comm, store
        self.shared_rows = int(shared_rows)
        self.defer_writes = defer_writes and store.admission is None
        self.pull_ahead = pull_ahead and store.admission is None and store.cfg.ttl_passes == 0
        self._held: np.ndarray | None = None  # the keys the last warmed window asked this owner for
        self.push_behind = push_behind and self.pull_ahead
        self._prev: WindowExchange | None = None  # that window, as holder and owner (push_behind)
        self._pending: _PendingPush | None = None  # the rows the last push left behind
        self._push_lock = threading.Lock()  # one thread runs them (the prefetch thread, or a reader)
        self._ahead: WindowExchange | None = None  # the exchange whose pull may run beside deferred rows
        if sparse_rule is SparseRule.AUTO:
            raise ValueError("merge.sparse_rule = auto is resolved for the world size first "
                             "(hvctr.config.resolve.resolve_merge)")
        self.sparse_rule = sparse_rule  # what an owner keeps of a row several ranks moved (hvctr.storage.row_merge)
        self.bucket_owner = np.asarray(bucket_owner, dtype=np.int32)
        self.device = torch.device(device)
        self.width = store.layout.width
        self._totals: dict[str, float] = {}
        self._lock = threading.Lock()
        self._local = threading.local()  # the prefetch thread's warm must not overwrite pull's split

    @property
    def last(self) -> dict[str, float]:
        """Timing split (total, exchange, cache, shard, other seconds) and bytes of the calling
        thread's last call."""
        return getattr(self._local, "last", {})

    # --- routing and timing ------------------------------------------------------------

    def route(self, unique_keys: np.ndarray, trusted: bool = False) -> Routing:
        """The Routing of ``unique_keys`` (uint64, or torch's int64 view) under this table's
        bucket table. Their uniqueness is checked unless ``trusted`` (a window's keys are
        unique by construction), or always under store.DEBUG_CHECKS."""
        keys = as_keys(unique_keys) if trusted and not _store.DEBUG_CHECKS else require_unique(unique_keys)
        return _routing.route(keys, self.bucket_owner, self.comm.size)

    def exchange(self, unique_keys: np.ndarray, trusted: bool = False) -> WindowExchange:
        """A WindowExchange of ``unique_keys`` (route's arguments), nothing sent yet."""
        return WindowExchange(self.route(unique_keys, trusted))

    def _routed(self, keys: Exchange) -> Routing:
        if isinstance(keys, WindowExchange):
            keys = keys.routing
        if not isinstance(keys, Routing):
            return self.route(keys)
        if keys.world_size != self.comm.size:
            raise ValueError(f"a routing for {keys.world_size} ranks, this table has {self.comm.size}")
        return keys

    def _kept(self, keys: Exchange, name: str) -> Asked | None:
        """The request a WindowExchange kept (None: its keys are still to send, or plain keys)."""
        asked = keys.asked if isinstance(keys, WindowExchange) else None
        if asked is not None and len(asked.received) != self.comm.size:
            raise ValueError(f"{name}: a request of {len(asked.received)} ranks, this table has {self.comm.size}")
        return asked

    def _alltoall(self, rec: dict, msg: torch.Tensor, splits: list[int], name: str) -> tuple[torch.Tensor, list[int]]:
        t0 = time.perf_counter()
        out, received = self.comm.alltoall(msg, splits, name)  # comm: alltoall of keys/rows to/from owners
        rec["exchange_s"] += time.perf_counter() - t0
        per_row = msg.element_size() * int(np.prod(msg.shape[1:]))
        received = received.tolist()
        me = self.comm.rank
        rec["bytes_sent"] += (sum(splits) - splits[me]) * per_row
        rec["bytes_received"] += (sum(received) - received[me]) * per_row
        return out, received

    def _send_keys(self, rec: dict, keys: np.ndarray, splits: list[int], name: str) -> tuple[np.ndarray, list[int]]:
        out, received = self._alltoall(rec, torch.from_numpy(keys.view(np.int64)), splits, name)
        return out.numpy().view(np.uint64), received

    @contextmanager
    def _call(self, op: str) -> Iterator[dict]:
        rec = dict.fromkeys(("exchange_s", "bytes_sent", "bytes_received"), 0.0)
        store0, shard0 = self.store.thread_times()
        t0 = time.perf_counter()
        yield rec
        store1, shard1 = self.store.thread_times()
        rec["total_s"] = time.perf_counter() - t0
        rec["shard_s"] = shard1 - shard0
        rec["cache_s"] = (store1 - store0) - rec["shard_s"]
        rec["other_s"] = rec["total_s"] - rec["exchange_s"] - (store1 - store0)
        self._local.last = {"op": op, **rec}
        with self._lock:
            self._totals[f"{op}_calls"] = self._totals.get(f"{op}_calls", 0) + 1
            for k, v in rec.items():
                self._totals[f"{op}_{k}"] = self._totals.get(f"{op}_{k}", 0.0) + v

    def stats(self) -> dict[str, float]:
        """Per operation: calls, seconds (total, exchange, cache, shard, other), bytes to and
        from other ranks; e.g. ``pull_exchange_s``, ``push_bytes_sent``."""
        with self._lock:
            return dict(self._totals)

    # --- operations --------------------------------------------------------------------

    def pull(self, keys: Exchange, name: str) -> torch.Tensor:
        """Rows of the keys as float32 [U, width] on ``device``; owners create new rows. A
        WindowExchange whose keys went to their owners (warm) sends none again; one whose keys
        did not keeps the request this pull sends, for the window's push."""
        asked = self._kept(keys, name)
        window = keys if isinstance(keys, WindowExchange) else None
        # the window the last push wrote ahead of: the rows it left to write are none of its own
        ahead, self._ahead = self._ahead is not None and keys is self._ahead, None
        read = functools.partial(self._read_owned, window, deferred_ok=ahead,
                                 tag=window.tag if window is not None else None)
        r = self._routed(keys)
        if window is not None and window.ahead is not None:
            rows = self._answer_late(window, name, read)
        else:
            rows, asked = self._answer(r, name, "pull", read, asked, keep=window)
            if self.pull_ahead:  # a window no warm answered ahead (the first, where no warm ran)
                self._held, self._prev = asked.uniq, window
        if window is not None:
            window.asked = asked
            if self.shared_rows:
                window.shared = self._share(r, asked, window, name)
        if ahead:
            self.store.start_deferred()  # while this window trains
        return rows

    def _read_owned(self, x: WindowExchange | None, keys: np.ndarray, at: np.ndarray | None = None,
                    **read: Any) -> np.ndarray:
        """The owner's training read of ``keys`` (x's ``asked.uniq``, or ``asked.uniq[at]``, a
        part read ahead or late): their rows; where the store found them goes to ``x.placed``
        for the push's write (as pulled, the rows' places do not change before it)."""
        rows, placed = self.store.read_placed(keys, **read)
        if x is None:
            return rows
        if at is None:
            x.placed = placed
        else:
            if x.placed is None or x.placed.epoch != placed.epoch:  # a part read before a compaction: dropped
                x.placed = RowPositions(np.full(x.asked.uniq.shape[0], -1, dtype=np.int64), placed.epoch)
            x.placed.pos[at] = placed.pos
        return rows

    def _share(self, r: Routing, asked: Asked, window: "WindowExchange", name: str) -> SharedRows:
        """The pulled window's shared rows (hvctr.storage.shared_rows): each owner chooses among
        the keys it was asked for and numbers them after the owners before it; each rank learns
        the numbers of its own working set's rows."""
        with self._call("share") as rec:
            asked_by = np.bincount(asked.inverse, minlength=asked.uniq.shape[0])
            owned = choose_owned(asked_by, self.shared_rows, self.comm.size)
            t0 = time.perf_counter()
            # comm: allgather of each owner's count of shared rows (one int64 a rank)
            counts = self.comm.allgather(torch.tensor([owned.size], dtype=torch.int64), f"{name}.shared.n").numpy()
            rec["exchange_s"] += time.perf_counter() - t0
            first = int(counts[:self.comm.rank].sum())
            number = np.full(asked.uniq.shape[0], -1, dtype=np.int64)
            number[owned] = first + np.arange(owned.size, dtype=np.int64)
            back, _ = self._alltoall(rec, torch.from_numpy(number[asked.inverse]), asked.received, f"{name}.shared")
            mine = back.numpy()
            if not r.in_order:  # to working-set order, as the pull's rows
                ordered = np.empty(len(r), dtype=np.int64)
                ordered[r.order] = mine
                mine = ordered
            positions = np.flatnonzero(mine >= 0)
            first_of = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
            owner_rows = np.ascontiguousarray(window.pulled[owned])  # stepped by their owner, kept at the push
            if self.sparse_rule is SparseRule.AVERAGE:
                window.pulled = None  # kept for the shares alone
            return SharedRows(int(counts.sum()), positions, mine[positions], owned, first_of, owner_rows)

    def _answer_ahead(self, x: WindowExchange, name: str) -> None:
        """The warm's answer ahead (pull_ahead): each owner sends the rows of x's keys that the
        window warmed before x does not hold (their values cannot change before x's pull) and
        tells each rank which of its keys wait for the pull; x keeps the rest for it."""
        asked, r = x.asked, x.routing
        prev = self._prev if self.push_behind else None  # the window warmed before x, training now
        with self._call("ahead") as rec:
            held = self._held
            late_key = (held_by(asked.uniq, held) if held is not None and held.size
                        else np.zeros(asked.uniq.shape[0], dtype=bool))
            late_entry = late_key[asked.inverse]  # per key asked, in message order
            early = np.flatnonzero(~late_key)
            if early.size == asked.uniq.shape[0]:
                owned = self._read_owned(x, asked.uniq, tag=x.tag)
            else:
                owned = np.empty((asked.uniq.shape[0], self.width), dtype=np.float32)
                if early.size:
                    owned[early] = self._read_owned(x, asked.uniq[early], early, tag=x.tag)
            source = np.repeat(np.arange(self.comm.size), asked.received)
            late_entries = np.flatnonzero(late_entry)
            late_splits = np.bincount(source[late_entries], minlength=self.comm.size).tolist()
            early_splits = [n - m for n, m in zip(asked.received, late_splits)]
            if prev is None:
                # comm: alltoall of a byte a key asked: whether its row waits for the pull
                flags, _ = self._alltoall(rec, torch.from_numpy(late_entry.view(np.uint8)), asked.received,
                                          f"{name}.late")
                flags = flags.numpy()
            else:  # and a byte a key prev asked: whether x holds it (its row goes with prev's push)
                now_key = held_by(prev.asked.uniq, asked.uniq)
                msg = _by_rank(late_entry, asked.received, now_key[prev.asked.inverse], prev.asked.received)
                # comm: alltoall of a byte a key asked for x and for the window before: x's rows that
                # wait for the pull, the window before's rows x holds (push_behind)
                both, _ = self._alltoall(rec, torch.from_numpy(msg.view(np.uint8)),
                                         [a + b for a, b in zip(asked.received, prev.asked.received)], f"{name}.late")
                flags, now_sent = _from_ranks(both.numpy(), r.splits, prev.routing.splits)
                prev.split = PushSplit(now_sent.view(bool), now_key, x)
                rec["behind_rows"] = float(now_key.size - np.count_nonzero(now_key))
            # comm: alltoall of the rows answered ahead, owners to holders
            back, _ = self._alltoall(rec, torch.from_numpy(take_rows(owned, asked.inverse[~late_entry])),
                                     early_splits, f"{name}.rows")
            late_sent = flags.view(bool)  # in the order this rank sent its keys
            at = np.arange(len(r)) if r.in_order else r.order  # working-set position of each key sent
            rows = np.empty((len(r), self.width), dtype=np.float32)
            put_rows(rows, at[~late_sent], back.numpy())
            owner = np.repeat(np.arange(self.comm.size), r.splits)
            late_counts = np.bincount(owner[late_sent], minlength=self.comm.size).tolist()
            rec["rows"] = float(early.size)
            rec["late_rows"] = float(asked.uniq.shape[0] - early.size)
            if self.sparse_rule is SparseRule.AVERAGE and not self.shared_rows:
                owned = None  # nothing reads the rows as pulled again: the pull reads the late ones alone
        self._held, self._prev = asked.uniq, x
        x.ahead = PulledAhead(owned, np.flatnonzero(late_key), late_entries, late_splits, rows, at[late_sent],
                              late_counts)

    def _answer_late(self, x: WindowExchange, name: str, read: Callable[[np.ndarray], np.ndarray]) -> torch.Tensor:
        """The pull of a window whose warm answered ahead: the rows both windows hold, read
        after the push, into the working set the warm began."""
        a, asked = x.ahead, x.asked
        x.ahead = None
        with self._call("pull") as rec:
            late = read(asked.uniq[a.late], a.late) if a.late.size else np.empty((0, self.width), dtype=np.float32)
            if a.owned is not None:  # the rows as pulled are kept whole
                put_rows(a.owned, a.late, late)
                msg = take_rows(a.owned, asked.inverse[a.late_entries])
            else:  # a.late ascends: each late entry's row among them
                msg = take_rows(late, np.searchsorted(a.late, asked.inverse[a.late_entries]))
            # comm: alltoall of the rows held over, owners to holders
            back, received = self._alltoall(rec, torch.from_numpy(msg), a.late_splits, f"{name}.rows")
            if received != a.late_counts:
                raise ValueError(f"{name}: {received} rows from the owners, {a.late_counts} expected")
            put_rows(a.rows, a.late_at, back.numpy())
            if self.sparse_rule is not SparseRule.AVERAGE or self.shared_rows:
                x.pulled = a.owned  # the rows as pulled, for this window's push (and shares)
            return self._to_device(torch.from_numpy(a.rows))

    def read_only(self, keys: Keys, name: str) -> torch.Tensor:
        """Like pull, for evaluation: owners insert and count nothing (unseen keys: init rows)."""
        return self._answer(self._routed(keys), name, "read_only", self.store.read_only)[0]

    def _answer(self, r: Routing, name: str, op: str, read: Callable[[np.ndarray], np.ndarray],
                asked: Asked | None = None, keep: "WindowExchange | None" = None) -> tuple[torch.Tensor, Asked]:
        with self._call(op) as rec:
            if asked is None:
                asked = self._ask(rec, r, name)
            owned = read(asked.uniq)
            if keep is not None and (self.sparse_rule is not SparseRule.AVERAGE or self.shared_rows):
                keep.pulled = owned  # the rows as pulled, for this window's push (and shares): not read again
            rows = take_rows(owned, asked.inverse)
            received = asked.received
            back, _ = self._alltoall(rec, torch.from_numpy(rows), received, f"{name}.rows")
            if r.in_order:  # a window's working set is laid out as the rows arrive
                return self._to_device(back), asked
            # numpy, not torch: index_put sorts its indices under torch.use_deterministic_algorithms
            # (and torch.empty may be NaN-filled there); a permutation's scatter is deterministic as it is
            out = np.empty((len(r), self.width), dtype=np.float32)
            put_rows(out, r.order, back.numpy())
            return self._to_device(torch.from_numpy(out)), asked

    def push(self, keys: Exchange, rows: torch.Tensor | np.ndarray, name: str, steps: int = 1,
             ahead: WindowExchange | None = None) -> None:
        """Sends rows back to their owners, which average each key over the ranks that sent it
        (then apply merge.sparse_rule, hvctr.storage.row_merge, to the model columns; ``steps``:
        the local steps the rows took, which the matched rule reads). A WindowExchange whose
        keys the owners were sent (warm or pull) sends rows only: each owner merges them by the
        request it kept. ``ahead``: the next window's exchange; where its keys were sent
        (warm), the rows it does not hold are sent later with push_behind (``settle_push``),
        else written after its pull with defer_writes."""
        self.settle_push()
        self._ahead = None
        r = self._routed(keys)
        asked = self._kept(keys, name)
        split = keys.split if isinstance(keys, WindowExchange) else None
        if split is not None:
            keys.split = None
            if ahead is None or split.following is not ahead or asked is None:
                split = None  # no next window taken (the run's end, a stop): every row now
        with self._call("push") as rec:
            values = _host(rows, (len(r), self.width))
            if asked is None:
                got, received = self._alltoall(rec, _pack(r.keys, values, r.order), r.splits, f"{name}.rows")
                uniq, mean, count = merge_messages(got, received, divide=True)
                placed = None
                if self.sparse_rule is not SparseRule.AVERAGE:
                    old, placed = self.store.read_placed(uniq, count=False)
                    spread = None
                    if self.sparse_rule is SparseRule.MATCHED:
                        sent_keys, copies = _unpack(got)
                        order = np.argsort(uniq)
                        inverse = order[np.searchsorted(uniq, sent_keys, sorter=order)]
                        spread = contributor_spread(copies, inverse, old, count, self.store.layout)
                    mean = merged_rows(self.sparse_rule, self.store.layout, old, mean, count, spread, steps)
                self._store_merged(uniq, mean, ahead, placed)
                return
            # the rows in the order their keys were sent: the owner's request says whose they are
            msg = values if r.in_order else values[r.order]
            if split is None:
                self._merge_sent(rec, keys, msg, r.splits, None, name, steps, ahead)
                keys.pulled = keys.placed = None
                return
            owner = np.repeat(np.arange(self.comm.size), r.splits)
            now, later = split.now_sent, ~split.now_sent
            self._merge_sent(rec, keys, msg[now], np.bincount(owner[now], minlength=self.comm.size).tolist(),
                             split.now_key, name, steps, ahead)
            pending = _PendingPush(keys, np.ascontiguousarray(msg[later]),
                                   np.bincount(owner[later], minlength=self.comm.size).tolist(),
                                   ~split.now_key, f"{name}.behind", steps)
            with self._push_lock:  # the prefetch thread takes it once asked for the window after next
                self._pending = pending

    def settle_push(self) -> None:
        """Sends and merges the rows the last push left behind (push_behind), once: the prefetch
        thread runs it before its next warm, every other reader of the rows before it reads
        (validation, a checkpoint, a pass's end, the next push). Collective: every rank runs it
        at the same point of its windows, on one thread or the other."""
        with self._push_lock:
            p, self._pending = self._pending, None
            if p is None:
                return
            # comm: its collectives in the "behind" stream, whichever thread sends them (TorchComm's group)
            with self._call("push_behind") as rec, self.comm.stream("behind"):
                self._merge_sent(rec, p.window, p.msg, p.splits, p.keep, p.name, p.steps, None)
                rec["rows"] = float(p.msg.shape[0])
            p.window.pulled = p.window.placed = None

    def _merge_sent(self, rec: dict, x: WindowExchange, msg: np.ndarray, splits: list[int], keep: np.ndarray | None,
                    name: str, steps: int, ahead: WindowExchange | None) -> None:
        """The push of rows sent without keys (``msg``, in the order their keys were sent,
        ``splits`` a rank): every key of x's request, or those ``keep`` flags (a part of a
        push_behind push); each owner merges them by its part of the request and stores them."""
        asked, idx = (x.asked, None) if keep is None else sub_asked(x.asked, keep)
        got, received = self._alltoall(rec, torch.from_numpy(np.ascontiguousarray(msg)), splits, f"{name}.rows")
        if received != asked.received:
            raise ValueError(f"{name}: rows of {received} keys per rank, the owners were sent "
                             f"{asked.received} (a push of other keys than the window's)")
        copies = got.numpy()
        uniq, mean, count = merge_asked(copies, asked, divide=True)
        # merge_asked's numpy fallback sorts the keys: the rows as pulled and the copies' keys follow
        perm = None if uniq is asked.uniq else np.argsort(asked.uniq, kind="stable")
        placed = x.placed  # where the pull found them, in the order of uniq
        if placed is not None:
            placed = placed if idx is None else placed.take(idx)
            placed = placed if perm is None else placed.take(perm)
        owners_rows = None  # merge.shared_rows: the owner stepped them: its copies, not the holders'
        shared = x.shared
        if shared is not None and shared.owned.size:
            owned, shared_values = shared.owned, shared.rows
            if idx is not None:  # those of this part, as indices into it
                part = keep[owned]
                owned, shared_values = np.searchsorted(idx, owned[part]), shared_values[part]
            if owned.size:
                owners_rows = (owned if perm is None else np.searchsorted(uniq, asked.uniq[owned]), shared_values)
        if self.sparse_rule is not SparseRule.AVERAGE:
            # the rows as pulled (nothing wrote them since): kept by the pull, else read again
            if x.pulled is not None:
                old = x.pulled if idx is None else x.pulled[idx]
                old = old if perm is None else old[perm]
            else:
                old, placed = self.store.read_placed(uniq, count=False)
            spread = None
            if self.sparse_rule is SparseRule.MATCHED:
                inverse = asked.inverse
                if perm is not None:
                    rank_of = np.empty_like(perm)
                    rank_of[perm] = np.arange(perm.size)
                    inverse = rank_of[inverse]
                spread = contributor_spread(copies, inverse, old, count, self.store.layout)
            mean = merged_rows(self.sparse_rule, self.store.layout, old, mean, count, spread, steps)
        del got, copies  # merged: freed before the write
        if owners_rows is not None:
            mean[owners_rows[0]] = owners_rows[1]
        self._store_merged(uniq, mean, ahead, placed)

    def _store_merged(self, uniq: np.ndarray, mean: np.ndarray, ahead: WindowExchange | None,
                      placed: RowPositions | None = None) -> None:
        """The owner's merged rows into its store (``placed``: where it found them, if known):
        those the next window holds now, the rest deferred to its pull (where ``ahead``'s keys
        were sent and defer_writes is on)."""
        asked = ahead.asked if ahead is not None else None
        if not self.defer_writes or asked is None or len(asked.received) != self.comm.size or uniq.size == 0:
            self.store.write(uniq, mean, placed)
            return
        later = ~held_by(uniq, asked.uniq)
        now = np.flatnonzero(~later)
        later = np.flatnonzero(later)
        if now.size:
            self.store.write(uniq[now], mean[now], None if placed is None else placed.take(now))
        if later.size:
            self.store.defer_write(uniq[later], mean[later] if later.size < uniq.size else mean,
                                   None if placed is None else placed.take(later))
            self._ahead = ahead

    def push_gradients(self, keys: Keys, grads: torch.Tensor | np.ndarray, apply_fn: ApplyFn, name: str) -> None:
        """Sync mode: owners sum each key's gradients over ranks (ascending source rank),
        divide by the world size, and store ``apply_fn(rows, grads)``.

        apply_fn gets CPU float32 tensors, rows [u, width] and grads [u, G] (G = grads' width),
        and returns the new rows [u, width].
        """
        r = self._routed(keys)
        with self._call("push_gradients") as rec:
            g = _host(grads, (len(r), -1))
            got, received = self._alltoall(rec, _pack(r.keys, g, r.order), r.splits, f"{name}.grads")
            uniq, acc, _ = merge_messages(got, received, divide=False)
            acc /= np.float32(self.comm.size)
            rows, placed = self.store.read_placed(uniq, count=False)
            new = apply_fn(torch.from_numpy(rows), torch.from_numpy(acc))
            self.store.write(uniq, _host(new, rows.shape), placed)

    def _ask(self, rec: dict, r: Routing, name: str) -> Asked:
        """Sends the keys to their owners; returns what this rank was asked as an owner."""
        keys, received = self._send_keys(rec, r.keys_by_owner, r.splits, f"{name}.keys")
        # ranks ask for the same keys: read each once (at least 1 / W of them distinct)
        uniq, first, inv = unique_in_order(keys, distinct=keys.shape[0])
        return Asked(received, uniq, inv, first)

    def warm(self, keys: Exchange, name: str) -> WindowExchange:
        """Owners bring these keys' shard rows into their caches; nothing comes back. Returns the
        WindowExchange (the one given, or a new one for plain keys) holding what this rank was
        asked as an owner: its pull and push then send no keys."""
        r = self._routed(keys)
        x = keys if isinstance(keys, WindowExchange) else WindowExchange(r)
        with self._call("warm") as rec:
            asked = self._ask(rec, r, name)
            self.store.warm(asked.uniq, tag=x.tag)
        x.asked = asked
        if self.pull_ahead and isinstance(keys, WindowExchange):
            self._answer_ahead(x, f"{name}.ahead")
        return x

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cpu":
            return t
        # Pinned staging buffer: the copy to the GPU runs as DMA, asynchronously.
        return t.pin_memory().to(self.device, non_blocking=True)


def _host(t: torch.Tensor | np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    """A float32 numpy array on the host, checked against ``shape`` (-1: any width)."""
    a = t.detach().to("cpu", torch.float32).numpy() if isinstance(t, torch.Tensor) else np.asarray(t, np.float32)
    if a.ndim != 2 or a.shape[0] != shape[0] or (shape[1] != -1 and a.shape[1] != shape[1]):
        raise ValueError(f"expected an array of shape {shape}, got {tuple(a.shape)}")
    return a
