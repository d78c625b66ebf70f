"""External agents, the learner's side: chunks of trajectories in, policy versions out.

An application that owns its loop acts through ``trustrl.Agent`` (agent.py) with a
local copy of the policy and ships what it did as *chunks*: up to
``agent.max_chunk_length`` steps of one episode, acted on by one policy version, with
the value to bootstrap from where the chunk stops short of a terminal state. The
learner is the ordinary ``Trainer`` over an ``ExternalRunner``, a ``Runner``
(contract.py) whose rollouts are the chunks that arrived: there is no second trainer.

::

    agent (any process)            Inbox (Ray actor or in-process)        learner
      act(obs, reward) ...  ─chunk─>  checked, spooled, queued  ──take──>  ExternalRunner
      new snapshot      <──latest───  newest snapshot         <─publish──  .collect(snapshot)

Chunks and snapshots travel as safetensors bytes: arrays and string metadata, parsed
without pickle, checked field by field against the spaces before anything is queued.
Ray's own transport is pickle-based and trusts whoever holds the cluster's token; the
learner's API takes nothing from an agent but these bytes. The inbox parses each chunk
once and hands the learner the parsed chunks (between the learner's own processes).

Nothing is lost while the learner is away. The inbox writes each accepted chunk to the
run folder's ``inbox/`` before it acknowledges it, and deletes it only once a checkpoint
covers the update that used it; a learner resumed from its checkpoint finds every chunk
it had not yet checkpointed there, and trains on it. Agents keep what was not
acknowledged and send it again.

Packing. A chunk of L steps fills L valid rows of one column of the (T, N) rollout and
one more, invalid row holding the bootstrap value: the layout the collector uses for
the step after an episode end (rollout.py), so ``values[t + 1]`` is the next value for
every row and the GAE sweep is the one every run uses. The last step is flagged
terminated, or truncated (a time limit, or the chunk's cut), so credit never flows
across chunks.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from trustrl.config import Config, ConfigError
from trustrl.contract import (
    CollectionStopped,
    EpisodeStats,
    GroupBatch,
    GroupSnapshot,
    PolicySnapshot,
    RolloutBatch,
)
from trustrl.envs.rows import AgentGroup
from trustrl.envs.spaces import SpaceSpec
from trustrl.normalize import RunningStats

CHUNK_FORMAT = "trustrl-chunk/1"
SNAPSHOT_FORMAT = "trustrl-snapshot/1"
ENDINGS = ("terminated", "truncated", "cut")
"""How a chunk ends: its episode terminated (no bootstrap), hit a time limit, or goes on
in the next chunk (both bootstrapped from the chunk's last value)."""
MAX_CHUNK_BYTES = 64 * 1024 * 1024


class ChunkError(ValueError):
    """A chunk that does not fit the learner's spaces; the message says what and where."""


class LinkError(ConnectionError):
    """An agent could not reach its learner (it queues and retries)."""


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
        "env_id": config.env_id,
    }


# The wire format.


def encode_snapshot(snapshot: PolicySnapshot) -> bytes:
    from safetensors.numpy import save

    tensors = {
        f"{index}/{key}": np.ascontiguousarray(value)
        for index, group in enumerate(snapshot.groups)
        for key, value in group.weights.items()
    }
    metadata = {
        "format": SNAPSHOT_FORMAT,
        "version": str(snapshot.version),
        "descriptions": json.dumps([group.description for group in snapshot.groups]),
        # safetensors sorts its keys (the layers are read in the module's order) and
        # stores some 0-d arrays as (1,): the names and shapes as they were.
        "keys": json.dumps(
            [[[k, list(v.shape)] for k, v in group.weights.items()] for group in snapshot.groups]
        ),
    }
    return save(tensors, metadata)


def decode_snapshot(data: bytes) -> PolicySnapshot:
    """A snapshot from the learner's bytes (safetensors: no code runs)."""
    metadata, tensors = _parse(data, SNAPSHOT_FORMAT)
    descriptions = json.loads(metadata["descriptions"])
    keys = json.loads(metadata["keys"])
    groups = []
    for index, (description, names) in enumerate(zip(descriptions, keys, strict=True)):
        weights = {name: tensors[f"{index}/{name}"].reshape(shape) for name, shape in names}
        groups.append(GroupSnapshot(description, weights))
    return PolicySnapshot(int(metadata["version"]), tuple(groups))


