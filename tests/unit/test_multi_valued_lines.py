"""Multi-valued fields in hvctr.formats.lines: the vectorised parse against a per-row Python reference."""

from __future__ import annotations

import random

import numpy as np
import pytest

from hvctr import formats
from hvctr.formats.lines import RowFormat, parse_block

MULTI = (2, 20, 25)  # C3, C21, C26 (the last field: its text ends at the newline)


def _token(rng: random.Random) -> str:
    r = rng.random()
    if r < 0.45:
        return "%08x" % rng.getrandbits(32)  # Criteo's own values
    if r < 0.55:
        return ""  # dropped: "a,,b" is 2 keys
    if r < 0.75:
        return "".join(rng.choice("abcxyz0123_") for _ in range(rng.randint(1, 40)))  # string rule, long ones too
    return "%x" % rng.getrandbits(rng.randint(1, 64))  # hex of 1..16 digits


def _lines(rng: random.Random, rows: int, sep: str = ",") -> list[list[str]]:
    """Rows of 40 fields; MULTI fields hold 0..17 tokens (empty ones included); a few bad integers."""
    out = []
    for i in range(rows):
        f = [str(rng.randint(0, 1))] + [str(rng.randint(0, 999)) if rng.random() > 0.2 else "" for _ in range(13)]
        for c in range(formats.NUM_FIELDS):
            if c in MULTI:
                f.append(sep.join(_token(rng) for _ in range(rng.choice([0, 1, 1, 2, 5, 17]))))
            else:
                f.append(_token(rng).replace(sep, ""))
        if i % 97 == 5:
            f[3] = "x1"  # a bad line among the multi-valued ones
        out.append(f)
    return out


def _reference(rows: list[list[str]], multi=MULTI, sep: str = ","):
    """Per row, the slow obvious way: good rows' indices, lengths [n, 26] and flat keys."""
    good, lengths, keys = [], [], []
    for i, f in enumerate(rows):
        if f[3] and not f[3].isdigit():
            continue
        good.append(i)
        row_len = []
        for c in range(formats.NUM_FIELDS):
            text = f[1 + formats.NUM_DENSE + c]
            tokens = [t for t in text.split(sep) if t] if c in multi else [text]
            row_len.append(len(tokens))
            keys += [formats.key_of(c, t) for t in tokens]
        lengths.append(row_len)
    return good, lengths, keys


def test_tokens_and_keys_match_the_per_row_reference():
    rows = _lines(random.Random(1), 2000)
    data = "".join("\t".join(f) + "\n" for f in rows).encode()
    blk = parse_block(data, RowFormat.tsv(), MULTI)
    good, lengths, keys = _reference(rows)
    assert blk.lines.tolist() == good and len(blk.bad) == len(rows) - len(good)
    assert blk.lengths.dtype == np.uint16 and blk.lengths.tolist() == lengths
    assert blk.keys.dtype == np.uint64 and blk.keys.tolist() == keys
    assert (blk.lengths[:, list(MULTI)] == 0).any()  # empty bags were exercised
    one = [c for c in range(formats.NUM_FIELDS) if c not in MULTI]
    assert (blk.lengths[:, one] == 1).all()
    # missing: a multi-valued field is missing when it holds no key
    np.testing.assert_array_equal(blk.missing[formats.NUM_DENSE + np.array(MULTI)],
                                  (blk.lengths[:, list(MULTI)] == 0).sum(axis=0))


def test_a_token_is_keyed_as_the_same_one_valued_value_of_its_field():
    values = ["68fd1e64", "", "abc", "ABCDEF0123456789", "not hex at all, longer than 16"]
    line = ["1"] + ["1"] * 13 + ["05db9164"] * 26
    one_rows = []
    for v in values:
        for c in (2, 20):
            one = list(line)
            one[14 + c] = v.replace(",", "")
            one_rows.append(one)
    data = "".join("\t".join(f) + "\n" for f in one_rows).encode()
    blk_one = parse_block(data, RowFormat.tsv())  # C3 and C21 one-valued
    blk_multi = parse_block(data, RowFormat.tsv(), (2, 20))  # the same text, multi-valued
    lengths = blk_multi.lengths.astype(np.int64)
    # every row: one value in each field, or none where that value is empty
    expect = np.where(np.array([[r[14 + c] == "" for c in range(26)] for r in one_rows]) & np.isin(np.arange(26), (2, 20)),
                      0, 1)
    np.testing.assert_array_equal(lengths, expect)
    at = np.concatenate([[0], np.cumsum(lengths.ravel())])
    for r in range(len(one_rows)):
        for c in range(26):
            got = blk_multi.keys[at[r * 26 + c]:at[r * 26 + c + 1]]
            if lengths[r, c]:
                assert got.tolist() == [blk_one.keys[r, c]]


