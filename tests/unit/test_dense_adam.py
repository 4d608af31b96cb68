import torch

from hvctr.optim import adam_step_count, get_adam_states, set_adam_states


def _model_and_opt(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 1))
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def _train(model, opt, steps, seed=1):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(8, 4, generator=g)).square().mean().backward()
        opt.step()


def test_states_come_in_parameter_order_and_are_the_live_tensors():
    model, opt = _model_and_opt()
    _train(model, opt, 3)
    states = get_adam_states(opt)
    params = list(model.parameters())
    assert len(states) == 2 * len(params)
    for k, p in enumerate(params):
        assert states[2 * k] is opt.state[p]["exp_avg"] and states[2 * k + 1] is opt.state[p]["exp_avg_sq"]
    assert [s.shape for s in get_adam_states(opt, ("exp_avg_sq",))] == [p.shape for p in params]
    assert adam_step_count(opt) == 3


def test_set_states_then_training_continues_from_them():
    a, opt_a = _model_and_opt()
    b, opt_b = _model_and_opt()
    _train(a, opt_a, 4, seed=1)
    _train(b, opt_b, 4, seed=2)
    # Copy a's moments and parameters into b: b must then train exactly like a.
    set_adam_states(opt_b, [t.clone() for t in get_adam_states(opt_a)])
    with torch.no_grad():
        for pa, pb in zip(a.parameters(), b.parameters()):
            pb.copy_(pa)
    _train(a, opt_a, 2, seed=3)
    _train(b, opt_b, 2, seed=3)
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)


def test_state_before_the_first_step_is_zero_and_changes_nothing():
    a, opt_a = _model_and_opt()
    b, opt_b = _model_and_opt()
    assert adam_step_count(opt_a) == 0
    assert all(torch.count_nonzero(t) == 0 for t in get_adam_states(opt_a))
    _train(a, opt_a, 3)
    _train(b, opt_b, 3)  # b's state was created by Adam itself
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)


def test_set_states_rejects_wrong_count_and_shape():
    import pytest
    _, opt = _model_and_opt()
    states = get_adam_states(opt)
    with pytest.raises(ValueError):
        set_adam_states(opt, states[:-1])
    with pytest.raises(ValueError):
        set_adam_states(opt, [torch.zeros(2)] * len(states))