@dataclass(frozen=True)
class Chunk:
    """Up to ``max_chunk_length`` steps of one agent's episode, one policy version."""

    agent: str  # the agent's id in its group ("" for single-agent spaces)
    source: str  # which Agent object sent it (a random id) and ...
    seq: int  # ... its number there: (source, seq) identifies the chunk
    version: int  # the policy version that acted
    ending: str  # one of ENDINGS
    obs: np.ndarray  # (L, obs_dim) float32, normalized as acted on
    actions: np.ndarray  # (L, *action_shape)
    logprob: np.ndarray  # (L,) float32, the behaviour policy's
    values: np.ndarray  # (L + 1,) float32: the last is the bootstrap (0 when terminated)
    rewards: np.ndarray  # (L,) float32, after the agent's reward scaling
    action_mask: np.ndarray | None  # (L, A) bool
    obs_delta: RunningStats | None  # the raw observations seen
    episode_return: float | None  # raw return of the episode this chunk ended, if it did
    episode_length: int | None

    def __len__(self) -> int:
        return len(self.logprob)


def encode_chunk(chunk: Chunk) -> bytes:
    from safetensors.numpy import save

    tensors: dict[str, np.ndarray] = {
        "obs": chunk.obs,
        "actions": chunk.actions,
        "logprob": chunk.logprob,
        "values": chunk.values,
        "rewards": chunk.rewards,
    }
    if chunk.action_mask is not None:
        tensors["action_mask"] = chunk.action_mask
    metadata = {
        "format": CHUNK_FORMAT,
        "agent": chunk.agent,
        "source": chunk.source,
        "seq": str(chunk.seq),
        "version": str(chunk.version),
        "ending": chunk.ending,
    }
    if chunk.obs_delta is not None:
        tensors["obs_mean"] = chunk.obs_delta.mean
        tensors["obs_m2"] = chunk.obs_delta.m2
        metadata["obs_count"] = repr(chunk.obs_delta.count)
    if chunk.episode_return is not None:
        metadata["episode_return"] = repr(chunk.episode_return)
        metadata["episode_length"] = str(chunk.episode_length)
    return save({k: np.ascontiguousarray(v) for k, v in tensors.items()}, metadata)


def _parse(data: Any, expected_format: str) -> tuple[dict[str, str], dict[str, np.ndarray]]:
    from safetensors import SafetensorError
    from safetensors.numpy import load

    if not isinstance(data, bytes):
        raise ChunkError(f"expected safetensors bytes, got {type(data).__name__}")
    if len(data) > MAX_CHUNK_BYTES:
        raise ChunkError(f"{len(data):,} bytes is over the limit of {MAX_CHUNK_BYTES:,}")
    try:
        tensors = load(data)
        header_size = int.from_bytes(data[:8], "little")
        header = json.loads(data[8 : 8 + header_size])
    except (SafetensorError, ValueError, json.JSONDecodeError) as exc:
        raise ChunkError(f"not a safetensors payload ({exc})") from None
    metadata = header.get("__metadata__") or {}
    if metadata.get("format") != expected_format:
        raise ChunkError(
            f"format {metadata.get('format')!r}, expected {expected_format!r} (an agent of "
            "another trustrl version?)"
        )
    return metadata, tensors


