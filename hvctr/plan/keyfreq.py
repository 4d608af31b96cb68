"""How many distinct keys a stretch of data touches: the unique-key curve D(n).

D(n) is the expected number of distinct feature keys in n consecutive training rows. One
curve answers every sizing question of the planner (rows are assumed exchangeable, so a
window anywhere in the stream has the same expectation as the stream's first n rows):

    working set of a window      D(k * B)             rows per rank, k batches of B
    what one owner answers       D(W * k * B) / W     the union of every rank's window
    new keys of a pass           D(N)                 N rows of the pass: the table

Two sources:

- ``zipf_curve(keys, exponent, fields)``: every row draws ``fields`` keys from one Zipf law
  over ``keys`` keys, p_i ~ i^-s. D(n) = sum_i 1 - exp(-n F p_i), summed exactly for the
  first 2^16 ranks and by Euler-Maclaurin (a trapezoid in log i) beyond, so 10^11 keys
  cost milliseconds. An assumption: real fields have their own vocabularies.
- ``data_curve(data_dir)``: measured on a data_prep output: exact distinct counts on a
  prefix of the train split (small sizes: the mean over up to 16 disjoint windows; larger
  ones: the prefix itself), and the whole split's count from the union of its shards'
  HyperLogLog sketches.

Between measured points D is interpolated linearly in log n / log D; below the first point
it grows linearly, beyond the last with the last segment's slope, never above n * F nor
above the number of keys.

``hit_rate(window_rows, cached_keys)``: the fraction of an owner's reads (distinct keys of
a window) that an ideal frequency cache of ``cached_keys`` keys (the hottest) answers.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

import numpy as np

_EXACT_RANKS = 1 << 16  # ranks summed term by term; the smooth tail is integrated
_TAIL_POINTS = 4096
_WINDOWS, _SMALL_KEYS = 16, 1 << 21  # data curve: windows averaged per size, while that many keys


def _zipf_sum(fn, n_keys: int, exponent: float) -> float:
    """sum_{i=1}^{n_keys} fn(i^-s), fn vectorised and smooth in i: exact head, integrated tail."""
    head = min(n_keys, _EXACT_RANKS)
    i = np.arange(1, head + 1, dtype=np.float64)
    total = float(fn(i ** -exponent).sum())
    if n_keys > head:
        # sum_{i=a}^{b} f(i) ~ int_a^b f + (f(a) + f(b)) / 2, with f smooth and monotone;
        # the integral in t = log i: int f(e^t) e^t dt, trapezoid on a uniform grid in t.
        a, b = float(head + 1), float(n_keys)
        t = np.linspace(math.log(a), math.log(b), _TAIL_POINTS)
        x = np.exp(t)
        y = fn(x ** -exponent) * x
        integral = float(np.sum((y[1:] + y[:-1]) * np.diff(t)) / 2)
        ends = fn(np.array([a ** -exponent, b ** -exponent]))
        total += integral + float(ends.sum()) / 2
    return total


@dataclass(frozen=True)
class KeyCurve:
    """D(n) through measured or computed points; see the module docstring."""

    rows: tuple[float, ...]  # ascending row counts
    distinct: tuple[float, ...]  # expected distinct keys at each
    fields: float  # keys per row (a mean where fields are multi-valued)
    keys: float = math.inf  # the key space: D never exceeds it
    source: str = ""  # how the curve was made, for the plan's report
    # For hit_rate: ("zipf", exponent) or ("counts", keys' counts in the sample, descending,
    # and the sample's rows).
    zipf_exponent: float = 0.0
    sample_counts: np.ndarray | None = field(default=None, compare=False, repr=False)
    sample_rows: int = 0

    def __post_init__(self) -> None:
        if len(self.rows) != len(self.distinct) or not self.rows:
            raise ValueError("a key curve needs at least one (rows, distinct) point")
        if any(b <= a for a, b in zip(self.rows, self.rows[1:])):
            raise ValueError(f"key curve rows must ascend: {self.rows}")

    def __call__(self, n: float) -> float:
        """Expected distinct keys in ``n`` rows."""
        if n <= 0:
            return 0.0
        r, d = np.log(np.asarray(self.rows)), np.log(np.maximum(np.asarray(self.distinct), 1e-300))
        x = math.log(n)
        if n <= self.rows[0]:
            value = self.distinct[0] * n / self.rows[0]  # few rows: nearly every key is new
        elif len(r) == 1:
            value = self.distinct[0]
        elif n >= self.rows[-1]:
            slope = (d[-1] - d[-2]) / (r[-1] - r[-2])
            value = math.exp(d[-1] + max(slope, 0.0) * (x - r[-1]))
        else:
            value = math.exp(float(np.interp(x, r, d)))
        return float(min(value, n * self.fields, self.keys))

    def hit_rate(self, window_rows: float, cached_keys: float) -> float:
        """Share of a window's distinct keys that are among the ``cached_keys`` hottest."""
        if cached_keys <= 0:
            return 0.0
        if cached_keys >= self.keys:
            return 1.0
        m = window_rows * self.fields  # key draws in the window
        if self.sample_counts is not None:
            # q_j = P(key j is in the window), from its count in the sample (descending).
            q = -np.expm1(-self.sample_counts.astype(np.float64) * (window_rows / self.sample_rows))
            total = q.sum()
            if total <= 0:
                return 1.0
            n_sample = q.shape[0]
            # Keys seen once in the sample are the data's rare ones: the data has more of them
            # than the sample shows (self.keys, from the split's sketches), and the cache holds
            # only its share of that pool, never every one the sample happened to see (which
            # would read 1.000 for any cache larger than the sample's keys).
            multi = int(np.searchsorted(-self.sample_counts, -1, side="left"))  # keys seen twice or more
            if cached_keys <= multi or self.keys <= n_sample:
                c = int(min(cached_keys, n_sample))
                return float(q[:c].sum() / total)
            share = min((cached_keys - multi) / max(self.keys - multi, 1.0), 1.0)
            return float((q[:multi].sum() + share * q[multi:].sum()) / total)
        s, n_keys = self.zipf_exponent, int(self.keys)
        norm = _zipf_sum(lambda p: p, n_keys, s)
        q = lambda p: -np.expm1(-m * p / norm)
        hot = _zipf_sum(q, int(cached_keys), s)
        return float(min(hot / max(_zipf_sum(q, n_keys, s), 1e-300), 1.0))


