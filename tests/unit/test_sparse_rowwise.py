"""Row-wise optimiser states (train.sparse_optimizer): the row layouts, the two row-wise steps
against a float64 reference written from their definitions, the C kernels against the torch
path, and a shard that keeps its rows' optimiser."""

import contextlib

import h5py
import numpy as np
import pytest
import torch

from hvctr.config import StorageConfig
from hvctr.formats import C_LAYOUTS, RowLayout, SparseOptimizer
from hvctr.kernels import native as _native
from hvctr.optim import apply_step_to_rows, sparse_adam_step, sparse_step
from hvctr.storage import EmbeddingStore

LR, B1, B2, EPS = 1e-2, 0.9, 0.999, 1e-8
ROWWISE = [SparseOptimizer.ROWWISE_ADAM, SparseOptimizer.ROWWISE_ADAGRAD]


def _path(name):
    if name == "native":
        assert _native.lib() is not None, "the C kernels are built at install time"
        return contextlib.nullcontext()
    return _native.disabled()


def test_layouts_widths_and_bytes_at_dim_128():
    # the figures: Adam 3 (D + 1) + 1 floats; row-wise Adagrad about D + 3
    assert [RowLayout(128, o).row_bytes for o in SparseOptimizer] == [1552, 1040, 524]
    assert RowLayout(128, "rowwise_adagrad").width == 128 + 3
    for o in SparseOptimizer:
        for dim in (1, 2, 7, 16, 128):
            lay = RowLayout(dim, o)
            assert RowLayout.of_width(lay.width, o) == lay
            assert lay.model == slice(0, dim + 1) and lay.states == slice(dim + 1, lay.width)
            assert lay.step == lay.width - 1 and lay.v.stop == lay.step
    assert RowLayout(4, "adam") != RowLayout(4, "rowwise_adam")
    assert RowLayout(16, "rowwise_adagrad").columns() == "w[16] w1[1] v[1] step[1]"
    assert RowLayout(16, "rowwise_adam").columns() == "w[16] w1[1] m[17] v[1] step[1]"
    assert RowLayout(16).columns() == "w[16] w1[1] m[17] v[17] step[1]"
    with pytest.raises(ValueError, match=r"w\[D\] w1\[1\] m\[D\+1\] v\[1\] step\[1\]"):
        RowLayout.of_width(13, "rowwise_adam")  # 2 (D + 1) + 2 is even


def test_the_loaded_kernels_have_every_layout():
    lib = _native.lib()
    out = np.zeros(4, dtype=np.int64)
    for kind, o in enumerate(C_LAYOUTS):
        lay = RowLayout(33, o)
        lib.hv_row_layout(kind, lay.model_width, out.ctypes.data)
        assert out.tolist() == [lay.m.start, lay.v.start, lay.step, lay.width]


def _reference(optimizer, rows, steps):
    """Float64, row by row, from the optimisers' definitions: ``steps`` [(idx, grad)]."""
    lay = RowLayout.of_width(rows.shape[1], optimizer)
    r = rows.astype(np.float64)
    for idx, grad in steps:
        for i, g in zip(idx, grad.astype(np.float64)):
            row = r[i]
            row[lay.step] += 1
            t = row[lay.step]
            ms = np.mean(g * g)
            if optimizer is SparseOptimizer.ROWWISE_ADAGRAD:
                row[lay.v] += ms
                row[lay.model] -= LR * g / (np.sqrt(row[lay.v]) + EPS)
            else:
                row[lay.m] = B1 * row[lay.m] + (1 - B1) * g
                row[lay.v] = B2 * row[lay.v] + (1 - B2) * ms
                m_hat, v_hat = row[lay.m] / (1 - B1 ** t), row[lay.v] / (1 - B2 ** t)
                row[lay.model] -= LR * m_hat / (np.sqrt(v_hat) + EPS)
    return r


@pytest.mark.parametrize("path", ["native", "torch"])
@pytest.mark.parametrize("optimizer", ROWWISE)
def test_rowwise_steps_follow_their_definition(optimizer, path):
    g = torch.Generator().manual_seed(3)
    U, D = 300, 8
    lay = RowLayout(D, optimizer)
    rows = torch.zeros(U, lay.width)
    rows[:, lay.model] = torch.rand(U, D + 1, generator=g) * 0.02 - 0.01
    rows[:, lay.step] = torch.randint(0, 30, (U,), generator=g).float()  # rows first touched at other steps
    start = rows.clone()
    steps = []
    with _path(path):
        for _ in range(12):
            idx = torch.randperm(U, generator=g)[:90]  # distinct, unsorted; rows skip steps (lazy)
            grad = torch.randn(90, D + 1, generator=g) * torch.rand(90, 1, generator=g)
            sparse_step(lay, rows, idx, grad, LR, B1, B2, EPS)
            steps.append((idx.numpy(), grad.numpy()))
    want = _reference(optimizer, start.numpy(), steps)
    np.testing.assert_allclose(rows.numpy(), want, rtol=2e-5, atol=1e-7)
    touched = np.unique(np.concatenate([i for i, _ in steps]))
    untouched = np.setdiff1d(np.arange(U), touched)
    assert untouched.size and torch.equal(rows[untouched], start[untouched])  # lazy: bit for bit
    if optimizer is SparseOptimizer.ROWWISE_ADAGRAD:
        assert lay.m.stop == lay.m.start  # no first moment kept


