"""The one TOML reader: the run config, the sweep's search space, the hardware map, the rates file.

    raw = read_toml(path, "config file")   # {...}, or a ValueError naming the file

Every error is a ValueError whose message starts with what the file is and its path: those of
``hvctr.formats.textfile.read_text`` (missing, a directory, unreadable, not UTF-8: with the line
and column of the first bad byte), and ``<what> <path>: <the parser's message> (at line L,
column C)`` (the end of the file, too, is named by its line and column).
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Any

from hvctr.formats.textfile import read_text


def read_toml(path: str | os.PathLike[str], what: str, missing_hint: str = "") -> dict[str, Any]:
    """The table in the TOML file at ``path``; ``what`` names the file in every error
    ("config file", "hardware map", ...), ``missing_hint`` follows the one for a missing file."""
    path = Path(path)
    text = read_text(path, what, missing_hint)
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:  # its message ends "(at line L, column C)" or "(at end of document)"
        msg = str(e)
        if msg.endswith(_AT_END):
            line, column = text.count("\n") + 1, len(text.rsplit("\n", 1)[-1]) + 1
            msg = f"{msg[:-len(_AT_END)]}(at line {line}, column {column}: the end of the file)"
        raise ValueError(f"{what} {path}: {msg}") from None


_AT_END = "(at end of document)"
