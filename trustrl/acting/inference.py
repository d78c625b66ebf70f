"""The collector's inference path: a Policy's forward pass in numpy, on a weight snapshot.

Collection runs the networks on a handful of rows per env step (4 for the usual
CartPole setting), where torch spends far longer dispatching each op than computing it;
numpy's per-op cost is several times lower (docs/performance.md), so this is the one path
the collector acts with; the update keeps torch, for autograd.
``tests/test_inference.py`` checks that both give the same log-probabilities and values.
The arithmetic is the numpy twins': each policy part's (acting/parts.py) and the heads'
(acting/kernels.py), which the gradient code uses too.

``Inference(snapshot)`` is built from a policy snapshot (contract.py: numpy weights,
pre-transposed here for ``x @ W``, and normalizer statistics), never from the learner's
modules, so it is what a runner in another process holds between snapshots. It takes
observations already normalized by its own copy of the observation statistics
(``obs_normalizer``), frozen for a rollout unless the collector updates it per step.

Per env step only the actor runs (``act``); the log-probabilities and the critic run once
per rollout on what the steps stored (``log_prob``, ``value``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from trustrl.acting import kernels, parts
from trustrl.acting.memory import NumpyCell
from trustrl.contract import GroupSnapshot
from trustrl.normalize import MeanStd

if TYPE_CHECKING:
    from trustrl.learner.policy import Policy


class Inference:
    """Sampling, log-probabilities and values of a Policy, in numpy (float32).

    Acting is split so that an env step does only what choosing the action needs:

    * ``noise``, once per rollout: every step's random draws at once (Gumbel noise for
      discrete heads, the scaled normal draw for Gaussian ones);
    * ``act``, per step: the actor's outputs and the action, argmax(logits + Gumbel)
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
        self.obs_normalizer = MeanStd.of_stats(obs_stats, obs_clip) if obs_stats else None
        self.critic_normalizer = MeanStd.of_stats(critic_stats, obs_clip) if critic_stats else None
        value = snapshot.stats("value_normalizer")
        # Value normalization: the critic's output in return units is raw * std + mean.
        self.value_scale = (
            (np.sqrt(value.var).astype(np.float32), value.mean.astype(np.float32))
            if value is not None
            else None
        )
        # The parts' numpy twins (acting/parts.py): each side's encoder, then the head's
        # linear layer (the actor) or the value layer (the critic).
        settings = description["policy"]
        entries = spec.get("obs_entries", ())
        self.actor = parts.encoder_twin(entries, settings, weights, "actor.")
        self.head_linear = kernels.Dense(weights["head.linear.weight"], weights["head.linear.bias"])
        # A critic reading a global state (multi-agent) reads a flat vector.
        critic_entries = entries if description.get("critic_dim") is None else ()
        self.shared = bool(settings.get("share_encoder", False))
        self.critic = (
            self.actor  # the critic's value layer reads the actor's features
            if self.shared
            else parts.encoder_twin(critic_entries, settings, weights, "critic.0.")
        )
        self.value_linear = kernels.Dense(weights["critic.1.weight"], weights["critic.1.bias"])
        # The memory cores (policy.memory): the actor's, and the critic's own unless shared.
        memory = settings.get("memory", "none")

        def cell(prefix: str) -> NumpyCell:
            post = None
            if settings.get("post_memory_sizes"):  # the MLP twin: the same layers' pattern
                post = parts.NumpyMLP(settings, weights, f"{prefix}post.")
            return NumpyCell(memory, weights, f"{prefix}rnn.", post)

        self.actor_memory = cell("actor_memory.") if memory != "none" else None
        self.critic_memory = (
            cell("critic_memory.") if memory != "none" and not self.shared else None
        )
        self.state_size = sum(
            m.state_size for m in (self.actor_memory, self.critic_memory) if m is not None
        )
        log_std = weights.get("head.log_std")
        self.head = kernels.numpy_head(
            spec["action_kind"],
            spec.get("nvec", ()),
            log_std.copy() if log_std is not None else None,
        )
        self.width = self.head.width  # head outputs per row: logits, or the Gaussian means

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

    def _encode(self, x: np.ndarray, agent: np.ndarray | None) -> np.ndarray:
        """``Policy.encode``: the actor's encoder on its rows (with the agent's id where
        a shared actor reads it)."""
        return self.actor(x if self.per_agent else self._with_id(x, agent), agent)

    def _head_out(self, x: np.ndarray, agent: np.ndarray | None) -> np.ndarray:
        return self.head_linear(self._encode(x, agent), agent)

    def noise(self, rng: np.random.Generator, steps: int, agent: np.ndarray) -> np.ndarray:
        """(steps, rows, width) draws for a rollout of ``steps`` steps of the rows whose
        agents ``agent`` (rows,) gives: what ``act`` adds to the head outputs."""
        return self.head.noise(rng, steps, agent)

    def act(
        self,
        x: np.ndarray,
        mask: np.ndarray | None,
        noise: np.ndarray,
        agent: np.ndarray | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Normalized observations (rows, obs_dim) and one step's ``noise`` rows ->
        (actions, head outputs)."""
        out = self._head_out(x, agent)
        return self.head.act(out, mask, noise, agent), out

    def act_valued(
        self,
        x: np.ndarray,
        mask: np.ndarray | None,
        noise: np.ndarray,
        agent: np.ndarray | None = None,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``act`` and the rows' values from one pass of a shared encoder
        (``policy.share_encoder``): (actions, head outputs, values in return units)."""
        features = self._encode(x, agent)
        out = self.head_linear(features, agent)
        values = self._return_units(self.value_linear(features)[:, 0])
        return self.head.act(out, mask, noise, agent), out, values

    def act_recurrent(
        self,
        x: np.ndarray,
        mask: np.ndarray | None,
        noise: np.ndarray | None,
        state: np.ndarray,
        critic_x: np.ndarray | None = None,
        agent: np.ndarray | None = None,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """A recurrent policy's step (``policy.memory``) on normalized observations from
        the rows' states (rows, state_size): (actions, head outputs, values in return
        units, next states). ``noise`` None: the deterministic actions. ``critic_x`` and
        ``agent`` as ``value`` takes them (a multi-agent group's rows)."""
        actor_memory = self.actor_memory
        assert actor_memory is not None
        split = actor_memory.state_size
        features, next_state = actor_memory(self._encode(x, agent), state[:, :split], agent)
        out = self.head_linear(features, agent)
        if self.critic_memory is None:  # the value layer reads the actor's core
            raw = self.value_linear(features)[:, 0]
        else:
            critic_in = self._with_id(critic_x if critic_x is not None else x, agent)
            critic_features, critic_state = self.critic_memory(
                self.critic(critic_in), state[:, split:]
            )
            raw = self.value_linear(critic_features)[:, 0]
            next_state = np.concatenate([next_state, critic_state], 1)
        actions = self.head.act(out, mask, noise, agent)
        return actions, out, self._return_units(raw), next_state

    def value_recurrent(
        self,
        x: np.ndarray,
        state: np.ndarray,
        critic_x: np.ndarray | None = None,
        agent: np.ndarray | None = None,
    ) -> np.ndarray:
        """A recurrent critic's values of normalized observations seen from ``state``."""
        actor_memory = self.actor_memory
        assert actor_memory is not None
        split = actor_memory.state_size
        if self.critic_memory is None:
            features, _ = actor_memory(self._encode(x, agent), state[:, :split], agent)
        else:
            critic_in = self._with_id(critic_x if critic_x is not None else x, agent)
            features, _ = self.critic_memory(self.critic(critic_in), state[:, split:])
        return self._return_units(self.value_linear(features)[:, 0])

    def mode(
        self, x: np.ndarray, mask: np.ndarray | None, agent: np.ndarray | None = None
    ) -> np.ndarray:
        """The deterministic actions for normalized observations: ``act`` without noise
        (the argmax of the logits, per block for multi-discrete, or the Gaussian mean)."""
        return self.head.act(self._head_out(x, agent), mask, None, agent)

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
        head = self.head
        if isinstance(head, kernels.NumpyGaussian):
            return head.log_prob_of_noise(noise, agent)
        return head.log_prob(head.params(out, mask), actions)

    def log_prob_of(
        self,
        x: np.ndarray,
        actions: np.ndarray,
        mask: np.ndarray | None,
        agent: np.ndarray | None = None,
    ) -> np.ndarray:
        """Log-probabilities (B,) of ``actions`` chosen elsewhere on normalized
        observations ``x`` (B, obs_dim): for an agent that sampled with its own runtime
        and sent what it did (remote/thin.py). A Gaussian action is taken as sampled,
        before any clipping to the space's bounds."""
        params = self.head.params(self._head_out(x, agent), mask)
        return self.head.log_prob(params, actions, agent).astype(np.float32, copy=False)

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
        return self._return_units(self._raw_value(x, critic_x, agent))

    def _return_units(self, raw: np.ndarray) -> np.ndarray:
        if self.value_scale is None:
            return raw
        std, mean = self.value_scale
        return raw * std + mean

    def _raw_value(
        self, x: np.ndarray, critic_x: np.ndarray | None, agent: np.ndarray | None
    ) -> np.ndarray:
        """The critic's output (standardized with value normalization): ``value_raw``."""
        if self.shared:
            return self.value_linear(self._encode(x, agent))[:, 0]
        critic_in = self._with_id(critic_x if critic_x is not None else x, agent)
        return self.value_linear(self.critic(critic_in))[:, 0]
