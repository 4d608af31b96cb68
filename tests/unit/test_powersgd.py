"""merge.dense_gradients = powersgd (hvctr.train.merger.PowerSGD), on simulated ranks (ThreadComm):
every rank applies the same gradient; with error feedback the applied gradients add up to the
ranks' mean gradient; vectors and matrices too small to factor are averaged exactly; the bytes
are the factors'."""

import dataclasses

import torch

from hvctr.config import DenseGradients, MergeConfig
from hvctr.train.merger import KStepMerger
from tests.unit.test_sim_comm import run_ranks

W = 4
SHAPES = [(48, 40), (40,), (1, 40), (3, 2)]  # a matrix it factors; a vector; two it sends whole


def _grads(rank, step):
    g = torch.Generator().manual_seed(1000 * rank + step % 5)  # a few gradients, over and over
    return [torch.randn(s, generator=g) for s in SHAPES]


def _train(steps, rank_r=4):
    cfg = dataclasses.replace(MergeConfig(), dense_gradients=DenseGradients.POWERSGD, powersgd_rank=rank_r,
                              dense_every_steps=0)

    def rank_fn(comm):
        params = [torch.zeros(s, requires_grad=True) for s in SHAPES]
        merger = KStepMerger(comm, cfg, params, seed=7)
        applied = [torch.zeros(s) for s in SHAPES]
        for t in range(steps):
            for p, g in zip(params, _grads(comm.rank, t)):
                p.grad = g.clone()
            merger.average_gradients(name=f"step{t}")
            for a, p in zip(applied, params):
                a += p.grad
        flags = merger.merge(([], []), [1, 0], name="end")  # the window's end: the flags alone
        return applied, merger.bytes_sent, flags

    results, errors, _ = run_ranks(W, rank_fn)
    assert not any(errors), errors
    return results


def test_every_rank_applies_the_same_gradients_and_they_add_up_to_the_mean():
    steps = 200
    results = _train(steps)
    for applied, _, flags in results[1:]:
        for a, b in zip(applied, results[0][0]):
            torch.testing.assert_close(a, b, rtol=0, atol=0)  # the same bits on every rank
        assert flags == [W, 0]
    mean = [sum(sum(_grads(r, t)[i] for t in range(steps)) for r in range(W)) / W for i in range(len(SHAPES))]
    got = results[0][0]
    for i in (1, 2, 3):  # sent whole: the exact mean (up to the sums' rounding)
        torch.testing.assert_close(got[i], mean[i], rtol=1e-5, atol=1e-4)
    # factored: rank 4 of a 48 x 40 matrix a step, yet over 200 steps the error feedback carries
    # what each step left out into the next: the sum is the mean's within a few steps' error
    rel = (got[0] - mean[0]).norm() / mean[0].norm()
    assert rel < 0.05, rel
    # without the error feedback (one step, rank 4 of 40) the gap is most of the gradient
    one = _train(1)[0][0][0]
    one_mean = sum(_grads(r, 0)[0] for r in range(W)) / W
    assert (one - one_mean).norm() / one_mean.norm() > 0.3


def test_the_factors_are_what_travels():
    (_, sent, _), *_ = _train(3, rank_r=4)
    floats_a_step = 4 * (48 + 40) + 40 + 40 + 6  # P and Q of the matrix; the rest whole
    assert sent == 4 * (3 * floats_a_step + 2)  # and the window end's two flags


def test_config_names_what_powersgd_does_not_take():
    import pytest

    from hvctr.config import load_config
    from hvctr.config.resolve import resolve_merge

    cfg = load_config(None, ["--merge.dense_gradients=powersgd"])
    assert resolve_merge(cfg.merge, 64).dense_every_steps == 0  # never the auto dense merges of 32+ ranks
    for flags, what in ((["--merge.mode=sync"], "kstep mode"), (["--merge.dense_every_steps=4"], "never merged"),
                        (["--merge.compression=fp16"], "never merged"), (["--merge.outer_lr=0.5"], "outer step"),
                        (["--merge.powersgd_rank=0"], "merge.powersgd_rank")):
        with pytest.raises(ValueError, match="merge.") as e:
            load_config(None, ["--merge.dense_gradients=powersgd", *flags])
        assert what in str(e.value)


def test_the_planner_counts_the_factors():
    from hvctr.config import load_config
    from hvctr.plan.cmd import job_from
    from hvctr.plan.model import dense_params, powersgd_step_bytes

    cfg = load_config(None, ["--merge.dense_gradients=powersgd", "--merge.powersgd_rank=4"])
    job = job_from(cfg, 1, 2, 10**6, 0)
    assert job.powersgd_rank == 4 and job.dense_every_steps == 0
    first, second = powersgd_step_bytes(cfg.model, cfg.storage.dim, 4)
    # the default DNN, 429 -> 512 -> 256 -> 1: both large weights factored, the last sent whole
    assert first == 4 * (4 * 512 + 512 + 4 * 256 + 256 + 256 + 1) and second == 4 * (4 * 429 + 4 * 512)
    assert (first + second) / (4 * dense_params(cfg.model, cfg.storage.dim)) < 0.03  # 2% of sync's gradients
