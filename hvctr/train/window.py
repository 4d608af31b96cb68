"""A training window: the k batches trained between two merges, and their working set.

The window's unique keys are the working set: pulled from their owners before the window's
first step, pushed back at its end. Every batch key is remapped to its position in that set,
so the k steps gather rows with one index operation and never look at a key again.

One pass over the candidate batches' keys (hvctr.kernels.unique.unique_in_order: a hash table in C,
numpy's sort where no compiler is found) gives the distinct keys in order of first occurrence. That
order answers both questions the prefetch thread asks: how many leading batches fit the
working-set bound (the distinct keys of a prefix are a prefix of that list), and, once ranks
agree on the length, the window itself, without sorting every key again.

The window also carries what its steps and exchanges would otherwise recompute: its exchange
with the owners (hvctr.storage.exchange.WindowExchange: the routing of its keys, hvctr.storage.routing,
which warm, pull and push all send along, and what the owners were asked once the keys went
to them, so that neither the pull nor the push sends them again) and each batch's unique
positions (hvctr.optim.batch_unique; sum_rows_grad takes them). Both are computed where the
window is built, in the prefetch thread when prefetch is on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from hvctr.data.bags import Bags
from hvctr.kernels import unique_in_order
from hvctr.optim import batch_unique
from hvctr.storage.exchange import WindowExchange
from hvctr.storage.routing import Routing

Route = Callable[[np.ndarray], Routing]


@dataclass
class Window:
    index: int  # window number since the start of the run (names its collectives)
    epoch: int
    first_batch: int  # index within the epoch of the window's first batch
    labels: np.ndarray  # float32 [n, B]
    dense: np.ndarray  # float32 [n, B, num_dense]
    # int64 [n, B, F]: index of each key in unique_keys; multi-valued data: a Bags of the
    # n x B rows' positions (``bags`` below holds each batch's, ready for the pooled gather)
    positions: np.ndarray | Bags
    unique_keys: np.ndarray  # uint64 [U]: sorted; routed, grouped by owner (sorted within each)
    batch_unique: list[tuple[torch.Tensor, torch.Tensor]]  # per batch: batch_unique of its positions
    # unique_keys routed to their owners, and what the owners were asked once warm or pull sent
    # them (None: not routed, and no warm ran)
    exchange: WindowExchange | None = None
    # multi-valued data, per batch: (its positions int64 [nnz], its bag offsets int64 [B F + 1]),
    # what hvctr.optim.pooling takes (None: one-valued, positions[i] is batch i's [B, F])
    bags: list[tuple[np.ndarray, np.ndarray]] | None = None

    @property
    def num_batches(self) -> int:
        return int(self.labels.shape[0])

    @property
    def multi_valued(self) -> bool:
        return self.bags is not None

    @property
    def routing(self) -> Routing | None:
        """unique_keys routed to their owners (None: not routed)."""
        return self.exchange.routing if self.exchange is not None else None

    @property
    def exchange_keys(self) -> WindowExchange | np.ndarray:
        """What warm, pull and push take: the window's exchange, or the keys where none was built."""
        return self.exchange if self.exchange is not None else self.unique_keys


@dataclass
class KeyIndex:
    """Distinct keys of a run of batches in order of first occurrence."""

    uniq: np.ndarray  # uint64 [K]
    first: np.ndarray  # int64 [K], increasing: flat index of each key's first occurrence
    inverse: np.ndarray  # int64 [all keys]: index of each key in uniq
    batch_ends: np.ndarray  # int64 [n]: flat index one past each batch's last key

    def distinct_in_prefix(self, batches: int) -> int:
        return int(np.searchsorted(self.first, self.batch_ends[batches - 1])) if batches > 0 else 0


def index_keys(keys: np.ndarray | Bags, batches: int | None = None) -> KeyIndex:
    """keys: uint64 [n, B, F], or the Bags of n batches of equal rows (``batches`` = n) -> their
    KeyIndex. Multi-valued batches hold different numbers of keys: their ends come from the
    bags' row offsets; the distinct keys are those of every value of every bag."""
    if isinstance(keys, Bags):
        n = batches if batches is not None else 1
        if keys.rows % n:
            raise ValueError(f"index_keys: {keys.rows} rows are not {n} batches of equal rows")
        ends = keys.row_offsets()[keys.rows // n::keys.rows // n] if keys.rows else np.zeros(n, np.int64)
        uniq, first, inverse = unique_in_order(keys.values)
        return KeyIndex(uniq, first, inverse, ends.astype(np.int64))
    per_batch = int(np.prod(keys.shape[1:])) if keys.ndim > 1 else 1
    n = int(keys.shape[0]) if keys.ndim > 1 else int(keys.size)
    uniq, first, inverse = unique_in_order(keys)
    return KeyIndex(uniq, first, inverse, np.arange(1, n + 1, dtype=np.int64) * per_batch)


def fitting_prefix(index: KeyIndex, batches: int, max_rows: int) -> int:
    """Largest number of leading batches (of ``batches``) with at most max_rows distinct keys."""
    counts = np.searchsorted(index.first, index.batch_ends[:batches])
    return int(np.searchsorted(counts, max_rows, side="right"))


def build_window(index: int, epoch: int, first_batch: int, labels: np.ndarray, dense: np.ndarray,
                 keys: np.ndarray | Bags, keys_index: KeyIndex, route: Route | None = None) -> Window:
    """The window of the first ``labels.shape[0]`` batches indexed by ``keys_index``; ``route``
    (e.g. ShardedTable.route) routes its unique keys once, for all its exchanges.

    A routed window's working set is laid out in owner order (Routing.grouped): the rows a
    pull receives are the working set as they arrive, and a push sends them as they lie. The
    layout changes no result: a row's updates do not depend on where it sits, and the
    messages are those of the sorted layout."""
    n = labels.shape[0]
    m = keys_index.distinct_in_prefix(n)
    order = np.argsort(keys_index.uniq[:m])  # distinct keys: any sort gives the one order (quicksort's is faster)
    unique_keys = keys_index.uniq[:m][order]
    exchange = None
    if route is not None:
        routed = route(unique_keys)  # routed.keys is unique_keys: keys_by_owner is unique_keys[routed.order]
        exchange = WindowExchange(routed.grouped(), tag=(epoch, first_batch))
        order = order[routed.order]
        unique_keys = exchange.routing.keys
    rank = np.empty(m, dtype=np.int64)
    rank[order] = np.arange(m)
    end = int(keys_index.batch_ends[n - 1]) if n else 0
    flat = rank[keys_index.inverse[:end]]
    bags = None
    if isinstance(keys, Bags):
        b = labels.shape[1]
        positions: np.ndarray | Bags = Bags(flat, keys.lengths[: n * b])
        starts = np.concatenate([[0], keys_index.batch_ends[:n]])
        bags = [(flat[starts[i]:starts[i + 1]], Bags(flat[starts[i]:starts[i + 1]], keys.lengths[i * b:(i + 1) * b])
                 .bag_offsets()) for i in range(n)]
        per_batch = [p for p, _ in bags]
    else:
        positions = flat.reshape((n, *keys.shape[1:]))
        per_batch = list(positions)
    return Window(index=index, epoch=epoch, first_batch=first_batch, labels=labels, dense=dense,
                  positions=positions, unique_keys=unique_keys,
                  batch_unique=[batch_unique(torch.from_numpy(p)) for p in per_batch], exchange=exchange, bags=bags)

