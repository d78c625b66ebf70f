"""The numpy MLP (trustrl/acting/kernels.py) against torch: forward passes, plain and stacked per
agent, equal to the Policy's modules; the backward pass equal to autograd."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from trustrl.acting import kernels
from trustrl.learner.heads import StackedLinear
from trustrl.learner.policy import ACTIVATIONS, StackedMLP, mlp

SIZES = (5, 16, 8)
ROWS = 33


def plain_net(activation: str) -> nn.Sequential:
    """A policy-style MLP with a linear output layer of 3."""
    torch.manual_seed(0)
    return nn.Sequential(mlp(SIZES[0], SIZES[1:], activation), nn.Linear(SIZES[-1], 3))


def dense_layers(modules: list[nn.Module], copy: bool = True) -> list[kernels.Dense]:
    return [
        kernels.Dense(m.weight.detach().numpy(), m.bias.detach().numpy(), copy=copy)
        for m in modules
        if isinstance(m, nn.Linear | StackedLinear)
    ]


def inputs(rows: int = ROWS) -> np.ndarray:
    return np.random.default_rng(1).normal(0.0, 2.0, size=(rows, SIZES[0])).astype(np.float32)


@pytest.mark.parametrize("activation", list(ACTIVATIONS))
@pytest.mark.parametrize("copy", [True, False], ids=["copied", "views"])
def test_forward_is_the_torch_mlp(activation: str, copy: bool) -> None:
    net = plain_net(activation)
    layers = dense_layers(list(net.modules()), copy)
    x = inputs()
    with torch.no_grad():
        expected = net(torch.from_numpy(x)).numpy()
    hidden = kernels.forward(layers, activation, x)
    assert len(hidden) == len(layers) + 1 and hidden[0] is x
    np.testing.assert_allclose(hidden[-1], expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(kernels.output(layers, activation, x.copy()), hidden[-1])
    with torch.no_grad():  # the first hidden layer, after its activation
        first = net[0][1](net[0][0](torch.from_numpy(x))).numpy()
    np.testing.assert_allclose(hidden[1], first, rtol=1e-5, atol=1e-6)


def test_views_see_the_weights_move() -> None:
    """Without ``copy`` the layers read the torch weights' memory (the optimizer's steps)."""
    net = plain_net("tanh")
    layers = dense_layers(list(net.modules()), copy=False)
    x = inputs()
    before = kernels.output(layers, "tanh", x)
    with torch.no_grad():
        net[1].bias.add_(1.0)
    np.testing.assert_allclose(kernels.output(layers, "tanh", x), before + 1.0, rtol=1e-6)


@pytest.mark.parametrize("activation", list(ACTIVATIONS))
def test_stacked_forward_is_each_rows_agents_mlp(activation: str) -> None:
    torch.manual_seed(2)
    agents = 3
    net = StackedMLP(agents, SIZES[0], SIZES[1:], activation)
    out_layer = StackedLinear(agents, SIZES[-1], 4)
    layers = dense_layers([*net.layers, out_layer])
    x = inputs()
    agent = np.random.default_rng(3).integers(0, agents, ROWS)
    with torch.no_grad():
        t_agent = torch.from_numpy(agent)
        expected = out_layer(net(torch.from_numpy(x), t_agent), t_agent).numpy()
    np.testing.assert_allclose(
        kernels.output(layers, activation, x, agent), expected, rtol=1e-5, atol=1e-6
    )
    with pytest.raises(ValueError, match="agent index"):
        kernels.output(layers, activation, x)


@pytest.mark.parametrize("outputs", [3, 1], ids=["head", "value"])
@pytest.mark.parametrize("activation", list(ACTIVATIONS))
def test_backward_is_autograd(activation: str, outputs: int) -> None:
    """d (sum(w * output)) / d every weight and bias, written into the given arrays;
    one output is the critic's case (its outer-product branch)."""
    torch.manual_seed(0)
    net = nn.Sequential(mlp(SIZES[0], SIZES[1:], activation), nn.Linear(SIZES[-1], outputs))
    linears = [m for m in net.modules() if isinstance(m, nn.Linear)]
    layers = dense_layers(linears, copy=False)
    x = inputs()
    d_out = np.random.default_rng(4).normal(size=(ROWS, outputs)).astype(np.float32)
    (net(torch.from_numpy(x)) * torch.from_numpy(d_out)).sum().backward()
    grads = [
        (np.full(m.weight.shape, np.nan, np.float32), np.full(m.bias.shape, np.nan, np.float32))
        for m in linears
    ]
    kernels.backward(layers, activation, kernels.forward(layers, activation, x), d_out, grads)
    for m, (grad_weight, grad_bias) in zip(linears, grads, strict=True):
        assert m.weight.grad is not None and m.bias.grad is not None
        np.testing.assert_allclose(grad_weight, m.weight.grad.numpy(), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(grad_bias, m.bias.grad.numpy(), rtol=1e-5, atol=1e-5)


def test_activations_in_place_closed_form() -> None:
    y = np.array([[-2.0, 0.0, 0.5]], dtype=np.float32)
    assert kernels.activate("relu", y) is y
    np.testing.assert_array_equal(y, [[0.0, 0.0, 0.5]])
    z = np.array([[0.0, 30.0, -30.0]], dtype=np.float32)
    np.testing.assert_array_equal(kernels.activate("tanh", z), [[0.0, 1.0, -1.0]])
