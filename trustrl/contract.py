"""The runner contract: what goes to a collector and what comes back.

::

    learner                                        runner (in-process, Ray actor, agent)
      PolicySnapshot(version, groups)      ───>      acts with it, statistics frozen
      merge deltas; update; version += 1   <───      RolloutBatch(groups, episodes,
                                                                  version, runner)

The learner alone owns state: weights, optimizer, normalizer statistics. A snapshot is
plain data (numpy arrays, a JSON-able description, an integer), so it can be held by a
runner in another process or on another machine; a batch is plain data too, so the
learner never runs anything a runner sent. The in-process trainer goes through exactly
this seam (trainer.py), so there is one training path wherever the collector runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from trustrl.normalize import RunningStats

if TYPE_CHECKING:
    from trustrl.envs.rows import AgentGroup
    from trustrl.learner.policy import Policy


@dataclass(frozen=True)
class GroupSnapshot:
    """One agent group's policy: ``Policy.describe()`` and its ``state_dict`` as numpy
    arrays (copies), normalizer statistics included (``obs_normalizer.mean`` etc.)."""

    description: dict[str, Any]
    weights: dict[str, np.ndarray]

    @classmethod
    def of(cls, policy: Policy) -> GroupSnapshot:
        weights = {k: v.detach().numpy().copy() for k, v in policy.state_dict().items()}
        return cls(policy.describe(), weights)

    def stats(self, name: str) -> RunningStats | None:
        """The statistics of normalizer ``name`` (``obs_normalizer``, ``critic_normalizer``,
        ``value_normalizer``), or None where the policy has none."""
        if f"{name}.mean" not in self.weights:
            return None
        count = float(self.weights[f"{name}.count"])
        return RunningStats(
            count, self.weights[f"{name}.mean"], self.weights[f"{name}.var"] * count
        )


@dataclass(frozen=True)
class PolicySnapshot:
    """Every agent group's policy at one ``version`` (the learner's update count)."""

    version: int
    groups: tuple[GroupSnapshot, ...]

    @classmethod
    def of(cls, policies: Sequence[Policy], version: int) -> PolicySnapshot:
        return cls(version, tuple(GroupSnapshot.of(p) for p in policies))


@dataclass
class EpisodeStats:
    """Episodes that finished during one collect call, in raw (unscaled) reward.

    One entry per finished (env, agent) episode; ``agents`` names the agent ("" for
    single-agent envs).
    """

    returns: list[float] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)
    agents: list[str] = field(default_factory=list)
    dropped: int = 0
    """Episodes dropped for a non-finite value (env.nonfinite = "drop"), not reported."""

    def extend(self, other: EpisodeStats) -> None:
        self.returns += other.returns
        self.lengths += other.lengths
        self.agents += other.agents
        self.dropped += other.dropped


# The (T, rows, ...) arrays of a group's batch, by name; rows = envs x agents of the group.
ROW_ARRAYS = (
    *("obs", "critic_obs", "actions", "logprob", "values", "rewards"),
    *("terminated", "truncated", "valid", "action_mask", "starts"),
)


@dataclass(frozen=True)
class GroupBatch:
    """One agent group's rollout, as numpy arrays."""

    obs: np.ndarray  # (T, R, obs_dim) float32, normalized as acted on
    critic_obs: np.ndarray | None  # (T, R, critic_dim) float32, or None: the critic reads obs
    actions: np.ndarray  # (T, R, *act)
    logprob: np.ndarray  # (T, R) float32, the behaviour policy's, frozen at collection
    values: np.ndarray  # (T, R) float32
    rewards: np.ndarray  # (T, R) float32, after the runner's reward scaling
    terminated: np.ndarray  # (T, R) bool
    truncated: np.ndarray  # (T, R) bool
    valid: np.ndarray  # (T, R) bool: False on reset rows and finished agents' rows
    action_mask: np.ndarray | None  # (T, R, A) bool, only for masked discrete policies
    last_value: np.ndarray  # (R,) float32, V of the observation after the last step
    obs_delta: RunningStats | None  # the raw observations seen (None: not normalized)
    critic_delta: RunningStats | None  # the raw critic inputs seen
    # Recurrent policies (policy.memory) only: (T, R) bool, the steps that start an episode
    # (the state is reset before them), and (C, state_size) float32, the state each
    # sequence chunk starts from, in acting/memory.py's ``chunk_layout`` order.
    starts: np.ndarray | None = None
    states: np.ndarray | None = None


