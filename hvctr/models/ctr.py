"""DNN, DeepFM and Wide & Deep: forward(dense [B, 13], emb [B, F, D], w1 [B, F]) -> logits [B].

The first-order weight of a feature lives in its row (column ``w1``), so the sparse side of
DeepFM's and Wide & Deep's linear part trains, moves and merges with the embedding; only the
linear term on the dense features is a dense parameter.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor, nn


class MLP(nn.Sequential):
    """Linear + ReLU per hidden layer, then a Linear to one output (the logit)."""

    def __init__(self, in_features: int, hidden: Sequence[int]) -> None:
        layers: list[nn.Module] = []
        for width in hidden:
            layers += [nn.Linear(in_features, width), nn.ReLU()]
            in_features = width
        layers.append(nn.Linear(in_features, 1))
        super().__init__(*layers)


def fm_interaction(emb: Tensor) -> Tensor:
    """Second-order FM term, sum_{i<j} <e_i, e_j>, per sample: [B, F, D] -> [B].

    The textbook identity 0.5 * ((sum_f e_f)^2 - sum_f e_f^2), taken per embedding dimension
    and summed over D: O(F*D) instead of O(F^2*D).
    """
    square_of_sum = emb.sum(dim=1).square()
    sum_of_squares = emb.square().sum(dim=1)
    return 0.5 * (square_of_sum - sum_of_squares).sum(dim=1)


class _CTRModel(nn.Module):
    """Shared shape bookkeeping: the deep part reads the concatenated embeddings and dense features."""

    def __init__(self, num_fields: int, dim: int, num_dense: int) -> None:
        super().__init__()
        self.num_fields, self.dim, self.num_dense = num_fields, dim, num_dense
        self.deep_in = num_fields * dim + num_dense

    def _deep_input(self, dense: Tensor, emb: Tensor) -> Tensor:
        assert emb.shape[1:] == (self.num_fields, self.dim), \
            f"emb {tuple(emb.shape)} vs F={self.num_fields}, D={self.dim}"
        return torch.cat([emb.flatten(1), dense], dim=1)


class DNN(_CTRModel):
    """Concatenated embeddings and dense features through an MLP. It does not read w1."""

    def __init__(self, num_fields: int, dim: int, num_dense: int = 13, hidden: Sequence[int] = (512, 256)) -> None:
        super().__init__(num_fields, dim, num_dense)
        self.mlp = MLP(self.deep_in, hidden)

    def forward(self, dense: Tensor, emb: Tensor, w1: Tensor) -> Tensor:
        return self.mlp(self._deep_input(dense, emb)).squeeze(1)


class DeepFM(_CTRModel):
    """First order (sum of w1 + a linear layer on dense, with the bias) + FM + the DNN part."""

    def __init__(self, num_fields: int, dim: int, num_dense: int = 13, hidden: Sequence[int] = (512, 256)) -> None:
        super().__init__(num_fields, dim, num_dense)
        self.dense_linear = nn.Linear(num_dense, 1)
        self.mlp = MLP(self.deep_in, hidden)

    def forward(self, dense: Tensor, emb: Tensor, w1: Tensor) -> Tensor:
        first = w1.sum(dim=1) + self.dense_linear(dense).squeeze(1)
        deep = self.mlp(self._deep_input(dense, emb)).squeeze(1)
        return first + fm_interaction(emb) + deep


class WideDeep(_CTRModel):
    """Wide (sum of w1 + a linear layer on dense) + deep (the MLP over embeddings and dense)."""

    def __init__(self, num_fields: int, dim: int, num_dense: int = 13, hidden: Sequence[int] = (512, 256)) -> None:
        super().__init__(num_fields, dim, num_dense)
        self.wide_dense = nn.Linear(num_dense, 1)
        self.mlp = MLP(self.deep_in, hidden)

    def forward(self, dense: Tensor, emb: Tensor, w1: Tensor) -> Tensor:
        wide = w1.sum(dim=1) + self.wide_dense(dense).squeeze(1)
        return wide + self.mlp(self._deep_input(dense, emb)).squeeze(1)
