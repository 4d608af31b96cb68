"""The vectorised Criteo parser against a slow, obvious reference, value by value."""

from __future__ import annotations

import math
import random
import re

import numpy as np
import pytest

from hvctr import formats
from hvctr.formats.lines import RowFormat, parse_block
from hvctr.formats import EMPTY_KEY, EMPTY_KEY_REMAP, mix64
from tests.conftest import TEST_DATA

SAMPLE = TEST_DATA / "criteo_sample_400.tsv"
_INT = re.compile(r"-?[0-9]+(\.0*)?")

INT_MENU = ["", "", "0", "7", "-1", "-12", "42", "123456789012345", "1234567890123456", "99999999",
            "-9999999", "100000000", "17668.0", "5.00", "5.", "12345678.0", "-1234567.0",
            # malformed: each makes its line bad
            "12345678901234567", "1.5", "abc", "-", "1-2", "--1", ".0", "+5", "1.0.0", " 3", "0x1F"]
CAT_MENU = ["", "", "05db9164", "0", "a", "ABCDEF12", "aBcD", "123456789abcdef0", "123456789abcdef01",
            "hello", "xyz_1", "00000000", "ffffffffffffffff", "g1234567", "1234567g", "-1", "1.5",
            "x" * 40, "68fd1e64"]
LABEL_MENU = ["0", "1", "0", "1", "1.0", "2", "", "x"]


def ref_int(text: str) -> int | None:
    """The integer rule, spelled out: optional '-', digits, optional zero fraction, <= 16 chars."""
    if text == "":
        return 0
    if len(text) > 16 or not _INT.fullmatch(text):
        return None
    return int(text.split(".")[0])


def ref_parse(text: str, fmt: RowFormat):
    rows, bad = [], []
    lines = text.split("\n")
    if text.endswith("\n"):
        lines = lines[:-1]
    for i, line in enumerate(lines):
        f = line.rstrip("\r").split(chr(fmt.sep))
        if len(f) != fmt.ncols:
            bad.append(i)
            continue
        f = [f[c] for c in fmt.cols]
        ints = [ref_int(x) for x in f[:14]]
        if any(v is None for v in ints) or ints[0] not in (0, 1) or f[0] == "":
            bad.append(i)
            continue
        dense = [math.log1p(max(v, 0)) for v in ints[1:]]
        keys = [formats.key_of(j, f[14 + j]) for j in range(26)]
        rows.append((ints[0], dense, keys, i))
    return rows, bad


def check_same(blk, rows, bad) -> None:
    assert [i for i, _ in blk.bad] == bad
    assert blk.lines.tolist() == [r[3] for r in rows]
    assert blk.labels.tolist() == [float(r[0]) for r in rows]
    np.testing.assert_array_equal(blk.dense, np.array([r[1] for r in rows], dtype=np.float32).reshape(-1, 13))
    np.testing.assert_array_equal(blk.keys, np.array([r[2] for r in rows], dtype=np.uint64).reshape(-1, 26))


def random_lines(n: int, seed: int, p_bad: float = 0.15) -> list[str]:
    rnd = random.Random(seed)
    good_ints = [x for x in INT_MENU if ref_int(x) is not None]
    out = []
    for _ in range(n):
        bad = rnd.random() < p_bad
        f = [rnd.choice(LABEL_MENU if bad else ["0", "1"])]
        f += [rnd.choice(INT_MENU if bad else good_ints) for _ in range(13)]
        f += [rnd.choice(CAT_MENU) for _ in range(26)]
        if bad and rnd.random() < 0.3:
            f = f[:-1] if rnd.random() < 0.5 else f + ["extra"]
        out.append("\t".join(f))
    return out


def test_key_rule_is_designs():
    # the key rule (docs/data.md): mix64((field << 56) ^ int(hex, 16)); the reference key_of must say the same
    ref = lambda f, v: int(mix64(np.array([((f << 56) ^ v) & (2**64 - 1)], dtype=np.uint64))[0])
    assert formats.key_of(0, "05db9164") == ref(0, 0x05DB9164)
    assert formats.key_of(25, "ABCdef12") == ref(25, 0xABCDEF12)
    assert formats.key_of(3, "ffffffffffffffff") == ref(3, 2**64 - 1)
    # missing values: one key per field, none equal to another field's
    assert len(set(formats.MISSING_KEYS.tolist())) == 26
    assert formats.key_of(7, "") == int(formats.MISSING_KEYS[7])
    # non-hex: a string hash of (field, value), different per field
    assert formats.key_of(1, "hello") != formats.key_of(2, "hello")
    # the reserved empty marker never appears
    keys = formats.hex_keys(np.zeros(1, dtype=np.uint64), np.array([0], dtype=np.uint64))
    assert keys[0] != EMPTY_KEY and EMPTY_KEY_REMAP != EMPTY_KEY


