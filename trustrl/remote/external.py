"""External agents, the learner's side: the spaces agents act in, the learner's settings,
and ``ExternalRunner``, the ``Runner`` (contract.py) whose rollouts are the chunks that
agents delivered. The learner is the ordinary ``Trainer`` over it: there is no second
trainer.

The remote side's other modules hold the rest of the path: ``wire.py`` the payloads
(chunks and snapshots, safetensors, checked field by field), ``inbox.py`` where chunks
arrive, are spooled and wait for the learner, ``serve.py`` the inbox as a Ray actor for
agents in other processes (``trustrl serve``). The agent itself is client/agent.py.

Packing. A chunk of L steps fills L valid rows of one column of the (T, N) rollout and
one more, invalid row holding the bootstrap value: the layout the collector uses for
the step after an episode end (rollout.py), so ``values[t + 1]`` is the next value for
every row and the GAE sweep is the one every run uses. The last step is flagged
terminated, or truncated (a time limit, or the chunk's cut), so credit never flows
across chunks.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from trustrl.acting.memory import chunk_layout, state_size
from trustrl.config import Config, ConfigError
from trustrl.contract import (
    CollectionStopped,
    EpisodeStats,
    GroupBatch,
    PolicySnapshot,
    RolloutBatch,
    Runner,
)
from trustrl.envs.rows import AgentGroup
from trustrl.envs.spaces import SpaceSpec
from trustrl.remote.wire import Chunk, encode_snapshot

# The spaces.


def external_groups(config: Config) -> list[AgentGroup]:
    """The agent groups external agents act in: from ``agent.observation_shape`` and the
    action fields when set (an application with no Gymnasium env), else from env_id's
    spaces (one env built and closed)."""
    agent = config.agent
    if agent.observation_shape is not None:
        return [AgentGroup("default", ("",), spec_of(config))]
    from trustrl.envs.gym import make_row_env

    probe = replace(config, env=replace(config.env, num_envs=1, backend="sync"))
    rows = make_row_env(probe)
    try:
        rows.reset(config.seed)  # masks are detected from the reset info
        groups = rows.groups
    finally:
        rows.close()
    for group in groups:
        if group.critic_dim is not None:
            raise ConfigError(
                f"external agents send their own observations only, but {config.env_id}'s "
                f"critic reads a global state (multiagent.critic_input = "
                f"{config.multiagent.critic_input!r}); set multiagent.critic_input = 'local'"
            )
    return groups


def spec_of(config: Config) -> SpaceSpec:
    """The SpaceSpec that ``agent.observation_shape`` and the action fields describe."""
    import gymnasium as gym

    agent = config.agent
    assert agent.observation_shape is not None
    observations = gym.spaces.Box(-np.inf, np.inf, agent.observation_shape, np.float32)
    if agent.action_kind == "discrete":
        actions: gym.Space = gym.spaces.Discrete(agent.action_choices[0])
    elif agent.action_kind == "multidiscrete":
        actions = gym.spaces.MultiDiscrete(list(agent.action_choices))
    else:
        high = np.asarray(agent.action_high, np.float32)
        low = np.broadcast_to(np.asarray(agent.action_low, np.float32), high.shape)
        actions = gym.spaces.Box(low, high, dtype=np.float32)
    return SpaceSpec.from_spaces(observations, actions)


def learner_config(config: Config) -> tuple[Config, list[str]]:
    """``config`` as an external agents' learner runs it, and notes on what changed: with
    spaces given in ``[agent]`` there is no env to evaluate on."""
    if config.agent.observation_shape is None or config.eval_episodes == 0:
        return config, []
    note = (
        f"no evaluation (eval_episodes {config.eval_episodes} -> 0): the spaces come from "
        "[agent], with no env to evaluate on"
    )
    return replace(config, eval_episodes=0, eval_every=0), [note]


def memory_info(config: Config) -> dict[str, int] | None:
    """A recurrent policy's chunk contract (None without memory): the columns of a state
    and the learner's ``rollout.sequence_length``; a chunk carries the state it started
    from and the state at every ``sequence_length`` steps after (wire.Chunk.states)."""
    policy = config.policy
    if policy.memory == "none":
        return None
    cores = 1 if policy.share_encoder else 2
    return {
        "state_size": cores * state_size(policy.memory, policy.memory_size),
        "sequence_length": config.rollout.sequence_length,
    }


def learner_info(config: Config, groups: Sequence[AgentGroup]) -> dict[str, Any]:
    """What an agent needs from the learner besides weights (JSON-able)."""
    return {
        "groups": [
            {"name": g.name, "agents": list(g.agents), "spec": g.spec.to_json()} for g in groups
        ],
        "gamma": config.rollout.gamma,
        "normalize_reward": config.env.normalize_reward,
        "reward_clip": config.env.reward_clip,
        "max_chunk_length": config.agent.max_chunk_length,
        "queue_size": config.agent.queue_size,
        "memory": memory_info(config),
        "env_id": config.env_id,
    }


# The learner's runner.


class ExternalRunner(Runner):
    """A ``Runner`` whose rollouts are the chunks external agents delivered.

    ``collect(snapshot)`` publishes the snapshot, then takes chunks until every group has
    a batch's worth of rows (``env.num_envs x rollout.num_steps`` per agent of the
    group); chunks from a version more than ``runners.max_version_lag`` away from the learner's
    are dropped and counted. ``inbox`` is an ``Inbox`` or anything with its learner-side
    methods (``take``, ``publish``, ``release``), such as the Ray actor's client.
    """

    def __init__(self, config: Config, groups: Sequence[AgentGroup], inbox: Any) -> None:
        self.config = config
        self.groups = list(groups)
        self.inbox = inbox
        self.stop_event = threading.Event()
        self.consumed = -1  # the highest inbox seq taken into a batch (or dropped)
        self.dropped = 0
        self.published = -1
        self.idle_seconds = 0.0
        self.metrics_since = time.monotonic()
        self.last_lags: list[int] = []
        self.rows_per_group = [
            config.num_envs * config.rollout.num_steps * g.num_agents for g in self.groups
        ]
        memory = memory_info(config)
        self.sequence_length = memory["sequence_length"] if memory else 0

    def publish(self, snapshot: PolicySnapshot) -> None:
        if snapshot.version != self.published:
            self.inbox.publish(snapshot.version, encode_snapshot(snapshot))
            self.published = snapshot.version

    def stop(self) -> None:
        """Make a ``collect`` that waits for chunks raise ``CollectionStopped``."""
        self.stop_event.set()

    def collect(self, snapshot: PolicySnapshot, train: bool = True) -> RolloutBatch:
        start = time.perf_counter()
        self.publish(snapshot)
        chunks: list[list[Chunk]] = [[] for _ in self.groups]
        rows = [0] * len(self.groups)
        lag_bound = self.config.runners.max_version_lag
        consumed = self.consumed  # recorded when the batch is complete: a stop before
        # that leaves the chunks taken so far to the spool, for the resumed learner
        while True:
            missing = [need - r for r, need in zip(rows, self.rows_per_group, strict=True)]
            if all(m <= 0 for m in missing):
                break
            if self.stop_event.is_set():
                raise CollectionStopped
            waited = time.perf_counter()
            taken = self.inbox.take(0.25, missing, snapshot.version, lag_bound)
            self.idle_seconds += time.perf_counter() - waited
            consumed = max(consumed, taken["last"])
            self.dropped += taken["drained"]
            for where, chunk in taken["chunks"]:
                chunks[where].append(chunk)
                rows[where] += len(chunk)
        self.consumed = consumed
        episodes = EpisodeStats()
        lags = []
        for group_chunks in chunks:
            for chunk in group_chunks:
                lags += [abs(snapshot.version - chunk.version)] * len(chunk)
                if chunk.episode_return is not None:
                    episodes.returns.append(chunk.episode_return)
                    episodes.lengths.append(int(chunk.episode_length or 0))
                    episodes.agents.append(chunk.agent)
        self.last_lags = lags
        groups = tuple(
            pack(group, group_chunks, self.config.rollout.num_steps, self.sequence_length)
            for group, group_chunks in zip(self.groups, chunks, strict=True)
        )
        agents = sum(g.num_agents for g in self.groups)
        # The batch's version is the learner's: every chunk is within the lag bound of it
        # (absorb checks a batch against one version; the rows' own lags are reported).
        return RolloutBatch(
            groups,
            episodes,
            snapshot.version,
            "agents",
            sum(rows) // agents,
            time.perf_counter() - start,
        )

    def checkpointed(self, state: dict[str, Any]) -> None:
        """A checkpoint holding ``state`` (this runner's ``state_dict``) is on disk: the
        chunks it covers may go."""
        self.inbox.release(state["consumed"])

    def metrics(self) -> dict[str, float]:
        now = time.monotonic()
        elapsed = max(now - self.metrics_since, 1e-9)
        lags = self.last_lags or [0]
        metrics = {
            "dropped_rollouts": float(self.dropped),
            "runner_idle": min(1.0, self.idle_seconds / elapsed),
            "version_lag_mean": float(np.mean(lags)),
            "version_lag_max": float(np.max(lags)),
        }
        self.idle_seconds, self.metrics_since = 0.0, now
        return metrics

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"consumed": self.consumed, "dropped": self.dropped}
        # Served through a gateway (its Published inbox): the thin agents' reward
        # statistics, which only the learner keeps.
        streams = getattr(self.inbox, "streams_state", None)
        if streams is not None:
            state["streams"] = streams()
        return state

    def load_state_dict(self, state: dict[str, Any], env_state: Any = None) -> None:
        self.consumed, self.dropped = int(state["consumed"]), int(state["dropped"])
        self.inbox.release(self.consumed)  # what the checkpoint already trained on
        load = getattr(self.inbox, "load_streams", None)
        if load is not None and state.get("streams"):
            load(state["streams"])

    def close(self) -> None:
        self.inbox.finish()


def pack(
    group: AgentGroup, chunks: Sequence[Chunk], num_steps: int, sequence_length: int = 0
) -> GroupBatch:
    """A group's chunks as (T, N) rollout arrays (module docstring): N = agents x column
    sets; agent j's chunks fill columns j, j + agents, ... (rows are (env, agent) pairs,
    agent fastest), each chunk followed by its bootstrap row, the longest chunks first into
    the shortest column, so that T stays near ``num_steps``.

    A recurrent policy's chunks (``sequence_length``) each start a sequence: the batch
    flags their first rows as starts, and the sequence chunks (acting/memory.py's
    ``chunk_layout``) start from the states the agent sent, every ``sequence_length``
    steps of its chunk; a sequence of bootstrap or padding rows alone trains nothing and
    starts from zeros."""
    spec, agents = group.spec, group.num_agents
    by_agent: list[list[Chunk]] = [[] for _ in range(agents)]
    for chunk in chunks:
        by_agent[group.agents.index(chunk.agent)].append(chunk)
    sets = max(1, max(-(-sum(len(c) + 1 for c in mine) // num_steps) for mine in by_agent))
    columns: list[list[Chunk]] = [[] for _ in range(agents * sets)]
    heights = [0] * len(columns)
    for j, mine in enumerate(by_agent):
        for chunk in sorted(mine, key=len, reverse=True):
            shortest = min(range(j, len(columns), agents), key=lambda c: heights[c])
            columns[shortest].append(chunk)
            heights[shortest] += len(chunk) + 1
    steps, width = max([*heights, 1]), len(columns)
    obs = np.zeros((steps, width, spec.obs_dim), spec.obs_dtype)  # uint8 rows: frames
    actions = np.zeros((steps, width, *spec.action_shape), spec.action_dtype)
    logprob = np.zeros((steps, width), np.float32)
    values = np.zeros((steps, width), np.float32)
    rewards = np.zeros((steps, width), np.float32)
    terminated = np.zeros((steps, width), bool)
    truncated = np.ones((steps, width), bool)  # padding and bootstrap rows carry nothing
    valid = np.zeros((steps, width), bool)
    mask = np.ones((steps, width, spec.mask_dim), bool) if spec.mask_dim is not None else None
    recurrent = sequence_length > 0
    starts = np.zeros((steps, width), bool) if recurrent else None
    sent: dict[tuple[int, int], np.ndarray] = {}  # (row, first step): a state the agent sent
    for c, column_chunks in enumerate(columns):
        t = 0
        for chunk in column_chunks:
            n = len(chunk)
            rows = slice(t, t + n)
            obs[rows, c] = chunk.obs
            actions[rows, c] = chunk.actions
            logprob[rows, c] = chunk.logprob
            values[t : t + n + 1, c] = chunk.values  # the bootstrap lands on the extra row
            rewards[rows, c] = chunk.rewards
            valid[rows, c] = True
            truncated[rows, c] = False
            if chunk.ending == "terminated":
                terminated[t + n - 1, c] = True
            else:
                truncated[t + n - 1, c] = True
            if mask is not None and chunk.action_mask is not None:
                mask[rows, c] = chunk.action_mask
            if starts is not None:
                assert chunk.states is not None  # decode_chunk requires them
                starts[t, c] = True
                for k, state in enumerate(chunk.states):
                    sent[(c, t + k * sequence_length)] = state
            t += n + 1
    delta = None
    deltas = [c.obs_delta for c in chunks if c.obs_delta is not None]
    if deltas:
        delta = deltas[0]
        for other in deltas[1:]:
            delta = delta.merge(other)
    states = None
    if starts is not None:
        size = max((len(s) for s in sent.values()), default=0)
        chunk_rows, firsts, _ = chunk_layout(starts, sequence_length)
        states = np.zeros((len(chunk_rows), size), np.float32)
        for i, key in enumerate(zip(chunk_rows.tolist(), firsts.tolist(), strict=True)):
            if key in sent:
                states[i] = sent[key]
    return GroupBatch(
        obs=obs,
        critic_obs=None,
        actions=actions,
        logprob=logprob,
        values=values,
        rewards=rewards,
        terminated=terminated,
        truncated=truncated,
        valid=valid,
        action_mask=mask,
        last_value=np.zeros(width, np.float32),  # the last row is a bootstrap or padding row
        obs_delta=delta,
        critic_delta=None,
        starts=starts,
        states=states,
    )


def queue_capacity(config: Config, groups: Sequence[AgentGroup]) -> int:
    """The steps an inbox queues before it asks agents to slow down (Inbox's
    ``capacity``): ``runners.max_version_lag + 1`` batches. A chunk queued behind more
    would reach the learner more than ``max_version_lag`` updates after it arrived, and be
    drained unread."""
    batch = sum(config.num_envs * config.rollout.num_steps * g.num_agents for g in groups)
    return (config.runners.max_version_lag + 1) * batch


def max_chunk(config: Config) -> int:
    """The longest chunk a learner accepts: agents may choose their own chunk length,
    within reason (a batch's rows, or 100,000 steps)."""
    return max(config.agent.max_chunk_length, config.batch_size, 100_000)
