"""What an owner does with the copies of a row that several ranks trained in one window.

Each rank that touched a key sends its copy back; the owner has the copies' mean over those c
contributors (summed in ascending source rank) and its own copy from before the window, old.
``merge.sparse_rule`` chooses the row it keeps, for the model columns (w, w1):

- ``average``: mean. A rare key (c = 1) keeps its one rank's move whole; a hot key (touched by
  every rank) moves by the mean of W moves, about one rank's worth for W ranks' samples.
- ``sum``: old + c * (mean - old), the sum of the moves: a hot key moves as if one rank had
  seen all W ranks' samples (if their moves agree); noisy moves add up too.
- ``sqrt``: old + sqrt(c) * (mean - old): between the two (the moves' noise grows as sqrt(c)).

Adam's moments and the per-row step are averaged under every rule (a rule scales moves of the
model, not the optimiser's estimates of them). c = 1 gives mean under every rule, bit for bit.
"""

from __future__ import annotations

import numpy as np

from hvctr.config import SparseRule
from hvctr.formats import RowLayout


def merged_rows(rule: SparseRule, layout: RowLayout, old: np.ndarray | None, mean: np.ndarray,
                count: np.ndarray) -> np.ndarray:
    """The rows an owner stores: ``mean`` [n, width] (modified in place and returned), given
    each key's contributor count ``count`` [n] and, for the rules that need it, ``old``."""
    if rule is SparseRule.AVERAGE:
        return mean
    scale = count.astype(np.float32) if rule is SparseRule.SUM else np.sqrt(count.astype(np.float32))
    many = count > 1
    if many.any():
        m = layout.model
        before = old[many, m]
        mean[many, m] = before + scale[many, None] * (mean[many, m] - before)
    return mean
