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
    positions: np.ndarray  # int64 [n, B, F]: index of each key in unique_keys
    unique_keys: np.ndarray  # uint64 [U]: sorted; routed, grouped by owner (sorted within each)
    batch_unique: list[tuple[torch.Tensor, torch.Tensor]]  # per batch: batch_unique(positions[i])
    # unique_keys routed to their owners, and what the owners were asked once warm or pull sent
    # them (None: not routed, and no warm ran)
    exchange: WindowExchange | None = None

    @property
    def num_batches(self) -> int:
        return int(self.labels.shape[0])

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
    inverse: np.ndarray  # int64 [n * B * F]: index of each key in uniq
    keys_per_batch: int

    def distinct_in_prefix(self, batches: int) -> int:
        return int(np.searchsorted(self.first, batches * self.keys_per_batch))


def index_keys(keys: np.ndarray) -> KeyIndex:
    """keys: uint64 [n, B, F] -> their KeyIndex."""
    per_batch = int(np.prod(keys.shape[1:])) if keys.ndim > 1 else 1
    uniq, first, inverse = unique_in_order(keys)
    return KeyIndex(uniq, first, inverse, per_batch)


def fitting_prefix(index: KeyIndex, batches: int, max_rows: int) -> int:
    """Largest number of leading batches (of ``batches``) with at most max_rows distinct keys."""
    counts = np.searchsorted(index.first, np.arange(1, batches + 1) * index.keys_per_batch)
    return int(np.searchsorted(counts, max_rows, side="right"))


def build_window(index: int, epoch: int, first_batch: int, labels: np.ndarray, dense: np.ndarray,
                 keys_shape: tuple[int, ...], keys_index: KeyIndex, route: Route | None = None) -> Window:
    """The window of the first ``labels.shape[0]`` batches indexed by ``keys_index``; ``route``
    (e.g. ShardedTable.route) routes its unique keys once, for all its exchanges.

    A routed window's working set is laid out in owner order (Routing.grouped): the rows a
    pull receives are the working set as they arrive, and a push sends them as they lie. The
    layout changes no result: a row's updates do not depend on where it sits, and the
    messages are those of the sorted layout."""
    n = labels.shape[0]
    m = keys_index.distinct_in_prefix(n)
    order = np.argsort(keys_index.uniq[:m], kind="stable")
    unique_keys = keys_index.uniq[:m][order]
    exchange = None
    if route is not None:
        routed = route(unique_keys)  # routed.keys is unique_keys: keys_by_owner is unique_keys[routed.order]
        exchange = WindowExchange(routed.grouped(), tag=(epoch, first_batch))
        order = order[routed.order]
        unique_keys = exchange.routing.keys
    rank = np.empty(m, dtype=np.int64)
    rank[order] = np.arange(m)
    positions = rank[keys_index.inverse[: n * keys_index.keys_per_batch]].reshape((n, *keys_shape[1:]))
    return Window(index=index, epoch=epoch, first_batch=first_batch, labels=labels, dense=dense,
                  positions=positions, unique_keys=unique_keys,
                  batch_unique=[batch_unique(torch.from_numpy(p)) for p in positions], exchange=exchange)

