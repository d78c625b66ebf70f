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

Per env step only the actor runs (``act``); the log-probabilities and the critic run once
per rollout on what the steps stored (``log_prob``, ``value``). An earlier version fused
actor and critic into one network per step; with the critic out of the step, the fusion
saved nothing and is gone.
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
    log_softmax_array,
    tanh_array,
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
    return log_softmax_array(logits)


class Inference:
    """Sampling, log-probabilities and values of a Policy, in numpy (float32).

    Acting is split so that an env step does only what choosing the action needs:

    * ``noise``, once per rollout: every step's random draws at once (Gumbel noise for
      discrete heads, the scaled normal draw for Gaussian ones);
    * ``act``, per step: the actor's outputs and the action, argmax(logits + Gumbel)
      (the Gumbel-max trick: log-softmax only shifts a row, so the argmax needs none)
      or mean + std z;
    * ``log_prob`` and ``value``, once per rollout, on every step's stored outputs and
      inputs: one batched call where a step would make a dozen tiny ones.

    ``step`` chains them for a single batch of rows.
    """

    def __init__(self, policy: Any) -> None:
        self.policy = policy
        # The modules the collector reads every step, looked up once (nn.Module's
        # attribute lookup for submodules costs about a microsecond each).
        self.obs_normalizer = policy.obs_normalizer
        self.critic_normalizer = policy.critic_normalizer
        self.value_normalizer = policy.value_normalizer
        self.per_agent = policy.per_agent
        self.activation = tanh_array if policy.config.activation == "tanh" else _relu
        self.actor = _mlp(policy.actor)
        self.head = _Linear.of(policy.head.linear)
        self.critic = _mlp(policy.critic)
        head = policy.head
        self.width = self.head.out  # head outputs per row: logits, or the Gaussian means
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

    def _per_row(self, values: np.ndarray, agent: np.ndarray | None) -> np.ndarray:
        """A Gaussian head's std or log-density constant for each row: per-agent heads
        (log_std of shape (A, k)) pick each row's agent's, a shared head's is shared."""
        return values[agent] if self.log_std.ndim == 2 else values

    def noise(self, rng: np.random.Generator, steps: int, agent: np.ndarray) -> np.ndarray:
        """(steps, rows, width) draws for a rollout of ``steps`` steps of the rows whose
        agents ``agent`` (rows,) gives: what ``act`` adds to the head outputs."""
        shape = (steps, len(agent), self.width)
        if self.kind == "gaussian":
            z = rng.standard_normal(shape, dtype=np.float32)
            z *= self._per_row(self.std, agent)
            return z
        noise = rng.standard_exponential(shape, dtype=np.float32)
        # A draw of exactly 0 would give +inf and win even over a masked action.
        np.maximum(noise, np.finfo(np.float32).tiny, out=noise)
        np.log(noise, out=noise)
        np.negative(noise, out=noise)  # -log E, E ~ Exp(1): standard Gumbel
        return noise

    def act(
        self,
        x: np.ndarray,
        mask: np.ndarray | None,
        noise: np.ndarray,
        agent: np.ndarray | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Normalized observations (rows, obs_dim) and one step's ``noise`` rows ->
        (actions, head outputs)."""
        actor_in = x if self.per_agent else self._with_id(x, agent)
        out = self.head(self._features(self.actor, actor_in, agent), agent)
        if self.kind == "gaussian":
            return out + noise, out
        if mask is not None:
            perturbed = np.where(mask, out, np.float32(MASKED_LOGIT))
            perturbed += noise
        else:
            perturbed = out + noise
        if self.kind == "categorical":
            return perturbed.argmax(-1), out
        blocks = np.split(perturbed, self.splits, -1)
        return np.stack([block.argmax(-1) for block in blocks], -1), out

    def mode(
        self, x: np.ndarray, mask: np.ndarray | None, agent: np.ndarray | None = None
    ) -> np.ndarray:
        """The deterministic actions for normalized observations: ``act`` without noise
        (the argmax of the logits, per block for multi-discrete, or the Gaussian mean)."""
        return self.act(x, mask, np.zeros((len(x), self.width), dtype=np.float32), agent)[0]

    def log_prob(
        self,
        out: np.ndarray,
        actions: np.ndarray,
        mask: np.ndarray | None,
        noise: np.ndarray,
        agent: np.ndarray | None = None,
    ) -> np.ndarray:
        """Log-probabilities (B,) of the actions ``act`` chose from head outputs ``out``
        with ``noise``, all (B, ...) (a rollout's steps flattened)."""
        rows = np.arange(len(out))
        if self.kind == "gaussian":
            z = noise / self._per_row(self.std, agent)
            logprob = np.einsum("ij,ij->i", z, z) * np.float32(-0.5)
            logprob -= self._per_row(self.log_norm, agent)
            return logprob.astype(np.float32, copy=False)
        if self.kind == "categorical":
            return _log_softmax(out, mask)[rows, actions]
        masks = np.split(mask, self.splits, -1) if mask is not None else None
        blocks = [
            _log_softmax(block, masks[i] if masks is not None else None)
            for i, block in enumerate(np.split(out, self.splits, -1))
        ]
        return np.sum([b[rows, actions[:, i]] for i, b in enumerate(blocks)], axis=0)

    def step(
        self,
        x: np.ndarray,
        mask: np.ndarray | None,
        rng: np.random.Generator,
        critic_x: np.ndarray | None = None,
        agent: np.ndarray | None = None,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Normalized observations (B, obs_dim) -> (actions, log-probabilities, values)."""
        rows = agent if agent is not None else np.zeros(len(x), dtype=np.int64)
        noise = self.noise(rng, 1, rows)[0]
        actions, out = self.act(x, mask, noise, agent)
        logprob = self.log_prob(out, actions, mask, noise, agent)
        return actions, logprob, self.value(x, critic_x, agent)

    def value(
        self, x: np.ndarray, critic_x: np.ndarray | None = None, agent: np.ndarray | None = None
    ) -> np.ndarray:
        """``Policy.value``: the critic's output in return units."""
        return self._denormalize(self._raw_value(x, critic_x, agent))

    def _raw_value(
        self, x: np.ndarray, critic_x: np.ndarray | None, agent: np.ndarray | None
    ) -> np.ndarray:
        hidden = self._features(
            self.critic[:-1], self._with_id(critic_x if critic_x is not None else x, agent), None
        )
        return self.critic[-1](hidden, None)[:, 0]

    def _denormalize(self, raw: np.ndarray) -> np.ndarray:
        norm = self.value_normalizer
        if norm is None:
            return raw
        mean, var, _ = norm.arrays()
        return raw * np.sqrt(var).astype(np.float32) + mean.astype(np.float32)


def _relu(x: np.ndarray) -> np.ndarray:
    return np.maximum(x, np.float32(0.0), out=x)
