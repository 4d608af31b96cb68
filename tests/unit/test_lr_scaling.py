"""merge.lr_scaling: the rates of a step at W ranks (hvctr.train.lr)."""

import math

import pytest

from hvctr.config import AdamScaling, LrScaling, MergeConfig, TrainConfig, load_config
from hvctr.train.lr import LearningRates


@pytest.mark.parametrize("rule,world,want", [(LrScaling.NONE, 8, 1.0), (LrScaling.LINEAR, 8, 8.0),
                                             (LrScaling.SQRT, 16, 4.0), (LrScaling.SQRT, 1, 1.0)])
def test_the_factor_after_warmup(rule, world, want):
    lr = LearningRates(TrainConfig(dense_lr=1e-3, sparse_lr=2e-3), MergeConfig(lr_scaling=rule), world)
    assert lr.factor(0) == lr.factor(10_000) == want
    assert lr.dense(5) == 1e-3 * want and lr.sparse(5) == 2e-3 * want


def test_warmup_ramps_linearly_from_the_base_rates():
    lr = LearningRates(TrainConfig(), MergeConfig(lr_scaling=LrScaling.LINEAR, lr_warmup_steps=100), 4)
    assert lr.factor(0) == pytest.approx(1 + 3 * 0.01)
    assert lr.factor(49) == pytest.approx(2.5)
    assert lr.factor(99) == lr.factor(500) == 4.0
    assert [lr.factor(s) for s in range(100)] == sorted(lr.factor(s) for s in range(100))


def test_no_scaling_gives_the_configured_rates_exactly():
    t = TrainConfig(dense_lr=3e-4, sparse_lr=7e-3)
    lr = LearningRates(t, MergeConfig(lr_scaling=LrScaling.NONE, lr_warmup_steps=50), 64)
    assert all(lr.dense(s) == 3e-4 and lr.sparse(s) == 7e-3 for s in (0, 1, 49, 50, 10_000))


def test_the_default_is_the_square_root_rule():
    assert MergeConfig().lr_scaling is LrScaling.SQRT and MergeConfig().adam_scaling is AdamScaling.SQRT
    assert LearningRates(TrainConfig(), MergeConfig(), 1).factor(0) == 1.0  # one rank: the rates as given


def test_config_keys_are_checked():
    with pytest.raises(ValueError, match="merge.outer_momentum"):
        load_config(None, ["--merge.outer_momentum=1.0"])
    with pytest.raises(ValueError, match="merge.lr_warmup_steps"):
        load_config(None, ["--merge.lr_warmup_steps=-1"])
    assert load_config(None, ["--merge.lr_scaling=sqrt"]).merge.lr_scaling is LrScaling.SQRT
    assert math.isclose(LearningRates(TrainConfig(), MergeConfig(lr_scaling=LrScaling.SQRT), 2).factor(0), 2 ** 0.5)


def test_adam_scaling_shortens_the_moments_memory_by_sqrt_w():
    t = TrainConfig(beta1=0.9, beta2=0.999, eps=1e-8)
    lr = LearningRates(t, MergeConfig(adam_scaling=AdamScaling.SQRT), 16)
    assert lr.beta1 == pytest.approx(1 - 4 * 0.1) and lr.beta2 == pytest.approx(1 - 4 * 0.001)
    assert lr.eps == pytest.approx(1e-8 / 2)
    one = LearningRates(t, MergeConfig(adam_scaling=AdamScaling.SQRT), 1)
    assert (one.beta1, one.beta2, one.eps) == (0.9, 0.999, 1e-8)  # one rank: Adam as configured, exactly
    off = LearningRates(t, MergeConfig(adam_scaling=AdamScaling.NONE), 64)
    assert (off.beta1, off.beta2, off.eps) == (0.9, 0.999, 1e-8)
    assert LearningRates(t, MergeConfig(adam_scaling=AdamScaling.SQRT), 400).beta1 == 0.0  # never negative


def test_a_fixed_global_batch_is_dealt_over_the_ranks_and_grows_nothing():
    from hvctr.config import DataConfig
    from hvctr.config.resolve import batch_growth
    from hvctr.config.resolve import size_batch

    cfg = load_config(None, ["--data.global_batch_size=4096"])
    assert size_batch(cfg, 64).data.batch_size_per_rank == 64
    assert size_batch(cfg, 1).data.batch_size_per_rank == 4096
    plain = load_config(None, ["--data.batch_size_per_rank=512"])
    assert size_batch(plain, 8) == plain  # 0: the per-rank batch as given
    with pytest.raises(ValueError, match="data.global_batch_size.*not a multiple of the world size 3"):
        size_batch(cfg, 3)
    with pytest.raises(ValueError, match="data.global_batch_size"):
        load_config(None, ["--data.global_batch_size=-1"])
    # the rates and Adam scale with the global batch's growth, not the rank count
    assert batch_growth(DataConfig(), 16) == 16 and batch_growth(DataConfig(global_batch_size=4096), 16) == 1
    fixed = LearningRates(TrainConfig(), MergeConfig(), batch_growth(DataConfig(global_batch_size=4096), 64))
    assert fixed.factor(0) == 1.0 and (fixed.beta1, fixed.beta2, fixed.eps) == (0.9, 0.999, 1e-8)