def zipf_distinct(n_rows: float, keys: int, exponent: float, fields: int) -> float:
    """sum_i 1 - exp(-n F p_i) with p_i = i^-s / H(keys, s): expected distinct keys in n rows."""
    norm = _zipf_sum(lambda p: p, keys, exponent)
    m = n_rows * fields
    return _zipf_sum(lambda p: -np.expm1(-m * p / norm), keys, exponent)


def zipf_curve(keys: int, exponent: float, fields: int, max_rows: float = 1e13) -> KeyCurve:
    """D(n) of the Zipf model at 2 points per decade of n, from one row to ``max_rows``."""
    if keys < 1:
        raise ValueError(f"--keys must be >= 1, got {keys}")
    if exponent <= 0:
        raise ValueError(f"--zipf exponent must be > 0, got {exponent}")
    rows = np.unique(np.round(np.logspace(0, math.log10(max_rows), int(2 * math.log10(max_rows)) + 1)))
    distinct = [zipf_distinct(float(n), keys, exponent, fields) for n in rows]
    return KeyCurve(rows=tuple(float(r) for r in rows), distinct=tuple(distinct), fields=fields,
                    keys=float(keys), source=f"Zipf model: {keys:,} keys, exponent {exponent:g}, "
                                            f"{fields} keys per row (an assumption)",
                    zipf_exponent=exponent)


# measured on data --------------------------------------------------------------------