@pytest.mark.parametrize("optimizer", ROWWISE)
def test_native_and_torch_paths_agree(optimizer):
    g = torch.Generator().manual_seed(5)
    U, D = 4000, 16
    lay = RowLayout(D, optimizer)
    rows = torch.rand(U, lay.width, generator=g) * 0.1
    rows[:, lay.step] = torch.randint(0, 50, (U,), generator=g).float()
    idx = torch.randperm(U, generator=g)[:1500]
    grad = torch.randn(idx.numel(), D + 1, generator=g)
    a, b = rows.clone(), rows.clone()
    sparse_step(lay, a, idx, grad, LR, B1, B2, EPS)
    with _native.disabled():
        sparse_step(lay, b, idx, grad, LR, B1, B2, EPS)
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert torch.equal(a[:, lay.step], b[:, lay.step]) and not torch.equal(a, rows)


def test_adam_layout_takes_the_adam_kernel():
    g = torch.Generator().manual_seed(7)
    lay = RowLayout(4)
    rows = torch.rand(50, lay.width, generator=g)
    idx, grad = torch.arange(0, 50, 2), torch.randn(25, 5, generator=g)
    a, b = rows.clone(), rows.clone()
    sparse_step(lay, a, idx, grad, LR, B1, B2, EPS)
    sparse_adam_step(b, idx, grad, LR, B1, B2, EPS)
    assert torch.equal(a, b)


@pytest.mark.parametrize("optimizer", ROWWISE)
def test_pure_form_returns_the_inputs_kind(optimizer):
    lay = RowLayout(3, optimizer)
    rng = np.random.default_rng(0)
    rows = rng.random((20, lay.width), dtype=np.float32)
    grads = rng.standard_normal((20, 4)).astype(np.float32)
    keep = rows.copy()
    out = apply_step_to_rows(lay, rows, grads, LR, B1, B2, EPS)
    assert isinstance(out, np.ndarray) and np.array_equal(rows, keep)
    ref = torch.from_numpy(keep.copy())
    sparse_step(lay, ref, torch.arange(20), torch.from_numpy(grads), LR, B1, B2, EPS)
    assert np.array_equal(out, ref.numpy())
    t_out = apply_step_to_rows(lay, torch.from_numpy(keep), torch.from_numpy(grads), LR, B1, B2, EPS)
    assert isinstance(t_out, torch.Tensor) and np.array_equal(t_out.numpy(), out)


def test_wrong_widths_and_gradients_are_refused():
    lay = RowLayout(2, "rowwise_adagrad")
    with pytest.raises(ValueError, match="columns"):
        sparse_step(lay, torch.zeros(10, RowLayout(2).width), torch.tensor([1]), torch.zeros(1, 3), LR, B1, B2, EPS)
    with pytest.raises(ValueError, match="grad has shape"):
        sparse_step(lay, torch.zeros(10, lay.width), torch.tensor([1, 2]), torch.zeros(2, 4), LR, B1, B2, EPS)
    with pytest.raises(IndexError):
        sparse_step(lay, torch.zeros(10, lay.width), torch.tensor([10]), torch.zeros(1, 3), LR, B1, B2, EPS)


def test_a_shard_keeps_its_rows_optimizer(tmp_path):
    cfg = StorageConfig(dim=4, rows_per_rank=1000)
    path = tmp_path / "s.h5"
    store = EmbeddingStore(cfg, path, create=True, optimizer=SparseOptimizer.ROWWISE_ADAGRAD)
    keys = np.arange(1, 101, dtype=np.uint64)
    rows = store.read(keys)
    assert rows.shape == (100, 7) and not rows[:, 5:].any()  # w, w1 drawn; accumulator and step 0
    rows[:, 5] = 2.0
    store.write(keys, rows)
    store.close()
    with h5py.File(path, "r") as f:
        assert f.attrs["sparse_optimizer"] == "rowwise_adagrad" and f.attrs["width"] == 7
        assert f.attrs["row_columns"] == "w[4] w1[1] v[1] step[1]"
    again = EmbeddingStore(cfg, path, create=False, optimizer=SparseOptimizer.ROWWISE_ADAGRAD)
    assert again.layout == RowLayout(4, "rowwise_adagrad")
    assert np.array_equal(again.read(keys), rows)
    again.close()
    with pytest.raises(ValueError, match=r"train.sparse_optimizer=rowwise_adagrad, this run has adam"):
        EmbeddingStore(cfg, path, create=False)
