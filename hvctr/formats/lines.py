"""Criteo rows from a block of bytes, vectorised in numpy: no Python work per row or per field.

    fmt = RowFormat.tsv()                      # or RowFormat.from_header(b"label,I1,...,C26")
    block = parse_block(data, fmt)             # data: bytes of complete lines
    block.labels, block.dense, block.keys      # the good rows, in line order
    block.bad                                  # [(line index in the block, reason), ...]

How: one pass finds every delimiter (separator or newline); a line with the wrong number of
fields is set aside; the rest reshape to a [lines, fields] table of field end positions. A
field's last 8 (or 16) bytes are read as one little-endian uint64 through an unaligned strided
view of the buffer, so a value is right-aligned without a per-field loop: bytes before the
field are masked, and SWAR arithmetic turns 8 ASCII digits (or hex digits) into a number.
Non-hex categorical values (rare in Criteo) take a column-wise FNV-1a loop over their bytes.

Integers accept an optional leading '-' and a zero fraction ("17668.0", as DeepCTR's CSV
writes them); anything else in an integer column makes the line bad. The label must be 0 or 1.

Multi-valued fields (``parse_block(data, fmt, multi_valued=(2, 20), value_sep=b",")``): the text
of those fields is cut at the value separator; each non-empty token is keyed as a one-valued value
of that field is ("a,,b" is 2 keys, an empty field 0). The block then holds ``lengths`` [n, 26]
and a flat ``keys``, row by row, field by field, tokens in line order. Still no loop per row or
per field: the separator bytes inside the fields' byte ranges are found with one search over
the ranges sorted by position, token ends are those separators plus each range's end (a
separator j of range k ends token j + k), and every token is hashed in one call.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from hvctr import formats
from hvctr.formats import NUM_FIELDS, NUM_COLS, NUM_DENSE

PAD = 16  # bytes before and after the data, so 16-byte right-aligned reads never leave the buffer
_COL8 = np.arange(8, dtype=np.int64)
_COL16 = np.arange(16, dtype=np.int64)
_FIELDS = np.arange(NUM_FIELDS, dtype=np.uint64)
_M8 = np.uint64(0x00FF00FF00FF00FF)
_M16 = np.uint64(0x0000FFFF0000FFFF)
_M32 = np.uint64(0x00000000FFFFFFFF)
_U4, _U8, _U16, _U32 = np.uint64(4), np.uint64(8), np.uint64(16), np.uint64(32)
_LOW4 = np.uint64(0x0F0F0F0F0F0F0F0F)
_ONES = np.uint64(0x0101010101010101)
# _INSIDE[l]: 0xFF in the last l bytes of a word (a field of l bytes, right-aligned); _FIRST[l]:
# 0x01 in the first byte of such a field.
_INSIDE = np.array([0] + [((1 << 64) - 1) ^ ((1 << (8 * (8 - l))) - 1) for l in range(1, 9)], dtype=np.uint64)
_FIRST = np.array([0] + [1 << (8 * (8 - l)) for l in range(1, 9)], dtype=np.uint64)


@dataclass(frozen=True)
class RowFormat:
    """How to cut a line into the 40 Criteo columns.

    sep: the separator byte; ncols: fields per line in the file; cols: for each canonical
    column (label, I1..I13, C1..C26) its index among the file's fields.
    """
    sep: int
    ncols: int
    cols: tuple[int, ...]
    header: tuple[str, ...] = ()
    kind: str = "tsv"

    @staticmethod
    def tsv() -> "RowFormat":
        return RowFormat(ord("\t"), NUM_COLS, tuple(range(NUM_COLS)))

    @staticmethod
    def from_header(line: bytes, where: str = "header", sep: bytes = b",") -> "RowFormat":
        """DeepCTR-style CSV: a header naming label, I1..I13, C1..C26 in any order (any case);
        other columns (e.g. Kaggle's Id) are ignored. sep=b"\\t": a TSV file's header line."""
        names = [c.strip().decode("ascii", "replace") for c in line.rstrip(b"\r\n").split(sep)]
        lower = [n.lower() for n in names]
        cols = []
        for want in formats.COLUMN_NAMES:
            if lower.count(want.lower()) != 1:
                what = "CSV header" if sep == b"," else "a header line"
                raise ValueError(f"{where}: {what} must name column {want!r} exactly once; "
                                 f"found {names}")
            cols.append(lower.index(want.lower()))
        kind = "csv" if sep == b"," else "tsv"
        return RowFormat(ord(sep), len(names), tuple(cols), tuple(names), kind)

    @property
    def identity(self) -> bool:
        return self.cols == tuple(range(NUM_COLS)) and self.ncols == NUM_COLS


@dataclass
class Block:
    """Parsed rows of one block. ``lines`` holds each row's line index within the block.

    Without multi-valued fields ``keys`` is [n, 26] and ``lengths`` None; with them ``keys`` is
    flat, row by row and field by field, and ``lengths`` says how many keys each field holds."""
    labels: np.ndarray  # float32 [n]
    dense: np.ndarray  # float32 [n, 13]
    keys: np.ndarray  # uint64 [n, 26], or [lengths.sum()] with multi-valued fields
    lines: np.ndarray  # int64 [n]
    num_lines: int
    missing: np.ndarray  # int64 [39]: empty values per column I1..I13, C1..C26 (0 keys), over good rows
    bad: list[tuple[int, str]] = field(default_factory=list)
    lengths: np.ndarray | None = None  # uint16 [n, 26]: keys per field (multi-valued fields only)


def check_value_sep(value_sep: bytes, fmt: RowFormat | None = None, option: str = "--value-separator",
                    where: str = "") -> None:
    """A value separator must be one byte that neither ends a line nor separates ``fmt``'s columns."""
    if len(value_sep) != 1 or value_sep in b"\r\n":
        raise ValueError(f"{option} must be one ASCII character other than a line end, got "
                         f"{value_sep.decode('utf-8', 'replace')!r}")
    if fmt is not None and value_sep[0] == fmt.sep:
        raise ValueError(f"{where}{option} {value_sep.decode('ascii', 'replace')!r} is the column separator of "
                         f"{fmt.kind.upper()} input: the values inside a multi-valued field need another "
                         f"separator (e.g. {option} '|')")


def parse_block(data: bytes, fmt: RowFormat, multi_valued: Sequence[int] = (), value_sep: bytes = b",") -> Block:
    """Parses complete lines (a final line without a newline is accepted). ``multi_valued``: the
    0-based categorical fields whose text holds 0..n values separated by ``value_sep``."""
    if multi_valued:
        check_value_sep(value_sep, fmt)
    if b"\r" in data:
        data = data.replace(b"\r\n", b"\n")
    if data and not data.endswith(b"\n"):
        data += b"\n"
    raw = bytes(PAD) + data + bytes(PAD)
    buf = np.frombuffer(raw, dtype=np.uint8)
    # v64[i] is the little-endian uint64 of raw[i:i+8]: any byte offset, no copy.
    v64 = np.ndarray(shape=(len(raw) - 7,), dtype="<u8", buffer=raw, strides=(1,))
    line_start, nfields, ends = _split_fields(buf, len(data), fmt)
    num_lines = len(nfields)
    good = nfields == fmt.ncols
    bad = [(int(i), f"expected {fmt.ncols} fields, found {int(nfields[i])}")
           for i in np.flatnonzero(~good)]
    rows = np.flatnonzero(good)
    starts = np.empty_like(ends)
    starts[:, 0] = line_start[rows]
    starts[:, 1:] = ends[:, :-1] + 1
    if not fmt.identity:
        ends, starts = ends[:, fmt.cols], starts[:, fmt.cols]
    lengths = ends - starts

    ivals, iok = _parse_ints(v64, ends[:, :1 + NUM_DENSE].ravel(), lengths[:, :1 + NUM_DENSE].ravel(),
                             dots=b"." in data, signs=b"-" in data)
    ivals = ivals.reshape(-1, 1 + NUM_DENSE)
    iok = iok.reshape(-1, 1 + NUM_DENSE)
    label_ok = iok[:, 0] & ((ivals[:, 0] == 0) | (ivals[:, 0] == 1)) & (lengths[:, 0] > 0)
    row_ok = label_ok & iok[:, 1:].all(axis=1)
    if not row_ok.all():
        bad += _int_reasons(raw, starts, ends, rows, iok, label_ok)
        bad.sort()
        keep = np.flatnonzero(row_ok)
        rows, ivals, starts, ends, lengths = rows[keep], ivals[keep], starts[keep], ends[keep], lengths[keep]

    if multi_valued:
        return _multi_block(buf, v64, len(data), value_sep[0], np.asarray(sorted(set(multi_valued)), dtype=np.int64),
                            rows, ivals, ends, lengths, num_lines, bad)
    keys = _parse_cats(buf, v64, ends[:, 1 + NUM_DENSE:], lengths[:, 1 + NUM_DENSE:])
    with np.errstate(divide="ignore"):
        dense = np.log1p(np.maximum(ivals[:, 1:], 0).astype(np.float64)).astype(np.float32)
    missing = (lengths[:, 1:] == 0).sum(axis=0, dtype=np.int64)
    return Block(ivals[:, 0].astype(np.float32), dense, keys, rows.astype(np.int64), num_lines, missing, bad)


def _multi_block(buf: np.ndarray, v64: np.ndarray, n_data: int, sep: int, multi: np.ndarray, rows: np.ndarray,
                 ivals: np.ndarray, ends: np.ndarray, lengths: np.ndarray, num_lines: int,
                 bad: list[tuple[int, str]]) -> Block:
    """parse_block's end when some fields are multi-valued: tokens, too-long fields, flat keys."""
    cat_ends, cat_lengths = ends[:, 1 + NUM_DENSE:], lengths[:, 1 + NUM_DENSE:]
    tok_end, tok_len, tok_range, counts = _multi_tokens(buf, n_data, sep, cat_ends[:, multi], cat_lengths[:, multi])
    too_long = counts > formats.MAX_FIELD_KEYS  # [n, m]
    if too_long.any():
        row_bad = too_long.any(axis=1)
        for k in np.flatnonzero(row_bad):  # rare: a per-line reason, as _int_reasons gives
            j = int(np.argmax(too_long[k]))
            bad.append((int(rows[k]), f"{formats.CAT_NAMES[multi[j]]}: {int(counts[k, j]):,} values, more than "
                                      f"{formats.MAX_FIELD_KEYS:,} (the most one field of a row holds)"))
        bad.sort()
        keep = ~row_bad
        m = len(multi)
        tok_keep = keep[tok_range // m]
        new_row = np.cumsum(keep) - 1  # a kept row's index among the kept rows
        tok_end, tok_len = tok_end[tok_keep], tok_len[tok_keep]
        tok_range = new_row[tok_range[tok_keep] // m] * m + tok_range[tok_keep] % m
        rows, ivals, counts = rows[keep], ivals[keep], counts[keep]
        cat_ends, cat_lengths = cat_ends[keep], cat_lengths[keep]
        lengths = lengths[keep]
    n = len(rows)
    one_lengths = cat_lengths.copy()
    one_lengths[:, multi] = 0  # keyed below, token by token; here the cheap missing key, unused
    one_keys = _parse_cats(buf, v64, cat_ends, one_lengths)
    field_len = np.ones((n, NUM_FIELDS), dtype=np.uint16)
    field_len[:, multi] = counts
    keys = _flat_keys(field_len, one_keys, multi, tok_range, _value_keys(buf, v64, tok_end, tok_len, multi[tok_range % len(multi)]))
    with np.errstate(divide="ignore"):
        dense = np.log1p(np.maximum(ivals[:, 1:], 0).astype(np.float64)).astype(np.float32)
    empty = lengths[:, 1:] == 0
    empty[:, NUM_DENSE + multi] = counts == 0  # a multi-valued field is missing when it holds no key
    missing = empty.sum(axis=0, dtype=np.int64)
    return Block(ivals[:, 0].astype(np.float32), dense, keys, rows.astype(np.int64), num_lines, missing, bad,
                 lengths=field_len)


def _multi_tokens(buf: np.ndarray, n_data: int, sep: int, ends: np.ndarray,
                  lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The non-empty tokens of byte ranges ([n, m] ends and lengths: m fields of n rows).

    Returns each token's end and length (positions index ``buf``), its range k = row * m + j
    (tokens ordered by range, then by position), and the tokens per range [n, m]."""
    n, m = ends.shape
    r_end = ends.ravel()
    r_start = r_end - lengths.ravel()
    num_ranges = r_end.size
    # Ranges are disjoint, so their starts are distinct; in a TSV (and any file whose columns come
    # in order) they are already sorted by position; a CSV's columns can come in any order.
    order = None if np.all(r_start[1:] > r_start[:-1]) else np.argsort(r_start, kind="stable")
    s_sorted = r_start if order is None else r_start[order]
    e_sorted = r_end if order is None else r_end[order]
    pos = np.flatnonzero(buf[PAD:PAD + n_data] == sep) + PAD
    at = np.searchsorted(s_sorted, pos, side="right") - 1  # the last range starting at or before
    inside = at >= 0
    inside[inside] = pos[inside] < e_sorted[at[inside]]
    pos, at = pos[inside], at[inside]
    sep_range = at if order is None else order[at]
    if order is not None:  # by range, each range's separators in line order
        o = np.argsort(sep_range, kind="stable")
        pos, sep_range = pos[o], sep_range[o]
    per_range = np.bincount(sep_range, minlength=num_ranges)
    # separator j of range k ends token j + k and starts token j + k + 1; range k's last token
    # (the separators of ranges 0..k, plus k) ends at the range's end, its first starts at its start
    num_tokens = len(pos) + num_ranges
    tok_end = np.empty(num_tokens, dtype=np.int64)
    tok_start = np.empty(num_tokens, dtype=np.int64)
    j = np.arange(len(pos), dtype=np.int64)
    tok_end[j + sep_range] = pos
    tok_start[j + sep_range + 1] = pos + 1
    last = np.cumsum(per_range) + np.arange(num_ranges, dtype=np.int64)
    tok_end[last] = r_end
    tok_start[last - per_range] = r_start
    tok_range = np.repeat(np.arange(num_ranges, dtype=np.int64), per_range + 1)
    tok_len = tok_end - tok_start
    keep = np.flatnonzero(tok_len > 0)  # "a,,b": 2 tokens; an empty field: none
    tok_range = tok_range[keep]
    counts = np.bincount(tok_range, minlength=num_ranges).reshape(n, m)
    return tok_end[keep], tok_len[keep], tok_range, counts


def _value_keys(buf: np.ndarray, v64: np.ndarray, ends: np.ndarray, lengths: np.ndarray,
                field_of: np.ndarray) -> np.ndarray:
    """Keys of non-empty values of any fields (flat arrays): what _parse_cats computes for a
    one-valued field's value, through the same routines (_hex_values, hex_keys, _string_keys)."""
    values, hexok = _hex_values(v64, ends, lengths)
    field_of = field_of.astype(np.uint64)
    keys = formats.hex_keys(field_of, values)
    other = np.flatnonzero(~hexok)
    if other.size:
        keys[other] = _string_keys(buf, ends[other], lengths[other], field_of[other])
    return keys


def _flat_keys(field_len: np.ndarray, one_keys: np.ndarray, multi: np.ndarray, tok_range: np.ndarray,
               tok_keys: np.ndarray) -> np.ndarray:
    """The flat keys of rows: row by row, field by field; one-valued fields from ``one_keys``
    [n, 26], multi-valued ones from the tokens (ordered by range k = row * m + j, then in line order)."""
    n, m = field_len.shape[0], len(multi)
    at = np.zeros(n * NUM_FIELDS + 1, dtype=np.int64)  # where each (row, field)'s keys start
    np.cumsum(field_len.ravel(), out=at[1:])
    keys = np.empty(int(at[-1]), dtype=np.uint64)
    one = np.ones(NUM_FIELDS, dtype=bool)
    one[multi] = False
    starts = at[:-1].reshape(n, NUM_FIELDS)
    keys[starts[:, one].ravel()] = one_keys[:, one].ravel()
    # a token's rank inside its range: its index minus the range's first token's
    first = np.zeros(n * m + 1, dtype=np.int64)
    np.cumsum(np.bincount(tok_range, minlength=n * m), out=first[1:])
    rank = np.arange(len(tok_range), dtype=np.int64) - first[tok_range]
    keys[starts[tok_range // m, multi[tok_range % m]] + rank] = tok_keys
    return keys


def _split_fields(buf: np.ndarray, n: int, fmt: RowFormat) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Line starts and field counts of every line, and the field end positions of the lines
    with the right field count as an [n_good, ncols] table (positions index ``buf``)."""
    body = buf[PAD:PAD + n]
    delims = np.flatnonzero((body == fmt.sep) | (body == 10)) + PAD
    nl = np.flatnonzero(buf[delims] == 10)  # index into delims of each line's newline
    nfields = np.diff(nl, prepend=-1)
    line_start = np.empty(len(nl), dtype=np.int64)
    line_start[0:1] = PAD
    line_start[1:] = delims[nl[:-1]] + 1
    if len(delims) == len(nl) * fmt.ncols and np.all(nfields == fmt.ncols):
        return line_start, nfields, delims.reshape(-1, fmt.ncols)
    good_line = np.repeat(nfields == fmt.ncols, nfields)
    return line_start, nfields, delims[good_line].reshape(-1, fmt.ncols)


def _swar_dec8(x: np.ndarray) -> np.ndarray:
    """8 decimal digit values, one per byte (first byte most significant) -> their number."""
    x = (x * np.uint64(10) + (x >> _U8)) & _M8
    x = (x * np.uint64(100) + (x >> _U16)) & _M16
    return (x * np.uint64(10000) + (x >> _U32)) & _M32


def _swar_hex8(x: np.ndarray) -> np.ndarray:
    """8 nibble values, one per byte (first byte most significant) -> their 32-bit number."""
    x = ((x & _M8) << _U4) | ((x >> _U8) & _M8)
    x = ((x & _M16) << _U8) | ((x >> _U16) & _M16)
    return ((x & _M32) << _U16) | (x >> _U32)


def _right_aligned(v64: np.ndarray, ends: np.ndarray, width: int) -> np.ndarray:
    """The ``width`` (8 or 16) bytes that end at each field's end, as a [K, width] uint8 matrix."""
    if width == 8:
        return v64[ends - 8].view(np.uint8).reshape(-1, 8)
    return np.stack([v64[ends - 16], v64[ends - 8]], axis=1).view(np.uint8).reshape(-1, 16)


def _parse_ints(v64: np.ndarray, ends: np.ndarray, lengths: np.ndarray, dots: bool,
                signs: bool) -> tuple[np.ndarray, np.ndarray]:
    """Values (int64; 0 where empty) and validity of integer fields. At most 16 characters."""
    vals = np.zeros(len(ends), dtype=np.int64)
    ok = lengths <= 16
    short = lengths <= 8
    if short.all():
        return _ints_width(v64, ends, lengths, 8, dots, signs)
    for sel, width in ((np.flatnonzero(short), 8), (np.flatnonzero(~short & ok), 16)):
        if sel.size:
            vals[sel], ok[sel] = _ints_width(v64, ends[sel], lengths[sel], width, dots, signs)
    return vals, ok


def _word(mask: np.ndarray) -> np.ndarray:
    """A [K, 8] bool/uint8 matrix as K uint64 words: 'all' and 'any' of a row become one compare."""
    return mask.view(np.uint8).view("<u8")[:, 0]


def _ints_width(v64: np.ndarray, ends: np.ndarray, lengths: np.ndarray, width: int,
                dots: bool = True, signs: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """dots / signs: whether the block holds any '.' / '-' at all (else those checks are skipped)."""
    if width == 16:
        return _ints_16(v64, ends, lengths)
    w = v64[ends - 8]
    b = w.view(np.uint8).reshape(-1, 8)
    m8 = np.minimum(lengths, 8)
    inside = _INSIDE[m8]  # 0xFF in the bytes that belong to the field
    if dots:
        dot = _word(b == 46) & inside
        if dot.any():  # "17668.0": the zero fraction is cut off, then the integer part is read
            return _ints_dotted(v64, ends, lengths, b, inside, dot, signs)
    d = b - np.uint8(48)
    bad = _word(d > 9) & inside
    digits = _word(d) & inside
    if not signs:
        return _swar_dec8(digits).astype(np.int64), bad == 0
    minus = _word(b == 45) & _FIRST[m8]  # a '-' only as the first byte, and not alone
    neg = minus != 0
    ok = ((bad & ~minus) == 0) & ~(neg & (lengths == 1))
    vals = _swar_dec8(digits & ~(minus * np.uint64(0xFF))).astype(np.int64)
    return np.where(neg, -vals, vals), ok


def _ints_dotted(v64: np.ndarray, ends: np.ndarray, lengths: np.ndarray, b: np.ndarray,
                 inside: np.ndarray, dot: np.ndarray, signs: bool) -> tuple[np.ndarray, np.ndarray]:
    has = dot != 0
    lowest = dot & (~dot + np.uint64(1))  # the first dot's byte (a power of two: exact in float64)
    col = np.zeros(len(dot), dtype=np.int64)
    col[has] = np.log2(lowest[has].astype(np.float64)).astype(np.int64) >> 3
    cut = np.where(has, 8 - col, 0)  # bytes from the dot to the end of the field
    after = inside & _INSIDE[np.maximum(cut - 1, 0)]  # the bytes after the dot
    zeros = (_word(b != 48) & after) == 0
    vals, ok = _ints_width(v64, ends - cut, lengths - cut, 8, dots=False, signs=signs)
    return vals, ok & (~has | (zeros & (lengths - cut > 0)))


def _ints_16(v64: np.ndarray, ends: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Fields of 9..16 characters (rare): byte matrices, no speed tricks."""
    b = _right_aligned(v64, ends, 16)
    inside = _COL16 >= (16 - lengths)[:, None]
    dot = (b == 46) & inside
    has = dot.any(axis=1)
    cut = np.where(has, 16 - dot.argmax(axis=1), 0)  # bytes from the first dot to the end
    zeros = np.all((b == 48) | ~inside | (_COL16 < (17 - cut)[:, None]), axis=1)
    ends, lengths = ends - cut, lengths - cut
    vals = np.zeros(len(ends), dtype=np.int64)
    ok = np.zeros(len(ends), dtype=bool)
    short = np.flatnonzero(lengths <= 8)
    vals[short], ok[short] = _ints_width(v64, ends[short], lengths[short], 8, dots=False)
    long = np.flatnonzero(lengths > 8)
    if long.size:
        b = _right_aligned(v64, ends[long], 16)
        first = (16 - lengths[long])[:, None]
        inside = _COL16 >= first
        minus = (b == 45) & (_COL16 == first)
        digit = b - np.uint8(48)
        ok[long] = ~np.any((digit > 9) & inside & ~minus, axis=1)
        digit[~inside | minus] = 0
        words = _swar_dec8(digit.view("<u8"))
        v = words[:, 1].astype(np.int64) + words[:, 0].astype(np.int64) * 100_000_000
        vals[long] = np.where(minus.any(axis=1), -v, v)
    return vals, ok & (~has | (zeros & (lengths > 0)))


def _parse_cats(buf: np.ndarray, v64: np.ndarray, ends: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Feature keys [n, 26] of the categorical fields (see hvctr.formats for the rule)."""
    n = ends.shape[0]
    ends, lengths = ends.ravel(), lengths.ravel()
    values, hexok = _hex_values(v64, ends, lengths)
    keys = formats.hex_keys(_FIELDS, values.reshape(n, NUM_FIELDS))  # fields broadcast over rows
    missing = lengths.reshape(n, NUM_FIELDS) == 0
    keys = np.where(missing, formats.MISSING_KEYS, keys)
    other = np.flatnonzero(~hexok & ~missing.ravel())
    if other.size:
        field_of = (other % NUM_FIELDS).astype(np.uint64)
        keys.reshape(-1)[other] = _string_keys(buf, ends[other], lengths[other], field_of)
    return keys


def _hex_values(v64: np.ndarray, ends: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Values (uint64) of hex fields and whether a field is 1..16 hex digits."""
    ok = (lengths >= 1) & (lengths <= 16)
    if np.all((lengths == 8) | (lengths == 0)):  # Criteo's own values: one pass, no masks
        vals, good = _hex_width(v64, ends, lengths, 8, full=True)
        return vals, ok & good
    vals = np.zeros(len(ends), dtype=np.uint64)
    for mask, width in ((ok & (lengths <= 8), 8), (ok & (lengths > 8), 16)):
        sel = np.flatnonzero(mask)
        if sel.size:
            vals[sel], good = _hex_width(v64, ends[sel], lengths[sel], width)
            ok[sel] &= good
    return vals, ok


def _hex_width(v64: np.ndarray, ends: np.ndarray, lengths: np.ndarray, width: int,
               full: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """full: every field is 8 bytes or empty (an empty one's value is never used): no masks."""
    if width == 16:
        hi, okhi = _hex_width(v64, ends - 8, np.maximum(lengths - 8, 0), 8)
        lo, oklo = _hex_width(v64, ends, np.minimum(lengths, 8), 8)
        return (hi << _U32) | lo, okhi & oklo
    w = v64[ends - 8]
    b = w.view(np.uint8).reshape(-1, 8)
    lower = b | np.uint8(0x20)
    nothex = _word(((b - np.uint8(48)) > 9) & ((lower - np.uint8(97)) > 5))
    # ASCII hex -> nibble: low 4 bits, plus 9 for letters (bit 6 set)
    nib = (w & _LOW4) + np.uint64(9) * ((w >> np.uint64(6)) & _ONES)
    if full:
        return _swar_hex8(nib), nothex == 0
    inside = _INSIDE[np.minimum(lengths, 8)]
    return _swar_hex8(nib & inside), (nothex & inside) == 0


def _string_keys(buf: np.ndarray, ends: np.ndarray, lengths: np.ndarray, field_of: np.ndarray) -> np.ndarray:
    """FNV-1a of (field prefix, value bytes), one column of bytes at a time across the values,
    while at least _LANES values are still that long; the bytes beyond, of the few longer
    values, one value at a time. A column costs a few numpy calls whatever the number of values
    in it, so one 10 MB value took 10M of them (41 s); now the work follows the bytes."""
    h = formats.FIELD_FNV_STATE[field_of.astype(np.int64)].copy()
    starts = ends - lengths
    columns = int(np.partition(lengths, -_LANES)[-_LANES]) if lengths.size > _LANES else 0
    for j in range(columns):
        active = j < lengths
        byte = buf[np.where(active, starts + j, 0)].astype(np.uint64)
        h = np.where(active, (h ^ byte) * formats.FNV_PRIME, h)
    for i in np.flatnonzero(lengths > columns):  # fewer than _LANES values
        h[i] = formats.fnv1a64_bytes(buf[starts[i] + columns:ends[i]].tobytes(), int(h[i]))
    return formats.string_keys(h)


_LANES = 32  # below this many values a column, a Python loop over each one's bytes is cheaper


def _int_reasons(raw: bytes, starts: np.ndarray, ends: np.ndarray, rows: np.ndarray,
                 iok: np.ndarray, label_ok: np.ndarray) -> list[tuple[int, str]]:
    """Why each rejected line was rejected: the first bad integer column and its text."""
    out = []
    for k in np.flatnonzero(~(label_ok & iok[:, 1:].all(axis=1))):
        if not label_ok[k]:
            col = 0
            what = "label must be 0 or 1"
        else:
            col = 1 + int(np.argmin(iok[k, 1:]))
            what = "not an integer"
        text = raw[starts[k, col]:ends[k, col]].decode("ascii", "replace")
        if len(text) > 16:
            what = "longer than 16 characters"
        out.append((int(rows[k]), f"{formats.COLUMN_NAMES[col]}: {what}: {text[:40]!r}"))
    return out
