import ast
import itertools
from pathlib import Path

import pytest
import torch

import hvctr.models
from hvctr.config import ModelArch, ModelConfig
from hvctr.models import DNN, DeepFM, WideDeep, build_model, fm_interaction

B, Fn, D = 8, 5, 4


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, 13, generator=g), torch.randn(B, Fn, D, generator=g), torch.randn(B, Fn, generator=g)


def test_fm_matches_brute_force_pairwise_sum():
    g = torch.Generator().manual_seed(1)
    emb = torch.randn(16, 26, 8, generator=g, dtype=torch.float64)
    brute = torch.zeros(16, dtype=torch.float64)
    for i, j in itertools.combinations(range(26), 2):
        brute += (emb[:, i] * emb[:, j]).sum(1)
    torch.testing.assert_close(fm_interaction(emb), brute, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("arch", list(ModelArch))
def test_every_model_maps_inputs_to_one_logit_per_sample_and_backprops(arch):
    model = build_model(ModelConfig(arch=arch, hidden=(16, 8), num_fields=Fn, bottom_mlp=(8, D)), dim=D, seed=3)
    dense, emb, w1 = _inputs()
    emb.requires_grad_()
    w1.requires_grad_()
    out = model(dense, emb, w1)
    assert out.shape == (B,) and out.dtype == torch.float32
    out.sum().backward()
    assert emb.grad.abs().sum() > 0
    assert all(p.grad is not None for p in model.parameters())
    if arch not in (ModelArch.DEEPFM, ModelArch.WDL):
        assert w1.grad is None or torch.count_nonzero(w1.grad) == 0  # no first-order term
    else:
        assert torch.equal(w1.grad, torch.ones_like(w1))  # first order: d logit / d w1 = 1


def test_deepfm_is_first_order_plus_fm_plus_deep():
    model = DeepFM(num_fields=Fn, dim=D, hidden=(16,))
    dense, emb, w1 = _inputs(2)
    first = w1.sum(1) + model.dense_linear(dense).squeeze(1)
    deep = model.mlp(torch.cat([emb.flatten(1), dense], 1)).squeeze(1)
    torch.testing.assert_close(model(dense, emb, w1), first + fm_interaction(emb) + deep)


def test_wide_and_deep_is_wide_plus_deep():
    model = WideDeep(num_fields=Fn, dim=D, hidden=(16,))
    dense, emb, w1 = _inputs(3)
    wide = w1.sum(1) + model.wide_dense(dense).squeeze(1)
    deep = model.mlp(torch.cat([emb.flatten(1), dense], 1)).squeeze(1)
    torch.testing.assert_close(model(dense, emb, w1), wide + deep)


def test_dnn_shapes_follow_the_config():
    model = build_model(ModelConfig(hidden=(512, 256)), dim=16)
    assert isinstance(model, DNN)
    widths = [(m.in_features, m.out_features) for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert widths == [(26 * 16 + 13, 512), (512, 256), (256, 1)]


def test_seeded_builds_are_identical_and_leave_the_global_rng_alone():
    torch.manual_seed(7)
    before = torch.get_rng_state()
    a = build_model(ModelConfig(hidden=(8,)), dim=4, seed=11)
    assert torch.equal(torch.get_rng_state(), before)
    b = build_model(ModelConfig(hidden=(8,)), dim=4, seed=11)
    c = build_model(ModelConfig(hidden=(8,)), dim=4, seed=12)
    pa, pb, pc = (torch.cat([p.flatten() for p in m.parameters()]) for m in (a, b, c))
    assert torch.equal(pa, pb) and not torch.equal(pa, pc)


def test_model_code_imports_nothing_from_storage_dist_mpi_or_hdf5():
    banned = ("hvctr.storage", "hvctr.distributed", "hvctr.train", "horovod", "mpi4py", "h5py")
    files = sorted(Path(hvctr.models.__file__).parent.rglob("*.py"))
    assert files
    for f in files:
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                # `from hvctr import storage` names the module in its alias
                names = [f"{node.module}.{a.name}" for a in node.names] if node.level == 0 else []
            else:
                continue
            for name in names:
                assert not name.startswith(banned), f"{f.name} imports {name}"


@pytest.mark.parametrize("bias", [True, False])
def test_mlp_over_blocks_is_the_mlp_over_their_concatenation(bias):
    mlp = hvctr.models.MLP(Fn * D + 13, (16, 8))
    if not bias:
        mlp[0].bias = None
    dense, emb, _ = _inputs(4)
    a_emb, b_emb = emb.flatten(1).clone().requires_grad_(), emb.flatten(1).clone().requires_grad_()
    cat = mlp(torch.cat([a_emb, dense], 1))
    cat.sum().backward()
    want = [p.grad.clone() for p in mlp.parameters()]
    mlp.zero_grad()
    blocks = mlp.forward_blocks([b_emb, dense])
    blocks.sum().backward()
    torch.testing.assert_close(blocks, cat)
    torch.testing.assert_close(b_emb.grad, a_emb.grad)
    for got, exp in zip((p.grad for p in mlp.parameters()), want):
        torch.testing.assert_close(got, exp)
    with pytest.raises(ValueError, match="widths"):
        mlp.forward_blocks([b_emb, dense[:, :5]])
