"""The settings that depend on the world size, resolved from the config for a run of W ranks:
every rank, a resumed run, the simulation and the planner resolve them the same way.

- ``size_batch``: with ``data.global_batch_size`` set (> 0), each rank takes G / W rows a step, so
  W ranks take the steps one rank would, on the same samples;
- ``batch_growth``: the global batch over one rank's (W, or 1 at a fixed global batch), the factor
  the learning-rate rules of hvctr.train.lr scale by;
- ``resolve_merge``: ``merge.dense_gradients``, ``merge.dense_every_steps = -1``,
  ``merge.sparse_rule = auto`` and ``merge.shared_rows = -1`` at this world size (why the dense
  gradients are averaged every step, owners scale the rows' moves and the rows the most ranks
  touch are synchronised at many ranks: docs/merging.md).
"""

from __future__ import annotations

import dataclasses

from hvctr.config import Compression, Config, DataConfig, DenseGradients, MergeConfig, MergeMode, SparseRule
from hvctr.formats import SparseOptimizer

AUTO_DENSE_RANKS = 32  # merge.dense_every_steps = -1 merges a local dense model every 4 steps from here on
AUTO_POWERSGD_RANKS = 4  # merge.dense_gradients = auto is powersgd from here on
AUTO_DENSE_EVERY = 4
AUTO_MATCHED_RANKS = 4  # merge.sparse_rule = auto is matched from here on, average below
AUTO_SHARED_RANKS = 32  # merge.shared_rows = -1 shares AUTO_SHARED_ROWS rows a window from here on,
AUTO_SHARED_RANKS_LONG = 16  # and from here on where k > AUTO_SHARED_LONG_K; none below
AUTO_SHARED_LONG_K = 8
AUTO_SHARED_ROWS = 32768


