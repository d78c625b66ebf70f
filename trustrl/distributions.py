"""Action heads: network features -> distribution parameters -> samples, log-probs, entropy, KL.

No ``torch.distributions`` objects: each head's distribution is one parameter tensor
(B, P) and a handful of pure functions on it, so the update builds no Python objects
per minibatch, and TRPO can take the KL between two parameter tensors.

* categorical: P = n normalized log-probabilities (masked actions at ``MASKED_LOGIT``)
* multi-categorical: P = sum(nvec), one normalized block per component
* diagonal Gaussian: P = 2 * d, the mean then a state-independent log-std

Each torch head has its numpy twin beside it (``NumpyCategorical`` for both categorical
heads, ``NumpyGaussian``), for the two numpy paths: acting (inference.py: noise, act,
mode, log-prob) and the hand-written gradients (updates/grads.py: log-prob, entropy and
their backward pass to the head's outputs). The twins take the head's raw outputs (the
last linear layer's: logits, or the Gaussian means) where the torch heads take their
parameter tensor; ``tests/test_distributions.py`` holds each twin equal to its head and
each backward pass equal to autograd.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch
from torch import Tensor, nn

from trustrl.kernels import log_softmax_array, row_sum

# A finite stand-in for -inf: exp() of it is exactly 0 in float32, and 0 * it is 0, so
# entropies and KLs over masked actions stay finite (an -inf would give NaN there).
MASKED_LOGIT = -1e8


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
        copy and its scatter-add in backward: 50x slower at B = 2400, 64x64, 3 agents.
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
            torch.zeros(params.shape[:-1], dtype=params.dtype),
        )

    def entropy(self, params: Tensor) -> Tensor:
        return sum(
            (_categorical_entropy(b) for b in self._blocks(params)),
            torch.zeros(params.shape[:-1], dtype=params.dtype),
        )

    def kl(self, old: Tensor, new: Tensor) -> Tensor:
        pairs = zip(self._blocks(old), self._blocks(new), strict=True)
        return sum(
            (_categorical_kl(o, n) for o, n in pairs),
            torch.zeros(old.shape[:-1], dtype=old.dtype),
        )


class NumpyCategorical:
    """The numpy twin of ``CategoricalHead`` (one block) and ``MultiCategoricalHead``
    (a block per component), on raw logits (rows, sum(nvec))."""

    def __init__(self, nvec: Sequence[int]) -> None:
        self.nvec = list(nvec)
        self.width = sum(self.nvec)
        self.blocks = list(itertools.pairwise(np.cumsum([0, *self.nvec]).tolist()))

    def params(self, logits: np.ndarray, mask: np.ndarray | None) -> np.ndarray:
        """The head's ``forward`` after its linear layer: per-block log-softmax, masked
        logits at ``MASKED_LOGIT`` first."""
        if mask is not None:
            logits = np.where(mask, logits, np.float32(MASKED_LOGIT))
        if len(self.blocks) == 1:  # Discrete: no per-block copies
            return log_softmax_array(logits)
        log_probs = np.empty_like(logits)
        for lo, hi in self.blocks:
            log_probs[:, lo:hi] = log_softmax_array(logits[:, lo:hi])
        return log_probs

    def log_prob(
        self, params: np.ndarray, actions: np.ndarray, agent: np.ndarray | None = None
    ) -> np.ndarray:
        """(rows,) log-probabilities of ``actions`` (rows,) or (rows, components)."""
        rows = np.arange(len(params))
        if len(self.blocks) == 1:
            return params[rows, actions]
        logprob = np.zeros(len(params), dtype=params.dtype)
        for i, (lo, _) in enumerate(self.blocks):
            logprob += params[rows, lo + actions[:, i]]
        return logprob

    def entropy(self, params: np.ndarray, agent: np.ndarray | None = None) -> np.ndarray:
        """(rows,): the blocks' entropies summed, which is -sum p log p over every column."""
        return -row_sum(np.exp(params) * params)[:, 0]

    def noise(self, rng: np.random.Generator, steps: int, agent: np.ndarray) -> np.ndarray:
        """(steps, rows, width) standard Gumbel draws, -log E with E ~ Exp(1)."""
        noise = rng.standard_exponential((steps, len(agent), self.width), dtype=np.float32)
        # A draw of exactly 0 would give +inf and win even over a masked action.
        np.maximum(noise, np.finfo(np.float32).tiny, out=noise)
        np.log(noise, out=noise)
        return np.negative(noise, out=noise)

    def act(
        self,
        logits: np.ndarray,
        mask: np.ndarray | None,
        noise: np.ndarray | None,
        agent: np.ndarray | None = None,
    ) -> np.ndarray:
        """argmax(logits + Gumbel noise) per block: a sample (the Gumbel-max trick, as
        ``sample``; log-softmax only shifts a row, so the argmax needs none), or with
        ``noise`` None the mode."""
        if mask is not None:
            perturbed = np.where(mask, logits, np.float32(MASKED_LOGIT))
            if noise is not None:
                perturbed += noise
        else:
            perturbed = logits + noise if noise is not None else logits
        if len(self.blocks) == 1:
            return perturbed.argmax(-1)
        return np.stack([perturbed[:, lo:hi].argmax(-1) for lo, hi in self.blocks], -1)

    def terms(
        self, logits: np.ndarray, actions: np.ndarray, mask: np.ndarray | None
    ) -> tuple[np.ndarray, float, tuple]:
        """The gradient path's forward pass: (log-probabilities (rows,), the mean entropy
        over rows, what ``backward`` needs)."""
        params = self.params(logits, mask)
        probs = np.exp(params)
        # The mean over rows of each row's summed entropies: one sum over everything.
        entropy = -float((probs * params).sum()) / len(params)
        return self.log_prob(params, actions), entropy, (params, probs, actions, mask)

    def backward(
        self, residuals: tuple, d_logprob: np.ndarray, d_entropy: float
    ) -> tuple[np.ndarray, None]:
        """d loss / d logits (rows, width) for a loss with d loss / d logprob ``d_logprob``
        (rows,) and d loss / d (the mean entropy) ``d_entropy``, from ``terms``'
        residuals; no parameter of the head's own (a Gaussian's log-std) to differentiate."""
        params, probs, actions, mask = residuals
        n = len(params)
        # d logprob / d logits = onehot(action) - softmax, per block.
        d_out = -d_logprob[:, None] * probs
        rows = np.arange(n)
        for i, (lo, _) in enumerate(self.blocks):
            taken = actions if actions.ndim == 1 else actions[:, i]
            d_out[rows, lo + taken] += d_logprob
        if d_entropy:
            # d entropy / d logits_j = -p_j (log p_j + H) within each block.
            block_entropy = np.empty_like(params)
            plogp = probs * params
            for lo, hi in self.blocks:
                block_entropy[:, lo:hi] = -row_sum(plogp[:, lo:hi])
            d_out -= (np.float32(d_entropy) / n) * probs * (params + block_entropy)
        if mask is not None:
            d_out *= mask  # masked logits were replaced by a constant
        return d_out.astype(np.float32, copy=False), None


LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)  # the Gaussian log-density's constant


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


_LOG_SQRT_2PI = np.float32(LOG_SQRT_2PI)


class NumpyGaussian:
    """The numpy twin of ``DiagGaussianHead``, on the means (rows, d); ``log_std`` (d,),
    or (A, d) for per-agent heads, may be a live view of the torch parameter."""

    def __init__(self, log_std: np.ndarray) -> None:
        self.log_std = log_std
        self.width = log_std.shape[-1]

    def _rows(self, values: np.ndarray, agent: np.ndarray | None) -> np.ndarray:
        """Per-agent values (A, ...) picked for each row; shared ones as they are."""
        return values[agent] if self.log_std.ndim == 2 else values

    def params(self, means: np.ndarray, mask: np.ndarray | None) -> np.ndarray:
        """The means are the varying part of the parameters; the log-std is the head's."""
        return means

    def log_prob(
        self, params: np.ndarray, actions: np.ndarray, agent: np.ndarray | None = None
    ) -> np.ndarray:
        log_std = self._rows(self.log_std, agent)
        return _log_density((actions - params) * np.exp(-log_std), log_std)

    def log_prob_of_noise(self, noise: np.ndarray, agent: np.ndarray | None) -> np.ndarray:
        """``log_prob`` of the actions ``act`` made with ``noise`` = std z: -z.z / 2 -
        (sum(log std) + d log sqrt(2 pi)). The draw itself, not actions - means, which
        loses digits when a mean is large against its std."""
        z = noise / self._rows(np.exp(self.log_std), agent)
        logprob = np.einsum("ij,ij->i", z, z) * np.float32(-0.5)
        logprob -= self._rows(self.log_std.sum(-1) + self.width * _LOG_SQRT_2PI, agent)
        return logprob.astype(np.float32, copy=False)

    def entropy(self, params: np.ndarray, agent: np.ndarray | None = None) -> np.ndarray:
        """(rows,): state-independent, sum(1/2 + log sqrt(2 pi) + log std)."""
        per_agent = (np.float32(0.5) + _LOG_SQRT_2PI + self.log_std).sum(-1)
        return np.broadcast_to(self._rows(per_agent, agent), (len(params),))

    def noise(self, rng: np.random.Generator, steps: int, agent: np.ndarray) -> np.ndarray:
        """(steps, rows, d) draws std z, z ~ N(0, I): what ``act`` adds to the means."""
        z = rng.standard_normal((steps, len(agent), self.width), dtype=np.float32)
        z *= self._rows(np.exp(self.log_std), agent)
        return z

    def act(
        self,
        means: np.ndarray,
        mask: np.ndarray | None,
        noise: np.ndarray | None,
        agent: np.ndarray | None = None,
    ) -> np.ndarray:
        """mean + std z (``sample``), or with ``noise`` None the mean (``mode``)."""
        return means + noise if noise is not None else means

    def terms(
        self, means: np.ndarray, actions: np.ndarray, mask: np.ndarray | None
    ) -> tuple[np.ndarray, float, tuple]:
        """The gradient path's forward pass: (log-probabilities (rows,), the mean entropy,
        what ``backward`` needs). A shared log-std only (per-agent heads train by
        autograd)."""
        assert self.log_std.ndim == 1
        inv_std = np.exp(-self.log_std)
        z = (actions - means) * inv_std
        entropy = float(np.sum(np.float32(0.5) + _LOG_SQRT_2PI + self.log_std))
        return _log_density(z, self.log_std), entropy, (z, inv_std)

    def backward(
        self, residuals: tuple, d_logprob: np.ndarray, d_entropy: float
    ) -> tuple[np.ndarray, np.ndarray]:
        """(d loss / d means (rows, d), d loss / d log_std (d,)) for a loss with d loss /
        d logprob ``d_logprob`` (rows,) and d loss / d mean entropy ``d_entropy``."""
        z, inv_std = residuals
        d_means = d_logprob[:, None] * z * inv_std
        # d logprob / d log_std = z^2 - 1; the entropy's is 1 per dimension.
        d_log_std = np.sum(d_logprob[:, None] * (z * z - 1.0), axis=0)
        d_log_std += np.float32(d_entropy)
        return d_means, d_log_std