def decode_chunk(
    data: Any, groups: Sequence[AgentGroup], max_length: int = 1_000_000
) -> tuple[int, Chunk]:
    """(group index, chunk) from an agent's bytes, checked against the groups' spaces:
    field names, dtypes, shapes, lengths, finiteness, action ranges. A ChunkError says
    which field was wrong and how."""
    metadata, tensors = _parse(data, CHUNK_FORMAT)
    agent = metadata.get("agent", "")
    where = next((i for i, g in enumerate(groups) if agent in g.agents), None)
    if where is None:
        names = [a for g in groups for a in g.agents]
        raise ChunkError(f"agent {agent!r} is not one of the learner's agents {names}")
    spec = groups[where].spec
    try:
        seq, version = int(metadata["seq"]), int(metadata["version"])
        ending, source = metadata["ending"], metadata["source"]
        count = float(metadata["obs_count"]) if "obs_count" in metadata else None
        episode_return = float(metadata["episode_return"]) if "episode_return" in metadata else None
        episode_length = int(metadata["episode_length"]) if "episode_length" in metadata else None
    except (KeyError, ValueError) as exc:
        raise ChunkError(f"metadata {sorted(metadata)}: missing or malformed ({exc})") from None
    if ending not in ENDINGS:
        raise ChunkError(f"ending {ending!r}; allowed: {', '.join(ENDINGS)}")
    if version < 0 or seq < 0:
        raise ChunkError(f"version {version} and seq {seq} must be >= 0")
    allowed = {"obs", "actions", "logprob", "values", "rewards", "action_mask"}
    allowed |= {"obs_mean", "obs_m2"}
    unknown = sorted(set(tensors) - allowed)
    if unknown:
        raise ChunkError(f"unknown arrays {unknown}; allowed: {sorted(allowed)}")
    length = len(tensors["logprob"]) if "logprob" in tensors else 0
    if not 1 <= length <= max_length:
        raise ChunkError(f"a chunk holds 1 to {max_length:,} steps, got {length}")
    expected: dict[str, tuple[tuple[int, ...], Any]] = {
        "obs": ((length, spec.obs_dim), np.float32),
        "actions": ((length, *spec.action_shape), spec.action_dtype),
        "logprob": ((length,), np.float32),
        "values": ((length + 1,), np.float32),
        "rewards": ((length,), np.float32),
    }
    if spec.mask_dim is not None and "action_mask" in tensors:
        expected["action_mask"] = ((length, spec.mask_dim), np.bool_)
    elif "action_mask" in tensors:
        raise ChunkError("action_mask sent for a policy without action masks")
    if count is not None:
        expected["obs_mean"] = ((spec.obs_dim,), np.float64)
        expected["obs_m2"] = ((spec.obs_dim,), np.float64)
    for name, (shape, dtype) in expected.items():
        if name not in tensors:
            raise ChunkError(f"array {name!r} is missing")
        array = tensors[name]
        if array.shape != shape or array.dtype != dtype:
            raise ChunkError(
                f"array {name!r} is {array.dtype}{list(array.shape)}, expected "
                f"{np.dtype(dtype)}{list(shape)}"
            )
        if array.dtype.kind == "f" and not np.isfinite(array).all():
            raise ChunkError(f"array {name!r} holds NaN or infinite values")
    actions = tensors["actions"]
    if spec.action_kind != "box":
        high = np.asarray(spec.nvec)
        if ((actions < 0) | (actions >= high)).any():
            raise ChunkError(f"actions outside 0..{[n - 1 for n in spec.nvec]}")
    delta = None
    if count is not None:
        if not (count == length and math.isfinite(count)):
            raise ChunkError(f"obs_count {count} must equal the chunk's {length} steps")
        if (tensors["obs_m2"] < 0).any():
            raise ChunkError("obs_m2 must be >= 0")
        delta = RunningStats(count, tensors["obs_mean"], tensors["obs_m2"])
    chunk = Chunk(
        agent,
        source,
        seq,
        version,
        ending,
        tensors["obs"],
        actions,
        tensors["logprob"],
        tensors["values"],
        tensors["rewards"],
        tensors.get("action_mask"),
        delta,
        episode_return if ending != "cut" else None,
        episode_length if ending != "cut" else None,
    )
    return where, chunk


# The inbox: where agents deliver and the learner takes.