def resolve_merge(cfg: MergeConfig, world_size: int,
                  optimizer: SparseOptimizer = SparseOptimizer.ADAM) -> MergeConfig:
    """The merge settings a run of ``world_size`` ranks uses, its rows stepped by ``optimizer``
    (train.sparse_optimizer):

    - ``dense_gradients = auto`` becomes powersgd (rank ``merge.powersgd_rank``, 16) in kstep mode
      from AUTO_POWERSGD_RANKS ranks on, where the user set none of the local merge's knobs, else
      local: at a fixed global batch of 15,360, k = 8, on two data sets (tail-heavy / criteo
      shape), the dense gradients averaged every step as rank-16 factors (8% of sync's gradient
      bytes) lost 0.0020 / +0.0009 at 8 ranks, 0.0004 / 0.0007 at 16, 0.0006 / 0.0011 at 32 and
      0.0010 / 0.0011 at 64, against 0.0036 / +0.0004, 0.0012 / 0.0014, 0.0018 / 0.0021 and
      0.0026 / 0.0024 with local dense steps (merged every 4 steps in fp16 from 32 ranks on: 12.5%
      of the bytes). At 4 ranks, with matched rows, +0.0001 / 0.0000 (k = 8) and 0.0002 / 0.0001
      (k = 32) against 0.0015 / +0.0003 and 0.0036 / +0.0004 with the local dense model and the
      owners' average; at 2 ranks that path stays (0.0004 / +0.0002 and 0.0012 / +0.0002);

    - ``dense_every_steps = -1`` (auto) becomes 4 steps with float16 moves (``compression =
      fp16``) in kstep mode from AUTO_DENSE_RANKS ranks on, else 0 (the window's end);
    - ``sparse_rule = auto`` becomes matched in kstep mode from AUTO_MATCHED_RANKS ranks on, else
      average: at 16 and 64 ranks on tail-heavy data the owners' average kept a fraction of
      sync's progress on rows a few ranks each moved (-0.0066 and -0.0176 AUC, matched -0.0012
      and -0.0026), while on data whose rare values carry little signal matched cost 0.0006-0.0007
      at 64 ranks (two seeds): the rule with the smaller worst gap over both data sets. At 8
      ranks, with the dense gradients every step (powersgd), average lost 0.0020 on tail-heavy
      data and matched 0.0003 at worst (D4M); at 4 ranks with powersgd, matched 0.0002 at worst
      (the local path lost 0.0036 on tail-heavy data at k = 32), so it starts at 4;
    - ``sparse_rule = auto`` becomes sum in kstep mode for row-wise Adagrad's rows, at every world
      size: the moves and the accumulator's increments summed are sync's update where one rank
      touches a row a step (hvctr.storage.row_merge). At 2 ranks it beat the owners' average on all
      six runs (multi-hot and one-hot data, two seeds each), at 8 ranks matched on three of four
      (+0.0031 to +0.0085 AUC; -0.0015 on one multi-hot seed): docs/merging.md, "Row-wise Adagrad's rows";
    - ``shared_rows = -1`` (auto) becomes AUTO_SHARED_ROWS (32,768) in kstep mode from
      AUTO_SHARED_RANKS (32) ranks on, and from AUTO_SHARED_RANKS_LONG (16) where k > 8, else 0:
      at 16 ranks k = 8 held without them (0.0004 / 0.0008) and they would cost the most bytes
      there (0.8-0.9 MB a rank a step). At a fixed global batch of 15,360 on the two data sets,
      without them k = 32 lost 0.0020 / 0.0011 (tail-heavy / criteo shape) at 16 ranks, 0.0031 /
      0.0017 at 32 and 0.0051 / 0.0023 at 64, and k = 8 0.0011 on the criteo shape at 32 and 64;
      with them k = 32 0.0012 / 0.0002, 0.0015 / 0.0001, 0.0017 / 0.0002 (two seeds at 64) and
      k = 8 within 0.0008 everywhere, for 0.19-0.49 MB a rank a step on their bfloat16 wire
      (docs/merging.md); below 16 ranks not measured with them."""
    if cfg.shared_rows < 0:
        long_windows = world_size >= AUTO_SHARED_RANKS_LONG and cfg.every_k_steps > AUTO_SHARED_LONG_K
        many = cfg.mode is MergeMode.KSTEP and (world_size >= AUTO_SHARED_RANKS or long_windows)
        cfg = dataclasses.replace(cfg, shared_rows=AUTO_SHARED_ROWS if many else 0)
    if cfg.sparse_rule is SparseRule.AUTO:
        if SparseOptimizer(optimizer) is SparseOptimizer.ROWWISE_ADAGRAD:
            rule = SparseRule.SUM if cfg.mode is MergeMode.KSTEP else SparseRule.AVERAGE
        else:
            many = cfg.mode is MergeMode.KSTEP and world_size >= AUTO_MATCHED_RANKS
            rule = SparseRule.MATCHED if many else SparseRule.AVERAGE
        cfg = dataclasses.replace(cfg, sparse_rule=rule)
    if cfg.dense_gradients is DenseGradients.AUTO:
        # powersgd only where the user left the local merge's knobs alone (an explicit dense
        # merge, fp16 moves or an outer step asks for local steps)
        many = (cfg.mode is MergeMode.KSTEP and world_size >= AUTO_POWERSGD_RANKS and cfg.dense_every_steps == -1
                and cfg.compression is Compression.NONE and cfg.outer_lr == 1.0 and cfg.outer_momentum == 0.0)
        cfg = dataclasses.replace(cfg, dense_gradients=DenseGradients.POWERSGD if many else DenseGradients.LOCAL)
    if cfg.dense_gradients is DenseGradients.POWERSGD:  # the dense model is averaged every step
        return dataclasses.replace(cfg, dense_every_steps=0)
    if cfg.dense_every_steps >= 0:
        return cfg
    if cfg.mode is MergeMode.KSTEP and world_size >= AUTO_DENSE_RANKS and cfg.every_k_steps > AUTO_DENSE_EVERY:
        return dataclasses.replace(cfg, dense_every_steps=AUTO_DENSE_EVERY, compression=Compression.FP16)
    return dataclasses.replace(cfg, dense_every_steps=0)


def batch_growth(data: DataConfig, world_size: int) -> int:
    """How many times one rank's batch the global batch is: W, or 1 where ``data.global_batch_size``
    fixes the global batch (W ranks then take the steps one rank would, on the same samples)."""
    return 1 if data.global_batch_size else world_size


def size_batch(cfg: Config, size: int) -> Config:
    """``cfg`` with ``data.batch_size_per_rank`` = ``data.global_batch_size`` / W where the global
    batch is fixed (> 0): the same steps over the same samples at any rank count."""
    g = cfg.data.global_batch_size
    if g == 0:
        return cfg
    if g % size:
        raise ValueError(f"config key 'data.global_batch_size': {g} is not a multiple of the world size {size}: "
                         f"each rank takes global / W rows per step (set it to {max(size, g // size * size)})")
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, batch_size_per_rank=g // size))


PUSH_BEHIND_CACHE_FRACTION = 0.1  # a cache of at most this share of its shard's rows: out of core


def pushes_behind(cpus_per_rank: float, threads: int, on_gpu: bool, cache_rows: float, shard_rows: float) -> bool:
    """storage.push_behind = auto for one rank (the trainer agrees it over ranks; the planner
    reads it for its node): on where the prefetch thread has a core beside the rank's torch
    threads, a GPU computes, or the cache holds at most PUSH_BEHIND_CACHE_FRACTION of the
    shard's rows (out of core, what moves off the window's end is mostly waiting on the device:
    1.02-1.05x on 2 cores for 2 ranks, where all cached the moved CPU work gave 0.95-0.99x)."""
    return (on_gpu or cpus_per_rank >= threads + 1
            or cache_rows <= PUSH_BEHIND_CACHE_FRACTION * max(shard_rows, 1))
