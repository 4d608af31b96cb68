"""``python -m data_prep synth``: Criteo-format TSV from a known model, with the true click probability.

    python -m data_prep synth --rows 2000000 --seed 1 --out synth.tsv --truth-out synth.truth

The hidden model (all of it a function of --seed):
- 26 categorical fields with Criteo's cardinalities (at least 10 values: tens to ten million);
  a field's value k in [0, V) is drawn with frequency ~ (k + q)^-a (Zipf-like, a in 1.05..1.4),
  written as 8 hex digits (a 32-bit bijection of k, so two values never share a string);
  Criteo's missing rates (0 to 76%).
- 13 heavy-tailed integer fields: floor(exp(mu + s * z)) (lognormal counts, s up to 2.6),
  Criteo's missing rates; I2 is sometimes -1..-3 as in the real logs.
- logit = bias + scale * (sum of per-value effects of the 26 fields (missing has its own)
  + dense effects beta_j * (log1p(x_j) - mu_j) / s_j (missing has its own)
  + 10 pairwise categorical interactions <e_a(v_a), e_b(v_b)> / 2 with 4-dim value embeddings
  + 2 products of dense fields); a value's effect and embedding are weighted
  S + (1 - S) / (1 + rank / 50), S = --tail-signal: at 0 (the default) rare values carry
  little of the signal, at 1 every value's effect has full weight whatever its frequency
  (see _tail_weight).
- --shape loguniform: a structurally different table, for results that must hold on more than
  one data set: vocabularies log-uniform from 10 to 2M values per field (not Criteo's), Zipf
  exponents 1.05..1.2 (flatter: more of the rows fall in the tail) and 8 interaction pairs.
  Per-value effects and embeddings are hashed from (seed, field, value): no table, so memory
  does not grow with the vocabularies. The scale and bias are set on a calibration sample so
  that the Bayes-optimal AUC is --target-auc (0.80) and the positive rate --positive-rate (0.25).
- --multi-hot SIZES (MLPerf DLRM-DCNv2's multi_hot_sizes: 26 integers, or C3=20,C21=100 for a
  few fields, the others 1): a field of size K > 1 is multi-valued. A row draws its number of
  values uniformly in 0..K (empty bags included) and that many values from the field's own
  distribution; the mean of their (weighted) effects and embeddings stands where a one-valued
  field's single value's would (an empty bag: the missing value's). The TSV joins a bag's values
  with ","; pass ``--multi-valued <those fields>`` to ``data_prep criteo``. The bags come from a
  stream of their own, so the other fields' values are those of the same seed without it.
- label ~ Bernoulli(sigmoid(logit)); --truth-out gets sigmoid(logit) of every row, one per line.
- Days (--day D, --drift F): the same fields, values and keys every day, fresh rows, and
  per-value effects that walk from day to day, e_d = sqrt(1 - F) e_{d-1} + sqrt(F) n_d (n_d
  hashed from the value and the day; the variance stays 1): a click model that drifts, for
  day-by-day training. Day 0 is the file without --day.

Streaming: rows are made in chunks of 2^16, each from its own seeded stream, so memory is
bounded and the output is the same whatever the chunking of the writes.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
from dataclasses import dataclass

import numpy as np

from hvctr.formats import CAT_NAMES, MAX_FIELD_KEYS, NUM_FIELDS, NUM_DENSE
from hvctr.formats import mix64

CHUNK_ROWS = 1 << 14  # small enough that the temporaries stay in cache: ~2x faster than 2^16
CALIBRATION_ROWS = 1 << 17  # sample that sets scale and bias: the AUC lands within ~0.002 of the target
CRITEO_VOCAB = [1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194,
                27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572]
CAT_MISSING = [0.0, 0.0, 0.03, 0.03, 0.0, 0.12, 0.0, 0.0, 0.0, 0.0, 0.0, 0.03, 0.0, 0.0, 0.0, 0.03,
               0.0, 0.0, 0.44, 0.44, 0.03, 0.76, 0.0, 0.03, 0.44, 0.44]
DENSE_MISSING = [0.45, 0.0, 0.21, 0.22, 0.03, 0.22, 0.04, 0.0005, 0.04, 0.45, 0.04, 0.76, 0.22]
NUM_PAIRS, EMB_DIM, NUM_DENSE_PAIRS = 10, 4, 2
_HEXCHARS = np.frombuffer(b"0123456789abcdef", dtype=np.uint8)
MAX_INT = 10 ** 10 - 1
_BUCKETS = 1 << 16
_M32 = np.uint64(0xFFFFFFFF)
_EMB_SHIFTS = np.arange(0, 64, 16, dtype=np.uint64)
_LOGIT_RANGE = 16.0
TAIL_RANK = 50  # value effects shrink past this frequency rank (see _tail_weight)
SHAPES = ("criteo", "loguniform")  # --shape: the tables' vocabularies, skews and interactions
LOGUNIFORM_VOCAB = (10, 2_000_000)
LOGUNIFORM_ZIPF = (1.05, 1.2)
LOGUNIFORM_PAIRS = 8


@dataclass(frozen=True)
class Model:
    seed: int
    vocab: np.ndarray  # [26] values per field
    zipf_a: np.ndarray  # [26]
    zipf_q: np.ndarray  # [26]
    cat_missing: np.ndarray  # [26]
    cat_scale: np.ndarray  # [26] std of a field's value effects
    salts: np.ndarray  # [26] uint64, per-field hash salts
    dense_mu: np.ndarray  # [13]
    dense_sigma: np.ndarray  # [13]
    dense_missing: np.ndarray  # [13]
    dense_beta: np.ndarray  # [13]
    dense_missing_effect: np.ndarray  # [13]
    pairs: np.ndarray  # [NUM_PAIRS, 2] categorical field pairs
    pair_scale: np.ndarray  # [NUM_PAIRS]
    dense_pairs: np.ndarray  # [NUM_DENSE_PAIRS, 2]
    dense_pair_scale: np.ndarray
    pair_fields: np.ndarray  # the fields that take part in a pair
    pair_index: np.ndarray  # pairs as indices into pair_fields
    scale: float = 1.0
    bias: float = 0.0
    day: int = 0  # the value effects' day (see _value_effects)
    drift: float = 0.0  # fraction of each value effect's variance renewed per day
    unique_fields: int = 0  # the last this many fields carry a value unique to the row (an id), no signal
    tail_signal: float = 0.0  # S of _tail_weight: 0 rare values carry little signal, 1 full weight
    shape: str = "criteo"
    multi_hot: tuple[int, ...] = ()  # 26 bag sizes (--multi-hot), or () when every field holds one value

    @property
    def multi_fields(self) -> list[int]:
        """The multi-valued fields (bag size > 1), 0-based."""
        return [f for f, k in enumerate(self.multi_hot) if k > 1]


def parse_multi_hot(text: str) -> tuple[int, ...]:
    """--multi-hot: 26 comma-separated sizes, or NAME=SIZE pairs (C3=20,C21=100; the rest 1).
    Returns the 26 sizes, or () when no field holds more than one value."""
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        return ()
    if any("=" in t for t in items):
        sizes = [1] * NUM_FIELDS
        by_name = {n.lower(): i for i, n in enumerate(CAT_NAMES)}
        for t in items:
            name, _, size = t.partition("=")
            if name.strip().lower() not in by_name:
                raise ValueError(f"--multi-hot: unknown field {name.strip()!r} in {t!r}: name fields C1..C26 "
                                 "(e.g. C3=20,C21=100)")
            sizes[by_name[name.strip().lower()]] = _size(size, t)
    else:
        if len(items) != NUM_FIELDS:
            raise ValueError(f"--multi-hot: {len(items)} sizes, want {NUM_FIELDS} (one per field C1..C26, as "
                             "MLPerf's multi_hot_sizes) or NAME=SIZE pairs (C3=20,C21=100)")
        sizes = [_size(t, t) for t in items]
    return tuple(sizes) if max(sizes) > 1 else ()


def _size(text: str, item: str) -> int:
    try:
        k = int(text)
    except ValueError:
        raise ValueError(f"--multi-hot: {item!r}: a size must be an integer") from None
    if not 1 <= k <= MAX_FIELD_KEYS:
        raise ValueError(f"--multi-hot: {item!r}: a size must be in 1..{MAX_FIELD_KEYS}")
    return k


@functools.lru_cache(maxsize=4)
def build_model(seed: int, target_auc: float = 0.80, positive_rate: float = 0.25,
                day: int = 0, drift: float = 0.0, unique_fields: int = 0, tail_signal: float = 0.0,
                shape: str = "criteo", multi_hot: tuple[int, ...] = ()) -> Model:
    """The hidden model of a seed (on a day), scaled and shifted to the target AUC and positive
    rate (cached: a Model is immutable and costs about a second to calibrate)."""
    if day < 0 or not 0.0 <= drift <= 1.0:
        raise ValueError(f"--day must be >= 0 and --drift in [0, 1], got {day} and {drift}")
    if not 0 <= unique_fields <= NUM_FIELDS:
        raise ValueError(f"--unique-fields must be in [0, {NUM_FIELDS}], got {unique_fields}")
    if not 0.0 <= tail_signal <= 1.0:
        raise ValueError(f"--tail-signal must be in [0, 1], got {tail_signal}")
    if shape not in SHAPES:
        raise ValueError(f"--shape must be one of {', '.join(SHAPES)}, got {shape!r}")
    if multi_hot and (len(multi_hot) != NUM_FIELDS or min(multi_hot) < 1):
        raise ValueError(f"--multi-hot: {NUM_FIELDS} sizes of at least 1, got {list(multi_hot)}")
    if multi_hot and unique_fields and max(multi_hot[NUM_FIELDS - unique_fields:]) > 1:
        raise ValueError(f"--multi-hot and --unique-fields {unique_fields}: the last {unique_fields} fields hold a "
                         "row's id, one value; name other fields multi-valued")
    rng = np.random.default_rng([seed, 0])
    m = Model(
        seed=seed, day=day, drift=drift, unique_fields=unique_fields, tail_signal=tail_signal, shape=shape,
        vocab=np.maximum(np.array(CRITEO_VOCAB, dtype=np.int64), 10),
        zipf_a=rng.uniform(1.05, 1.4, NUM_FIELDS), zipf_q=rng.uniform(1.0, 20.0, NUM_FIELDS),
        cat_missing=np.array(CAT_MISSING), cat_scale=np.exp(rng.uniform(np.log(0.2), np.log(1.0), NUM_FIELDS)),
        salts=mix64(np.arange(NUM_FIELDS, dtype=np.uint64) + np.uint64(seed) * np.uint64(1000003)),
        dense_mu=rng.uniform(0.0, 4.0, NUM_DENSE), dense_sigma=rng.uniform(0.8, 2.6, NUM_DENSE),
        dense_missing=np.array(DENSE_MISSING), dense_beta=rng.normal(0.0, 0.35, NUM_DENSE),
        dense_missing_effect=rng.normal(0.0, 0.3, NUM_DENSE),
        pairs=np.array([rng.choice(NUM_FIELDS, 2, replace=False) for _ in range(NUM_PAIRS)]),
        pair_scale=rng.uniform(0.3, 0.8, NUM_PAIRS),
        dense_pairs=np.array([rng.choice(NUM_DENSE, 2, replace=False) for _ in range(NUM_DENSE_PAIRS)]),
        dense_pair_scale=rng.normal(0.0, 0.25, NUM_DENSE_PAIRS),
        pair_fields=np.zeros(0, dtype=np.int64), pair_index=np.zeros((0, 2), dtype=np.int64),
        multi_hot=tuple(multi_hot),
    )
    if shape == "loguniform":  # its own stream: the criteo shape's draws above stay as they were
        alt = np.random.default_rng([seed, 5])
        lo, hi = np.log(LOGUNIFORM_VOCAB[0]), np.log(LOGUNIFORM_VOCAB[1])
        m = Model(**{**m.__dict__, "vocab": np.exp(alt.uniform(lo, hi, NUM_FIELDS)).astype(np.int64),
                     "zipf_a": alt.uniform(*LOGUNIFORM_ZIPF, NUM_FIELDS),
                     "pairs": m.pairs[:LOGUNIFORM_PAIRS], "pair_scale": m.pair_scale[:LOGUNIFORM_PAIRS]})
    fields = np.unique(m.pairs)
    m = Model(**{**m.__dict__, "pair_fields": fields, "pair_index": np.searchsorted(fields, m.pairs)})
    z = np.concatenate([_draw(m, rng_for(seed, i, stream=2), CHUNK_ROWS)[-1]
                        for i in range(CALIBRATION_ROWS // CHUNK_ROWS)])
    scale, bias = _calibrate(z, target_auc, positive_rate)
    return Model(**{**m.__dict__, "scale": scale, "bias": bias})


def rng_for(seed: int, chunk: int, stream: int = 1, day: int = 0) -> np.random.Generator:
    return np.random.default_rng([seed, chunk, stream] + ([day] if day else []))


def _value_effects(m: Model, h: np.ndarray) -> np.ndarray:
    """Per-value effects [n, 26] on day m.day: an AR(1) walk from day 0's, variance 1 each day."""
    e = _effect_from_hash(h)
    if m.day == 0 or m.drift == 0.0:
        return e
    keep, renew = np.sqrt(1.0 - m.drift), np.sqrt(m.drift)
    for d in range(1, m.day + 1):
        salt = np.uint64((d * 0xD6E8FEB86659FD93) & 0xFFFFFFFFFFFFFFFF)  # a distinct salt per day
        e = keep * e + renew * _effect_from_hash(mix64(h ^ salt))
    return e