class Inbox:
    """Accepted chunks, in arrival order, and the newest snapshot; thread-safe.

    It lives in the learner's process (``Agent.local``) or in a named Ray actor
    (``trustrl serve``, distributed/serve.py) that agents in any process reach by name.
    With a ``spool`` folder every accepted chunk is written there (atomically) before it
    is acknowledged; ``release(seq)`` deletes those a checkpoint covers, and a new inbox
    over the same folder (a resumed learner) queues what is left.
    """

    def __init__(
        self,
        groups: Sequence[AgentGroup],
        info: dict[str, Any],
        spool: str | Path | None = None,
        max_length: int = 1_000_000,
    ) -> None:
        self.groups = list(groups)
        self._info = info
        self.max_length = max_length
        self.spool = Path(spool) if spool is not None else None
        self.condition = threading.Condition()
        # (inbox seq, group, chunk), in arrival order: parsed and checked once, here
        self.queue: deque[tuple[int, int, Chunk]] = deque()
        self.seen: set[tuple[str, int]] = set()  # (source, seq) of chunks accepted
        self.next_seq = 0
        self.snapshot: tuple[int, bytes] | None = None
        self.finished = False
        self.received = self.rejected = self.duplicates = 0
        self.taken_upto = 0  # chunks received when the learner last waited for more
        self.last_error = ""
        if self.spool is not None and self.spool.is_dir():
            for path in sorted(self.spool.glob("*.chunk")):
                data = path.read_bytes()
                seq = int(path.stem)
                try:
                    where, chunk = decode_chunk(data, self.groups, max_length)
                except ChunkError:
                    continue  # written by this inbox, so checked; a damaged file is skipped
                self.queue.append((seq, where, chunk))
                self.seen.add((chunk.source, chunk.seq))
                self.next_seq = max(self.next_seq, seq + 1)

    # The agents' side.

    def info(self) -> dict[str, Any]:
        return self._info

    def submit(self, data: bytes) -> dict[str, Any]:
        """Deliver one chunk. The reply: ``ok`` (accepted, or already had), ``retry`` (not
        taken now: the learner has not published a policy yet; send it again later),
        or ``error`` (refused for good, with why)."""
        with self.condition:
            if self.snapshot is None:
                return {"ok": False, "retry": True}
        try:
            where, chunk = decode_chunk(data, self.groups, self.max_length)
        except ChunkError as exc:
            with self.condition:
                self.rejected += 1
                self.last_error = str(exc)
            return {"ok": False, "error": str(exc)}
        with self.condition:
            key = (chunk.source, chunk.seq)
            if key in self.seen:  # sent again after a lost acknowledgement
                self.duplicates += 1
                return {"ok": True}
            seq = self.next_seq
            self.next_seq += 1
            if self.spool is not None:
                _write_spool(self.spool, seq, data)
            self.seen.add(key)
            self.queue.append((seq, where, chunk))
            self.received += 1
            self.condition.notify_all()
            return {"ok": True}

    def submit_many(self, chunks: list[bytes]) -> list[dict[str, Any]]:
        """``submit`` for each, in order."""
        return [self.submit(data) for data in chunks]

    def latest(self, have: int) -> dict[str, Any]:
        """The newest version, its snapshot's bytes if it is newer than version ``have``
        (else None), and whether the run has finished."""
        with self.condition:
            version, data = self.snapshot if self.snapshot is not None else (-1, None)
            return {
                "version": version,
                "data": data if version > have else None,
                "finished": self.finished,
            }

    def status(self) -> dict[str, Any]:
        with self.condition:
            return {
                "version": self.snapshot[0] if self.snapshot else -1,
                "finished": self.finished,
                "queued": len(self.queue),
                "received": self.received,
                "rejected": self.rejected,
                "duplicates": self.duplicates,
                "last_error": self.last_error,
            }

    # The learner's side.

    def publish(self, version: int, data: bytes) -> None:
        with self.condition:
            self.snapshot = (version, data)
            self.condition.notify_all()

    def take(
        self, timeout: float, needs: Sequence[int], version: int, max_lag: int
    ) -> dict[str, Any]:
        """The oldest chunks, in order, until every group ``g`` has ``needs[g]`` more
        steps (or the queue is empty), waiting up to ``timeout`` seconds for one to
        arrive; the rest stay queued for the next batch. Chunks of a version more than
        ``max_lag`` from the learner's ``version`` are drained on the way, not sent (a
        backlog costs no transfer). Returns ``chunks`` ((group, chunk) each), ``drained``
        (how many were) and ``last`` (the highest seq taken or drained, -1 for none)."""
        with self.condition:
            if not self.queue:
                self.taken_upto = self.received  # everything delivered is in hand
                self.condition.notify_all()
                self.condition.wait(timeout)
            needs = list(needs)
            taken, drained, last = [], 0, -1
            while self.queue and any(n > 0 for n in needs):
                seq, where, chunk = self.queue.popleft()
                last = max(last, seq)
                if abs(version - chunk.version) > max_lag:
                    drained += 1  # too stale, or of a version lost to a resume
                    continue
                needs[where] -= len(chunk)
                taken.append((where, chunk))
            return {"chunks": taken, "drained": drained, "last": last}

    def release(self, upto: int) -> None:
        """Forget the spooled chunks numbered ``upto`` or lower: a checkpoint covers them."""
        with self.condition:
            self.queue = deque(item for item in self.queue if item[0] > upto)
            self.condition.notify_all()
        if self.spool is None or not self.spool.is_dir():
            return
        for path in self.spool.glob("*.chunk"):
            if int(path.stem) <= upto:
                path.unlink(missing_ok=True)

    def wait_until_taken(self) -> None:
        """Until the learner has taken every chunk delivered so far and waits for more
        (or the run is over): ``Agent.local`` keeps its loop in step with the learner."""
        with self.condition:
            received = self.received
            while self.taken_upto < received and not self.finished:
                self.condition.wait(1.0)

    def finish(self) -> None:
        with self.condition:
            self.finished = True
            self.condition.notify_all()