@dataclass(frozen=True)
class RolloutBatch:
    """What a runner sends back: every group's rows, the episodes that ended, the policy
    version that acted and who collected it."""

    groups: tuple[GroupBatch, ...]
    episodes: EpisodeStats
    version: int
    runner: str
    env_steps: int  # env steps taken (steps x envs), what the learner counts
    seconds: float = 0.0  # the runner's wall time collecting it


def join(batches: Sequence[RolloutBatch], mixed: bool = False) -> RolloutBatch:
    """Several runners' batches of one version as one: rows side by side (runner by
    runner, so each runner's (env, agent) rows keep their agent order), statistics
    merged, episodes in runner order. With ``mixed`` (asynchronous collection) the
    versions may differ; the joined batch carries the oldest."""
    if len(batches) == 1:
        return batches[0]
    versions = {b.version for b in batches}
    if len(versions) != 1 and not mixed:
        raise ValueError(f"cannot join batches of different policy versions {sorted(versions)}")
    episodes = EpisodeStats()
    for b in batches:
        episodes.extend(b.episodes)
    groups = []
    for parts in zip(*(b.groups for b in batches), strict=True):
        joined: dict[str, Any] = {}
        for name in ROW_ARRAYS:
            arrays = [getattr(p, name) for p in parts]
            joined[name] = None if arrays[0] is None else np.concatenate(arrays, axis=1)
        joined["last_value"] = np.concatenate([p.last_value for p in parts])
        # Chunks come row by row: the joined rows' chunks are each part's, in turn.
        states = [p.states for p in parts]
        joined["states"] = None if states[0] is None else np.concatenate(states)
        for name in ("obs_delta", "critic_delta"):
            deltas = [getattr(p, name) for p in parts]
            merged = deltas[0]
            for delta in deltas[1:]:
                merged = merged.merge(delta) if merged is not None and delta else merged
            joined[name] = merged
        groups.append(replace(parts[0], **joined))
    return RolloutBatch(
        tuple(groups),
        episodes,
        min(versions),
        "+".join(b.runner for b in batches),
        sum(b.env_steps for b in batches),
        max(b.seconds for b in batches),
    )


class CollectionStopped(Exception):
    """A runner was asked to stop (``Runner.stop``) while it waited for rollouts."""


class Runner(Protocol):
    """Where a collector runs: in this process (``acting.collector.Collector``), in Ray
    actors (``remote.runners.RayRunners``), or in external agents
    (``remote.external.ExternalRunner``).

    An implementation subclasses this and writes ``collect``, ``state_dict`` and
    ``load_state_dict``, and sets ``groups``; the rest have defaults for a runner with
    nothing to report, capture, reset, stop or release. (The defaults return None
    explicitly: mypy takes a protocol method whose body is only a docstring as abstract.)
    """

    groups: list[AgentGroup]

    def collect(self, snapshot: PolicySnapshot, train: bool = True) -> RolloutBatch: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any], env_state: Any = None) -> None: ...

    def capture(self) -> Any:
        """The environments' state for an exact resume, or None: not captured (the envs
        run elsewhere), and a resumed run starts fresh episodes (``reset``)."""
        return None

    def reset(self, seed: int) -> None:
        """Start fresh episodes in every env (nothing to do where the episodes run in
        external agents)."""
        return None

    def metrics(self) -> dict[str, float]:
        """What the runner reports per iteration beside the rollout (restarts, drops)."""
        return {}

    def checkpointed(self, state: dict[str, Any]) -> None:
        """A checkpoint holding ``state`` (from ``state_dict``) is on disk: what it covers
        may be let go of."""
        return None

    def stop(self) -> None:
        """Asked from a signal handler: a ``collect`` waiting on something outside the
        learner (external agents) gives up with ``CollectionStopped``; a rollout that ends
        by itself has nothing to do."""
        return None

    def close(self) -> None:
        """Release the envs, actors or connections the runner holds."""
        return None
