"""The dense side's Adam state in a fixed order, for the k-step merger.

Dense parameters train with ``torch.optim.Adam``: one global step, the same on every rank.
The merger averages the parameters and the moments ``merge.states`` names across ranks; it
reads them with get_adam_states (parameter order of the optimizer's param_groups, the same on
every rank that built the same model) and writes the averages back with set_adam_states.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _params(opt: torch.optim.Optimizer) -> list[Tensor]:
    return [p for group in opt.param_groups for p in group["params"]]


def _ensure_state(opt: torch.optim.Adam) -> None:
    """Creates the zero state torch's Adam would create at its first step, so that a merge
    before any step (or a checkpoint load) finds every tensor; Adam keeps it as it is."""
    for p in _params(opt):
        state = opt.state[p]
        if len(state) == 0:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def get_adam_states(opt: torch.optim.Adam, names: tuple[str, ...] = ("exp_avg", "exp_avg_sq")) -> list[Tensor]:
    """The state tensors themselves (not copies): for each parameter in order, each of ``names``."""
    if any(group.get("amsgrad") for group in opt.param_groups):
        raise ValueError("get_adam_states: amsgrad keeps a third moment the merger does not handle")
    _ensure_state(opt)
    return [opt.state[p][name] for p in _params(opt) for name in names]


def set_adam_states(opt: torch.optim.Adam, tensors: list[Tensor],
                    names: tuple[str, ...] = ("exp_avg", "exp_avg_sq")) -> None:
    """Copies ``tensors`` (get_adam_states' order) into the optimizer's state."""
    targets = get_adam_states(opt, names)
    if len(tensors) != len(targets):
        raise ValueError(f"set_adam_states: got {len(tensors)} tensors, the optimizer holds {len(targets)}")
    with torch.no_grad():
        for dst, src in zip(targets, tensors):
            if dst.shape != src.shape:
                raise ValueError(f"set_adam_states: shape {tuple(src.shape)} for a state of shape {tuple(dst.shape)}")
            dst.copy_(src)


def adam_step_count(opt: torch.optim.Adam) -> int:
    """The optimizer's global step (0 before the first); every parameter must agree."""
    _ensure_state(opt)
    steps = {int(opt.state[p]["step"]) for p in _params(opt)}
    assert len(steps) <= 1, f"dense parameters disagree on Adam's step: {sorted(steps)}"
    return steps.pop() if steps else 0
