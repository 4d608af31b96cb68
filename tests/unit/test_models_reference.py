"""DLRM, DCN-v2 and DLRM-DCNv2 against their formulas written out by hand (issue 29, item 1).

Each vectorised piece meets a brute-force reference, as fm_interaction meets its pairwise sum:
DLRM's dot interaction against a double loop over the pairs (j < i, row by row, the reference
DLRM's order), a cross layer against x_{l+1}[k] = x0[k] * (sum_m W[k, m] x_l[m] + b[k]) + x_l[k]
one element at a time, a low-rank cross network against the full-rank one with W = U V^T, and
every model's gradients (inputs and parameters) against finite differences in float64
(torch.autograd.gradcheck). The whole models are then their pieces composed, as the papers
draw them.
"""

from __future__ import annotations

import pytest
import torch
from torch.func import functional_call

from hvctr.config import ModelArch, ModelConfig, load_config
from hvctr.models import DLRM, CrossNet, DCNv2, DLRMDCNv2, build_model, dot_interaction

B, Fn, D = 4, 3, 2
NEW_ARCHS = [ModelArch.DLRM, ModelArch.DCNV2, ModelArch.DLRM_DCNV2]


def _inputs(seed=0, dtype=torch.float32, num_dense=13):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, num_dense, generator=g, dtype=dtype), torch.randn(B, Fn, D, generator=g, dtype=dtype),
            torch.randn(B, Fn, generator=g, dtype=dtype))


def pairs_by_loops(x: torch.Tensor) -> torch.Tensor:
    """<x_i, x_j> for i = 1 .. N-1, j = 0 .. i-1, each dot a sum over d."""
    cols = []
    for i in range(x.shape[1]):
        for j in range(i):
            dot = torch.zeros(x.shape[0], dtype=x.dtype)
            for d in range(x.shape[2]):
                dot = dot + x[:, i, d] * x[:, j, d]
            cols.append(dot)
    return torch.stack(cols, dim=1)


def cross_by_elements(x0: torch.Tensor, weights, biases) -> torch.Tensor:
    """x_{l+1}[b, k] = x0[b, k] * (sum_m W_l[k, m] x_l[b, m] + b_l[k]) + x_l[b, k], in loops."""
    x = x0
    for w, bias in zip(weights, biases):
        nxt = torch.empty_like(x)
        for b in range(x.shape[0]):
            for k in range(x.shape[1]):
                s = bias[k]
                for m in range(x.shape[1]):
                    s = s + w[k, m] * x[b, m]
                nxt[b, k] = x0[b, k] * s + x[b, k]
        x = nxt
    return x


def full_rank_weights(net: CrossNet):
    """Each layer's W and b: the Linear's own, or U V^T (U: the second Linear's weight [N, r],
    V^T: the first's [r, N]) and the second's bias."""
    if net.rank == 0:
        return [layer.weight for layer in net.layers], [layer.bias for layer in net.layers]
    return [up.weight @ down.weight for down, up in net.layers], [up.bias for _, up in net.layers]


