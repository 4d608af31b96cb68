"""The row-wise sparse optimisers, and one optimiser step on embedding rows for each row layout.

``sparse_step(layout, rows, idx, grad, lr, beta1, beta2, eps)`` steps ``rows[idx]`` in place with
the optimiser ``layout`` names; ``apply_step_to_rows`` is its pure form, for an owner applying
pushed gradients (merge.mode = sync). Every optimiser is lazy: a row not in ``idx`` is left bit
for bit, and each touched row's step column counts its steps.

- ``adam``: hvctr.optim.sparse_adam's lazy Adam, m and v per model column.
- ``rowwise_adam`` (fbgemm's PARTIAL_ROWWISE_ADAM): m per model column, one v a row, from the
  mean over the row's c = D + 1 columns of the squared gradient; Adam's bias corrections with
  the row's step. D + 3 state floats where Adam keeps 2 D + 3.
- ``rowwise_adagrad`` (fbgemm's EXACT_ROWWISE_ADAGRAD, TorchRec's fused optimiser and MLPerf's
  DLRM): ``acc += mean(g^2)``, ``w -= lr g / (sqrt(acc) + eps)``, the initial accumulator 0;
  beta1 and beta2 are not read. 2 state floats (the accumulator, the step).

On the CPU the loops run as C kernels (hvctr.kernels.native); elsewhere, or under
HVCTR_NATIVE=0, as the torch code below, the reference the kernels are tested against. The mean
square is summed in float64, in column order, in both (each square is exact there); torch's CPU
sqrt is not always correctly rounded where C's sqrtf is, so the two paths agree to a few ulps,
not bit for bit (as sparse_adam's).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from hvctr.formats import RowLayout, SparseOptimizer
from hvctr.kernels import native as _native
from hvctr.optim.sparse_adam import _check_index, _native_ok, sparse_adam_step, step_bias_corrections


def _mean_square(g: Tensor) -> Tensor:
    # a cumulative sum adds in column order, as the C kernels do
    return (g.double().square().cumsum(1)[:, -1] / g.shape[1]).float()


def _rowwise_adam_torch_(r: Tensor, lay: RowLayout, g: Tensor, lr: float, beta1: float, beta2: float,
                         eps: float) -> None:
    p, m, v, step = r[:, lay.model], r[:, lay.m], r[:, lay.v], r[:, lay.step]
    step_size, bc2_sqrt = step_bias_corrections(step, lr, beta1, beta2)
    m.lerp_(g, 1 - beta1)
    v.mul_(beta2).add_(_mean_square(g).unsqueeze(1) * (1 - beta2))
    denom = (v.sqrt() / bc2_sqrt).add_(eps)
    p.sub_(step_size * m / denom)


def _rowwise_adagrad_torch_(r: Tensor, lay: RowLayout, g: Tensor, lr: float, eps: float) -> None:
    p, acc, step = r[:, lay.model], r[:, lay.v], r[:, lay.step]
    step.add_(1)
    acc.add_(_mean_square(g).unsqueeze(1))
    p.sub_(lr * g / (acc.sqrt() + eps))


def sparse_step(layout: RowLayout, rows: Tensor, idx: Tensor, grad: Tensor, lr: float, beta1: float,
                beta2: float, eps: float) -> None:
    """One step of ``layout``'s optimiser, in place, on ``rows[idx]`` with gradients ``grad``
    [n, D+1]; ``idx`` distinct (sum_rows_grad's output is)."""
    if layout.optimizer is SparseOptimizer.ADAM:
        return sparse_adam_step(rows, idx, grad, lr, beta1, beta2, eps)
    assert rows.dtype == torch.float32 and grad.dtype == torch.float32, (rows.dtype, grad.dtype)
    if rows.shape[1] != layout.width:
        raise ValueError(f"rows have {rows.shape[1]} columns, a {layout} row has {layout.width}")
    c = layout.model_width
    if grad.shape != (idx.numel(), c):
        raise ValueError(f"grad has shape {tuple(grad.shape)}, expected ({idx.numel()}, {c})")
    idx = idx.reshape(-1).long().contiguous()
    _check_index(idx, rows.shape[0], "sparse_step")
    grad = grad.contiguous()
    rowwise_adam = layout.optimizer is SparseOptimizer.ROWWISE_ADAM
    if _native_ok(rows, idx, grad):
        lib = _native.lib()
        if rowwise_adam:
            lib.hv_sparse_rowwise_adam(rows.data_ptr(), rows.shape[1], idx.data_ptr(), idx.numel(), grad.data_ptr(),
                                       c, lr, beta1, beta2, eps)
        else:
            lib.hv_sparse_rowwise_adagrad(rows.data_ptr(), rows.shape[1], idx.data_ptr(), idx.numel(),
                                          grad.data_ptr(), c, lr, eps)
        return
    r = rows.index_select(0, idx)
    if rowwise_adam:
        _rowwise_adam_torch_(r, layout, grad, lr, beta1, beta2, eps)
    else:
        _rowwise_adagrad_torch_(r, layout, grad, lr, eps)
    rows.index_copy_(0, idx, r)


def apply_step_to_rows(layout: RowLayout, rows, grads, lr: float, beta1: float, beta2: float, eps: float):
    """Pure form of one step on every row: returns new rows, leaves ``rows`` as it was; numpy
    arrays or torch tensors in, the same kind out (an owner applying pushed gradients)."""
    as_numpy = isinstance(rows, np.ndarray)
    r = torch.from_numpy(np.array(rows, dtype=np.float32)) if as_numpy else rows.detach().clone().contiguous()
    g = torch.as_tensor(np.asarray(grads, dtype=np.float32) if isinstance(grads, np.ndarray) else grads)
    idx = torch.arange(r.shape[0], device=r.device)
    sparse_step(layout, r, idx, g.to(device=r.device, dtype=torch.float32), lr, beta1, beta2, eps)
    return r.numpy() if as_numpy else r
