"""trustrl.optim.Adam computes what torch.optim.Adam computes, step for step."""

from __future__ import annotations

import torch
from torch import nn

from trustrl.optim import Adam


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 3))


def _loss(model: nn.Module, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(32, 5, generator=g)
    return model(x).square().mean() + model(x).sin().sum()


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
    for step in range(3):
        opt.zero_grad()
        _loss(model, step).backward()
        opt.step()
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


def test_parameters_without_gradient_are_left_alone() -> None:
    model = _model(2)
    opt = Adam(model.parameters(), lr=1e-2)
    before = [p.detach().clone() for p in model.parameters()]
    model[2].weight.grad = torch.ones_like(model[2].weight)
    opt.step()
    after = list(model.parameters())
    assert not torch.equal(after[2], before[2])
    for i in (0, 1, 3):
        assert torch.equal(after[i], before[i])
        assert after[i] not in opt.state
