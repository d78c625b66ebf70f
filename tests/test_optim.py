"""trustrl.learner.optim.Adam computes what torch.optim.Adam computes, step for step."""

from __future__ import annotations

import torch
from torch import nn

from trustrl.learner.optim import Adam


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 3))


def _loss(model: nn.Module, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(32, 5, generator=g)
    return model(x).square().mean() + model(x).sin().sum()


def _train(model: nn.Module, opt: Adam, steps: int) -> None:
    for step in range(steps):
        opt.zero_grad()
        _loss(model, step).backward()
        opt.step()


def test_matches_torch_adam_over_many_steps() -> None:
    ours, theirs = _model(0), _model(0)
    opt = Adam(ours.parameters(), lr=3e-3, eps=1e-5)
    ref = torch.optim.Adam(theirs.parameters(), lr=3e-3, eps=1e-5)
    for step in range(50):
        for model, optimizer in ((ours, opt), (theirs, ref)):
            optimizer.zero_grad(set_to_none=True)
            _loss(model, step).backward()
            optimizer.step()
        if step == 20:  # a learning-rate change mid-run, as annealing does
            opt.param_groups[0]["lr"] = ref.param_groups[0]["lr"] = 1e-3
    for a, b in zip(ours.parameters(), theirs.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_state_dict_round_trip_and_torch_layout() -> None:
    model = _model(1)
    opt = Adam(model.parameters(), lr=1e-3)
    _train(model, opt, 3)
    state = opt.state_dict()
    # Loadable by torch.optim.Adam, and back.
    ref = torch.optim.Adam(model.parameters(), lr=5.0)
    ref.load_state_dict(state)
    assert ref.param_groups[0]["lr"] == 1e-3
    again = Adam(model.parameters(), lr=5.0)
    again.load_state_dict(ref.state_dict())
    for p in model.parameters():
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(again.state[p][key], opt.state[p][key])
    assert again.param_groups[0]["lr"] == 1e-3


def test_parameters_become_views_of_one_buffer() -> None:
    model = _model(2)
    before = [p.detach().clone() for p in model.parameters()]
    opt = Adam(model.parameters(), lr=1e-2)
    for p, value in zip(model.parameters(), before, strict=True):
        assert torch.equal(p, value)  # values kept
        assert p.untyped_storage().data_ptr() == opt.flat.untyped_storage().data_ptr()
    # A parameter without a gradient is stepped with a zero one (documented difference
    # from torch.optim.Adam, which skips it): its first step leaves it unchanged.
    model[2].weight.grad = torch.ones_like(model[2].weight)
    opt.step()
    after = list(model.parameters())
    assert not torch.equal(after[2], before[2])
    for i in (0, 1, 3):
        assert torch.equal(after[i], before[i])


def test_grow_keeps_moments_and_adds_zeros() -> None:
    model = _model(3)
    opt = Adam(model.parameters(), lr=1e-2)
    _train(model, opt, 2)
    old = model[0].weight
    moments = {k: opt.state[old][k].clone() for k in ("exp_avg", "exp_avg_sq")}
    new = torch.nn.Parameter(torch.cat([old.detach(), torch.zeros(16, 2)], 1))
    model[0].weight = new
    opt.grow([(old, new, 1)])
    assert any(p is new for p in opt.params) and not any(p is old for p in opt.params)
    for key, value in moments.items():
        assert torch.equal(opt.state[new][key][:, :5], value)
        assert torch.equal(opt.state[new][key][:, 5:], torch.zeros(16, 2))
    assert new.untyped_storage().data_ptr() == opt.flat.untyped_storage().data_ptr()
    opt.zero_grad()
    model(torch.randn(4, 7)).sum().backward()
    opt.step()  # steps on with the grown shapes
    assert float(opt.state[new]["step"]) == 3.0