def _read_keys(data_dir: str, records: list[dict], max_rows: int) -> tuple[np.ndarray, np.ndarray]:
    """(the first ``max_rows`` train rows' keys, flat, row by row; int64 [rows + 1] row offsets
    into them): one key a field in format version 1, 0..n in version 2's multi-valued fields."""
    import h5py

    parts, ends, have = [], [np.zeros(1, np.int64)], 0
    for rec in records:
        if have >= max_rows:
            break
        with h5py.File(os.path.join(data_dir, rec["file"]), "r") as f:
            take = min(int(rec["rows"]), max_rows - have)
            if "offsets" in f:  # multi-valued
                off = f["offsets"][:take + 1].astype(np.int64)
                parts.append(f["keys"][:int(off[-1])])
            else:
                keys = f["keys"][:take]
                off = np.arange(take + 1, dtype=np.int64) * keys.shape[1]
                parts.append(keys.reshape(-1))
            ends.append(off[1:] + ends[-1][-1])
            have += take
    if not parts:
        raise ValueError(f"{data_dir}: the train split has no rows")
    return np.concatenate(parts), np.concatenate(ends)


def _mean_distinct(keys: np.ndarray, row_offsets: np.ndarray, n: int) -> float:
    windows = min((row_offsets.size - 1) // n, _WINDOWS)
    return float(np.mean([np.unique(keys[row_offsets[w * n]:row_offsets[(w + 1) * n]]).shape[0]
                          for w in range(windows)]))


def _split_distinct(data_dir: str, records: list[dict]) -> float:
    """Distinct keys of the whole split: the union of its shards' HyperLogLog sketches."""
    import h5py

    from hvctr.formats import KeySketch

    union = KeySketch()
    for rec in records:
        with h5py.File(os.path.join(data_dir, rec["file"]), "r") as f:
            union.merge(KeySketch(f["key_sketch"][...]))
    return float(union.estimate().sum())


def data_curve(data_dir: str, sample_rows: int = 1 << 20) -> KeyCurve:
    """D(n) measured on the train split of a data_prep directory (see the module docstring)."""
    from hvctr.data.reader import load_manifest

    manifest = load_manifest(data_dir)
    records = manifest["shards"]["train"]
    total = int(sum(r["rows"] for r in records))
    sample, row_offsets = _read_keys(data_dir, records, min(sample_rows, total))
    n_s = row_offsets.size - 1
    fields = sample.size / n_s  # keys a row: model.num_fields, or multi-valued fields' mean
    # One sort gives every prefix's count (a key is new in the prefix that holds its first
    # occurrence) and each key's count; small windows are averaged over several instead.
    _, first, counts = np.unique(sample, return_index=True, return_counts=True)
    first_row = np.sort(np.searchsorted(row_offsets, first, side="right") - 1)
    sizes = [1 << e for e in range(0, 64) if (1 << e) <= n_s]
    rows = [float(n) for n in sizes]
    distinct = [_mean_distinct(sample, row_offsets, n) if n * fields * _WINDOWS <= _SMALL_KEYS
                else float(np.searchsorted(first_row, n)) for n in sizes]
    if n_s not in sizes:
        rows.append(float(n_s))
        distinct.append(float(counts.shape[0]))
    if total > n_s:
        split = _split_distinct(data_dir, records)
        # HLL's ~1.6% error must not make the curve fall: the union holds the sample's keys
        rows.append(float(total))
        distinct.append(max(split, distinct[-1]))
    counts = np.sort(counts)[::-1]
    n_keys = distinct[-1] if total > n_s else float(counts.shape[0])
    return KeyCurve(rows=tuple(rows), distinct=tuple(distinct), fields=fields, keys=n_keys,
                    source=f"measured on {data_dir}: {n_s:,} of {total:,} train rows counted exactly"
                           + (", the split's total from its shards' HyperLogLog sketches" if total > n_s else ""),
                    sample_counts=counts, sample_rows=n_s)
