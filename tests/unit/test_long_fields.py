"""A categorical value of 10 MB (issue 28, item 10): hvctr score took 41 s over it, data_prep 37 s.

Non-hex values are hashed by FNV-1a one byte column at a time across the values of a block, a
few numpy calls a column whatever their number: one long value cost as many calls as it has
bytes. The columns now run while 32 values or more are that long, and the few longer values
finish one at a time; the keys are the reference's (hvctr.formats.key_of), bit for bit.
"""

from __future__ import annotations

import time

import numpy as np

from hvctr import formats
from hvctr.formats.lines import RowFormat, parse_block


def _line(cats: list[str]) -> str:
    return "\t".join(["1", *["3"] * 13, *cats])


def _reference(cats: list[str]) -> list[int]:
    return [formats.key_of(f, v) if v else int(formats.MISSING_KEYS[f]) for f, v in enumerate(cats)]


def test_long_and_short_string_values_get_the_reference_keys():
    rng = np.random.default_rng(1)
    rows = []
    for _ in range(300):  # lengths around the 32-lane cut, hex and non-hex, empty
        rows.append(["".join(rng.choice(list("xyz019"), int(n))) if n else "" for n in
                     rng.choice([0, 3, 8, 9, 17, 40, 70, 300, 2000], 26)])
    blk = parse_block(("\n".join(_line(r) for r in rows) + "\n").encode(), RowFormat.tsv())
    assert not blk.bad
    assert np.array_equal(blk.keys, np.array([_reference(r) for r in rows], dtype=np.uint64))


def test_a_10_mb_value_costs_seconds_not_a_minute():
    cats = ["68fd1e64"] * 26
    cats[7] = "z" * (10 << 20)
    data = ("\n".join(_line(cats if i == 0 else ["68fd1e64"] * 26) for i in range(20)) + "\n").encode()
    t0 = time.perf_counter()
    blk = parse_block(data, RowFormat.tsv())
    took = time.perf_counter() - t0
    assert blk.keys[0, 7] == formats.key_of(7, cats[7]) and blk.keys.shape == (20, 26)
    assert took < 15, f"{took:.1f} s for one 10 MB value"  # 37 s before; about 1.5 s here
