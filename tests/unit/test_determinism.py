"""hvctr.determinism: deterministic algorithms on, torch's NaN fill of fresh tensors off, and a
training step that still gives the same bits twice."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import torch.utils.deterministic

from hvctr.determinism import deterministic_torch
from hvctr.models import DLRM, DNN


@pytest.fixture
def torch_modes():
    before = torch.are_deterministic_algorithms_enabled(), torch.utils.deterministic.fill_uninitialized_memory
    yield
    torch.use_deterministic_algorithms(before[0])
    torch.utils.deterministic.fill_uninitialized_memory = before[1]


def test_deterministic_torch_turns_the_fill_off_and_the_algorithms_on(torch_modes):
    torch.use_deterministic_algorithms(False)
    torch.utils.deterministic.fill_uninitialized_memory = True
    deterministic_torch()
    assert torch.are_deterministic_algorithms_enabled()
    assert torch.utils.deterministic.fill_uninitialized_memory is False


def _steps(cls) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = cls(5, 16)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    emb = torch.randn(64, 5, 16, generator=g, requires_grad=True)
    w1 = torch.randn(64, 5, generator=g, requires_grad=True)
    dense, y = torch.randn(64, 13, generator=g), (torch.rand(64, generator=g) < 0.3).float()
    for _ in range(3):
        opt.zero_grad()
        emb.grad = w1.grad = None
        F.binary_cross_entropy_with_logits(model(dense, emb, w1), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()] + [emb.grad.clone()]


@pytest.mark.parametrize("cls", [DNN, DLRM])
def test_steps_without_the_fill_give_the_same_bits_twice(torch_modes, cls):
    """No op of a model's step reads memory it did not write: unfilled, two runs agree exactly
    (and with the fill on, as the fill only writes what is overwritten)."""
    deterministic_torch()
    first, second = _steps(cls), _steps(cls)
    torch.utils.deterministic.fill_uninitialized_memory = True
    filled = _steps(cls)
    for a, b, c in zip(first, second, filled):
        assert torch.equal(a, b) and torch.equal(a, c)
