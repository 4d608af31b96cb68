"""The window schedule, and the prefetch thread that prepares window t+1 while t trains.

Every rank produces the same sequence of windows, and so the same sequence of collectives:
- the number of batches per epoch is agreed once (the minimum over ranks; the rest dropped);
- each window's length is the minimum over ranks of what each can take (k, or less while
  ``merge.k_warmup_steps`` ramps it up; the end of the epoch; the working-set bound), agreed
  by an allreduce-min;
- the thread prepares window t+1 only when the main thread asks for it, which it does when it
  takes window t. So when a stop is agreed at merge(t), every rank's thread has started
  exactly window t+1 and no further: no rank is left waiting in a collective for t+2.

Prefetch warms, it never answers: the thread reads the data, agrees on the length, computes the
unique keys, routes them to their owners (once: the window carries the routing to its pull and
push) and each batch's unique positions, and sends the keys to their owners, which bring
missing rows from SSD into the CPU cache and keep the request (the window's ``exchange``,
hvctr.storage.exchange.WindowExchange, records it: its pull and push send no keys again). The
rows themselves are read and sent by the main thread's pull after merge(t), so window t+1
sees the state after merge(t), and prefetch on or off gives bit-equal models (with prefetch
off the pull sends the keys, and the push sends rows only all the same). With storage.pull_ahead
the warm also answers the rows of t+1 that window t does not hold (nothing writes them before
t+1's pull), and with storage.push_behind the thread, before it prepares t+1, sends the rows
window t-1's push left behind (``before_window``: rows window t does not hold, so t's pull did
not wait for them).
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Protocol

import numpy as np

from hvctr.distributed.world import AgreedError
from hvctr.log import get_logger
from hvctr.storage.exchange import WindowExchange
from hvctr.train.window import Route, Window, build_window, fitting_prefix, index_keys

if TYPE_CHECKING:
    from hvctr.distributed.protocol import Comm

log = get_logger(__name__)

Warm = Callable[[WindowExchange | np.ndarray, str], WindowExchange]  # ShardedTable.warm


class BatchReader(Protocol):
    def read(self, first: int, count: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Batches first .. first+count-1 of the epoch: labels [n,B], dense [n,B,13], keys [n,B,F]."""


