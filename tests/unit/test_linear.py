"""hvctr.models.linear: the CPU layers' products through oneDNN, against float64 references."""

from __future__ import annotations

import platform

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hvctr.models import linear as lin
from hvctr.models.ctr import MLP, bottom_mlp


def _reference(x, w, b, relu):
    y = F.linear(x, w, b)
    return torch.relu(y) if relu else y


def _grads(fn, x, w, b):
    for t in (x, w, b):
        if t is not None and t.grad is not None:
            t.grad = None
    out = fn()
    (out * torch.linspace(-1, 1, out.numel()).reshape(out.shape).to(out.dtype)).sum().backward()
    return out.detach(), [None if t is None or t.grad is None else t.grad.clone() for t in (x, w, b)]


def test_onednn_is_what_the_cpu_layers_use_on_x86():
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("oneDNN's linear is checked where torch's x86 CPU wheels carry it")
    assert lin.cpu_gemm({}) == "onednn"
    x = torch.randn(4, 3, requires_grad=True)
    y = lin.linear(x, torch.randn(5, 3), torch.randn(5))
    assert "_OneDNNLinear" in type(y.grad_fn).__name__  # the dispatch did not fall back


@pytest.mark.parametrize("batch", [1, 7, 300])
@pytest.mark.parametrize("relu", [False, True])
@pytest.mark.parametrize("weight_kind", ["whole", "column slice", "no bias"])
def test_values_and_gradients_match_float64(batch, relu, weight_kind):
    g = torch.Generator().manual_seed(batch)
    x = torch.randn(batch, 40, generator=g, requires_grad=True)
    full = torch.randn(24, 53, generator=g, requires_grad=True)
    b = None if weight_kind == "no bias" else torch.randn(24, generator=g, requires_grad=True)
    w = full[:, 5:45] if weight_kind == "column slice" else full[:, :40]
    out, grads = _grads(lambda: lin.linear(x, w, b, relu), x, full, b)
    x64, full64 = x.detach().double().requires_grad_(), full.detach().double().requires_grad_()
    b64 = None if b is None else b.detach().double().requires_grad_()
    w64 = full64[:, 5:45] if weight_kind == "column slice" else full64[:, :40]
    ref, ref_grads = _grads(lambda: _reference(x64, w64, b64, relu), x64, full64, b64)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    for got, want in zip(grads, ref_grads):
        assert (got is None) == (want is None)
        if got is not None:
            torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_an_input_without_gradient_gets_none_and_results_repeat_bit_for_bit():
    x = torch.randn(64, 13)  # the dense features: no gradient wanted
    layer = nn.Linear(13, 32)
    runs = []
    for _ in range(2):
        layer.zero_grad(set_to_none=True)
        y = lin.linear(x, layer.weight, layer.bias, relu=True)
        y.sum().backward()
        runs.append((y.detach(), layer.weight.grad.clone(), layer.bias.grad.clone()))
    assert x.grad is None
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_mkl_puts_back_torchs_own_products_bit_for_bit(monkeypatch):
    monkeypatch.setattr(lin, "_USE_ONEDNN", False)
    x, layer = torch.randn(33, 20), nn.Linear(20, 9)
    assert torch.equal(lin.linear(x, layer.weight, layer.bias, relu=True), torch.relu(layer(x)))
    mlp = MLP(20, (16, 8))
    ref = nn.Sequential(*mlp)  # the same modules, torch's own forward
    assert torch.equal(mlp(x), ref(x))


def test_the_log_line_says_which_products_and_how_to_switch(monkeypatch):
    assert "HVCTR_CPU_GEMM=mkl" in lin.describe()
    monkeypatch.setattr(lin, "_USE_ONEDNN", False)
    assert lin.describe().startswith("torch's own")


def test_the_variable_is_checked():
    assert lin.cpu_gemm({"HVCTR_CPU_GEMM": "MKL"}) == "mkl"
    with pytest.raises(ValueError, match="HVCTR_CPU_GEMM='openblas'"):
        lin.cpu_gemm({"HVCTR_CPU_GEMM": "openblas"})


def test_layers_keep_sequentials_parameters_and_keys():
    torch.manual_seed(0)
    net = bottom_mlp(13, (32, 16))
    assert list(net.state_dict()) == list(nn.Sequential(*net).state_dict())
    x = torch.randn(50, 13)
    torch.testing.assert_close(net(x), nn.Sequential(*net)(x), rtol=1e-5, atol=1e-5)
    mlp = MLP(40, (24, 12))
    blocks = [torch.randn(50, 30), torch.randn(50, 10)]
    torch.testing.assert_close(mlp.forward_blocks(blocks), mlp(torch.cat(blocks, 1)), rtol=1e-5, atol=1e-5)