def _effect_from_hash(h: np.ndarray) -> np.ndarray:
    """A value effect of mean 0, variance 1 from one 64-bit hash: the sum of its two 32-bit
    halves as uniforms (a triangular distribution), centred and scaled."""
    s = ((h & _M32) + (h >> np.uint64(32))).astype(np.float64) * 2.0 ** -32 - 1.0
    return s * np.sqrt(6.0)


def _embeddings(h: np.ndarray) -> np.ndarray:
    """[n, F, 4] value embeddings (uniform, variance 1 per component) from a second hash."""
    e = mix64(h ^ np.uint64(0x5DEECE66D))
    parts = (e[:, :, None] >> _EMB_SHIFTS) & np.uint64(0xFFFF)
    return (parts.astype(np.float32) * np.float32(2.0 ** -16) - np.float32(0.5)) * np.float32(np.sqrt(12.0))


def _zipf_ids(m: Model, u: np.ndarray, f: "slice | int" = slice(None)) -> np.ndarray:
    """Value ids of field(s) f from uniforms in [0, 1): the continuous inverse CDF of (k + q)^-a
    on [0, V), floored."""
    one = 1.0 - m.zipf_a[f]
    lo, hi = m.zipf_q[f] ** one, (m.vocab[f] + m.zipf_q[f]) ** one
    x = np.exp(np.log(lo + np.maximum(u, 0.0) * (hi - lo)) * (1.0 / one)) - m.zipf_q[f]
    return np.minimum(x.astype(np.int64), m.vocab[f] - 1)


