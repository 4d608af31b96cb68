"""What an owner does with the copies of a row that several ranks trained in one window.

Each rank that touched a key sends its copy back; the owner has the copies' mean over those c
contributors (summed in ascending source rank) and its own copy from before the window, old.
``merge.sparse_rule`` chooses the row it keeps, for the model columns (w, w1):

- ``average``: mean. A rare key (c = 1) keeps its one rank's move whole; a hot key (touched by
  every rank) moves by the mean of W moves, about one rank's worth for W ranks' samples.
- ``sum``: old + c * (mean - old), the sum of the moves: a hot key moves as if one rank had
  seen all W ranks' samples (if their moves agree); noisy moves add up too.
- ``sqrt``: old + sqrt(c) * (mean - old): between the two (the moves' noise grows as sqrt(c)).
- ``matched``: old + f * (mean - old), f the ratio of the move synchronous training would have
  made to the mean move, estimated per row from what the owner holds (below).

``matched``. Synchronous training takes one Adam step on a row at each of the window's steps
where any rank touched it: S distinct steps, each about one learning rate long where Adam's
gradient is mostly signal, and each from the gradient averaged over the t ranks that touched the
row at that step. A contributor to the k-step merge took n steps on its own copy (the row's step
column counts them: n = mean step - old step), each from its own gradient. So f is the product of

- ``S / n``: the steps sync would have taken per step of one contributor. S is not sent; with
  c * n touches landing on k steps at random, S = k * (1 - (1 - 1/k)^(c n)). A key c ranks touched
  once each in a window of k >= c steps gets about c steps' move (sum's), a key every rank
  touched at every step gets one (average's);
- ``sqrt(min(r, t))``, t = c n / S the touches per step: where the moves are noise, sync's
  average of t gradients has sqrt(t) times less noise than each rank's, so its normalised step
  goes sqrt(t) further along the signal than a mean of t noisy steps does. r, the contributors'
  mean squared move over the squared mean move (1 when they agree, c when they are independent),
  tells noise from signal, row by row: the owner has every copy (``contributor_spread``).

Adam's moments and the per-row step are averaged under every rule (a rule scales moves of the
model, not the optimiser's estimates of them). c = 1 gives mean under every rule, bit for bit.

Row-wise Adagrad's accumulator is not an estimate but a running sum, and under ``sum`` it adds up
too: old + c * (mean - old), the contributors' increments summed. A rank's gradient is its share
of the global batch's mean gradient times W (its loss is the mean over its own rows), so a step
Adagrad takes on one rank's gradient alone is sync's step on that row (Adagrad's step does not
change when every gradient is scaled) with the accumulator at W^2 times sync's scale, the scale
the shared rows' owners keep (they step on the gradients' sum, hvctr.train.row_sync). Summing
the moves and the increments keeps that: at k = 1, where each row is touched by one rank a step,
it is sync's update; under ``average`` a row two ranks moved keeps half its moves and a
mixture of the two scales in its accumulator, and with the accumulators averaged W ranks' moves
pass through one rank's normaliser (-0.0207 AUC at 8 ranks on one data set). Measured on
multi-hot (DLRM, 112 keys a row) and one-hot data: docs/merging.md, "Row-wise Adagrad's rows".

Measured (data sets, global batch, steps a rank): docs/merging.md.
"""

from __future__ import annotations

import numpy as np

from hvctr.config import SparseRule
from hvctr.formats import RowLayout, SparseOptimizer


def contributor_spread(values: np.ndarray, inverse: np.ndarray, old: np.ndarray, count: np.ndarray,
                       layout: RowLayout) -> np.ndarray:
    """Each key's mean squared move over its contributors, model columns: ``values`` [n, width]
    the copies as received, ``inverse`` [n] the key of each (an index into ``old`` [u, width],
    the rows as pulled), ``count`` [u] the copies of each key. ``matched`` reads it."""
    m = layout.model
    d = values[:, m] - old[:, m][inverse]
    sq = np.einsum("ij,ij->i", d, d)
    return np.bincount(inverse, weights=sq, minlength=old.shape[0]) / np.maximum(count, 1)


def _matched_scale(layout: RowLayout, old: np.ndarray, mean: np.ndarray, count: np.ndarray,
                   spread: np.ndarray, steps: int) -> np.ndarray:
    """f of ``matched`` for every row (the module's docstring)."""
    k = max(int(steps), 1)
    n = np.maximum(mean[:, layout.step].astype(np.float64) - old[:, layout.step], 1.0)  # a contributor's steps
    touches = count * n
    distinct = k * -np.expm1(touches * np.log1p(-1.0 / k)) if k > 1 else np.ones_like(n)  # S, expected
    per_step = np.maximum(touches / distinct, 1.0)  # t
    m = layout.model
    d = mean[:, m] - old[:, m]
    mean_sq = np.einsum("ij,ij->i", d, d).astype(np.float64)
    r = np.divide(spread, mean_sq, out=np.ones_like(spread, dtype=np.float64), where=mean_sq > 0)
    return np.maximum(distinct / n, 1.0) * np.sqrt(np.clip(r, 1.0, per_step))


def merged_rows(rule: SparseRule, layout: RowLayout, old: np.ndarray | None, mean: np.ndarray,
                count: np.ndarray, spread: np.ndarray | None = None, steps: int = 1) -> np.ndarray:
    """The rows an owner stores: ``mean`` [n, width] (modified in place and returned), given
    each key's contributor count ``count`` [n] and, for the rules that need them, ``old``, and
    for ``matched`` the contributors' ``spread`` (contributor_spread) and the window's ``steps``."""
    if rule is SparseRule.AVERAGE:
        return mean
    if rule is SparseRule.MATCHED:
        if spread is None:
            raise ValueError("merged_rows: the matched rule needs the contributors' spread")
        scale = _matched_scale(layout, old, mean, count, spread, steps).astype(np.float32)
    else:
        scale = count.astype(np.float32) if rule is SparseRule.SUM else np.sqrt(count.astype(np.float32))
    many = count > 1
    if many.any():
        m = layout.model
        before = old[many, m]
        mean[many, m] = before + scale[many, None] * (mean[many, m] - before)
        if rule is SparseRule.SUM and layout.optimizer is SparseOptimizer.ROWWISE_ADAGRAD:
            v = layout.v  # the accumulator: the contributors' increments summed (the module's docstring)
            before = old[many, v]
            mean[many, v] = before + scale[many, None] * (mean[many, v] - before)
    return mean
