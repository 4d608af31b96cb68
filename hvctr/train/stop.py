"""Preemption: a signal becomes a request to checkpoint and stop at the next window boundary."""

from __future__ import annotations

import signal
from typing import Any

from hvctr.log import get_logger

log = get_logger(__name__)


class StopRequest:
    """SIGUSR1/SIGTERM -> checkpoint and stop at the next window boundary.

    Installed first thing in ``hvctr train`` (set-up takes seconds; a signal then must not kill
    the rank). The request is local; the next merge's allreduce makes every rank see it.
    """

    def __init__(self) -> None:
        self.requested = 0
        self.signal_name = ""

    def install(self) -> "StopRequest":
        for sig in (signal.SIGUSR1, signal.SIGTERM):
            signal.signal(sig, self._on_signal)
        return self

    def _on_signal(self, signum: int, _frame: Any) -> None:
        self.requested = 1
        self.signal_name = signal.Signals(signum).name
        log.warning(f"got {self.signal_name}: checkpoint and stop at the next window boundary")
