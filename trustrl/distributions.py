"""Action heads: network features -> distribution parameters -> samples, log-probs, entropy, KL.

No ``torch.distributions`` objects: each head's distribution is one parameter tensor
(B, P) and a handful of pure functions on it, so the inference path builds no
Python objects per step, and TRPO can take the KL between two parameter tensors.

* categorical: P = n normalized log-probabilities (masked actions at ``MASKED_LOGIT``)
* multi-categorical: P = sum(nvec), one normalized block per component
* diagonal Gaussian: P = 2 * d, the mean then a state-independent log-std
"""

from __future__ import annotations

import math
from typing import Protocol

import numpy as np
import torch
from torch import Tensor, nn

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


# numpy versions, for the numpy paths (the collector's inference.py, the update's grads.py).


def _numpy_tanh_is_fast() -> bool:
    """Whether numpy's float32 tanh runs its AVX-512 loop (x86-64-v4), as numpy's own
    dispatch reports it (numpy 2.1 and later; False where it cannot say)."""
    try:
        from numpy.lib.introspect import opt_func_info

        loops = opt_func_info(func_name="^tanh$", signature="float32")["tanh"].values()
        return any(loop["current"] in ("X86_V4", "AVX512_SKX") for loop in loops)
    except Exception:  # an older numpy, or a report of another shape
        return False


# Whether ``tanh_array`` takes the sigmoid form from ``TANH_VIA_SIGMOID_MIN`` elements on
# (see there): where numpy's tanh has no AVX-512 loop. Fixed per machine, so a run's
# rounding does not depend on a timing.
TANH_VIA_SIGMOID = not _numpy_tanh_is_fast()
TANH_VIA_SIGMOID_MIN = 4096
_TWO, _ONE = np.float32(2.0), np.float32(1.0)


def tanh_array(x: np.ndarray, view: Tensor | None = None) -> np.ndarray:
    """tanh of a float32 array, in place; on large arrays, on most machines, as
    ``2 sigmoid(2x) - 1``.

    The update's time on a CartPole-sized network is largely its tanh layers, and on an
    AVX2 machine numpy's float32 tanh costs 2.6-3.3 ns an element (torch's 2.5-3.1)
    where torch's sigmoid costs about 1 and a numpy multiply 0.14. So there, from
    ``TANH_VIA_SIGMOID_MIN`` elements on (the measured break-even, set by the torch
    call's overhead) tanh is a sigmoid between numpy multiplies: 38 against 62 µs at
    256 x 64 inside the update (``docs/performance.md``, round 7). Where numpy's tanh
    runs its AVX-512 loop (``TANH_VIA_SIGMOID`` False) it is the faster one at every
    size: 3.0 against 7.9 µs at 256 x 64 on an AMD EPYC with AVX-512 (round 9). The
    sigmoid form is within 1.8e-7 of tanh (3 float32 ulps at 1, 1e-7 near 0: a 64-term
    matmul's rounding); ``tests/test_distributions.py`` checks the bound. ``view``: ``x``
    as a tensor, where the caller keeps one (``torch.from_numpy`` costs some 4 µs)."""
    if not TANH_VIA_SIGMOID or x.size < TANH_VIA_SIGMOID_MIN:
        return np.tanh(x, out=x)
    np.multiply(x, _TWO, out=x)
    if view is None:
        view = torch.from_numpy(x)
    view.sigmoid_()
    np.multiply(x, _TWO, out=x)
    return np.subtract(x, _ONE, out=x)


def log_softmax_array(logits: np.ndarray) -> np.ndarray:
    """Log-softmax over the last axis of (n, K) logits, as ``row_max`` and ``row_sum``
    let it run fast on a few columns."""
    shifted = logits - row_max(logits)
    return shifted - np.log(row_sum(np.exp(shifted)))


def row_max(x: np.ndarray) -> np.ndarray:
    """(n, K) -> (n, 1), each row's maximum. numpy's reduction along a short last axis is
    slow (10 µs for 256 x 2 and 146 µs for 4,096 x 2 here), so up to 16 columns it runs as
    elementwise maxima of the columns instead (1.9 and 4.4 µs)."""
    columns = x.shape[1]
    if columns > 16:
        return x.max(-1, keepdims=True)
    out = x[:, :1].copy()
    for k in range(1, columns):
        np.maximum(out, x[:, k : k + 1], out=out)
    return out


def row_sum(x: np.ndarray) -> np.ndarray:
    """(n, K) -> (n, 1), each row's sum, as a matmul with ones: several times faster than
    ``x.sum(-1)`` along a short last axis (1.9 against 4.9 µs for 256 x 2, 2.9 against 61
    for 4,096 x 2)."""
    return x @ np.ones((x.shape[1], 1), dtype=x.dtype)