def _draw(m: Model, rng: np.random.Generator, n: int, first_row: int = 0):
    """One chunk: value ids [n,26] (-1 missing), integers [n,13], their missing mask, and the
    logit before scale and bias. The last ``m.unique_fields`` fields hold the row's index
    (``first_row`` + i: a key seen once, as a request or user id is) and take no part in the logit."""
    return _draw_rows(m, rng, n, first_row)[:4]


def _draw_rows(m: Model, rng: np.random.Generator, n: int, first_row: int = 0):
    """_draw, and the bags of the multi-valued fields: {field: (ids [n, K], counts [n])}, the
    slots past a row's count (all of an empty bag's) -1. A multi-valued field's column of ids is
    drawn (the stream stays that of the seed without --multi-hot) but the bag stands for it."""
    # one uniform per value: below the missing rate it is missing, else rescaled and put
    # through the continuous inverse CDF of (k + q)^-a on [0, V), floored
    u = rng.random((n, NUM_FIELDS))
    miss = u < m.cat_missing
    u = (u - m.cat_missing) / (1.0 - m.cat_missing)
    ids = _zipf_ids(m, u)
    ids[miss] = -1
    z = rng.standard_normal((n, NUM_DENSE))
    ints = np.minimum(np.exp(m.dense_mu + m.dense_sigma * z), MAX_INT).astype(np.int64)
    neg = np.flatnonzero(rng.random(n) < 0.03)
    ints[neg, 1] = -rng.integers(1, 4, neg.size)
    dmiss = rng.random((n, NUM_DENSE)) < m.dense_missing

    weight = _tail_weight(ids, m.tail_signal)
    if m.unique_fields:
        u0 = NUM_FIELDS - m.unique_fields
        ids[:, u0:] = (first_row + np.arange(n, dtype=np.int64))[:, None]
        weight[:, u0:] = 0.0
    h = mix64(ids.astype(np.uint64) ^ m.salts)  # missing (-1) hashes like any other value
    effects = _value_effects(m, h) * weight
    emb = _embeddings(h[:, m.pair_fields]) * weight[:, m.pair_fields, None]  # [n, F, 4]
    bags = _draw_bags(m, rng, n, effects, emb) if m.multi_hot else {}
    logit = effects @ m.cat_scale
    zd = (np.log1p(np.maximum(ints, 0)) - m.dense_mu) / m.dense_sigma
    zd[dmiss] = 0.0
    logit += zd @ m.dense_beta + dmiss @ m.dense_missing_effect
    a, b = m.pair_index[:, 0], m.pair_index[:, 1]
    dots = np.einsum("npk,npk->np", emb[:, a], emb[:, b])
    logit += dots @ (m.pair_scale / np.sqrt(EMB_DIM))
    logit += (zd[:, m.dense_pairs[:, 0]] * zd[:, m.dense_pairs[:, 1]]) @ m.dense_pair_scale
    return ids, ints, dmiss, logit, bags


