"""DNN, DeepFM, Wide & Deep, DLRM, DCN-v2 and MLPerf's DLRM-DCNv2:
forward(dense [B, 13], emb [B, F, D], w1 [B, F]) -> logits [B].

The first-order weight of a feature lives in its row (column ``w1``), so the sparse side of
DeepFM's and Wide & Deep's linear part trains, moves and merges with the embedding; only the
linear term on the dense features is a dense parameter. DLRM and the DCNs have no first-order
term and do not read w1 (as DNN).
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor, nn

from hvctr.models.linear import Layers, linear, run_layers


def linear_over_blocks(layer: nn.Linear, blocks: Sequence[Tensor]) -> Tensor:
    """``layer(torch.cat(blocks, dim=1))`` without the concatenation: the same function.

    Each block meets its own column slice of the weight. On the CPU this is faster than the
    concatenated form in two ways: the backward computes no input gradient for a block that needs
    none (the dense features), and no GEMM has the concatenation's odd width as its output (26 x 16
    + 13 = 429 columns: MKL's input-gradient GEMM into 429 columns runs at about 2/3 of its speed
    into 416). Measured on one core for the default DNN and a batch of 4096: backward 83 -> 68 ms
    per step. The widest block, which carries most of the products, goes through
    hvctr.models.linear.linear (oneDNN on the CPU) with the bias; each other block is added to it
    by one accumulating ``addmm``.
    """
    widths = [int(x.shape[1]) for x in blocks]
    if sum(widths) != layer.in_features:
        raise ValueError(f"blocks of widths {widths} (sum {sum(widths)}) for a Linear of {layer.in_features} inputs")
    starts = [sum(widths[:i]) for i in range(len(widths))]
    first = max(range(len(blocks)), key=lambda i: widths[i])
    w = layer.weight
    out = linear(blocks[first], w[:, starts[first]:starts[first] + widths[first]], layer.bias)
    for i, x in enumerate(blocks):
        if i != first:
            out = torch.addmm(out, x, w[:, starts[i]:starts[i] + widths[i]].t())
    return out


class MLP(Layers):
    """Linear + ReLU per hidden layer, then a Linear to one output (the logit); the products
    through hvctr.models.linear.

    ``forward_blocks(blocks)`` is ``forward(torch.cat(blocks, 1))`` computed without the
    concatenation (see linear_over_blocks).
    """

    def __init__(self, in_features: int, hidden: Sequence[int]) -> None:
        layers: list[nn.Module] = []
        for width in hidden:
            layers += [nn.Linear(in_features, width), nn.ReLU()]
            in_features = width
        layers.append(nn.Linear(in_features, 1))
        super().__init__(*layers)

    def forward_blocks(self, blocks: Sequence[Tensor]) -> Tensor:
        return run_layers(list(self)[1:], linear_over_blocks(self[0], blocks))


def fm_interaction(emb: Tensor) -> Tensor:
    """Second-order FM term, sum_{i<j} <e_i, e_j>, per sample: [B, F, D] -> [B].

    The textbook identity 0.5 * ((sum_f e_f)^2 - sum_f e_f^2), taken per embedding dimension
    and summed over D: O(F*D) instead of O(F^2*D).
    """
    square_of_sum = emb.sum(dim=1).square()
    sum_of_squares = emb.square().sum(dim=1)
    return 0.5 * (square_of_sum - sum_of_squares).sum(dim=1)


def dot_interaction(x: Tensor) -> Tensor:
    """Pairwise dot products <x_i, x_j> for j < i (the strictly-lower triangle, row by row, as
    the reference DLRM takes it): [B, N, D] -> [B, N (N - 1) / 2].

    One batched GEMM computes all N^2 products and the triangle is gathered: at N = 27 the
    wasted half costs less than N (N - 1) / 2 separate dots would. The backward is written out
    (_DotInteraction): autograd's for ``[:, i, j]`` is an index_put that accumulates, and sorts
    its indices under torch.use_deterministic_algorithms, though no pair repeats.
    """
    n = int(x.shape[1])
    i, j = torch.tril_indices(n, n, offset=-1, device=x.device)
    return _DotInteraction.apply(x, i * n + j)


class _DotInteraction(torch.autograd.Function):
    """out[b, p] = (x x^T)[b, flat_p] (flat: i * N + j of each pair); the gradient of x is
    (G + G^T) x with G [B, N, N] the output's gradient placed at the pairs, zero elsewhere: one
    copy into distinct places (index_copy_) and two batched GEMMs. One step of DLRM at batch
    4096 (27 vectors of 16, 1 thread): 23-25 ms autograd's way, 13-14 ms this way."""

    @staticmethod
    def forward(ctx, x: Tensor, flat: Tensor) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(x, flat)
        return torch.bmm(x, x.transpose(1, 2)).flatten(1).index_select(1, flat)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        x, flat = ctx.saved_tensors
        b, n, _ = x.shape
        g = x.new_zeros(b, n * n).index_copy_(1, flat, grad).view(b, n, n)
        return torch.baddbmm(torch.bmm(g, x), g.transpose(1, 2), x), None