def _write_spool(folder: Path, seq: int, data: bytes) -> None:
    """Atomically (a whole file or none), not synced: the file outlives the learner's
    process, which is the failure the spool is for; a sync per chunk (milliseconds
    each, under the inbox's lock) would make the spool the learner's bottleneck. Machine
    crashes are the checkpoints' business (those are synced)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{seq:012d}.chunk"
    temporary = path.with_suffix(".tmp")
    temporary.write_bytes(data)
    os.replace(temporary, path)


# The learner's runner.


class ExternalRunner:
    """A ``Runner`` whose rollouts are the chunks external agents delivered.

    ``collect(snapshot)`` publishes the snapshot, then takes chunks until every group has
    a batch's worth of rows (``env.num_envs x rollout.num_steps`` per agent of the
    group); chunks from a version more than ``max_version_lag`` away from the learner's
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
        lag_bound = self.config.max_version_lag
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
            pack(group, group_chunks, self.config.rollout.num_steps)
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
        return {"consumed": self.consumed, "dropped": self.dropped}

    def load_state_dict(self, state: dict[str, Any], env_state: Any = None) -> None:
        self.consumed, self.dropped = int(state["consumed"]), int(state["dropped"])
        self.inbox.release(self.consumed)  # what the checkpoint already trained on

    def capture(self) -> None:
        return None  # the episodes run in the agents

    def reset(self, seed: int) -> None:
        pass

    def close(self) -> None:
        self.inbox.finish()


def pack(group: AgentGroup, chunks: Sequence[Chunk], num_steps: int) -> GroupBatch:
    """A group's chunks as (T, N) rollout arrays (module docstring): N = agents x column
    sets; agent j's chunks fill columns j, j + agents, ... (rows are (env, agent) pairs,
    agent fastest), each chunk followed by its bootstrap row, the longest chunks first into
    the shortest column, so that T stays near ``num_steps``."""
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
    obs = np.zeros((steps, width, spec.obs_dim), np.float32)
    actions = np.zeros((steps, width, *spec.action_shape), spec.action_dtype)
    logprob = np.zeros((steps, width), np.float32)
    values = np.zeros((steps, width), np.float32)
    rewards = np.zeros((steps, width), np.float32)
    terminated = np.zeros((steps, width), bool)
    truncated = np.ones((steps, width), bool)  # padding and bootstrap rows carry nothing
    valid = np.zeros((steps, width), bool)
    mask = np.ones((steps, width, spec.mask_dim), bool) if spec.mask_dim is not None else None
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
            t += n + 1
    delta = None
    deltas = [c.obs_delta for c in chunks if c.obs_delta is not None]
    if deltas:
        delta = deltas[0]
        for other in deltas[1:]:
            delta = delta.merge(other)
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
    )


def max_chunk(config: Config) -> int:
    """The longest chunk a learner accepts: agents may choose their own chunk length,
    within reason (a batch's rows, or 100,000 steps)."""
    return max(config.agent.max_chunk_length, config.batch_size, 100_000)
