"""The collector's inference path: a Policy's forward pass in numpy, on a weight snapshot.

Collection runs the networks on a handful of rows per env step (4 for the usual
CartPole setting), where torch spends far longer dispatching each op (a few
microseconds, some 15 ops per step) than computing it. The same arithmetic on numpy
arrays costs about a microsecond per op, so this is the one path the collector acts
with; the update keeps torch, for autograd. ``tests/test_inference.py`` checks that
both give the same log-probabilities and values.

A snapshot is taken by ``Inference(policy)`` (weights pre-transposed for ``x @ W``) and
is what a remote runner holds between weight refreshes. It takes observations already
normalized (``RunningMeanStd.normalize_array``, whose statistics the collector updates every
step); the value normalizer's statistics are read live from the policy's buffers.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from torch import nn

from trustrl.distributions import (
    LOG_SQRT_2PI,
    MASKED_LOGIT,
    CategoricalHead,
    DiagGaussianHead,
    MultiCategoricalHead,
    StackedLinear,
)
from trustrl.policy import StackedMLP

_LOG_SQRT_2PI = np.float32(LOG_SQRT_2PI)


class _Linear:
    """y = x @ W + b for one layer, W (in, out); a stacked layer holds every agent's weights
    as (in, A * out) and biases as (A, out), and picks each row's agent's output."""

    def __init__(self, weight: np.ndarray, bias: np.ndarray, stacked: bool = False) -> None:
        self.weight, self.bias, self.stacked = weight, bias, stacked
        self.out = bias.shape[-1]

    @classmethod
    def of(cls, layer: nn.Module) -> _Linear:
        """A snapshot of an nn.Linear or StackedLinear (copies, pre-transposed)."""
        weight = layer.weight.detach().numpy()  # type: ignore[operator]
        bias = layer.bias.detach().numpy().copy()  # type: ignore[operator]
        if isinstance(layer, StackedLinear):
            agents, out, inp = weight.shape
            # (in, A * out): one matmul gives every agent's output for every row.
            return cls(weight.transpose(2, 0, 1).reshape(inp, agents * out).copy(), bias, True)
        return cls(weight.T.copy(), bias)  # (in, out), C order

    def __call__(self, x: np.ndarray, agent: np.ndarray | None) -> np.ndarray:
        y = x @ self.weight
        if not self.stacked:
            y += self.bias
            return y
        assert agent is not None
        rows = np.arange(len(x))
        return y.reshape(len(x), -1, self.out)[rows, agent] + self.bias[agent]


def _mlp(module: nn.Module) -> list[_Linear]:
    if isinstance(module, StackedMLP):
        return [_Linear.of(layer) for layer in module.layers]
    return [_Linear.of(layer) for layer in module.modules() if isinstance(layer, nn.Linear)]


def _log_softmax(logits: np.ndarray, mask: np.ndarray | None) -> np.ndarray:
    if mask is not None:
        logits = np.where(mask, logits, np.float32(MASKED_LOGIT))
    shifted = logits - logits.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


def _gumbel_argmax(log_probs: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """argmax(log p - log E), E ~ Exp(1): the Gumbel-max trick, as the torch heads sample."""
    noise = rng.standard_exponential(log_probs.shape, dtype=np.float32)
    # A draw of exactly 0 would give +inf and win even over a masked action.
    np.maximum(noise, np.finfo(np.float32).tiny, out=noise)
    return (log_probs - np.log(noise)).argmax(-1)


def _fused(actor: list[_Linear], head: _Linear, critic: list[_Linear]) -> list[_Linear]:
    """Actor (with its head) and critic as one MLP on their common input, whose output is
    [head outputs | value]: the first layer side by side, the others block-diagonal. Per
    env step that is half the matmuls and activations; the zero blocks cost nothing that
    a few rows would notice."""
    fused = []
    for i, (a, c) in enumerate(zip([*actor, head], critic, strict=True)):
        if i == 0:
            weight = np.concatenate([a.weight, c.weight], 1)
        else:
            (a_in, a_out), (c_in, c_out) = a.weight.shape, c.weight.shape
            weight = np.zeros((a_in + c_in, a_out + c_out), dtype=a.weight.dtype)
            weight[:a_in, :a_out] = a.weight
            weight[a_in:, a_out:] = c.weight
        fused.append(_Linear(weight, np.concatenate([a.bias, c.bias])))
    return fused


class Inference:
    """Sampling, log-probabilities and values of a Policy, in numpy (float32)."""

    def __init__(self, policy: Any) -> None:
        self.policy = policy
        # The modules the collector reads every step, looked up once (nn.Module's
        # attribute lookup for submodules costs about a microsecond each).
        self.obs_normalizer = policy.obs_normalizer
        self.critic_normalizer = policy.critic_normalizer
        self.value_normalizer = policy.value_normalizer
        self.per_agent = policy.per_agent
        self.activation = np.tanh if policy.config.activation == "tanh" else _relu
        self.actor = _mlp(policy.actor)
        self.head = _Linear.of(policy.head.linear)
        self.critic = _mlp(policy.critic)
        head = policy.head
        self.width = self.head.out
        # One network for both when they read the same input (not per-agent actors, not a
        # global-state critic).
        fused = (
            _fused(self.actor, self.head, self.critic)
            if not policy.per_agent and policy.critic_dim is None
            else None
        )
        # Split once here: the per-step path must not slice the list every call.
        self.fused_hidden: list[_Linear] = fused[:-1] if fused else []
        self.fused_out: _Linear | None = fused[-1] if fused else None
        if isinstance(head, DiagGaussianHead):
            self.kind = "gaussian"
            self.log_std = head.log_std.detach().numpy().copy()
            self.std = np.exp(self.log_std)
            # log N(a; mu, std) = -z.z / 2 - (sum(log std) + k log sqrt(2 pi)), where z is
            # the standard normal draw that made a = mu + std z: the constant per agent.
            k = self.log_std.shape[-1]
            self.log_norm = self.log_std.sum(-1) + k * _LOG_SQRT_2PI
        elif isinstance(head, MultiCategoricalHead):
            self.kind = "multi"
            self.splits = np.cumsum(head.nvec)[:-1]
        else:
            assert isinstance(head, CategoricalHead)
            self.kind = "categorical"

    def _with_id(self, x: np.ndarray, agent: np.ndarray | None) -> np.ndarray:
        if not self.policy.agent_id:
            return x
        assert agent is not None
        one_hot = np.zeros((len(x), self.policy.num_agents), dtype=np.float32)
        one_hot[np.arange(len(x)), agent] = 1.0
        return np.concatenate([x, one_hot], -1)

    def _features(self, layers: list[_Linear], x: np.ndarray, agent: np.ndarray | None):
        for layer in layers:
            x = self.activation(layer(x, agent))
        return x

    def _outputs(
        self, x: np.ndarray, critic_x: np.ndarray | None, agent: np.ndarray | None
    ) -> tuple[np.ndarray, np.ndarray]:
        """(head outputs, raw values)."""
        if self.fused_out is not None:
            out = self.fused_out(
                self._features(self.fused_hidden, self._with_id(x, agent), None), None
            )
            return out[:, : self.width], out[:, self.width]
        actor_in = x if self.per_agent else self._with_id(x, agent)
        head_out = self.head(self._features(self.actor, actor_in, agent), agent)
        return head_out, self._raw_value(x, critic_x, agent)

    def _raw_value(
        self, x: np.ndarray, critic_x: np.ndarray | None, agent: np.ndarray | None
    ) -> np.ndarray:
        hidden = self._features(
            self.critic[:-1], self._with_id(critic_x if critic_x is not None else x, agent), None
        )
        return self.critic[-1](hidden, None)[:, 0]

    def step(
        self,
        x: np.ndarray,
        mask: np.ndarray | None,
        rng: np.random.Generator,
        critic_x: np.ndarray | None = None,
        agent: np.ndarray | None = None,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Normalized observations (B, obs_dim) -> (actions, log-probabilities, values)."""
        out, raw_value = self._outputs(x, critic_x, agent)
        if self.kind == "categorical":
            log_probs = _log_softmax(out, mask)
            actions = _gumbel_argmax(log_probs, rng)
            logprob = log_probs[np.arange(len(actions)), actions]
        elif self.kind == "multi":
            masks = np.split(mask, self.splits, -1) if mask is not None else None
            blocks = [
                _log_softmax(block, masks[i] if masks is not None else None)
                for i, block in enumerate(np.split(out, self.splits, -1))
            ]
            actions = np.stack([_gumbel_argmax(b, rng) for b in blocks], -1)
            rows = np.arange(len(actions))
            logprob = np.sum([b[rows, actions[:, i]] for i, b in enumerate(blocks)], axis=0)
        else:
            per_agent = self.log_std.ndim == 2
            std = self.std[agent] if per_agent else self.std
            log_norm = self.log_norm[agent] if per_agent else self.log_norm
            z = rng.standard_normal(out.shape, dtype=np.float32)
            actions = out + z * std
            logprob = np.einsum("ij,ij->i", z, z) * np.float32(-0.5) - log_norm
        return actions, logprob.astype(np.float32, copy=False), self._denormalize(raw_value)

    def value(
        self, x: np.ndarray, critic_x: np.ndarray | None = None, agent: np.ndarray | None = None
    ) -> np.ndarray:
        """``Policy.value``: the critic's output in return units."""
        return self._denormalize(self._raw_value(x, critic_x, agent))

    def _denormalize(self, raw: np.ndarray) -> np.ndarray:
        norm = self.value_normalizer
        if norm is None:
            return raw
        mean, var, _ = norm.arrays()
        return raw * np.sqrt(var).astype(np.float32) + mean.astype(np.float32)


def _relu(x: np.ndarray) -> np.ndarray:
    return np.maximum(x, np.float32(0.0), out=x)