class CrossNet(nn.Module):
    """DCN-v2's cross network (Wang et al., arXiv 2008.13535, eq. 1): x_{l+1} = x0 * (W_l x_l + b_l) + x_l,
    [B, N] -> [B, N], ``num_layers`` layers.

    ``rank`` 0: W_l is a full N x N matrix, an ``nn.Linear(N, N)``; else W_l = U_l V_l^T of that
    rank (the paper's low-rank DCN, eq. 2; torchrec's LowRankCrossNet): V_l an ``nn.Linear(N, r)``
    without bias, then U_l an ``nn.Linear(r, N)`` that carries b_l. Either way every parameter is
    an nn.Linear's, which the planner counts.

    Initialised as torchrec's CrossNet and LowRankCrossNet (MLPerf's DLRM-DCNv2): every W, U and V
    by xavier_normal_, every b_l zero, so that x_{l+1} = x_l + x0 * (W_l x_l) at the start (with
    nn.Linear's own init, a uniform bias of +-1/sqrt(fan_in) scaled x0 into every layer). Against
    that init on multi-hot data (DLRM-DCNv2, 2 ranks, k = 8, two seeds): AUC +0.0022 / -0.0003 at
    a global batch of 4096, +0.0013 / +0.0011 at 2 x 4096 (docs/models.md).
    """

    def __init__(self, in_features: int, num_layers: int, rank: int = 0) -> None:
        super().__init__()
        if rank == 0:
            self.layers = nn.ModuleList(nn.Linear(in_features, in_features) for _ in range(num_layers))
        else:
            self.layers = nn.ModuleList(
                nn.Sequential(nn.Linear(in_features, rank, bias=False), nn.Linear(rank, in_features))
                for _ in range(num_layers))
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.xavier_normal_(m.weight)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
        self.in_features, self.rank = in_features, rank

    def forward(self, x0: Tensor) -> Tensor:
        x = x0
        for layer in self.layers:
            wx = run_layers(list(layer) if isinstance(layer, nn.Sequential) else [layer], x)
            x = torch.addcmul(x, x0, wx)  # x + x0 * (W x + b)
        return x


def bottom_mlp(in_features: int, widths: Sequence[int]) -> Layers:
    """DLRM's bottom MLP: Linear + ReLU per layer, the last one included (its output sits beside
    the embeddings, non-negative as in the reference DLRM and torchrec's DenseArch)."""
    layers: list[nn.Module] = []
    for width in widths:
        layers += [nn.Linear(in_features, width), nn.ReLU()]
        in_features = width
    return Layers(*layers)


class _CTRModel(nn.Module):
    """Shared shape bookkeeping: the deep part reads the concatenated embeddings and dense features."""

    def __init__(self, num_fields: int, dim: int, num_dense: int) -> None:
        super().__init__()
        self.num_fields, self.dim, self.num_dense = num_fields, dim, num_dense
        self.deep_in = num_fields * dim + num_dense

    def _deep(self, dense: Tensor, emb: Tensor) -> Tensor:
        """The MLP over [emb flattened | dense], one logit per sample: [B]."""
        assert emb.shape[1:] == (self.num_fields, self.dim), \
            f"emb {tuple(emb.shape)} vs F={self.num_fields}, D={self.dim}"
        return self.mlp.forward_blocks([emb.flatten(1), dense]).squeeze(1)


class DNN(_CTRModel):
    """Concatenated embeddings and dense features through an MLP. It does not read w1."""

    def __init__(self, num_fields: int, dim: int, num_dense: int = 13, hidden: Sequence[int] = (512, 256)) -> None:
        super().__init__(num_fields, dim, num_dense)
        self.mlp = MLP(self.deep_in, hidden)

    def forward(self, dense: Tensor, emb: Tensor, w1: Tensor) -> Tensor:
        return self._deep(dense, emb)


