"""Multi-valued fields: a batch's bags of rows pooled into one embedding a field, and the backward.

A multi-valued batch is B rows of F bags (hvctr.data.bags.Bags); bag b = (row b // F, field
b % F) holds the working-set positions ``pos[off[b]:off[b + 1]]`` (0..n of them). The model
sees what it sees for one-valued data, ``emb [B, F, D]`` and ``w1 [B, F]``: each bag's rows summed,
or for a field pooled by its mean (model.pooling) divided by the bag's length; an empty bag is 0.

    emb, w1 = gather_pooled(rows, pos, off, mean, dim)      # two leaves that require grad
    loss(model(dense, emb, w1)).backward()
    idx, g = sum_pooled_grads(pos, off, mean, emb.grad, w1.grad, batch_unique(pos))
    sparse_step(layout, rows, idx, g, ...)                   # as for one-valued data

The backward gives each value its bag's gradient (divided by the length where mean-pooled) and
sums them per distinct row in the order of the values, as sum_embedding_grads sums a one-valued
batch's: a batch of bags of one value each is that batch, bit for bit (the gather adds a row to
0, the sum adds the same gradients in the same order). On the CPU both run as C kernels
(hv_gather_pooled, hv_sum_pooled_ld); the torch code here is the reference, the CUDA path and
the path under HVCTR_NATIVE=0.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from hvctr.data.bags import Bags
from hvctr.formats import RowLayout
from hvctr.kernels import native as _native
from hvctr.optim.sparse_adam import _aligned_empty, _check_index, _native_ok, batch_unique, gather_embeddings


def _bag_lengths(off: Tensor) -> Tensor:
    return off[1:] - off[:-1]


def _value_bags(off: Tensor) -> Tensor:
    """int64 [nnz]: the bag of each value."""
    lengths = _bag_lengths(off)
    return torch.repeat_interleave(torch.arange(lengths.numel(), device=off.device), lengths)


def _mean_divisor(off: Tensor, mean: Tensor, fields: int) -> Tensor:
    """float32 [nbags]: the bag's length where its field is mean-pooled and it is not empty, else 1."""
    lengths = _bag_lengths(off)
    by_field = mean.to(off.device).bool().repeat(lengths.numel() // fields)
    return torch.where(by_field & (lengths > 0), lengths, torch.ones_like(lengths)).float()


def _checked(pos: Tensor, off: Tensor, mean: Tensor, fields: int, what: str) -> tuple[Tensor, Tensor, Tensor]:
    pos, off = pos.reshape(-1).long().contiguous(), off.reshape(-1).long().contiguous()
    mean = torch.as_tensor(mean, dtype=torch.uint8).reshape(-1).contiguous()
    nbags = off.numel() - 1
    if mean.numel() != fields or nbags % fields:
        raise ValueError(f"{what}: {nbags} bags of {fields} fields, {mean.numel()} pooling flags")
    if int(off[0]) != 0 or int(off[-1]) != pos.numel() or bool((off[1:] < off[:-1]).any()):
        raise ValueError(f"{what}: bag offsets do not cover the {pos.numel()} positions in order")
    return pos, off, mean


def gather_pooled(rows: Tensor, pos: Tensor, off: Tensor, mean: Tensor | np.ndarray, fields: int,
                  dim: int) -> tuple[Tensor, Tensor]:
    """Pooled embeddings [B, F, dim] and pooled first-order weights [B, F] of the bags
    (``off`` int64 [B F + 1] over ``pos`` int64 [nnz]; ``mean`` uint8 [F]) as two new
    contiguous leaves that require grad."""
    pos, off, mean = _checked(pos, off, mean, fields, "gather_pooled")
    nbags = off.numel() - 1
    lay = RowLayout(dim)
    if rows.dtype == torch.float32 and _native_ok(rows, pos, off):
        _check_index(pos, rows.shape[0], "gather_pooled")
        emb = torch.from_numpy(_aligned_empty((nbags // fields, fields, dim)))
        w1 = torch.from_numpy(_aligned_empty((nbags // fields, fields)))
        _native.lib().hv_gather_pooled(rows.data_ptr(), rows.shape[1], pos.data_ptr(), off.data_ptr(), nbags, fields,
                                       mean.data_ptr(), dim, emb.data_ptr(), w1.data_ptr())
    else:
        bags = _value_bags(off)
        picked = rows.index_select(0, pos)
        emb = torch.zeros(nbags, dim, dtype=rows.dtype, device=rows.device).index_add_(0, bags, picked[:, lay.w])
        w1 = torch.zeros(nbags, dtype=rows.dtype, device=rows.device).index_add_(0, bags, picked[:, lay.w1])
        div = _mean_divisor(off, mean, fields)
        emb = (emb / div.unsqueeze(1)).reshape(nbags // fields, fields, dim)
        w1 = (w1 / div).reshape(nbags // fields, fields)
    return emb.detach().requires_grad_(), w1.detach().requires_grad_()


def sum_pooled_grads(pos: Tensor, off: Tensor, mean: Tensor | np.ndarray, emb_grad: Tensor,
                     w1_grad: Tensor | None, unique: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor]:
    """The backward of gather_pooled, summed per distinct row: ``(uniq [n], summed [n, D+1])``,
    what sparse_step takes. ``unique``: batch_unique(pos), computed with the window; ``w1_grad``
    None (the model did not read w1) sums to zeros."""
    fields = emb_grad.shape[-2]
    pos, off, mean = _checked(pos, off, mean, fields, "sum_pooled_grads")
    uniq, inverse = unique if unique is not None else batch_unique(pos)
    lay = RowLayout(emb_grad.shape[-1])
    d, c = lay.dim, lay.model_width
    nbags = off.numel() - 1
    inv = inverse.reshape(-1).contiguous()
    ge = emb_grad.detach().reshape(-1, d).contiguous()
    if ge.shape[0] != nbags or inv.numel() != pos.numel():
        raise ValueError(f"sum_pooled_grads: gradients of {ge.shape[0]} bags for {nbags}, inverse of {inv.numel()} "
                         f"for {pos.numel()} positions")
    gw = None if w1_grad is None else w1_grad.detach().reshape(-1, 1).contiguous()
    out = torch.zeros(uniq.numel(), c, dtype=ge.dtype, device=ge.device)
    if ge.dtype == torch.float32 and _native_ok(ge, inv, off) and (gw is None or _native_ok(gw)):
        _check_index(inv, uniq.numel(), "sum_pooled_grads")
        lib = _native.lib()
        lib.hv_sum_pooled_ld(inv.data_ptr(), off.data_ptr(), nbags, fields, mean.data_ptr(), ge.data_ptr(), d,
                             out.data_ptr(), c)
        if gw is not None:
            lib.hv_sum_pooled_ld(inv.data_ptr(), off.data_ptr(), nbags, fields, mean.data_ptr(), gw.data_ptr(), 1,
                                 out.data_ptr() + 4 * lay.w1, c)
        return uniq, out
    bags = _value_bags(off)
    div = _mean_divisor(off, mean, fields).unsqueeze(1)
    per_value = (ge / div).index_select(0, bags)  # g / n is what the C kernel adds for each value
    out[:, lay.w].index_put_((inv,), per_value, accumulate=True)
    if gw is not None:
        out[:, lay.w1:].index_put_((inv,), (gw / div).index_select(0, bags), accumulate=True)
    return uniq, out


def embed_batch(rows: Tensor, positions: np.ndarray | Bags, mean: Tensor | np.ndarray, dim: int
                ) -> tuple[Tensor, Tensor]:
    """Evaluation's and scoring's lookup: (emb [B, F, dim], w1 [B, F]) of a batch whose keys
    are numbered ``positions`` into ``rows``: [B, F] one-valued, or the Bags of its B rows
    (pooled as training pools them). No gradients are kept."""
    with torch.no_grad():
        if isinstance(positions, Bags):
            pos = torch.from_numpy(np.ascontiguousarray(positions.values, dtype=np.int64)).to(rows.device)
            off = torch.from_numpy(positions.bag_offsets()).to(rows.device)
            emb, w1 = gather_pooled(rows, pos, off, mean, positions.fields, dim)
        else:
            emb, w1 = gather_embeddings(rows, torch.from_numpy(np.ascontiguousarray(positions, dtype=np.int64))
                                        .to(rows.device), dim)
    return emb.detach(), w1.detach()
