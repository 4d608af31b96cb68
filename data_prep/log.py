"""data_prep's log lines: ``[r<rank> HH:MM:SS] message``; rank 0 prints progress, every rank
its warnings and errors (data_prep imports nothing of hvctr but its formats)."""

from __future__ import annotations

import logging
import sys

_NAME = "data_prep"


def setup_logging(rank: int = 0, world_size: int = 1) -> None:
    log = logging.getLogger(_NAME)
    for h in list(log.handlers):
        log.removeHandler(h)
    handler = logging.StreamHandler(sys.stderr if rank else sys.stdout)
    width = len(str(max(world_size - 1, 0)))
    handler.setFormatter(logging.Formatter(f"[r{rank:<{width}d} %(asctime)s] %(message)s", datefmt="%H:%M:%S"))
    log.addHandler(handler)
    log.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    log.propagate = False


def get_logger() -> logging.Logger:
    return logging.getLogger(_NAME)
