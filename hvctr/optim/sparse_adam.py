"""Lazy Adam on embedding rows with per-row step counts, and the batch's sparse gradient path.

A row is hvctr.formats.RowLayout: ``[w (D) | w1 (1) | m (D+1) | v (D+1) | step (1)]``, float32;
its first ``c = D + 1`` columns are the model. One training step of the
sparse side, with ``pos [B, F]`` the batch's positions in the working set ``rows [U, width]``:

    uniq, inverse = batch_unique(pos)            # computed ahead, with the window (train/window.py)
    p = gather_rows(rows, pos, dim)              # [B, F, D+1], a leaf that requires grad
    loss(model(dense, p[..., :dim], p[..., dim])).backward()
    idx, g = sum_rows_grad(pos, p.grad, (uniq, inverse))   # one summed gradient per row
    sparse_adam_step(rows, idx, g, lr, beta1, beta2, eps)  # rows not in idx are untouched

Lazy: a row's m and v decay only on the steps that touch it, and its bias correction uses its
own step count, so a row first touched at global step 1000 takes a full-size first step. On
the CPU the three loops run as C kernels (hvctr.kernels.native); elsewhere, or under
HVCTR_NATIVE=0, as torch ops. The torch form is the reference the kernels are tested against.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from hvctr.formats import RowLayout
from hvctr.kernels import native as _native


def row_width(dim: int) -> int:
    """Float32 columns of a row for embedding dimension ``dim``: w, w1, m, v and step."""
    return RowLayout(dim).width


def dim_of_width(width: int) -> int:
    return RowLayout.of_width(width).dim


def _native_ok(*tensors: Tensor) -> bool:
    return all(t.device.type == "cpu" and t.is_contiguous() for t in tensors) and _native.lib() is not None


def _check_index(index: Tensor, bound: int, what: str) -> None:
    # The C kernels trust their indices; an out-of-range one would write outside the table.
    if index.numel() and (int(index.min()) < 0 or int(index.max()) >= bound):
        raise IndexError(f"{what}: indices span [{int(index.min())}, {int(index.max())}], table has {bound} rows")


def step_bias_corrections(step: Tensor, lr: float, beta1: float, beta2: float) -> tuple[Tensor, Tensor]:
    """Adds one to each row's ``step`` column (in place) and returns Adam's step size and
    sqrt(1 - beta2^step) per row, [n, 1] float32: computed in float64 per row, as torch.optim.Adam
    computes them in Python floats (the C kernels do the same)."""
    step.add_(1)
    s64 = step.double()
    step_size = (lr / (1 - torch.pow(beta1, s64))).float().unsqueeze(1)
    bc2_sqrt = (1 - torch.pow(beta2, s64)).sqrt().float().unsqueeze(1)
    return step_size, bc2_sqrt


def _adam_rows_torch_(r: Tensor, g: Tensor, lr: float, beta1: float, beta2: float, eps: float) -> None:
    """Adam on every row of ``r`` [n, width] in place, with each row's own step: the reference."""
    lay = RowLayout.of_width(r.shape[1])
    p, m, v, step = r[:, lay.model], r[:, lay.m], r[:, lay.v], r[:, lay.step]
    step_size, bc2_sqrt = step_bias_corrections(step, lr, beta1, beta2)
    m.lerp_(g, 1 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    denom = (v.sqrt() / bc2_sqrt).add_(eps)
    p.sub_(step_size * m / denom)


def sparse_adam_step(rows: Tensor, idx: Tensor, grad: Tensor, lr: float, beta1: float, beta2: float,
                     eps: float) -> None:
    """One lazy Adam step, in place, on ``rows[idx]`` with gradients ``grad`` [n, D+1].

    ``idx`` must hold distinct row positions (sum_rows_grad's output does). Each touched row's
    step count goes up by one and its bias correction uses it; every other row stays bit-equal.
    """
    assert rows.dtype == torch.float32 and grad.dtype == torch.float32, (rows.dtype, grad.dtype)
    c = RowLayout.of_width(rows.shape[1]).model_width
    if grad.shape != (idx.numel(), c):
        raise ValueError(f"grad has shape {tuple(grad.shape)}, expected ({idx.numel()}, {c})")
    idx = idx.reshape(-1).long()
    _check_index(idx, rows.shape[0], "sparse_adam_step")
    grad = grad.contiguous()
    idx = idx.contiguous()
    if _native_ok(rows, idx, grad):
        _native.lib().hv_sparse_adam(rows.data_ptr(), rows.shape[1], idx.data_ptr(), idx.numel(),
                                     grad.data_ptr(), c, lr, beta1, beta2, eps)
        return
    r = rows.index_select(0, idx)
    _adam_rows_torch_(r, grad, lr, beta1, beta2, eps)
    rows.index_copy_(0, idx, r)


def apply_adam_to_rows(rows, grads, lr: float, beta1: float, beta2: float, eps: float):
    """Pure form of one Adam step on every row: returns new rows, leaves ``rows`` as it was.

    For an owner that applies pushed gradients (``merge.mode = sync``): ``rows`` [n, width] and
    ``grads`` [n, D+1] as numpy arrays or torch tensors; the result has the input's kind.
    """
    as_numpy = isinstance(rows, np.ndarray)
    r = torch.from_numpy(np.array(rows, dtype=np.float32)) if as_numpy else rows.detach().clone().contiguous()
    g = torch.as_tensor(np.asarray(grads, dtype=np.float32) if isinstance(grads, np.ndarray) else grads)
    idx = torch.arange(r.shape[0], device=r.device)
    sparse_adam_step(r, idx, g.to(device=r.device, dtype=torch.float32), lr, beta1, beta2, eps)
    return r.numpy() if as_numpy else r


def batch_unique(pos: Tensor) -> tuple[Tensor, Tensor]:
    """Distinct positions of a batch (sorted) and, for each entry of ``pos``, its index in them.

    Positions index a working set, so they are small non-negative integers: on the CPU a bitmap
    over [0, max + 1) finds them in one pass (4x to 20x faster than torch.unique's sort,
    python -m bench.sparse); the result is the same as
    ``torch.unique(pos, sorted=True, return_inverse=True)``.
    """
    pos = pos.long().contiguous()
    if pos.numel() == 0 or not _native_ok(pos):
        return torch.unique(pos, sorted=True, return_inverse=True)
    lo, hi = int(pos.min()), int(pos.max())
    if lo < 0:
        raise IndexError(f"batch_unique: negative position {lo}")
    bound = hi + 1
    if bound > 64 * pos.numel() + (1 << 22):  # not working-set positions: scratch would dwarf the input
        return torch.unique(pos, sorted=True, return_inverse=True)
    # numpy scratch: never filled, whatever torch's fill_uninitialized_memory (hvctr.determinism)
    bits = np.zeros((bound + 63) // 64, dtype=np.uint64)
    slot = np.empty(bound, dtype=np.int32)
    uniq = np.empty(pos.numel(), dtype=np.int64)
    inverse = np.empty(pos.numel(), dtype=np.int64)
    n = _native.lib().hv_batch_unique(pos.data_ptr(), pos.numel(), bound, bits.ctypes.data, slot.ctypes.data,
                                      uniq.ctypes.data, inverse.ctypes.data)
    return torch.from_numpy(uniq[:n].copy()), torch.from_numpy(inverse).view(pos.shape)


def gather_rows(rows: Tensor, pos: Tensor, dim: int) -> Tensor:
    """``rows[pos, :dim+1]`` as a new leaf tensor [*pos.shape, dim+1] that requires grad.

    The model reads ``[..., :dim]`` as embeddings and ``[..., dim]`` as w1; after backward its
    ``.grad`` is what sum_rows_grad reduces per row.
    """
    lay = RowLayout(dim)
    c = lay.model_width
    pos = pos.long().contiguous()
    if rows.dtype == torch.float32 and _native_ok(rows, pos):
        _check_index(pos, rows.shape[0], "gather_rows")
        # numpy's empty: never filled, whatever torch's fill_uninitialized_memory (hvctr.determinism)
        out = torch.from_numpy(np.empty((*pos.shape, c), dtype=np.float32))
        _native.lib().hv_gather_rows(rows.data_ptr(), rows.shape[1], pos.data_ptr(), pos.numel(), c, out.data_ptr())
    else:
        out = F.embedding(pos, rows[:, lay.model])
    return out.detach().requires_grad_()


def _aligned_empty(shape: tuple[int, ...]) -> np.ndarray:
    """Uninitialised float32 of ``shape`` at a 64-byte boundary, as torch's allocator places
    its tensors (numpy's large blocks sit 16 bytes past a page: a GEMM's kernels may take
    other paths there); numpy's, not torch.empty, which deterministic mode NaN-fills wherever torch's
    fill_uninitialized_memory is on (hvctr.determinism turns it off; a library caller may not)."""
    n = int(np.prod(shape))
    buf = np.empty(n + 16, dtype=np.float32)
    off = (-buf.ctypes.data % 64) // 4
    return buf[off:off + n].reshape(shape)


def gather_embeddings(rows: Tensor, pos: Tensor, dim: int) -> tuple[Tensor, Tensor]:
    """``rows[pos, :dim]`` and ``rows[pos, dim]`` as two new contiguous leaves that require
    grad: embeddings [*pos.shape, dim] and first-order weights [*pos.shape].

    The split form of gather_rows, what the trainer uses: the model reads the embeddings
    flattened as a view, not a copy of a strided slice, and its backward writes their
    gradient contiguously, without zero-filling a [*pos.shape, dim+1] gradient to slice it
    into; w1 gets a gradient only where the model reads it (a DNN does not). Values and
    gradients are those of gather_rows, bit for bit.
    """
    lay = RowLayout(dim)
    pos = pos.long().contiguous()
    if rows.dtype == torch.float32 and _native_ok(rows, pos):
        _check_index(pos, rows.shape[0], "gather_embeddings")
        emb = torch.from_numpy(_aligned_empty((*pos.shape, dim)))
        w1 = torch.from_numpy(_aligned_empty(tuple(pos.shape)))
        lib, width = _native.lib(), rows.shape[1]
        lib.hv_gather_split(rows.data_ptr(), width, pos.data_ptr(), pos.numel(), dim, emb.data_ptr(), w1.data_ptr())
    else:
        emb = F.embedding(pos, rows[:, lay.w])
        w1 = F.embedding(pos, rows[:, lay.w1:lay.w1 + 1]).squeeze(-1)
    return emb.detach().requires_grad_(), w1.detach().requires_grad_()


def sum_embedding_grads(pos: Tensor, emb_grad: Tensor, w1_grad: Tensor | None,
                        unique: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor]:
    """sum_rows_grad for gather_embeddings' two gradients: ``(uniq [n], summed [n, D+1])``.

    ``w1_grad`` None (the model did not read w1) sums to zeros, as its zero gradient would.
    Each column is summed in the order of the batch's entries, as sum_rows_grad sums it.
    """
    uniq, inverse = unique if unique is not None else batch_unique(pos)
    lay = RowLayout(emb_grad.shape[-1])  # the gradient's columns are the row's model columns
    d = lay.dim
    inv = inverse.reshape(-1).contiguous()
    ge = emb_grad.detach().reshape(-1, d).contiguous()
    if ge.shape[0] != inv.numel():
        raise ValueError(f"grad holds {ge.shape[0]} rows of gradients, positions {inv.numel()}")
    gw = None if w1_grad is None else w1_grad.detach().reshape(-1, 1).contiguous()
    out = torch.zeros(uniq.numel(), lay.model_width, dtype=ge.dtype, device=ge.device)
    if _native_ok(ge, inv) and ge.dtype == torch.float32 and (gw is None or _native_ok(gw)):
        _check_index(inv, uniq.numel(), "sum_embedding_grads")
        lib = _native.lib()
        c = lay.model_width
        lib.hv_sum_rows_ld(inv.data_ptr(), inv.numel(), ge.data_ptr(), d, out.data_ptr(), c)
        if gw is not None:
            lib.hv_sum_rows_ld(inv.data_ptr(), inv.numel(), gw.data_ptr(), 1, out.data_ptr() + 4 * lay.w1, c)
    else:
        out[:, lay.w].index_put_((inv,), ge, accumulate=True)
        if gw is not None:
            out[:, lay.w1:].index_put_((inv,), gw, accumulate=True)
    return uniq, out


def sum_rows_grad(pos: Tensor, grad: Tensor, unique: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor]:
    """Gradient per distinct row: ``(uniq [n], summed [n, c])`` from ``grad`` [*pos.shape, c].

    ``unique`` is batch_unique(pos) when it was computed ahead of time (the trainer's windows
    carry it for each batch, computed in the prefetch thread); None computes it here.
    """
    uniq, inverse = unique if unique is not None else batch_unique(pos)
    c = grad.shape[-1]
    g = grad.detach().reshape(-1, c).contiguous()
    inv = inverse.reshape(-1).contiguous()
    if g.shape[0] != inv.numel():
        raise ValueError(f"grad holds {g.shape[0]} rows of gradients, positions {inv.numel()}")
    out = torch.zeros(uniq.numel(), c, dtype=g.dtype, device=g.device)
    if _native_ok(g, inv) and g.dtype == torch.float32:
        _check_index(inv, uniq.numel(), "sum_rows_grad")
        _native.lib().hv_sum_rows(inv.data_ptr(), inv.numel(), g.data_ptr(), c, out.data_ptr())
    else:
        out.index_put_((inv,), g, accumulate=True)
    return uniq, out