def test_dot_interaction_matches_a_double_loop_over_pairs():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 27, 5, generator=g, dtype=torch.float64)
    got = dot_interaction(x)
    assert got.shape == (6, 27 * 26 // 2)
    torch.testing.assert_close(got, pairs_by_loops(x), rtol=1e-12, atol=1e-12)


def test_dot_interactions_gradient_is_the_double_loops():
    """Its backward is written by hand (_DotInteraction): against autograd through the loops, and
    against finite differences."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(3, 6, 4, generator=g, dtype=torch.float64, requires_grad=True)
    upstream = torch.randn(3, 15, generator=g, dtype=torch.float64)
    (want,) = torch.autograd.grad(pairs_by_loops(x), x, upstream)
    (got,) = torch.autograd.grad(dot_interaction(x), x, upstream)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert torch.autograd.gradcheck(dot_interaction, (x,))


@pytest.mark.parametrize("rank", [0, 3])
def test_cross_network_matches_its_formula_element_by_element(rank):
    torch.manual_seed(2)
    net = CrossNet(7, num_layers=3, rank=rank).double()
    for p in net.parameters():  # biases away from 0, so a lost bias shows
        torch.nn.init.normal_(p)
    x0 = torch.randn(3, 7, dtype=torch.float64)
    weights, biases = full_rank_weights(net)
    with torch.no_grad():
        torch.testing.assert_close(net(x0), cross_by_elements(x0, weights, biases), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("rank", [0, 16])
def test_cross_network_starts_as_torchrecs_xavier_normal_weights_and_zero_biases(rank):
    torch.manual_seed(5)
    n = 400
    net = CrossNet(n, num_layers=2, rank=rank)
    for layer in net.layers:
        linears = list(layer) if isinstance(layer, torch.nn.Sequential) else [layer]
        for lin in linears:
            fan_out, fan_in = lin.weight.shape
            want = (2.0 / (fan_in + fan_out)) ** 0.5  # xavier_normal_'s standard deviation
            assert abs(lin.weight.std().item() / want - 1) < 0.05, (lin.weight.shape, lin.weight.std().item(), want)
            assert abs(lin.weight.mean().item()) < 0.1 * want  # normal around 0, not uniform's +-bound
        assert torch.count_nonzero(linears[-1].bias) == 0  # b_l starts at 0


def test_low_rank_cross_is_full_rank_with_w_equal_u_v_transposed():
    torch.manual_seed(3)
    low = CrossNet(9, num_layers=3, rank=2).double()
    full = CrossNet(9, num_layers=3, rank=0).double()
    assert sum(p.numel() for p in low.parameters()) == 3 * (9 * 2 + 2 * 9 + 9)
    with torch.no_grad():
        for layer, (down, up) in zip(full.layers, low.layers):
            layer.weight.copy_(up.weight @ down.weight)  # W = U V^T, rank 2
            layer.bias.copy_(up.bias)
        x0 = torch.randn(5, 9, dtype=torch.float64)
        torch.testing.assert_close(low(x0), full(x0), rtol=1e-12, atol=1e-12)
        assert torch.linalg.matrix_rank(full.layers[0].weight) == 2


def test_dlrm_is_the_top_mlp_over_the_bottom_output_and_its_pairwise_dots():
    torch.manual_seed(4)
    model = DLRM(num_fields=Fn, dim=D, hidden=(8,), bottom=(6, D)).double()
    dense, emb, w1 = _inputs(4, torch.float64)
    with torch.no_grad():
        z = dense
        for i in range(0, len(model.bottom), 2):  # Linear + ReLU, the last layer included
            z = torch.relu(z @ model.bottom[i].weight.T + model.bottom[i].bias)
        vectors = torch.cat([z.unsqueeze(1), emb], dim=1)  # z is vector 0: dotted with every embedding
        want = model.top(torch.cat([z, pairs_by_loops(vectors)], dim=1)).squeeze(1)
        torch.testing.assert_close(model(dense, emb, w1), want, rtol=1e-12, atol=1e-12)
        assert model.top[0].in_features == D + (Fn + 1) * Fn // 2


@pytest.mark.parametrize("rank", [0, 2])
def test_dcnv2_is_the_mlp_over_the_cross_network_of_embeddings_and_dense(rank):
    torch.manual_seed(5)
    model = DCNv2(num_fields=Fn, dim=D, num_dense=3, hidden=(8,), cross_layers=2, cross_rank=rank).double()
    dense, emb, w1 = _inputs(5, torch.float64, num_dense=3)
    with torch.no_grad():
        x0 = torch.cat([emb.flatten(1), dense], dim=1)
        want = model.mlp(cross_by_elements(x0, *full_rank_weights(model.cross))).squeeze(1)
        torch.testing.assert_close(model(dense, emb, w1), want, rtol=1e-12, atol=1e-12)


def test_dlrm_dcnv2_is_bottom_then_cross_over_bottom_and_embeddings_then_top():
    torch.manual_seed(6)
    model = DLRMDCNv2(num_fields=Fn, dim=D, num_dense=3, hidden=(8,), bottom=(5, D), cross_layers=3,
                      cross_rank=2).double()
    dense, emb, w1 = _inputs(6, torch.float64, num_dense=3)
    with torch.no_grad():
        x0 = torch.cat([model.bottom(dense), emb.flatten(1)], dim=1)  # (F + 1) D wide, the bottom output first
        assert x0.shape == (B, (Fn + 1) * D)
        want = model.top(cross_by_elements(x0, *full_rank_weights(model.cross))).squeeze(1)
        torch.testing.assert_close(model(dense, emb, w1), want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("arch", NEW_ARCHS)
@pytest.mark.parametrize("rank", [0, 1])
def test_gradients_of_inputs_and_parameters_match_finite_differences(arch, rank):
    cfg = ModelConfig(arch=arch, hidden=(4,), num_fields=Fn, num_dense=3, bottom_mlp=(3, D), cross_layers=2,
                      cross_rank=rank)
    model = build_model(cfg, dim=D, seed=7).double()
    dense, emb, w1 = _inputs(7, torch.float64, num_dense=3)
    names = [n for n, _ in model.named_parameters()]
    params = [p.detach().clone().requires_grad_() for p in model.parameters()]

    def logits(emb, dense, *ps):
        return functional_call(model, dict(zip(names, ps)), (dense, emb, w1))

    assert torch.autograd.gradcheck(logits, (emb.requires_grad_(), dense.requires_grad_(), *params),
                                    eps=1e-6, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("flags, key, says", [
    (["--model.arch=dlrm", "--model.bottom_mlp=64,32"], "model.bottom_mlp", "storage.dim (16), got [64, 32]"),
    (["--model.arch=dlrm-dcnv2", "--storage.dim=128"], "model.bottom_mlp", "storage.dim (128), got [512, 256, 16]"),
    (["--model.arch=dlrm", "--model.bottom_mlp=", "--storage.dim=4"], "model.bottom_mlp", "storage.dim (4), got []"),
    (["--model.arch=dcnv2", "--model.cross_layers=0"], "model.cross_layers", "must be >= 1, got 0"),
    (["--model.arch=dcnv2", "--model.cross_rank=-2"], "model.cross_rank", "must be >= 0 (0: full rank), got -2"),
    (["--model.bottom_mlp=8,0"], "model.bottom_mlp", "layer sizes must be >= 1"),
])
def test_config_errors_name_the_keys_to_change(flags, key, says):
    with pytest.raises(ValueError) as e:
        load_config(None, flags)
    assert str(e.value).startswith(f"config key {key!r}: ") and says in str(e.value)
    if key == "model.bottom_mlp" and "dlrm" in flags[0]:
        assert "change model.bottom_mlp's last width or storage.dim" in str(e.value)


def test_the_bottom_mlp_is_not_read_where_the_arch_has_none():
    cfg = load_config(None, ["--model.arch=dcnv2", "--model.bottom_mlp=64,32", "--model.cross_rank=8"])
    assert isinstance(build_model(cfg.model, cfg.storage.dim), DCNv2)
    cfg = load_config(None, ["--model.arch=dlrm", "--model.bottom_mlp=64,16"])  # storage.dim 16
    assert build_model(cfg.model, cfg.storage.dim).bottom[-2].out_features == 16