def _draw_bags(m: Model, rng: np.random.Generator, n: int, effects: np.ndarray, emb: np.ndarray) -> dict:
    """Draws the multi-valued fields' bags from a child stream of ``rng`` (the parent's draws stay
    as without them) and puts the mean of each bag's weighted effects (and, in a pair field,
    embeddings) in its field's column of ``effects`` [n, 26] (``emb`` [n, F, 4]), in place. An
    empty bag counts as the missing value (id -1), as an empty one-valued field does."""
    sub = rng.spawn(1)[0]
    bags = {}
    for f in m.multi_fields:
        size = m.multi_hot[f]
        counts = sub.integers(0, size + 1, n)  # 0..K: empty bags too
        ids = _zipf_ids(m, sub.random((n, size)), f)
        ids[np.arange(size) >= counts[:, None]] = -1  # unused slots; an empty bag's first is its "missing"
        used = np.arange(size) < np.maximum(counts, 1)[:, None]
        h = mix64(ids.astype(np.uint64) ^ m.salts[f])
        w = _tail_weight(ids, m.tail_signal) * used
        denom = used.sum(axis=1)
        effects[:, f] = (_value_effects(m, h) * w).sum(axis=1) / denom
        at = np.flatnonzero(m.pair_fields == f)
        if at.size:
            emb[:, at[0]] = (_embeddings(h) * w[:, :, None].astype(np.float32)).sum(axis=1) / denom[:, None]
        bags[f] = (ids, counts)
    return bags


