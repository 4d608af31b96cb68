"""A rank that never reaches a collective must end the job, not hold it until its time limit.

A rank that dies ends the job at once (mpirun or ``srun --kill-on-bad-exit`` kill the others).
A rank that hangs without dying does not: a frozen process, a node that stops answering, a
read stuck on a dead NFS mount, a deadlock in a library. The others wait in their next
collective, and neither MPI nor Horovod times it out (Horovod's stall inspector warns, naming
the missing ranks, but only while their processes still run its background thread).

``CollectiveWatchdog`` times every collective this rank is inside (``Comm`` enters each one
through ``waiting(name)``, from any thread): when one has waited ``timeout_s``, it reports the
collective and the wait on this rank and ends the whole job (``MPI_Abort``), so that the
allocation is freed and the job can be resumed from its last checkpoint elsewhere. Every rank
that waits reports; a process that itself did not run for a while (stopped, then continued by
the job's teardown) sees the gap in its own clock and does not count it. A rank that is merely
slow (a long checkpoint write on one rank) is the reason to raise the timeout, not lower it.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterator

from hvctr import memcg
from hvctr.distributed.world import abort_job

EXIT_STALLED = 3  # the exit status of a job the watchdog ended


class CollectiveWatchdog:
    """Ends the job when a collective of this rank has waited ``timeout_s`` seconds.

    ``on_stall(message)`` runs instead of the report and the abort (tests); it runs once.
    """

    def __init__(self, rank: int, timeout_s: float, program: str = "hvctr", setting: str = "train.stall_timeout_s",
                 on_stall: Callable[[str], None] | None = None) -> None:
        if timeout_s <= 0:
            raise ValueError(f"watchdog timeout must be > 0, got {timeout_s}")
        self.rank, self.timeout_s, self.program, self.setting = rank, float(timeout_s), program, setting
        self._on_stall = on_stall or self._abort
        self._inflight: dict[int, tuple[str, float]] = {}  # thread id -> (collective, since)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._fired = False
        self._thread = threading.Thread(target=self._run, name="hvctr-watchdog", daemon=True)
        self._thread.start()

    @contextmanager
    def waiting(self, name: str) -> Iterator[None]:
        """Marks the calling thread as inside collective ``name`` for the block."""
        tid = threading.get_ident()
        with self._lock:
            outer = self._inflight.get(tid)  # a collective made of collectives keeps its first name
            if outer is None:
                self._inflight[tid] = (name, time.monotonic())
        try:
            yield
        finally:
            if outer is None:
                with self._lock:
                    self._inflight.pop(tid, None)

    def oldest(self) -> tuple[str, float] | None:
        """(collective, seconds waited) of the longest wait now in progress, None when idle."""
        now = time.monotonic()
        with self._lock:
            if not self._inflight:
                return None
            name, since = min(self._inflight.values(), key=lambda v: v[1])
        return name, now - since

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        period = min(1.0, self.timeout_s / 4)
        last = time.monotonic()
        while not self._stop.wait(period):
            now = time.monotonic()
            gap, last = now - last, now
            if gap > 3 * period:
                # This process did not run (SIGSTOP, a frozen node, swapping): its own waits say
                # nothing about the other ranks. They count from now on.
                with self._lock:
                    self._inflight = {t: (n, since + gap - period) for t, (n, since) in self._inflight.items()}
                continue
            found = self.oldest()
            if found is None or found[1] < self.timeout_s or self._fired:
                continue
            self._fired = True
            name, waited = found
            # A full memory cgroup (the node's ranks share the job's) is the usual reason a rank
            # stops reaching collectives without failing: say so where it is the case.
            pressure = memcg.pressure_note(memcg.current())
            self._on_stall(
                f"rank {self.rank}: collective {name!r} has waited {waited:.0f} s for the other ranks "
                f"({self.setting} = {self.timeout_s:g}): a rank is not reaching it (hung, frozen, or stuck "
                f"in I/O; Horovod's stall warnings above name the ranks whose processes still run). "
                + (f"{pressure}. " if pressure else "")
                + "Ending the job; --resume continues from the last complete checkpoint.")

    def _abort(self, message: str) -> None:
        print(f"{self.program}: error: {message}", file=sys.stderr, flush=True)
        abort_job(EXIT_STALLED)
        os._exit(EXIT_STALLED)  # alone (no MPI job to abort): end this process