def _log_density(z: np.ndarray, log_std: np.ndarray) -> np.ndarray:
    """(rows,) log N(a; mean, std) from z = (a - mean) / std."""
    return row_sum(np.float32(-0.5) * z * z - log_std - _LOG_SQRT_2PI)[:, 0]


class NumpyHead(Protocol):
    """What the numpy paths ask of a head's twin (``numpy_head``)."""

    width: int

    def params(self, out: np.ndarray, mask: np.ndarray | None) -> np.ndarray: ...
    def log_prob(
        self, params: np.ndarray, actions: np.ndarray, agent: np.ndarray | None = None
    ) -> np.ndarray: ...
    def entropy(self, params: np.ndarray, agent: np.ndarray | None = None) -> np.ndarray: ...
    def noise(self, rng: np.random.Generator, steps: int, agent: np.ndarray) -> np.ndarray: ...
    def act(
        self,
        out: np.ndarray,
        mask: np.ndarray | None,
        noise: np.ndarray | None,
        agent: np.ndarray | None = None,
    ) -> np.ndarray: ...
    def terms(
        self, out: np.ndarray, actions: np.ndarray, mask: np.ndarray | None
    ) -> tuple[np.ndarray, float, tuple]: ...
    def backward(
        self, residuals: tuple, d_logprob: np.ndarray, d_entropy: float
    ) -> tuple[np.ndarray, np.ndarray | None]: ...


def numpy_head(
    action_kind: str, nvec: Sequence[int], log_std: np.ndarray | None
) -> NumpyCategorical | NumpyGaussian:
    """The twin of the head for an action space (``SpaceSpec.action_kind`` and ``nvec``);
    a Gaussian's needs the head's ``log_std``."""
    if action_kind == "box":
        assert log_std is not None
        return NumpyGaussian(log_std)
    return NumpyCategorical(nvec)