def _tail_weight(ids: np.ndarray, tail_signal: float = 0.0) -> np.ndarray:
    """Weight of each value's effect: S + (1 - S) / (1 + rank / TAIL_RANK), S = ``tail_signal``
    (rank 0 the most frequent; missing counts as frequent). At S = 0 (the default) rare values
    carry little: most of the signal sits in values seen often, and a model can approach the
    Bayes AUC. At S = 1 every value has full weight, as in a log whose long tail carries signal
    (which is why its tables are terabytes): much of the signal then sits in values a data set
    shows a handful of times, and what a trainer does with rarely-touched rows decides the AUC."""
    w = 1.0 / (1.0 + np.maximum(ids, 0) * (1.0 / TAIL_RANK))
    return w if tail_signal == 0.0 else tail_signal + (1.0 - tail_signal) * w


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def expected_auc(p: np.ndarray, presorted: bool = False) -> float:
    """AUC of the true probabilities when labels are drawn from them: every (positive, negative)
    pair of rows weighted p_i (1 - p_j), a row never paired with itself."""
    p = p if presorted else np.sort(p)
    neg_below = np.cumsum(1.0 - p) - (1.0 - p)
    return float(np.sum(p * neg_below) / (p.sum() * (1.0 - p).sum() - np.sum(p * (1.0 - p))))


def _calibrate(z: np.ndarray, target_auc: float, rate: float) -> tuple[float, float]:
    """Scale and bias with mean sigmoid = rate and expected AUC = target on the sample z."""
    z = np.sort(z)  # sigmoid(b + c z) keeps this order for every c > 0: sort once

    def bias_for(scale: float) -> float:
        b = np.log(rate / (1 - rate))
        for _ in range(30):  # Newton on mean(sigmoid(b + scale z)) = rate: monotone, smooth
            p = _sigmoid(b + scale * z)
            step = (p.mean() - rate) / max(np.mean(p * (1 - p)), 1e-12)
            b -= step
            if abs(step) < 1e-10:
                break
        return float(b)
    lo, hi = 1e-3, 20.0
    for _ in range(30):
        mid = (lo + hi) / 2
        auc = expected_auc(_sigmoid(bias_for(mid) + mid * z), presorted=True)
        lo, hi = (mid, hi) if auc < target_auc else (lo, mid)
    scale = (lo + hi) / 2
    return scale, bias_for(scale)


def sample_chunk(m: Model, chunk: int, n: int):
    """Rows of one chunk: labels (uint8), integers, their missing mask, hex values (uint32),
    categorical missing mask, true probabilities."""
    return sample_rows(m, chunk, n)[:6]


def sample_rows(m: Model, chunk: int, n: int):
    """sample_chunk, and the bags of the multi-valued fields as {field: (hex values [n, K]
    (uint32), counts [n])}: a row's values are the first count of its row."""
    rng = rng_for(m.seed, chunk, day=m.day)
    ids, ints, dmiss, z, bags = _draw_rows(m, rng, n, first_row=chunk * CHUNK_ROWS)
    p = _sigmoid(m.bias + m.scale * z)
    labels = (rng.random(n) < p).astype(np.uint8)
    hex_bags = {f: (_hex_values(b, m.salts[f]), counts) for f, (b, counts) in bags.items()}
    return labels, ints, dmiss, _hex_values(ids, m.salts), ids < 0, p, hex_bags


def _hex_values(ids: np.ndarray, salts: np.ndarray) -> np.ndarray:
    """A per-field bijection of 32-bit ids (murmur3's finaliser after a salt): distinct values
    stay distinct, and look like Criteo's hashed strings."""
    x = (ids.astype(np.uint64) ^ salts).astype(np.uint32)
    with np.errstate(over="ignore"):
        x ^= x >> np.uint32(16)
        x *= np.uint32(0x85EBCA6B)
        x ^= x >> np.uint32(13)
        x *= np.uint32(0xC2B2AE35)
        x ^= x >> np.uint32(16)
    return x


