"""The collector's inference path: a Policy's forward pass in numpy, on a weight snapshot.

Collection runs the networks on a handful of rows per env step (4 for the usual
CartPole setting), where torch spends far longer dispatching each op (a few
microseconds, some 15 ops per step) than computing it. The same arithmetic on numpy
arrays costs about a microsecond per op, so this is the one path the collector acts
with; the update keeps torch, for autograd. ``tests/test_inference.py`` checks that
both give the same log-probabilities and values.

``Inference(snapshot)`` is built from a policy snapshot (contract.py: numpy weights,
pre-transposed here for ``x @ W``, and normalizer statistics), never from the learner's
modules, so it is what a runner in another process holds between snapshots. It takes
observations already normalized by its own copy of the observation statistics
(``obs_normalizer``), frozen for a rollout unless the collector updates it per step.

Per env step only the actor runs (``act``); the log-probabilities and the critic run once
per rollout on what the steps stored (``log_prob``, ``value``). An earlier version fused
actor and critic into one network per step; with the critic out of the step, the fusion
saved nothing and is gone.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from trustrl.contract import GroupSnapshot
from trustrl.distributions import LOG_SQRT_2PI, MASKED_LOGIT, log_softmax_array, tanh_array
from trustrl.normalize import RunningMeanStd

if TYPE_CHECKING:
    from trustrl.policy import Policy

_LOG_SQRT_2PI = np.float32(LOG_SQRT_2PI)


class _Linear:
    """y = x @ W + b for one layer, W (in, out); a stacked layer holds every agent's weights
    as (in, A * out) and biases as (A, out), and picks each row's agent's output."""

    def __init__(self, weight: np.ndarray, bias: np.ndarray) -> None:
        """From a layer's weights as torch stores them: (out, in) and (out,), or stacked
        per agent (A, out, in) and (A, out). Copied, pre-transposed for ``x @ W``."""
        self.stacked = weight.ndim == 3
        if self.stacked:
            agents, out, inp = weight.shape
            # (in, A * out): one matmul gives every agent's output for every row.
            self.weight = weight.transpose(2, 0, 1).reshape(inp, agents * out).copy()
        else:
            self.weight = weight.T.copy()  # (in, out), C order
        self.bias = bias.copy()
        self.out = bias.shape[-1]

    def __call__(self, x: np.ndarray, agent: np.ndarray | None) -> np.ndarray:
        y = x @ self.weight
        if not self.stacked:
            y += self.bias
            return y
        assert agent is not None
        rows = np.arange(len(x))
        return y.reshape(len(x), -1, self.out)[rows, agent] + self.bias[agent]


def _layers(weights: dict[str, np.ndarray], prefix: str) -> list[_Linear]:
    """The linear layers under ``prefix`` in the order the module holds them (a
    ``state_dict`` keeps registration order: input layer first)."""
    names = [
        k[: -len(".weight")] for k in weights if k.startswith(prefix) and k.endswith(".weight")
    ]
    return [_Linear(weights[f"{n}.weight"], weights[f"{n}.bias"]) for n in names]


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

    def __init__(self, snapshot: GroupSnapshot) -> None:
        """Acting state from a snapshot: no torch module is read, none is written."""
        description, weights = snapshot.description, snapshot.weights
        spec = description["spec"]
        self.num_agents = description.get("num_agents", 1)
        self.per_agent = description.get("per_agent", False)
        self.agent_id = description.get("agent_id", False)
        obs_clip = description["obs_clip"]
        # Acting copies of the learner's statistics: the collector may update these (per
        # step collection) without touching the learner's.
        obs_stats, critic_stats = (
            snapshot.stats("obs_normalizer"),
            snapshot.stats("critic_normalizer"),
        )
        self.obs_normalizer = RunningMeanStd.of_stats(obs_stats, obs_clip) if obs_stats else None
        self.critic_normalizer = (
            RunningMeanStd.of_stats(critic_stats, obs_clip) if critic_stats else None
        )
        value = snapshot.stats("value_normalizer")
        # Value normalization: the critic's output in return units is raw * std + mean.
        self.value_scale = (
            (np.sqrt(value.var).astype(np.float32), value.mean.astype(np.float32))
            if value is not None
            else None
        )
        activation = description["policy"]["activation"]
        self.activation = tanh_array if activation == "tanh" else _relu
        self.actor = _layers(weights, "actor.")
        self.head = _Linear(weights["head.linear.weight"], weights["head.linear.bias"])
        self.critic = _layers(weights, "critic.")
        self.width = self.head.out  # head outputs per row: logits, or the Gaussian means
        if spec["action_kind"] == "box":
            self.kind = "gaussian"
            self.log_std = weights["head.log_std"].copy()
            self.std = np.exp(self.log_std)
            # log N(a; mu, std) = -z.z / 2 - (sum(log std) + k log sqrt(2 pi)), where z is
            # the standard normal draw that made a = mu + std z: the constant per agent.
            k = self.log_std.shape[-1]
            self.log_norm = self.log_std.sum(-1) + k * _LOG_SQRT_2PI
        elif spec["action_kind"] == "multidiscrete":
            self.kind = "multi"
            self.splits = np.cumsum(spec["nvec"])[:-1]
        else:
            self.kind = "categorical"

    @classmethod
    def of(cls, policy: Policy) -> Inference:
        """A snapshot of ``policy`` as it is now."""
        return cls(GroupSnapshot.of(policy))

    def _with_id(self, x: np.ndarray, agent: np.ndarray | None) -> np.ndarray:
        if not self.agent_id:
            return x
        assert agent is not None
        one_hot = np.zeros((len(x), self.num_agents), dtype=np.float32)
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
        if self.value_scale is None:
            return raw
        std, mean = self.value_scale
        return raw * std + mean


def _relu(x: np.ndarray) -> np.ndarray:
    return np.maximum(x, np.float32(0.0), out=x)
