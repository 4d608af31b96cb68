"""Logging that knows ranks: every line names the rank that wrote it; rank 0 prints by default.

    setup_logging(rank=comm.rank, all_ranks=cfg.metrics.all_ranks)
    log = get_logger(__name__)
"""

from __future__ import annotations

import logging
import sys
import time
from typing import IO, Callable

_ROOT = "hvctr"


class RankFormatter(logging.Formatter):
    """``[r<rank> HH:MM:SS] message``; a subclass may name the rank per record (``tag``)."""

    def __init__(self, rank: int, width: int) -> None:
        super().__init__()
        self._tag = f"r{rank:<{width}d}"

    def tag(self, record: logging.LogRecord) -> str:
        return self._tag

    def format(self, record: logging.LogRecord) -> str:
        stamp = time.strftime("%H:%M:%S", time.localtime(record.created))
        level = "" if record.levelno == logging.INFO else f"{record.levelname}: "
        msg = f"[{self.tag(record)} {stamp}] {level}{record.getMessage()}"
        if record.exc_info:
            msg += "\n" + self.formatException(record.exc_info)
        return msg


class _RankFilter(logging.Filter):
    """Non-zero ranks print warnings and errors always, info only when asked to."""

    def __init__(self, rank: int, all_ranks: bool) -> None:
        super().__init__()
        self.rank, self.all_ranks = rank, all_ranks

    def filter(self, record: logging.LogRecord) -> bool:
        return self.rank == 0 or self.all_ranks or record.levelno >= logging.WARNING


class _LogFile(logging.FileHandler):
    """A rank's log file. A write that fails (a full disk) is said once, in one line naming
    the file, and the file is left alone from then on: not a traceback per log line.
    ``open_file(path, mode, encoding=, errors=)`` opens it: the commands pass
    hvctr.formats.safefile.open_append (O_NOFOLLOW: a link planted at its name is refused,
    naming it); a layer above this one's, so it is handed in, not imported."""

    def __init__(self, filename, open_file: Callable[..., IO] | None = None) -> None:
        self._open_file = open_file
        super().__init__(filename)

    def _open(self):
        if self._open_file is None:
            return super()._open()
        return self._open_file(self.baseFilename, self.mode, encoding=self.encoding, errors=self.errors)

    def handleError(self, record: logging.LogRecord) -> None:
        e = sys.exc_info()[1]
        if not isinstance(e, OSError):
            return super().handleError(record)
        logging.getLogger(_ROOT).removeHandler(self)
        sys.stderr.write(f"hvctr: cannot write the log file {self.baseFilename}: {e.strerror or e}; "
                         f"this rank logs to the console only from now on\n")
        try:
            self.close()
        except OSError:
            pass


def setup_logging(rank: int = 0, world_size: int = 1, all_ranks: bool = False,
                  level: int = logging.INFO, file: str | None = None,
                  open_file: Callable[..., IO] | None = None) -> None:
    """Configures the ``hvctr`` logger; ``file`` also gets every line of this rank, opened by
    ``open_file`` (hvctr.formats.safefile.open_append: never through a planted link)."""
    root = logging.getLogger(_ROOT)
    for h in list(root.handlers):
        root.removeHandler(h)
        h.close()
    root.setLevel(level)
    root.propagate = False
    width = len(str(max(world_size - 1, 0)))
    stream = logging.StreamHandler(sys.stderr if rank else sys.stdout)
    stream.setFormatter(RankFormatter(rank, width))
    stream.addFilter(_RankFilter(rank, all_ranks))
    root.addHandler(stream)
    if file:
        fh = _LogFile(file, open_file)
        fh.setFormatter(RankFormatter(rank, width))
        root.addHandler(fh)


def get_logger(name: str) -> logging.Logger:
    if not name.startswith(_ROOT):
        name = f"{_ROOT}.{name}"
    return logging.getLogger(name)
