"""Action heads: network features -> distribution parameters -> samples, log-probs, entropy, KL.

No ``torch.distributions`` objects: each head's distribution is one parameter tensor
(B, P) and a handful of pure functions on it, so the update builds no Python objects
per minibatch, and TRPO can take the KL between two parameter tensors.

* categorical: P = n normalized log-probabilities (masked actions at ``MASKED_LOGIT``)
* multi-categorical: P = sum(nvec), one normalized block per component
* diagonal Gaussian: P = 2 * d, the mean then a state-independent log-std

Each torch head has a numpy twin in kernels.py (``NumpyCategorical`` for both categorical
heads, ``NumpyGaussian``; there, not here, so that the acting side imports no torch),
for the two numpy paths: acting (inference.py: noise, act,
mode, log-prob) and the hand-written gradients (learner/updates/grads.py: log-prob, entropy and
their backward pass to the head's outputs). The twins take the head's raw outputs (the
last linear layer's: logits, or the Gaussian means) where the torch heads take their
parameter tensor; ``tests/test_distributions.py`` holds each twin equal to its head and
each backward pass equal to autograd.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor, nn

from trustrl.acting.kernels import LOG_SQRT_2PI, MASKED_LOGIT


class StackedLinear(nn.Module):
    """One linear layer per agent, stored stacked: ``weight`` (A, out, in), ``bias`` (A, out).

    Each row goes through its own agent's weights; rows may come in any order and mix of
    agents (collector rows and shuffled minibatches alike). No loop over agents.
    """

    def __init__(self, num_agents: int, in_features: int, out_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_agents, out_features, in_features))
        self.bias = nn.Parameter(torch.empty(num_agents, out_features))
        for agent in range(num_agents):  # the same initialization as nn.Linear, per agent
            reference = nn.Linear(in_features, out_features)
            with torch.no_grad():
                self.weight[agent].copy_(reference.weight)
                self.bias[agent].copy_(reference.bias)

    @property
    def num_agents(self) -> int:
        return self.weight.shape[0]

    def forward(self, x: Tensor, agent: Tensor) -> Tensor:
        """x (B, in), agent (B,) -> (B, out).

        One matmul against every agent's weights at once, then each row keeps its own
        agent's output. Gathering a weight matrix per row instead costs a (B, out, in)
        copy and its scatter-add in backward, far slower at minibatch sizes.
        """
        agents, out, inp = self.weight.shape
        every = (x @ self.weight.permute(2, 0, 1).reshape(inp, agents * out)).view(-1, agents, out)
        mine = every.gather(1, agent.view(-1, 1, 1).expand(-1, 1, out)).squeeze(1)
        return mine + self.bias[agent]


def linear_for(num_agents: int | None, in_features: int, out_features: int) -> nn.Module:
    """nn.Linear shared by all agents (``num_agents`` None), or one per agent, stacked."""
    if num_agents is not None:
        return StackedLinear(num_agents, in_features, out_features)
    return nn.Linear(in_features, out_features)


def apply_linear(layer: nn.Module, x: Tensor, agent: Tensor | None) -> Tensor:
    if isinstance(layer, StackedLinear):
        if agent is None:
            raise ValueError("per-agent layers need the agent index of every row")
        return layer(x, agent)
    return layer(x)


class ActionHead(Protocol):
    def forward(
        self, features: Tensor, mask: Tensor | None = None, agent: Tensor | None = None
    ) -> Tensor: ...
    def sample(self, params: Tensor, generator: torch.Generator | None = None) -> Tensor: ...
    def mode(self, params: Tensor) -> Tensor: ...
    def log_prob(self, params: Tensor, actions: Tensor) -> Tensor: ...
    def entropy(self, params: Tensor) -> Tensor: ...
    def kl(self, old: Tensor, new: Tensor) -> Tensor: ...


def _categorical_log_probs(logits: Tensor, mask: Tensor | None) -> Tensor:
    if mask is not None:
        logits = logits.masked_fill(~mask, MASKED_LOGIT)
    return torch.log_softmax(logits, dim=-1)


def _gumbel_argmax(log_probs: Tensor, generator: torch.Generator | None) -> Tensor:
    """Sample by argmax(log p - log E), E ~ Exp(1): the Gumbel-max trick in one kernel."""
    noise = torch.empty_like(log_probs).exponential_(generator=generator)
    return (log_probs - noise.log()).argmax(dim=-1)


def _categorical_entropy(log_probs: Tensor) -> Tensor:
    return -(log_probs.exp() * log_probs).sum(-1)


def _categorical_kl(old: Tensor, new: Tensor) -> Tensor:
    return (old.exp() * (old - new)).sum(-1)


class CategoricalHead(nn.Module):
    def __init__(self, in_features: int, n: int, num_agents: int | None = None) -> None:
        super().__init__()
        self.linear = linear_for(num_agents, in_features, n)

    def forward(
        self, features: Tensor, mask: Tensor | None = None, agent: Tensor | None = None
    ) -> Tensor:
        return _categorical_log_probs(apply_linear(self.linear, features, agent), mask)

    def sample(self, params: Tensor, generator: torch.Generator | None = None) -> Tensor:
        return _gumbel_argmax(params, generator)

    def mode(self, params: Tensor) -> Tensor:
        return params.argmax(-1)

    def log_prob(self, params: Tensor, actions: Tensor) -> Tensor:
        return params.gather(-1, actions.long().unsqueeze(-1)).squeeze(-1)

    def entropy(self, params: Tensor) -> Tensor:
        return _categorical_entropy(params)

    def kl(self, old: Tensor, new: Tensor) -> Tensor:
        return _categorical_kl(old, new)


class MultiCategoricalHead(nn.Module):
    """Independent categoricals, one per MultiDiscrete component; log-probs add."""

    def __init__(
        self, in_features: int, nvec: tuple[int, ...], num_agents: int | None = None
    ) -> None:
        super().__init__()
        self.nvec = list(nvec)
        self.linear = linear_for(num_agents, in_features, sum(nvec))

    def _blocks(self, params: Tensor) -> tuple[Tensor, ...]:
        return torch.split(params, self.nvec, dim=-1)

    def forward(
        self, features: Tensor, mask: Tensor | None = None, agent: Tensor | None = None
    ) -> Tensor:
        logits = apply_linear(self.linear, features, agent)
        masks = (
            torch.split(mask, self.nvec, dim=-1) if mask is not None else [None] * len(self.nvec)
        )
        blocks = torch.split(logits, self.nvec, dim=-1)
        return torch.cat(
            [_categorical_log_probs(b, m) for b, m in zip(blocks, masks, strict=True)], -1
        )

    def sample(self, params: Tensor, generator: torch.Generator | None = None) -> Tensor:
        return torch.stack([_gumbel_argmax(b, generator) for b in self._blocks(params)], -1)

    def mode(self, params: Tensor) -> Tensor:
        return torch.stack([b.argmax(-1) for b in self._blocks(params)], -1)

    def log_prob(self, params: Tensor, actions: Tensor) -> Tensor:
        blocks = self._blocks(params)
        return sum(
            (
                b.gather(-1, actions[..., i : i + 1].long()).squeeze(-1)
                for i, b in enumerate(blocks)
            ),
            params.new_zeros(params.shape[:-1]),
        )

    def entropy(self, params: Tensor) -> Tensor:
        return sum(
            (_categorical_entropy(b) for b in self._blocks(params)),
            params.new_zeros(params.shape[:-1]),
        )

    def kl(self, old: Tensor, new: Tensor) -> Tensor:
        pairs = zip(self._blocks(old), self._blocks(new), strict=True)
        return sum(
            (_categorical_kl(o, n) for o, n in pairs),
            old.new_zeros(old.shape[:-1]),
        )


class DiagGaussianHead(nn.Module):
    """Gaussian with a learned, state-independent log standard deviation."""

    def __init__(
        self, in_features: int, dim: int, log_std_init: float = 0.0, num_agents: int | None = None
    ) -> None:
        super().__init__()
        self.dim = dim
        self.linear = linear_for(num_agents, in_features, dim)
        # (dim,), or (A, dim) with one log-std per agent for per-agent actors.
        shape = (num_agents, dim) if num_agents is not None else (dim,)
        self.log_std = nn.Parameter(torch.full(shape, float(log_std_init)))

    def forward(
        self, features: Tensor, mask: Tensor | None = None, agent: Tensor | None = None
    ) -> Tensor:
        mean = apply_linear(self.linear, features, agent)
        log_std = self.log_std[agent] if self.log_std.dim() == 2 else self.log_std.expand_as(mean)
        return torch.cat([mean, log_std], -1)

    def sample(self, params: Tensor, generator: torch.Generator | None = None) -> Tensor:
        mean, log_std = params.split(self.dim, -1)
        noise = torch.randn(mean.shape, generator=generator, dtype=mean.dtype)
        return mean + noise * log_std.exp()

    def mode(self, params: Tensor) -> Tensor:
        return params[..., : self.dim]

    def log_prob(self, params: Tensor, actions: Tensor) -> Tensor:
        mean, log_std = params.split(self.dim, -1)
        z = (actions - mean) * torch.exp(-log_std)
        return (-0.5 * z.square() - log_std - LOG_SQRT_2PI).sum(-1)

    def entropy(self, params: Tensor) -> Tensor:
        log_std = params[..., self.dim :]
        return (0.5 + LOG_SQRT_2PI + log_std).sum(-1)

    def kl(self, old: Tensor, new: Tensor) -> Tensor:
        mean_old, log_std_old = old.split(self.dim, -1)
        mean_new, log_std_new = new.split(self.dim, -1)
        var_ratio = torch.exp(2 * (log_std_old - log_std_new))
        mean_term = (mean_old - mean_new).square() * torch.exp(-2 * log_std_new)
        return (0.5 * (var_ratio + mean_term - 1) - (log_std_old - log_std_new)).sum(-1)