def test_real_criteo_rows_match_reference():
    data = SAMPLE.read_bytes()
    blk = parse_block(data, RowFormat.tsv())
    rows, bad = ref_parse(data.decode(), RowFormat.tsv())
    assert blk.num_lines == 400 and not blk.bad and not bad
    check_same(blk, rows, bad)
    assert blk.missing.sum() > 0  # Criteo has empty fields; they are counted


def test_random_and_malformed_fields_match_reference():
    text = "\n".join(random_lines(3000, seed=1)) + "\n"
    blk = parse_block(text.encode(), RowFormat.tsv())
    rows, bad = ref_parse(text, RowFormat.tsv())
    assert 200 < len(bad) < 900  # the corpus really exercises both paths
    check_same(blk, rows, bad)
    for i, why in blk.bad:
        assert why  # every rejection says why
    # blocks without any '-' or '.' take shortcuts: the same answers
    plain = text.replace("-", "x").replace(".", "y")
    check_same(parse_block(plain.encode(), RowFormat.tsv()), *ref_parse(plain, RowFormat.tsv()))


def test_reasons_name_the_column():
    line = "\t".join(["1"] + ["3"] * 4 + ["1.5"] + ["3"] * 8 + ["05db9164"] * 26)
    blk = parse_block((line + "\n" + line.replace("1.5", "7") + "\n").encode(), RowFormat.tsv())
    assert blk.bad == [(0, "I5: not an integer: '1.5'")]
    blk = parse_block(b"\t".join([b"2"] + [b""] * 39) + b"\n", RowFormat.tsv())
    assert blk.bad[0][1].startswith("label must be 0 or 1") or "label" in blk.bad[0][1]
    blk = parse_block((line.replace("1.5", "1" * 17) + "\n").encode(), RowFormat.tsv())
    assert blk.bad == [(0, "I5: longer than 16 characters: '" + "1" * 17 + "'")]
    blk = parse_block(b"1\t2\t3\n", RowFormat.tsv())
    assert blk.bad == [(0, "expected 40 fields, found 3")]


def test_block_edges_crlf_and_missing_final_newline():
    lines = random_lines(500, seed=2, p_bad=0.0)
    lf = ("\n".join(lines) + "\n").encode()
    whole = parse_block(lf, RowFormat.tsv())
    crlf = parse_block(("\r\n".join(lines)).encode(), RowFormat.tsv())  # CRLF, no final newline
    np.testing.assert_array_equal(whole.keys, crlf.keys)
    np.testing.assert_array_equal(whole.dense, crlf.dense)
    assert crlf.num_lines == 500
    # the same rows cut into arbitrary blocks of whole lines
    cuts = sorted(random.Random(3).sample(range(1, 500), 7))
    parts = [parse_block(("\n".join(lines[a:b]) + "\n").encode(), RowFormat.tsv())
             for a, b in zip([0] + cuts, cuts + [500])]
    np.testing.assert_array_equal(np.concatenate([p.keys for p in parts]), whole.keys)
    assert parse_block(b"", RowFormat.tsv()).num_lines == 0


def test_deepctr_csv_with_header_in_any_order_equals_tsv():
    lines = random_lines(400, seed=4, p_bad=0.0)
    tsv = parse_block(("\n".join(lines) + "\n").encode(), RowFormat.tsv())
    names = list(formats.COLUMN_NAMES)
    order = list(range(40))
    random.Random(5).shuffle(order)
    header = ",".join(["Id"] + [names[c].upper() if c % 3 == 0 else names[c] for c in order])
    fmt = RowFormat.from_header(header.encode())
    rows = []
    for k, line in enumerate(lines):
        f = line.split("\t")
        # DeepCTR writes integer columns as floats: "3" -> "3.0" (fields stay within 16 characters)
        f = [x + ".0" if 1 <= c <= 13 and x and "." not in x and len(x) <= 14 else x for c, x in enumerate(f)]
        rows.append(",".join([str(k)] + [f[c] for c in order]))
    csv = parse_block(("\r\n".join(rows) + "\r\n").encode(), fmt)
    np.testing.assert_array_equal(csv.labels, tsv.labels)
    np.testing.assert_array_equal(csv.dense, tsv.dense)
    np.testing.assert_array_equal(csv.keys, tsv.keys)


def test_csv_header_must_name_every_column():
    with pytest.raises(ValueError, match="C26"):
        RowFormat.from_header(",".join(formats.COLUMN_NAMES[:-1]).encode(), where="x.csv:1")
    with pytest.raises(ValueError, match="x.csv:1"):
        RowFormat.from_header(b"label,label," + ",".join(formats.COLUMN_NAMES[1:]).encode(), where="x.csv:1")