def _lut4(digits: bytes, base: int) -> np.ndarray:
    """uint32 words holding the 4 ASCII digits (in ``base``) of 0 .. base^4 - 1, zero-padded."""
    v = np.arange(base ** 4)
    chars = np.frombuffer(digits, dtype=np.uint8)
    cols = [chars[(v // base ** k) % base] for k in (3, 2, 1, 0)]
    return np.stack(cols, axis=1).astype(np.uint8).copy().view("<u4")[:, 0]


_DEC4 = _lut4(b"0123456789", 10)  # 10^4 entries
_HEX4 = _lut4(b"0123456789abcdef", 16)  # 2^16 entries
# _KEEP12[d]: keep the last d of 12 digit positions (d = 0: a missing value)
_KEEP12 = np.array([[c >= 12 - d for c in range(12)] for d in range(13)], dtype=bool)
_POW10_ASC = 10 ** np.arange(1, 12, dtype=np.int64)


def format_tsv(labels: np.ndarray, ints: np.ndarray, dmiss: np.ndarray, hexv: np.ndarray,
               cmiss: np.ndarray, bags: dict | None = None) -> bytes:
    """Criteo TSV lines, built as a byte matrix and a keep-mask from 4-character lookup tables
    (no per-row Python): an integer is [sign, 12 digits, tab], a hex value [8 digits, tab].
    ``bags`` ({field: (hex values [n, K], counts [n])}): those fields hold their first count
    values joined by ',' instead of hexv's."""
    n = len(labels)
    a = np.abs(ints)
    iw = np.empty((n, NUM_DENSE, 4), dtype="<u4")  # sign+pad word, 3 words of 4 digits
    iw[:, :, 0] = 0x2D << 24  # '-' in the word's last byte, right before the digits
    iw[:, :, 1] = _DEC4[a // 100_000_000]
    iw[:, :, 2] = _DEC4[(a // 10_000) % 10_000]
    iw[:, :, 3] = _DEC4[a % 10_000]
    ib = iw.view(np.uint8).reshape(n, NUM_DENSE, 16)[:, :, 3:]  # sign at 3, digits at 4..15
    ib = np.concatenate([ib, np.full((n, NUM_DENSE, 1), 9, dtype=np.uint8)], axis=2)  # [n, 13, 14]
    ndig = np.searchsorted(_POW10_ASC, a, side="right") + 1
    ndig[dmiss] = 0
    ik = np.empty((n, NUM_DENSE, 14), dtype=bool)
    ik[:, :, 0] = (ints < 0) & ~dmiss
    ik[:, :, 1:13] = _KEEP12[ndig]
    ik[:, :, 13] = True
    cw = np.empty((n, NUM_FIELDS, 3), dtype="<u4")
    cw[:, :, 0] = _HEX4[hexv >> np.uint32(16)]
    cw[:, :, 1] = _HEX4[hexv & np.uint32(0xFFFF)]
    cw[:, :, 2] = 9
    cb = cw.view(np.uint8).reshape(n, NUM_FIELDS, 12)[:, :, :9].copy()
    cb[:, -1, 8] = 10
    ck = np.empty((n, NUM_FIELDS, 9), dtype=bool)
    ck[:, :, :8] = ~cmiss[:, :, None]
    ck[:, :, 8] = True
    lab = np.empty((n, 2), dtype=np.uint8)
    lab[:, 0] = labels + 48
    lab[:, 1] = 9
    if bags:
        parts = [(lab, np.ones((n, 2), dtype=bool)), (ib.reshape(n, -1), ik.reshape(n, -1))]
        for f in range(NUM_FIELDS):
            parts.append(_bag_bytes(*bags[f], cb[:, f, 8]) if f in bags else (cb[:, f], ck[:, f]))
        mat = np.concatenate([b for b, _ in parts], axis=1)
        keep = np.concatenate([k for _, k in parts], axis=1)
        return mat[keep].tobytes()
    mat = np.concatenate([lab, ib.reshape(n, -1), cb.reshape(n, -1)], axis=1)
    keep = np.concatenate([np.ones((n, 2), dtype=bool), ik.reshape(n, -1), ck.reshape(n, -1)], axis=1)
    return mat[keep].tobytes()


def _bag_bytes(hexv: np.ndarray, counts: np.ndarray, end: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A multi-valued field's bytes [n, 9K + 1] and keep-mask: slot j is [8 digits, ','], kept for
    j < count (its ',' for j < count - 1), then ``end`` [n] (the tab, or the line's newline)."""
    n, size = hexv.shape
    w = np.empty((n, size, 3), dtype="<u4")
    w[:, :, 0] = _HEX4[hexv >> np.uint32(16)]
    w[:, :, 1] = _HEX4[hexv & np.uint32(0xFFFF)]
    w[:, :, 2] = ord(",")
    slot = np.arange(size)
    keep = np.empty((n, size, 9), dtype=bool)
    keep[:, :, :8] = (slot < counts[:, None])[:, :, None]
    keep[:, :, 8] = slot < counts[:, None] - 1
    b = np.concatenate([w.view(np.uint8).reshape(n, size, 12)[:, :, :9].reshape(n, -1), end[:, None]], axis=1)
    return b, np.concatenate([keep.reshape(n, -1), np.ones((n, 1), dtype=bool)], axis=1)


def format_truth(p: np.ndarray) -> bytes:
    """One probability per line as 0.ddddddddd (9 decimals)."""
    v = np.clip(np.rint(p * 1e9), 0, 999_999_999).astype(np.int64)
    w = np.empty((len(p), 3), dtype="<u4")
    w[:, 0] = _DEC4[v // 100_000_000]  # "000d": the leading zeros become "0." below
    w[:, 1] = _DEC4[(v // 10_000) % 10_000]
    w[:, 2] = _DEC4[v % 10_000]
    out = w.view(np.uint8).reshape(-1, 12).copy()
    out[:, 0], out[:, 1], out[:, 2] = 48, 46, out[:, 3]  # "0." and the first decimal
    out = np.concatenate([out[:, :3], out[:, 4:], np.full((len(p), 1), 10, dtype=np.uint8)], axis=1)
    return out.tobytes()


class Scores:
    """Streaming AUC and logloss of the true probabilities: expected (labels drawn from p)
    and realised (the labels written), from histograms over logit buckets."""

    def __init__(self) -> None:
        self.hist = np.zeros((4, _BUCKETS))  # expected pos, expected neg, realised pos, realised neg
        self.ll = np.zeros(2)  # expected, realised
        self.n = 0

    def add(self, p: np.ndarray, labels: np.ndarray) -> None:
        logit = np.log(p) - np.log1p(-p)
        b = np.clip(((logit + _LOGIT_RANGE) / (2 * _LOGIT_RANGE) * _BUCKETS).astype(np.int64), 0, _BUCKETS - 1)
        y = labels.astype(bool)
        for i, w in enumerate((p, 1.0 - p, y.astype(np.float64), (~y).astype(np.float64))):
            self.hist[i] += np.bincount(b, weights=w, minlength=_BUCKETS)
        self.ll[0] -= np.sum(p * np.log(p) + (1 - p) * np.log1p(-p))
        self.ll[1] -= np.sum(np.where(y, np.log(p), np.log1p(-p)))
        self.n += len(p)

    @staticmethod
    def _auc(pos: np.ndarray, neg: np.ndarray) -> float:
        below = np.cumsum(neg) - neg
        return float(np.sum(pos * (below + 0.5 * neg)) / (pos.sum() * neg.sum()))

    def result(self) -> dict:
        return {"expected_auc": self._auc(self.hist[0], self.hist[1]),
                "realised_auc": self._auc(self.hist[2], self.hist[3]),
                "expected_logloss": float(self.ll[0] / self.n), "realised_logloss": float(self.ll[1] / self.n),
                "expected_positive_rate": float(self.hist[0].sum() / self.n),
                "realised_positive_rate": float(self.hist[2].sum() / self.n)}


def generate(rows: int, seed: int, out: str, truth_out: str | None = None,
             target_auc: float = 0.80, positive_rate: float = 0.25, day: int = 0, drift: float = 0.0,
             unique_fields: int = 0, tail_signal: float = 0.0, shape: str = "criteo",
             multi_hot: tuple[int, ...] = ()) -> dict:
    """Writes the TSV (and the truth file); returns the model's and the file's scores.
    ``multi_hot``: 26 bag sizes (parse_multi_hot), () for one value a field."""
    if rows < 1:
        raise ValueError(f"--rows must be >= 1, got {rows}")
    t0 = time.monotonic()
    if rows >= 1 << 32 and unique_fields:
        raise ValueError(f"--unique-fields: ids are 32-bit, so at most {(1 << 32) - 1:,} rows, got {rows:,}")
    model = build_model(seed, target_auc, positive_rate, day, drift, unique_fields, tail_signal, shape,
                        tuple(multi_hot))
    scores = Scores()
    outs = [(out, out + ".tmp")] + ([(truth_out, truth_out + ".tmp")] if truth_out else [])
    try:
        files = [open(tmp, "wb") for _, tmp in outs]
    except OSError as e:
        raise ValueError(f"cannot write {e.filename}: {e.strerror}") from e
    with _closing(files):
        for chunk, start in enumerate(range(0, rows, CHUNK_ROWS)):
            # a full chunk is drawn even at the end, so N rows are the first N of any longer file
            n = min(CHUNK_ROWS, rows - start)
            *cols, bags = sample_rows(model, chunk, CHUNK_ROWS)
            labels, ints, dmiss, hexv, cmiss, p = (a[:n] for a in cols)
            bags = {f: (b[:n], c[:n]) for f, (b, c) in bags.items()}
            files[0].write(format_tsv(labels, ints, dmiss, hexv, cmiss, bags))
            if truth_out:
                files[1].write(format_truth(p))
            scores.add(p, labels)
    for final, tmp in outs:
        os.replace(tmp, final)
    info = {"scale": model.scale, "bias": model.bias, "target_auc": target_auc,
            "positive_rate": positive_rate, "day": day, "drift": drift, "unique_fields": unique_fields,
            "tail_signal": tail_signal, "shape": shape}
    if model.multi_hot:
        info["multi_hot"] = list(model.multi_hot)
    return {"rows": rows, "seed": seed, "seconds": time.monotonic() - t0, "model": info, **scores.result()}


class _closing:
    def __init__(self, files) -> None:
        self.files = files

    def __enter__(self):
        return self.files

    def __exit__(self, *exc) -> None:
        for f in self.files:
            f.close()


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rows", type=int, required=True, metavar="N", help="data lines to write")
    p.add_argument("--seed", type=int, default=1, metavar="S", help="model and sampling seed")
    p.add_argument("--out", required=True, metavar="FILE.tsv", help="output file, Criteo TSV (label, 13 dense, 26 hex)")
    p.add_argument("--truth-out", metavar="FILE", help="true click probability of each row, one per line")
    p.add_argument("--target-auc", type=float, default=0.80, help="Bayes-optimal AUC the model is scaled to")
    p.add_argument("--positive-rate", type=float, default=0.25, help="fraction of clicks (default 0.25, as Criteo Kaggle)")
    p.add_argument("--day", type=int, default=0, help="day of a drifting click model (same keys, fresh rows)")
    p.add_argument("--drift", type=float, default=0.0,
                   help="fraction of each value effect's variance renewed per day (0: no drift)")
    p.add_argument("--unique-fields", type=int, default=0, metavar="U",
                   help="the table's size knob: the last U categorical fields hold a value unique to each row "
                        "(an id: U new keys a row, U x rows keys in all) that carries no signal; 0 (default): "
                        "every field from the click model")
    p.add_argument("--tail-signal", type=float, default=0.0, metavar="S",
                   help="how much of the signal rare values carry: a value's effect is weighted "
                        "S + (1 - S) / (1 + rank / 50); 0 (default): rare values carry little, 1: full weight "
                        "whatever the value's frequency (a long tail that carries signal)")
    p.add_argument("--shape", choices=SHAPES, default="criteo",
                   help="criteo (default): Criteo's vocabularies, Zipf 1.05..1.4, 10 interaction pairs; "
                        "loguniform: vocabularies log-uniform 10..2M, Zipf 1.05..1.2, 8 pairs (a second, "
                        "structurally different data set)")
    p.add_argument("--multi-hot", default="", metavar="SIZES",
                   help="multi-valued fields: 26 comma-separated bag sizes (MLPerf DLRM-DCNv2's multi_hot_sizes, "
                        "e.g. 3,2,1,2,6,1,1,1,1,7,3,8,1,6,9,5,1,1,1,12,100,27,10,3,1,1) or NAME=SIZE pairs "
                        "(C3=20,C21=100; the others 1). A field of size K > 1 holds 0..K values a row, joined "
                        "by ','; preprocess the file with data_prep criteo --multi-valued <those fields> "
                        "(e.g. --multi-valued C3,C21). Default: one value a field")


def run(args: argparse.Namespace) -> int:
    try:
        multi_hot = parse_multi_hot(args.multi_hot)
        r = generate(args.rows, args.seed, args.out, args.truth_out, args.target_auc, args.positive_rate,
                     args.day, args.drift, args.unique_fields, args.tail_signal, args.shape, multi_hot)
    except ValueError as e:
        print(f"data_prep synth: error: {e}", file=sys.stderr)
        return 2
    print(f"synth: {r['rows']} rows, seed {r['seed']} -> {args.out}"
          + (f" (truth: {args.truth_out})" if args.truth_out else ""))
    print(f"synth: positive rate expected {r['expected_positive_rate']:.4f}, "
          f"realised {r['realised_positive_rate']:.4f}")
    print(f"synth: Bayes-optimal AUC expected {r['expected_auc']:.4f}, realised {r['realised_auc']:.4f}")
    print(f"synth: Bayes-optimal logloss expected {r['expected_logloss']:.4f}, realised {r['realised_logloss']:.4f}")
    print(f"synth: {r['seconds']:.1f} s, {r['rows'] / r['seconds'] / 1e3:.0f}k rows/s")
    if multi_hot:
        names = ",".join(CAT_NAMES[f] for f, k in enumerate(multi_hot) if k > 1)
        print(f"synth: multi-valued fields {names} (values joined by ','); next: python -m data_prep criteo "
              f"--input {args.out} --out DIR --shards S --multi-valued {names}")
    return 0