@dataclass(frozen=True)
class Schedule:
    batches_per_epoch: int  # agreed over ranks
    epochs: int
    every_k_steps: int
    max_working_set_rows: int
    max_steps: int  # 0: no limit
    k_warmup_steps: int = 0  # the window length ramps from 1 to k over this many steps (0: k from the start)

    def window_steps(self, steps_done: int) -> int:
        """k for a window starting after ``steps_done`` steps: during the warmup the length grows
        linearly with the step, from 1 to k (post-local SGD's early merges, arXiv 1808.07217,
        without its synchronous phase: local models drift most while the loss falls fast). A
        pure function of the step, so a resumed run takes the same windows."""
        n = self.k_warmup_steps
        if n <= 0 or steps_done >= n:
            return self.every_k_steps
        return max(1, min(self.every_k_steps, (steps_done + 1) * self.every_k_steps // n))

    def total_steps(self) -> int:
        total = self.batches_per_epoch * self.epochs
        return min(total, self.max_steps) if self.max_steps else total


class WindowSource:
    """Yields the run's windows in order from (epoch, batch) ``start``; see the module docstring."""

    def __init__(self, reader_for_epoch: Callable[[int], BatchReader], schedule: Schedule, comm: Comm,
                 warm: Warm | None, start: tuple[int, int, int],
                 prefetch: bool, timeout_s: float, route: Route | None = None,
                 before_window: Callable[[], None] | None = None) -> None:
        """``warm(keys, name)`` takes a window's exchange_keys and returns its WindowExchange
        holding what the owners were asked (kept as the window's ``exchange``); ``route``
        routes a window's unique keys (None: windows carry no routing); ``before_window``: what
        the prefetch thread runs before it prepares each window (ShardedTable.settle_push: the
        rows the last push left behind, sent while the window before trains)."""
        self._reader_for_epoch = reader_for_epoch
        self._route = route
        self._schedule = schedule
        self._comm = comm
        self._warm = warm if prefetch else None
        self._before_window = before_window if prefetch else None
        self._epoch, self._batch, self._index = start  # next window's epoch, first batch, number
        self._steps_done = start[0] * schedule.batches_per_epoch + start[1]
        self._readers: dict[int, BatchReader] = {}
        self._timeout_s = timeout_s
        self._prefetch = prefetch
        self.read_seconds = 0.0  # data reading time, main thread or prefetch thread
        if prefetch:
            self._requests: queue.Queue[bool] = queue.Queue()
            self._ready: queue.Queue[tuple[str, object]] = queue.Queue(maxsize=1)
            self._thread = threading.Thread(target=self._run, name="hvctr-prefetch", daemon=True)
            self._thread.start()
            self._requests.put(True)  # the first window
        self._unrequested = False  # a window was returned whose following one is not asked for yet

    # --- producing windows (thread or main) -----------------------------------------------

    def _produce(self) -> Window | None:
        s = self._schedule
        remaining_total = s.total_steps() - self._steps_done
        if self._epoch >= s.epochs or remaining_total <= 0:
            return None
        t0 = time.perf_counter()
        want = min(s.window_steps(self._steps_done), s.batches_per_epoch - self._batch, remaining_total)
        reader = self._readers.get(self._epoch) or self._readers.setdefault(
            self._epoch, self._reader_for_epoch(self._epoch))
        labels, dense, keys = reader.read(self._batch, want)
        index = index_keys(keys, want)
        fit = fitting_prefix(index, want, s.max_working_set_rows)
        # comm: allreduce (Min) of the window length every rank can take
        (n,) = self._comm.allreduce_min_int([fit], name=f"window{self._index}.len")
        if n == 0:  # multi-valued data: one batch's bags may hold more distinct keys than B x F
            raise AgreedError(f"batch {self._batch} of epoch {self._epoch} holds more distinct keys on some rank "
                              f"(rank {self._comm.rank}: {index.distinct_in_prefix(1):,}) than "
                              f"storage.max_working_set_rows = {s.max_working_set_rows:,}: raise it",
                              report=self._comm.rank == 0)
        window = build_window(self._index, self._epoch, self._batch, labels[:n], dense[:n], keys, index,
                              self._route)
        self.read_seconds += time.perf_counter() - t0
        if self._warm is not None:
            window.exchange = self._warm(window.exchange_keys, f"window{self._index}.warm")
        self._index += 1
        self._batch += n
        self._steps_done += n
        if self._batch >= s.batches_per_epoch:
            self._readers.pop(self._epoch, None)
            self._epoch, self._batch = self._epoch + 1, 0
        return window

    def _run(self) -> None:
        try:
            while self._requests.get():
                if self._before_window is not None:
                    self._before_window()
                window = self._produce()
                self._ready.put(("window", window))
                if window is None:
                    return
        except BaseException as e:  # re-raised in the main thread by next()
            self._ready.put(("error", e))

    # --- consuming (main thread) ---------------------------------------------------------

    def next(self, prepare_following: bool = True) -> Window | None:
        """The next window. ``prepare_following=False``: the thread waits for ``prepare_following()``
        before it starts the one after (the trainer takes a window before its predecessor's push
        and lets the following warm start only after that window's pull: the warm's rows would
        find the cache's room still held by that pull's)."""
        if not self._prefetch:
            return self._produce()
        deadline = time.monotonic() + self._timeout_s
        while True:
            try:
                kind, item = self._ready.get(timeout=1.0)
                break
            except queue.Empty:
                if not self._thread.is_alive():
                    raise RuntimeError("prefetch thread ended without a window") from None
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"no window from the prefetch thread within train.queue_timeout_s="
                        f"{self._timeout_s:g} s (data reading or a collective is stuck)") from None
        if kind == "error":
            raise RuntimeError(f"prefetch thread failed: {item!r}") from item  # type: ignore[arg-type]
        if item is not None:
            self._unrequested = True
            if prepare_following:
                self.prepare_following()
        return item  # type: ignore[return-value]

    def prepare_following(self) -> None:
        """Lets the thread start the window after the one ``next`` returned last (once)."""
        if self._prefetch and self._unrequested:
            self._unrequested = False
            self._requests.put(True)  # window t taken: start preparing t+1

    def close(self) -> None:
        """Stops after the window in preparation (every rank stops at the same one)."""
        if not self._prefetch or not self._thread.is_alive():
            return
        self._requests.put(False)
        self._thread.join(timeout=self._timeout_s)
        if self._thread.is_alive():
            raise TimeoutError("prefetch thread did not stop")
