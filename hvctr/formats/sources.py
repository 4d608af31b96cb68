"""Input files and units of work.

A unit is what one process parses in one go, fixed by the inputs and --chunk-mb alone (never
by the number of processes), so a row's place in the output does not depend on who parsed it:
- a plain file is cut into byte ranges of ``chunk_bytes``; a unit owns the lines that *start*
  inside its range (a line crossing the boundary belongs to the unit where it starts);
- a gzip file is one unit (a gzip stream cannot be entered in the middle): parallelism over
  gzip inputs comes from having several files.
Units are ordered by (input file as given, byte offset): the global line index of a row is its
position in that order, counting data lines only (a CSV header is not a data line).
"""

from __future__ import annotations

import gzip
import heapq
import os
import re
import zlib
from dataclasses import dataclass
from typing import Iterator

import numpy as np

from hvctr.formats import NUM_COLS
from hvctr.formats.lines import RowFormat

# Parse granularity: ~4k Criteo lines. 1 MiB keeps the parser's temporaries in cache: 3x faster
# than 8 MiB on the 2-core machine type, where fresh large arrays also cost page faults.
BLOCK_BYTES = 1 << 20
SNIFF_BYTES = 1 << 16
GZIP_MAGIC = b"\x1f\x8b"
UTF8_BOM = b"\xef\xbb\xbf"
_NAME = re.compile(rb"[A-Za-z_][A-Za-z0-9_ .-]*")


def is_tsv_header(first: bytes) -> bool:
    """Whether a TSV file's first line is a header: every field a name (a letter first, none
    empty), and 40 or more of them or one of them 'label'. A data line's label is 0 or 1 and
    its integer columns are digits or empty; a short line of words ("a<TAB>b") stays data."""
    fields = [f.strip() for f in first.rstrip(b"\r").split(b"\t")]
    return ((len(fields) >= NUM_COLS or b"label" in (f.lower() for f in fields))
            and all(_NAME.fullmatch(f) for f in fields))


@dataclass(frozen=True)
class Source:
    index: int
    path: str  # absolute
    size: int  # bytes on disk (compressed for gzip)
    gzip: bool
    fmt: RowFormat
    header_lines: int  # 1 for CSV (the header) and a TSV with a header line, else 0
    data_start: int  # byte offset of the first data line in the (uncompressed) stream (after a BOM)


@dataclass(frozen=True)
class Unit:
    id: int
    source: int
    begin: int  # nominal byte range of line starts; a gzip unit covers the whole stream
    end: int

    @property
    def size(self) -> int:
        return self.end - self.begin


def open_sources(paths: list[str], fmt: str = "auto") -> list[Source]:
    """Checks every input and works out its format. ValueError naming the file if missing,
    unreadable, empty (no data line) or of an unknown format."""
    if not paths:
        raise ValueError("no input files given")
    return [_open_source(i, p, fmt) for i, p in enumerate(paths)]


def _open_source(index: int, path: str, fmt: str) -> Source:
    apath = os.path.abspath(path)
    if os.path.isdir(apath):
        raise ValueError(f"{path}: a directory, not an input file")
    if not os.path.isfile(apath):
        raise ValueError(f"{path}: input file not found")
    size = os.path.getsize(apath)
    try:
        with open(apath, "rb") as f:
            is_gz = f.read(2) == GZIP_MAGIC
        head = _read_head(apath, is_gz)
    except (OSError, EOFError, zlib.error) as e:
        raise ValueError(f"{path}: cannot read input: {e}") from None
    bom = len(UTF8_BOM) if head.startswith(UTF8_BOM) else 0  # skipped: not part of line 1's first field
    head = head[bom:]
    first, _, rest = head.partition(b"\n")
    if not head.strip():
        raise ValueError(f"{path}: empty input (no data lines)")
    kind = fmt if fmt != "auto" else ("tsv" if b"\t" in first else "csv" if b"," in first else "")
    if kind == "tsv" and not is_tsv_header(first):
        return Source(index, apath, size, is_gz, RowFormat.tsv(), 0, bom)
    if kind in ("tsv", "csv"):  # a TSV header line is read as a CSV header is: column names
        sep = b"\t" if kind == "tsv" else b","
        try:
            row_fmt = RowFormat.from_header(first, where=f"{path}:1", sep=sep)
        except ValueError as e:
            if kind == "csv":
                raise
            raise ValueError(f"{e}; a TSV file's header line is read as its column names (label, I1..I13, "
                             "C1..C26, any order): rename them, or remove the line") from None
        if not rest.strip():
            raise ValueError(f"{path}: empty input (a header line and no data lines)")
        return Source(index, apath, size, is_gz, row_fmt, 1, bom + len(first) + 1)
    raise ValueError(f"{path}:1: neither Criteo TSV (tab-separated) nor CSV with a header row")


