"""The one reader of hvctr's text files (TOML, JSON, JSONL): UTF-8, and every error names the file.

    text = read_text(path, "metrics file")     # str, or a ValueError naming the file
    obj = read_json(path, "run identity")      # the parsed JSON, or a ValueError naming file and line

A person edits the config, the search space and the hardware map in an editor that may save
Latin-1, and a disk error may leave any file half-written; Python's own errors then name neither
(``'utf-8' codec can't decode byte 0xe9 in position 22``). Here every error is a ValueError
that starts with what the file is and its path, and says where in it:

- ``<what> <path> does not exist<missing_hint>``; ``<what> <path> is a directory, not a file``;
- ``<what> <path>: cannot read it: <reason>`` (permissions, an I/O error);
- ``<what> <path>: not UTF-8 text: byte 0xe9 at line 2, column 12 (save it as UTF-8)``;
- ``<what> <path>: not JSON: <reason> (at line L, column C)``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def read_text(path: str | os.PathLike[str], what: str, missing_hint: str = "") -> str:
    """The UTF-8 text of the file at ``path``; ``what`` names the file in every error ("config
    file", "hardware map", ...), ``missing_hint`` follows the one for a missing file."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise ValueError(f"{what} {path} does not exist{missing_hint}") from None
    except IsADirectoryError:
        raise ValueError(f"{what} {path} is a directory, not a file") from None
    except OSError as e:
        raise ValueError(f"{what} {path}: cannot read it: {e.strerror or e}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        column = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        raise ValueError(f"{what} {path}: not UTF-8 text: byte 0x{data[e.start]:02x} at line {line}, column "
                         f"{column} (save it as UTF-8)") from None


def parse_json(text: str, what: str, path: str | os.PathLike[str]) -> Any:
    """``text`` (the content of ``path``) as JSON; a ValueError naming the file, line and column."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{what} {path}: not JSON: {e.msg} (at line {e.lineno}, column {e.colno})") from None


def read_json(path: str | os.PathLike[str], what: str, missing_hint: str = "") -> Any:
    """The JSON value in the UTF-8 file at ``path`` (errors as read_text's, and parse_json's)."""
    return parse_json(read_text(path, what, missing_hint), what, path)