def test_empty_tokens_and_fields():
    line = ["0"] + [""] * 13 + ["a1"] * 26
    cases = {"a,,b": ["a", "b"], "": [], ",": [], ",,,x,": ["x"], "abc": ["abc"], ",y": ["y"]}
    rows = []
    for text in cases:
        f = list(line)
        f[14 + 2] = text
        rows.append(f)
    blk = parse_block("".join("\t".join(f) + "\n" for f in rows).encode(), RowFormat.tsv(), (2,))
    assert not blk.bad
    assert blk.lengths[:, 2].tolist() == [len(v) for v in cases.values()]
    at = np.concatenate([[0], np.cumsum(blk.lengths.sum(axis=1, dtype=np.int64))])
    for r, want in enumerate(cases.values()):
        row = blk.keys[at[r]:at[r + 1]].tolist()
        assert row[2:2 + len(want)] == [formats.key_of(2, t) for t in want]
        assert row[:2] == [formats.key_of(0, "a1"), formats.key_of(1, "a1")]


def test_a_field_with_too_many_values_is_a_bad_line():
    line = ["1"] + ["3"] * 13 + ["a1"] * 26
    rows = []
    for n in (3, formats.MAX_FIELD_KEYS, formats.MAX_FIELD_KEYS + 1, 2):
        f = list(line)
        f[14 + 20] = ",".join(["b"] * n + ["", ""])  # the empty tokens do not count
        rows.append(f)
    blk = parse_block("".join("\t".join(f) + "\n" for f in rows).encode(), RowFormat.tsv(), (2, 20))
    assert blk.lines.tolist() == [0, 1, 3]
    assert blk.bad == [(2, f"C21: {formats.MAX_FIELD_KEYS + 1:,} values, more than {formats.MAX_FIELD_KEYS:,} "
                           "(the most one field of a row holds)")]
    assert blk.lengths[:, 20].tolist() == [3, formats.MAX_FIELD_KEYS, 2]
    assert blk.keys.size == int(blk.lengths.sum()) == 3 * 26 + 3 + formats.MAX_FIELD_KEYS + 2 - 3


def test_csv_columns_in_any_order_with_another_separator():
    rng = random.Random(7)
    rows = _lines(rng, 400, sep="|")
    names = list(formats.COLUMN_NAMES)
    perm = list(range(len(names)))
    rng.shuffle(perm)
    header = ",".join(names[i] for i in perm)
    data = (header + "\n").encode()
    fmt = RowFormat.from_header(data.rstrip(b"\n"))
    body = "".join(",".join(f[i] for i in perm) + "\n" for f in rows).encode()
    blk = parse_block(body, fmt, MULTI, b"|")
    good, lengths, keys = _reference(rows, sep="|")
    assert blk.lines.tolist() == good
    assert blk.lengths.tolist() == lengths and blk.keys.tolist() == keys


def test_one_valued_parse_is_unchanged_without_multi_valued_fields():
    rows = _lines(random.Random(3), 300)
    data = "".join("\t".join(f) + "\n" for f in rows).encode()
    blk = parse_block(data, RowFormat.tsv())
    assert blk.lengths is None and blk.keys.shape == (len(blk.lines), 26)
    good, _, keys = _reference(rows, multi=())
    assert blk.keys.ravel().tolist() == keys and blk.lines.tolist() == good


@pytest.mark.parametrize("sep, fmt, msg", [(b",", RowFormat.from_header(",".join(formats.COLUMN_NAMES).encode()),
                                            "is the column separator of CSV input"),
                                           (b"\t", RowFormat.tsv(), "is the column separator of TSV input"),
                                           (b"\n", RowFormat.tsv(), "one ASCII character other than a line end"),
                                           (b";;", RowFormat.tsv(), "one ASCII character")])
def test_a_value_separator_that_cannot_work_is_refused(sep, fmt, msg):
    with pytest.raises(ValueError, match=msg):
        parse_block(b"", fmt, (2,), sep)