def _read_head(path: str, is_gz: bool) -> bytes:
    if is_gz:
        with gzip.open(path, "rb") as f:
            return f.read(SNIFF_BYTES)
    with open(path, "rb") as f:
        return f.read(SNIFF_BYTES)


def make_units(sources: list[Source], chunk_bytes: int) -> list[Unit]:
    units: list[Unit] = []
    for src in sources:
        if src.gzip:
            units.append(Unit(len(units), src.index, 0, src.size))
            continue
        for begin in range(0, max(src.size, 1), chunk_bytes):
            units.append(Unit(len(units), src.index, begin, min(begin + chunk_bytes, src.size)))
    return units


def assign_units(units: list[Unit], world_size: int) -> list[list[Unit]]:
    """Largest first, each to the least loaded process (ties: lowest rank); each process then
    works through its units in global order."""
    heap = [(0, r) for r in range(world_size)]  # (bytes assigned, rank): already a heap
    out: list[list[Unit]] = [[] for _ in range(world_size)]
    for u in sorted(units, key=lambda u: (-u.size, u.id)):
        load, r = heapq.heappop(heap)
        out[r].append(u)
        heapq.heappush(heap, (load + u.size, r))
    return [sorted(us, key=lambda u: u.id) for us in out]


def line_start_at(f, pos: int, size: int) -> int:
    """First line start at or after byte ``pos`` of an open plain file."""
    if pos <= 0:
        return 0
    if pos >= size:
        return size
    f.seek(pos - 1)
    at = pos - 1
    while True:
        chunk = f.read(1 << 16)
        if not chunk:
            return size
        i = chunk.find(b"\n")
        if i >= 0:
            return at + i + 1
        at += len(chunk)


def iter_blocks(src: Source, unit: Unit, block_bytes: int = BLOCK_BYTES) -> Iterator[tuple[bytes, int]]:
    """Blocks of complete lines of a unit, each ending with a newline, with the number of
    bytes read from disk for each (compressed bytes for gzip: what progress counts)."""
    if src.gzip:
        yield from _gzip_blocks(src, block_bytes)
        return
    with open(src.path, "rb", buffering=0) as f:
        begin = max(line_start_at(f, unit.begin, src.size), src.data_start)
        end = line_start_at(f, unit.end, src.size)
        f.seek(begin)
        carry, left = b"", end - begin
        while left > 0:
            data = f.read(min(block_bytes, left))
            if not data:  # the file shrank under us: what was read is all there is
                break
            left -= len(data)
            lines, carry = _split_last_line(carry + data, final=left <= 0)
            if lines:
                yield lines, len(data)
        if carry:
            yield carry + b"\n", 0


def _split_last_line(buf: bytes, final: bool) -> tuple[bytes, bytes]:
    if final:
        return (buf if buf.endswith(b"\n") or not buf else buf + b"\n"), b""
    i = buf.rfind(b"\n")
    return buf[:i + 1], buf[i + 1:]


def _gzip_blocks(src: Source, block_bytes: int) -> Iterator[tuple[bytes, int]]:
    with open(src.path, "rb") as raw, gzip.GzipFile(fileobj=raw, mode="rb") as gz:
        if src.data_start:  # a UTF-8 BOM and/or the header line
            _gzip_read(lambda: gz.read(src.data_start), src, raw, 0)
        carry, read_before, text = b"", raw.tell(), 0
        while True:
            data = _gzip_read(lambda: gz.read(block_bytes), src, raw, text)
            text += len(data)
            final = not data
            lines, carry = _split_last_line(carry + data, final)
            pos = raw.tell()
            if lines:
                yield lines, pos - read_before
                read_before = pos
            if final:
                return


def _gzip_read(read, src: Source, raw, text_bytes: int) -> bytes:
    """``read()`` of a gzip stream; a truncated or corrupt stream is a ValueError naming the file
    and where it broke (a compressed byte offset: what was read of the file so far)."""
    try:
        return read()
    except (EOFError, OSError, zlib.error) as e:
        why = "truncated" if isinstance(e, EOFError) else "corrupt"
        raise ValueError(f"{src.path}: {why} gzip input: {e} (at compressed byte {raw.tell():,} of {src.size:,}, "
                         f"after {text_bytes:,} bytes of text)") from None


def count_lines(path: str, begin: int, end: int) -> int:
    """Newlines in bytes [begin, end) of a plain file (to name a line in an error message)."""
    n = 0
    with open(path, "rb") as f:
        f.seek(begin)
        left = end - begin
        while left > 0:
            data = f.read(min(BLOCK_BYTES, left))
            if not data:
                break
            n += data.count(b"\n")
            left -= len(data)
    return n


def nth_newline(data: bytes, k: int) -> int:
    """Byte offset of the k-th newline (1-based) in data."""
    return int(np.flatnonzero(np.frombuffer(data, dtype=np.uint8) == 10)[k - 1])
