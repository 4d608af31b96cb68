import contextlib
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from hvctr.optim import (apply_adam_to_rows, batch_unique, dim_of_width, gather_embeddings, gather_rows, row_width,
                         sparse_adam_step, sum_embedding_grads, sum_rows_grad)
from hvctr.kernels import native as _native

LR, B1, B2, EPS = 1e-2, 0.9, 0.999, 1e-8
PATHS = ["native", "torch"]


def _path(name):
    if name == "native":
        assert _native.lib() is not None, "the C kernels are built at install time"
        return contextlib.nullcontext()
    return _native.disabled()


def _fresh_rows(w: torch.Tensor) -> torch.Tensor:
    """Rows holding the model columns w [n, D+1] and zero optimiser state."""
    n, c = w.shape
    rows = torch.zeros(n, row_width(c - 1))
    rows[:, :c] = w
    return rows


def test_row_width_round_trip():
    assert row_width(16) == 52
    assert dim_of_width(52) == 16
    with pytest.raises(ValueError):
        dim_of_width(50)


@pytest.mark.parametrize("path", PATHS)
def test_rows_touched_every_step_match_torch_adam(path):
    g = torch.Generator().manual_seed(0)
    n, c, steps = 40, 9, 25
    param = torch.nn.Parameter(torch.randn(n, c, generator=g))
    opt = torch.optim.Adam([param], lr=LR, betas=(B1, B2), eps=EPS)
    rows = _fresh_rows(param.detach().clone())
    with _path(path):
        for _ in range(steps):
            grad = torch.randn(n, c, generator=g) * 0.1
            param.grad = grad.clone()
            opt.step()
            sparse_adam_step(rows, torch.arange(n), grad, LR, B1, B2, EPS)
    state = opt.state[param]
    torch.testing.assert_close(rows[:, :c], param.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(rows[:, c:2 * c], state["exp_avg"], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(rows[:, 2 * c:3 * c], state["exp_avg_sq"], rtol=1e-5, atol=1e-9)
    assert torch.all(rows[:, 3 * c] == steps)


@pytest.mark.parametrize("path", PATHS)
def test_lazy_rows_keep_their_own_step_and_untouched_rows_stay(path):
    """Each row behaves like its own torch Adam fed only on the steps that touch it."""
    g = torch.Generator().manual_seed(1)
    n, c, steps = 12, 5, 30
    init = torch.randn(n, c, generator=g)
    rows = _fresh_rows(init)
    per_row = [torch.nn.Parameter(init[i].clone()) for i in range(n)]
    opts = [torch.optim.Adam([p], lr=LR, betas=(B1, B2), eps=EPS) for p in per_row]
    never = 11  # a row no step touches
    with _path(path):
        for t in range(steps):
            touched = torch.nonzero(torch.rand(n, generator=g) < 0.4).flatten()
            touched = touched[touched != never]
            if t == 20:  # row 10 is touched for the first time late: a full-size first step
                touched = torch.unique(torch.cat([touched, torch.tensor([10])]))
            elif (touched == 10).any():
                touched = touched[touched != 10]
            grad = torch.randn(touched.numel(), c, generator=g)
            before = rows.clone()
            sparse_adam_step(rows, touched, grad, LR, B1, B2, EPS)
            other = torch.ones(n, dtype=torch.bool)
            other[touched] = False
            assert torch.equal(rows[other], before[other])  # bit-equal, state included
            for j, i in enumerate(touched.tolist()):
                per_row[i].grad = grad[j].clone()
                opts[i].step()
    for i in range(n):
        torch.testing.assert_close(rows[i, :c], per_row[i].detach(), rtol=1e-5, atol=1e-6)
    assert torch.equal(rows[never, :c], init[never]) and rows[never, 3 * c] == 0
    assert rows[10, 3 * c] == 1
    # Adam's first step moves every coordinate by about lr, whatever the gradient's scale.
    assert torch.allclose((rows[10, :c] - init[10]).abs(), torch.full((c,), LR), rtol=1e-3)


def test_native_and_torch_paths_agree_on_a_large_table():
    assert _native.lib() is not None
    g = torch.Generator().manual_seed(2)
    U, D = 5000, 16
    rows = torch.rand(U, row_width(D), generator=g)
    rows[:, -1] = torch.randint(0, 50, (U,), generator=g).float()  # mixed step counts
    idx = torch.randperm(U, generator=g)[:1500]  # unsorted, distinct
    grad = torch.randn(idx.numel(), D + 1, generator=g)
    a, b = rows.clone(), rows.clone()
    sparse_adam_step(a, idx, grad, LR, B1, B2, EPS)
    with _native.disabled():
        sparse_adam_step(b, idx, grad, LR, B1, B2, EPS)
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert not torch.equal(a, rows)


def test_apply_adam_to_rows_is_pure_and_matches_the_in_place_step():
    rng = np.random.default_rng(3)
    rows = rng.random((30, row_width(4)), dtype=np.float32)
    rows[:, -1] = rng.integers(0, 5, 30)
    grads = rng.standard_normal((30, 5)).astype(np.float32)
    keep = rows.copy()
    out = apply_adam_to_rows(rows, grads, LR, B1, B2, EPS)
    assert isinstance(out, np.ndarray) and out.dtype == np.float32
    assert np.array_equal(rows, keep)
    ref = torch.from_numpy(keep.copy())
    sparse_adam_step(ref, torch.arange(30), torch.from_numpy(grads), LR, B1, B2, EPS)
    assert np.array_equal(out, ref.numpy())
    t_out = apply_adam_to_rows(torch.from_numpy(keep), torch.from_numpy(grads), LR, B1, B2, EPS)
    assert isinstance(t_out, torch.Tensor) and torch.equal(t_out, ref)


def test_bad_indices_and_shapes_are_errors():
    rows = torch.zeros(10, row_width(2))
    with pytest.raises(IndexError):
        sparse_adam_step(rows, torch.tensor([3, 10]), torch.zeros(2, 3), LR, B1, B2, EPS)
    with pytest.raises(ValueError):
        sparse_adam_step(rows, torch.tensor([3, 4]), torch.zeros(2, 4), LR, B1, B2, EPS)
    with pytest.raises(IndexError):
        gather_rows(rows, torch.tensor([[-1, 2]]), 2)


@pytest.mark.parametrize("path", PATHS)
def test_gather_and_sum_rows_grad_against_autograd(path):
    g = torch.Generator().manual_seed(4)
    U, D, B, Fn = 300, 6, 64, 5
    rows = torch.randn(U, row_width(D), generator=g)
    pos = torch.randint(0, 80, (B, Fn), generator=g) * 3  # repeats within the batch, gaps in the table
    with _path(path):
        p = gather_rows(rows, pos, D)
        assert p.requires_grad and p.is_leaf and p.shape == (B, Fn, D + 1)
        assert torch.equal(p.detach(), rows[pos, :D + 1])
        weights = torch.randn(Fn, D + 1, generator=g)
        ((p * weights).sum(-1).tanh().sum()).backward()
        idx, summed = sum_rows_grad(pos, p.grad)
        idx2, summed2 = sum_rows_grad(pos, p.grad, batch_unique(pos))
    # The same loss through a dense table: autograd's gradient per row.
    table = rows[:, :D + 1].clone().requires_grad_()
    ((F.embedding(pos, table) * weights).sum(-1).tanh().sum()).backward()
    touched = torch.nonzero(table.grad.abs().sum(1)).flatten()
    assert torch.equal(idx, torch.unique(pos)) and torch.equal(idx, touched)
    torch.testing.assert_close(summed, table.grad[idx], rtol=1e-5, atol=1e-6)
    assert torch.equal(idx, idx2) and torch.equal(summed, summed2)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("reads_w1", [True, False], ids=["w1", "no-w1"])
def test_split_gather_equals_gather_rows_bit_for_bit(path, reads_w1):
    """gather_embeddings + sum_embedding_grads (the trainer's) give gather_rows +
    sum_rows_grad's values and summed gradients exactly, with w1 read or not (a DNN)."""
    g = torch.Generator().manual_seed(6)
    U, D, B, Fn = 400, 8, 128, 6
    rows = torch.randn(U, row_width(D), generator=g)
    pos = torch.randint(0, 90, (B, Fn), generator=g) * 4
    lin = torch.nn.Linear(Fn * D, 1)

    def loss(emb, w1):
        out = lin(emb.flatten(1)).squeeze(1).tanh()
        return (out + (w1.sum(1).sin() if reads_w1 else 0)).sum()

    with _path(path):
        p = gather_rows(rows, pos, D)
        loss(p[..., :D], p[..., D]).backward()
        idx, summed = sum_rows_grad(pos, p.grad, batch_unique(pos))
        emb, w1 = gather_embeddings(rows, pos, D)
        assert emb.is_leaf and emb.requires_grad and emb.is_contiguous() and emb.shape == (B, Fn, D)
        assert w1.is_leaf and w1.shape == (B, Fn) and emb.data_ptr() % 64 == 0
        assert torch.equal(emb.detach(), p.detach()[..., :D]) and torch.equal(w1.detach(), p.detach()[..., D])
        lin.zero_grad()
        loss(emb, w1).backward()
        assert (w1.grad is None) is not reads_w1
        idx2, summed2 = sum_embedding_grads(pos, emb.grad, w1.grad, batch_unique(pos))
    assert torch.equal(idx, idx2) and torch.equal(summed, summed2)


def test_sum_rows_grad_brute_force():
    rng = np.random.default_rng(5)
    pos = rng.integers(0, 50, (200, 7))
    grad = rng.standard_normal((200, 7, 3)).astype(np.float32)
    idx, summed = sum_rows_grad(torch.from_numpy(pos), torch.from_numpy(grad))
    ref = np.zeros((50, 3), np.float64)
    np.add.at(ref, pos.reshape(-1), grad.reshape(-1, 3))
    assert idx.tolist() == np.unique(pos).tolist()
    np.testing.assert_allclose(summed.numpy(), ref[np.unique(pos)], rtol=1e-5, atol=1e-5)


def test_hvctr_native_0_runs_the_torch_path_without_a_compiler(tmp_path):
    code = (
        "import torch\n"
        "from hvctr.kernels import native as _native\n"
        "from hvctr.optim import sparse_adam_step, row_width\n"
        "assert _native.lib() is None and _native.kernel_path() == 'torch'\n"
        "rows = torch.zeros(4, row_width(2))\n"
        "sparse_adam_step(rows, torch.tensor([1, 2]), torch.ones(2, 3), 0.1, 0.9, 0.999, 1e-8)\n"
        "assert rows[1, -1] == 1 and rows[0, -1] == 0\n"
        "print('ok')\n"
    )
    env = dict(os.environ, CC=str(tmp_path / "no-such-cc"), HVCTR_NATIVE="0")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "ok" in r.stdout


def test_sparse_path_bench_runs_and_reports_both_paths(capsys, tmp_path):
    from bench import sparse as bench
    md = tmp_path / "B.md"
    md.write_text("# Benchmarks\n\n## Sparse path\n\nold figures\n\n## Other\n\nkept\n")
    assert bench.main(["--repeats", "1", "--window", "2", "--batch-size", "256", "--dim", "4", "--write", str(md)]) == 0
    text = md.read_text()
    assert "old figures" not in text and "kept" in text and "| **sparse path / MLP step** |" in text
    assert "`python -m bench.sparse --repeats 1 --window 2 --batch-size 256 --dim 4`" in text
    lines = [json.loads(x) for x in capsys.readouterr().out.strip().splitlines()]
    assert [x.get("path") for x in lines] == [None, "native", "torch"]
    assert all(x["total_ms"] > 0 and x["mlp_step_ms"] > 0 for x in lines[1:])
    setup = lines[0]
    assert setup["unique_rows_per_sample_window"] <= setup["unique_rows_per_sample_batch"] <= 26


@pytest.mark.parametrize("path", PATHS)
def test_batch_unique_equals_torch_unique(path):
    g = torch.Generator().manual_seed(6)
    cases = [torch.randint(0, 1000, (64, 26), generator=g), torch.randint(0, 100_000, (4096, 3), generator=g),
             torch.tensor([[5, 5], [5, 5]]), torch.tensor([[0, 63, 64, 127, 128]]), torch.zeros(0, 26, dtype=torch.long)]
    with _path(path):
        for pos in cases:
            uniq, inverse = batch_unique(pos)
            ref_u, ref_i = torch.unique(pos, sorted=True, return_inverse=True)
            assert torch.equal(uniq, ref_u) and torch.equal(inverse, ref_i) and inverse.shape == pos.shape
        if path == "native":
            with pytest.raises(IndexError):
                batch_unique(torch.tensor([[1, -2]]))


def test_batch_unique_of_far_apart_values():
    pos = torch.tensor([[3, 1 << 40], [3, 7]])
    uniq, inverse = batch_unique(pos)
    assert uniq.tolist() == [3, 7, 1 << 40] and inverse.tolist() == [[0, 2], [0, 1]]
