"""KStepMerger and SyncGradients against closed forms, at 2 and 3 ranks."""

import torch

from hvctr.config import Compression, MergeConfig, MergeStates
from hvctr.train.merger import KStepMerger, SyncGradients


def _tensors(rank):
    p = [torch.full((3, 2), float(rank)), torch.arange(4, dtype=torch.float32) + rank]
    m = [torch.full((3, 2), 10.0 * rank), torch.full((4,), 1.0 + rank)]
    v = [torch.full((3, 2), 1e-10 * (rank + 1)), torch.full((4,), 2e-9 * (rank + 1))]
    return p, m, v


def test_params_only_leaves_moments(comm):
    p, m, v = _tensors(comm.rank)
    merger = KStepMerger(comm, MergeConfig(states=MergeStates.PARAMS), p)
    flags = merger.merge((m, v), [1 if comm.rank == 0 else 0, 0], name="t.merge.p")
    mean = (comm.size - 1) / 2
    assert torch.allclose(p[0], torch.full((3, 2), mean))
    assert torch.allclose(p[1], torch.arange(4, dtype=torch.float32) + mean)
    assert torch.equal(m[0], torch.full((3, 2), 10.0 * comm.rank))  # untouched
    assert flags == [1, 0]  # rank 0's stop request reaches everyone


def test_params_m_v_average_everything(comm):
    p, m, v = _tensors(comm.rank)
    merger = KStepMerger(comm, MergeConfig(states=MergeStates.PARAMS_M_V), p)
    merger.merge((m, v), [0, 0], name="t.merge.pmv")
    n = comm.size
    assert torch.allclose(m[0], torch.full((3, 2), 10.0 * (n - 1) / 2))
    assert torch.allclose(v[0], torch.full((3, 2), 1e-10 * (n + 1) / 2), rtol=1e-6, atol=0)
    assert merger.bytes_sent == 4 * (6 + 4) * 3 + 4 * 2


def test_fp16_never_touches_v(comm):
    p, m, v = _tensors(comm.rank)
    merger = KStepMerger(comm, MergeConfig(states=MergeStates.PARAMS_M_V, compression=Compression.FP16), p)
    merger.start = [torch.zeros_like(t) for t in p]  # as mark_start() at an all-zero model
    merger.merge((m, v), [0, 0], name="t.merge.fp16")
    n = comm.size
    # v ~ 1e-10 is far below fp16's range: in float32 it survives, in fp16 it would be 0
    assert torch.allclose(v[1], torch.full((4,), 2e-9 * (n + 1) / 2), rtol=1e-6, atol=0)
    assert v[1].dtype == torch.float32 and p[0].dtype == torch.float32
    assert merger.bytes_sent == 2 * (6 + 4) * 2 + 4 * (6 + 4) + 4 * 2


def test_sync_gradients_average(comm):
    w = torch.nn.Parameter(torch.zeros(5))
    w.grad = torch.full((5,), float(comm.rank + 1))
    sync = SyncGradients(comm, MergeConfig(), [w])
    flags = sync.average([0, comm.rank], name="t.sync")
    assert torch.allclose(w.grad, torch.full((5,), (comm.size + 1) / 2))
    assert flags == [0, sum(range(comm.size))]


def test_outer_step_with_momentum_against_its_closed_form(comm):
    """SlowMo's outer step on the averaged move, two windows: u1 = d1, p1 = s0 - a*u1;
    u2 = b*u1 + d2, p2 = p1 - a*u2, where d is start minus the ranks' average."""
    a, b = 0.7, 0.5
    p = [torch.zeros(3)]
    merger = KStepMerger(comm, MergeConfig(outer_lr=a, outer_momentum=b), p)
    merger.mark_start()  # start s0 = 0
    n = comm.size
    mean_move = -(n - 1) / 2 - 1.0  # rank r moved by -(r + 1)
    with torch.no_grad():
        p[0].add_(-(comm.rank + 1.0))
    merger.merge(([], []), [0, 0], name="t.merge.outer1")
    u1 = -mean_move
    p1 = 0.0 - a * u1
    assert torch.allclose(p[0], torch.full((3,), p1))
    with torch.no_grad():
        p[0].add_(-(comm.rank + 1.0))
    merger.merge(([], []), [0, 0], name="t.merge.outer2")
    u2 = b * u1 - mean_move
    assert torch.allclose(p[0], torch.full((3,), p1 - a * u2))
    assert torch.allclose(merger.momentum[0], torch.full((3,), u2))


def test_outer_step_defaults_are_plain_averaging_bit_for_bit(comm):
    p, m, v = _tensors(comm.rank)
    q = [t.clone() for t in p]
    KStepMerger(comm, MergeConfig(), p).merge((m, v), [0, 0], name="t.merge.plain")
    outer = KStepMerger(comm, MergeConfig(outer_lr=1.0, outer_momentum=0.0), q)
    outer.mark_start()
    outer.merge((m, v), [0, 0], name="t.merge.plain2")
    assert not outer.outer and all(torch.equal(x, y) for x, y in zip(p, q))


def test_fp16_sends_moves_and_keeps_the_parameters_precision(comm):
    # Parameters near 3 move by a few 1e-3 a window: float16 of the parameters would round
    # them to 0.002 (fp16's spacing at 3); float16 of the moves keeps the average to ~1e-6.
    p = [torch.full((5,), 3.123456), torch.linspace(-2.0, 2.0, 7)]
    merger = KStepMerger(comm, MergeConfig(compression=Compression.FP16), p)
    merger.mark_start()
    start = [t.clone() for t in p]
    for window in range(3):
        moves = [torch.full_like(t, 1e-3 * (comm.rank + 1) * (window + 1)) for t in p]
        for t, d in zip(p, moves):
            t.add_(d)
        merger.merge(([], []), [0, 0], name=f"t.merge.moves{window}")
        mean_move = 1e-3 * (comm.size + 1) / 2 * (window + 1)
        for t, s0 in zip(p, start):
            s0.add_(mean_move)
            assert torch.allclose(t, s0, rtol=0, atol=1e-5), (t, s0)  # fp16 of the params: up to 1e-3 off
        # the next merge sends the move since this one (start follows the merged model)
        assert all(torch.equal(a, b) for a, b in zip(merger.start, p))
    assert merger.bytes_sent == 3 * (2 * (5 + 7) + 4 * 2)