def test_dense_gradients_every_step_from_4_ranks_on_by_default():
    from hvctr.config import Compression, DenseGradients, MergeConfig, MergeMode, SparseRule
    from hvctr.config.resolve import AUTO_POWERSGD_RANKS, resolve_merge

    auto = MergeConfig(every_k_steps=8)
    assert auto.dense_every_steps == -1 and auto.dense_gradients is DenseGradients.AUTO and auto.powersgd_rank == 16
    assert AUTO_POWERSGD_RANKS == 4
    small = resolve_merge(auto, AUTO_POWERSGD_RANKS - 1)
    assert small.dense_every_steps == 0 and small.compression is Compression.NONE
    assert small.dense_gradients is DenseGradients.LOCAL  # the 2-rank benchmarks unchanged
    big = resolve_merge(auto, AUTO_POWERSGD_RANKS)
    assert big.dense_gradients is DenseGradients.POWERSGD and big.dense_every_steps == 0
    assert big.compression is Compression.NONE
    # the local merge's knobs, set by the user, keep the local dense model; its auto merges as before
    local = resolve_merge(MergeConfig(every_k_steps=8, dense_gradients=DenseGradients.LOCAL), 64)
    assert local.dense_every_steps == 4 and local.compression is Compression.FP16  # one fp32 merge's bytes per 8 steps
    for knob in ({"dense_every_steps": 2}, {"dense_every_steps": 0}, {"compression": Compression.FP16},
                 {"outer_lr": 0.7}, {"outer_momentum": 0.5}):
        assert resolve_merge(MergeConfig(every_k_steps=8, **knob), 64).dense_gradients is DenseGradients.LOCAL, knob
    assert resolve_merge(MergeConfig(every_k_steps=4, dense_gradients=DenseGradients.LOCAL), 64).dense_every_steps == 0
    assert resolve_merge(MergeConfig(mode=MergeMode.SYNC), 64).dense_every_steps == 0
    assert resolve_merge(MergeConfig(mode=MergeMode.SYNC), 64).dense_gradients is DenseGradients.LOCAL
    assert resolve_merge(MergeConfig(mode=MergeMode.SYNC), 64).compression is Compression.NONE
    chosen = MergeConfig(every_k_steps=8, dense_every_steps=0, sparse_rule=SparseRule.SQRT,
                         dense_gradients=DenseGradients.LOCAL, shared_rows=0)
    assert resolve_merge(chosen, 64) is chosen  # what the user sets is kept
    assert resolve_merge(MergeConfig(every_k_steps=8, dense_every_steps=2), 2).dense_every_steps == 2


def test_owners_scale_the_rows_moves_from_4_ranks_on_by_default():
    from hvctr.config import MergeConfig, MergeMode, SparseRule
    from hvctr.config.resolve import AUTO_MATCHED_RANKS, resolve_merge

    auto = MergeConfig(every_k_steps=8)
    assert auto.sparse_rule is SparseRule.AUTO and AUTO_MATCHED_RANKS == 4
    assert resolve_merge(auto, AUTO_MATCHED_RANKS - 1).sparse_rule is SparseRule.AVERAGE
    assert resolve_merge(auto, 2).sparse_rule is SparseRule.AVERAGE  # the 2-rank benchmarks unchanged
    assert resolve_merge(auto, AUTO_MATCHED_RANKS).sparse_rule is SparseRule.MATCHED
    assert resolve_merge(MergeConfig(mode=MergeMode.SYNC), 64).sparse_rule is SparseRule.AVERAGE  # no owner merge
    assert resolve_merge(MergeConfig(sparse_rule=SparseRule.AVERAGE), 64).sparse_rule is SparseRule.AVERAGE


def test_owners_sum_rowwise_adagrads_rows_at_every_world_size_by_default():
    from hvctr.config import MergeConfig, MergeMode, SparseRule
    from hvctr.config.resolve import resolve_merge
    from hvctr.formats import SparseOptimizer

    auto = MergeConfig(every_k_steps=8)
    for w in (2, 3, 4, 8, 64):
        assert resolve_merge(auto, w, SparseOptimizer.ROWWISE_ADAGRAD).sparse_rule is SparseRule.SUM, w
        assert resolve_merge(auto, w, "rowwise_adagrad").sparse_rule is SparseRule.SUM, w
    assert resolve_merge(auto, 2, SparseOptimizer.ROWWISE_ADAM).sparse_rule is SparseRule.AVERAGE  # Adam's: as before
    assert resolve_merge(auto, 8, SparseOptimizer.ADAM).sparse_rule is SparseRule.MATCHED
    sync = MergeConfig(mode=MergeMode.SYNC)
    assert resolve_merge(sync, 8, SparseOptimizer.ROWWISE_ADAGRAD).sparse_rule is SparseRule.AVERAGE  # no owner merge
    chosen = MergeConfig(every_k_steps=8, sparse_rule=SparseRule.AVERAGE)
    assert resolve_merge(chosen, 8, SparseOptimizer.ROWWISE_ADAGRAD).sparse_rule is SparseRule.AVERAGE  # as set