class DeepFM(_CTRModel):
    """First order (sum of w1 + a linear layer on dense, with the bias) + FM + the DNN part."""

    def __init__(self, num_fields: int, dim: int, num_dense: int = 13, hidden: Sequence[int] = (512, 256)) -> None:
        super().__init__(num_fields, dim, num_dense)
        self.dense_linear = nn.Linear(num_dense, 1)
        self.mlp = MLP(self.deep_in, hidden)

    def forward(self, dense: Tensor, emb: Tensor, w1: Tensor) -> Tensor:
        first = w1.sum(dim=1) + self.dense_linear(dense).squeeze(1)
        return first + fm_interaction(emb) + self._deep(dense, emb)


class WideDeep(_CTRModel):
    """Wide (sum of w1 + a linear layer on dense) + deep (the MLP over embeddings and dense)."""

    def __init__(self, num_fields: int, dim: int, num_dense: int = 13, hidden: Sequence[int] = (512, 256)) -> None:
        super().__init__(num_fields, dim, num_dense)
        self.wide_dense = nn.Linear(num_dense, 1)
        self.mlp = MLP(self.deep_in, hidden)

    def forward(self, dense: Tensor, emb: Tensor, w1: Tensor) -> Tensor:
        wide = w1.sum(dim=1) + self.wide_dense(dense).squeeze(1)
        return wide + self._deep(dense, emb)


def _check_bottom(widths: Sequence[int], dim: int) -> None:
    if not widths or widths[-1] != dim:
        raise ValueError(f"bottom MLP {list(widths)}: its last width must be the embedding dim {dim}")


class DLRM(_CTRModel):
    """Naumov et al. (arXiv 1906.00091): bottom MLP(dense) -> z [B, D]; the dot products of every
    pair of [z, e_1 .. e_F]; the top MLP over [z | those dots] -> the logit. It does not read w1."""

    def __init__(self, num_fields: int, dim: int, num_dense: int = 13, hidden: Sequence[int] = (512, 256),
                 bottom: Sequence[int] = (512, 256, 16)) -> None:
        super().__init__(num_fields, dim, num_dense)
        _check_bottom(bottom, dim)
        self.bottom = bottom_mlp(num_dense, bottom)
        n = num_fields + 1
        self.top = MLP(dim + n * (n - 1) // 2, hidden)

    def forward(self, dense: Tensor, emb: Tensor, w1: Tensor) -> Tensor:
        z = self.bottom(dense)
        pairs = dot_interaction(torch.cat([z.unsqueeze(1), emb], dim=1))
        return self.top.forward_blocks([z, pairs]).squeeze(1)


class DCNv2(_CTRModel):
    """DCN-v2, stacked (Wang et al., arXiv 2008.13535, fig. 2b): x0 = [emb flattened | dense], the
    cross network, then the MLP to the logit. It does not read w1."""

    def __init__(self, num_fields: int, dim: int, num_dense: int = 13, hidden: Sequence[int] = (512, 256),
                 cross_layers: int = 3, cross_rank: int = 0) -> None:
        super().__init__(num_fields, dim, num_dense)
        self.cross = CrossNet(self.deep_in, cross_layers, cross_rank)
        self.mlp = MLP(self.deep_in, hidden)

    def forward(self, dense: Tensor, emb: Tensor, w1: Tensor) -> Tensor:
        x0 = torch.cat([emb.flatten(1), dense], dim=1)
        return self.mlp(self.cross(x0)).squeeze(1)


class DLRMDCNv2(_CTRModel):
    """MLPerf Training's DLRM-DCNv2 (torchrec's DLRM_DCN): bottom MLP(dense) -> z [B, D]; the cross
    network over x0 = [z | emb flattened], (F + 1) D wide; the top MLP to the logit. No w1."""

    def __init__(self, num_fields: int, dim: int, num_dense: int = 13, hidden: Sequence[int] = (512, 256),
                 bottom: Sequence[int] = (512, 256, 16), cross_layers: int = 3, cross_rank: int = 0) -> None:
        super().__init__(num_fields, dim, num_dense)
        _check_bottom(bottom, dim)
        self.bottom = bottom_mlp(num_dense, bottom)
        width = (num_fields + 1) * dim
        self.cross = CrossNet(width, cross_layers, cross_rank)
        self.top = MLP(width, hidden)

    def forward(self, dense: Tensor, emb: Tensor, w1: Tensor) -> Tensor:
        x0 = torch.cat([self.bottom(dense), emb.flatten(1)], dim=1)
        return self.top(self.cross(x0)).squeeze(1)
