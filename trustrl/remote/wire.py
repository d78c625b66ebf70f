"""The wire format between external agents and their learner: what travels, and how it
is checked. No Ray and no torch: the agent client (client/agent.py) imports this module
and the acting side only.

Two payloads travel, both safetensors bytes (arrays and string metadata, parsed without
pickle, so no code runs on receipt):

* a **chunk** (agent to learner): up to ``agent.max_chunk_length`` steps of one agent's
  episode, acted on by one policy version, with the value to bootstrap from where the
  chunk stops short of a terminal state. ``decode_chunk`` checks it field by field
  against the learner's spaces (names, dtypes, shapes, lengths, finiteness, action
  ranges, at most ``MAX_CHUNK_BYTES``) and raises a ``ChunkError`` that says which field
  was wrong and how;
* a **snapshot** (learner to agent): a ``PolicySnapshot`` (contract.py), its layers in the
  module's order.

``LinkError`` is the other failure at this boundary: the learner could not be reached
(the agent queues and retries). Ray's own transport is pickle-based and trusts whoever
holds the cluster's token; the learner's API takes nothing from an agent but these bytes.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from trustrl.contract import GroupSnapshot, PolicySnapshot
from trustrl.envs.rows import AgentGroup
from trustrl.envs.spaces import SpaceSpec
from trustrl.normalize import RunningStats

CHUNK_FORMAT = "trustrl-chunk/1"
SNAPSHOT_FORMAT = "trustrl-snapshot/1"
ENDINGS = ("terminated", "truncated", "cut")
"""How a chunk ends: its episode terminated (no bootstrap), hit a time limit, or goes on
in the next chunk (both bootstrapped from the chunk's last value)."""
MAX_CHUNK_BYTES = 64 * 1024 * 1024


REASONS = (
    "payload",  # not a chunk: not safetensors, another format, over the size limit
    "agent",  # an agent id the learner does not have
    "metadata",  # a metadata entry missing or malformed
    "ending",  # not one of ENDINGS
    "numbering",  # a negative version or seq
    "unknown_array",  # an array the format does not have
    "length",  # no steps, or more than the learner accepts
    "missing_array",  # a required array absent
    "array",  # an array of the wrong dtype or shape
    "not_finite",  # NaN or infinite values
    "action_range",  # discrete actions outside the space
    "mask",  # an action mask where the policy takes none
    "obs_stats",  # observation statistics that do not add up
)
"""Why a chunk was refused, one word per check of ``decode_chunk`` (ChunkError.reason):
what the gateway counts refusals by."""


class ChunkError(ValueError):
    """A chunk that does not fit the learner's spaces; the message says what and where,
    ``reason`` which check refused it (one of REASONS)."""

    def __init__(self, message: str, reason: str = "payload") -> None:
        super().__init__(message)
        self.reason = reason


class LinkError(ConnectionError):
    """An agent could not reach its learner (it queues and retries)."""


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
    obs: np.ndarray  # (L, obs_dim) of spec.obs_dtype, normalized as acted on (uint8: frames)
    actions: np.ndarray  # (L, *action_shape)
    logprob: np.ndarray  # (L,) float32, the behaviour policy's
    values: np.ndarray  # (L + 1,) float32: the last is the bootstrap (0 when terminated)
    rewards: np.ndarray  # (L,) float32, after the agent's reward scaling
    action_mask: np.ndarray | None  # (L, A) bool
    obs_delta: RunningStats | None  # the raw observations seen: their vector columns
    episode_return: float | None  # raw return of the episode this chunk ended, if it did
    episode_length: int | None
    sender: str = ""  # the gateway's name for the agent that sent it (its token's)
    # A recurrent policy's (policy.memory): (ceil(L / sequence_length), state_size) float32,
    # the state the chunk's first step was acted from, then every sequence_length steps.
    states: np.ndarray | None = None

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
    if chunk.states is not None:
        tensors["states"] = chunk.states
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
    if chunk.sender:
        metadata["sender"] = chunk.sender
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
    data: Any,
    groups: Sequence[AgentGroup],
    max_length: int = 1_000_000,
    memory: dict[str, int] | None = None,
) -> tuple[int, Chunk]:
    """(group index, chunk) from an agent's bytes, checked against the groups' spaces:
    field names, dtypes, shapes, lengths, finiteness, action ranges. A ChunkError says
    which field was wrong and how. ``memory`` (external.memory_info): the learner's
    policy is recurrent, and every chunk carries its states."""
    metadata, tensors = _parse(data, CHUNK_FORMAT)
    agent = metadata.get("agent", "")
    try:
        seq, version = int(metadata["seq"]), int(metadata["version"])
        ending, source = metadata["ending"], metadata["source"]
        count = float(metadata["obs_count"]) if "obs_count" in metadata else None
        episode_return = float(metadata["episode_return"]) if "episode_return" in metadata else None
        episode_length = int(metadata["episode_length"]) if "episode_length" in metadata else None
    except (KeyError, ValueError) as exc:
        raise ChunkError(
            f"metadata {sorted(metadata)}: missing or malformed ({exc})", "metadata"
        ) from None
    if episode_return is not None and not math.isfinite(episode_return):
        raise ChunkError(f"episode_return {episode_return} is not finite", "metadata")
    where = check_header(groups, agent, ending, version, seq)
    spec = groups[where].spec
    allowed = {"obs", "actions", "logprob", "values", "rewards", "action_mask"}
    allowed |= {"obs_mean", "obs_m2"} | ({"states"} if memory else set())
    unknown = sorted(set(tensors) - allowed)
    if unknown:
        raise ChunkError(f"unknown arrays {unknown}; allowed: {sorted(allowed)}", "unknown_array")
    length = len(tensors["logprob"]) if "logprob" in tensors else 0
    if not 1 <= length <= max_length:
        raise ChunkError(f"a chunk holds 1 to {max_length:,} steps, got {length}", "length")
    expected: dict[str, tuple[tuple[int, ...], Any]] = {
        "obs": ((length, spec.obs_dim), spec.obs_dtype),
        "actions": ((length, *spec.action_shape), spec.action_dtype),
        "logprob": ((length,), np.float32),
        "values": ((length + 1,), np.float32),
        "rewards": ((length,), np.float32),
    }
    expect_mask_and_states(
        expected, tensors, spec, length, memory, "every rollout.sequence_length steps"
    )
    if count is not None:  # the statistics of the row's vector columns (all of a flat row)
        expected["obs_mean"] = ((spec.vector_dim,), np.float64)
        expected["obs_m2"] = ((spec.vector_dim,), np.float64)
    check_arrays(tensors, expected, spec)
    actions = tensors["actions"]
    check_actions(spec, actions)
    delta = None
    if count is not None:
        if not (count == length and math.isfinite(count)):
            raise ChunkError(
                f"obs_count {count} must equal the chunk's {length} steps", "obs_stats"
            )
        if (tensors["obs_m2"] < 0).any():
            raise ChunkError("obs_m2 must be >= 0", "obs_stats")
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
        metadata.get("sender", ""),
        tensors.get("states"),
    )
    return where, chunk


def check_header(
    groups: Sequence[AgentGroup], agent: str, ending: str, version: int, seq: int
) -> int:
    """The index of the group ``agent`` is in, for a chunk whose ending and numbering are
    valid; a ChunkError names what is not."""
    where = next((i for i, g in enumerate(groups) if agent in g.agents), None)
    if where is None:
        names = [a for g in groups for a in g.agents]
        raise ChunkError(
            f"agent {agent[:80]!r} is not one of the learner's agents {names}", "agent"
        )
    if ending not in ENDINGS:
        raise ChunkError(f"ending {ending[:80]!r}; allowed: {', '.join(ENDINGS)}", "ending")
    if version < 0 or seq < 0:
        raise ChunkError(f"version {version} and seq {seq} must be >= 0", "numbering")
    return where


def check_arrays(
    tensors: dict[str, np.ndarray],
    expected: dict[str, tuple[tuple[int, ...], Any]],
    spec: SpaceSpec | None = None,
) -> None:
    """Each array of ``expected`` (name: (shape, dtype)) is in ``tensors``, of that shape
    and dtype, and finite if it is of floats; a ChunkError names the first that is not
    (for the rows of a structured observation, ``spec``'s, with the entries they hold)."""
    for name, (shape, dtype) in expected.items():
        if name not in tensors:
            raise ChunkError(f"array {name!r} is missing", "missing_array")
        array = tensors[name]
        if array.shape != shape or array.dtype != dtype:
            layout = ""
            if name == "obs" and spec is not None and spec.obs_entries:
                layout = f" (each row packs {row_layout(spec)})"
            raise ChunkError(
                f"array {name!r} is {array.dtype}{list(array.shape)}, expected "
                f"{np.dtype(dtype)}{list(shape)}{layout}",
                "array",
            )
        if array.dtype.kind == "f" and not np.isfinite(array).all():
            raise ChunkError(f"array {name!r} holds NaN or infinite values", "not_finite")


def expect_mask_and_states(
    expected: dict[str, tuple[tuple[int, ...], Any]],
    tensors: dict[str, np.ndarray],
    spec: SpaceSpec,
    length: int,
    memory: dict[str, int] | None,
    states_at: str,
) -> None:
    """Adds to ``expected`` (as ``check_arrays`` takes it) the optional arrays of a chunk
    of ``length`` steps: its action masks where it sends them (a ChunkError if the policy
    takes none), and the states it was acted from where the policy has memory (a
    ChunkError if missing; ``states_at`` says when they are taken, for that message, with
    ``memory``'s fields in braces)."""
    if spec.mask_dim is not None and "action_mask" in tensors:
        expected["action_mask"] = ((length, spec.mask_dim), np.bool_)
    elif "action_mask" in tensors:
        raise ChunkError("action_mask sent for a policy without action masks", "mask")
    if memory:
        if "states" not in tensors:
            raise ChunkError(
                "states missing: the learner's policy has memory, and a chunk carries the "
                f"states it was acted from ({states_at.format(**memory)})",
                "missing_array",
            )
        starts = -(-length // memory["sequence_length"])
        expected["states"] = ((starts, memory["state_size"]), np.float32)


def row_layout(spec: SpaceSpec) -> str:
    """A structured observation's row in words, for messages (envs/layout.py): "entry
    'vec' (vector float32 (2,), 2 columns), entry 'grid' (image bool (6, 6, 2), 72
    columns)"."""
    return ", ".join(
        f"{'entry ' + repr(e['key']) if e['key'] else 'the observation'} ({e['kind']} "
        f"{e['dtype']} {tuple(e['shape'])}, {e['width']} columns)"
        for e in spec.obs_entries
    )


def check_actions(spec: SpaceSpec, actions: np.ndarray) -> None:
    """Discrete actions within their space (a Box action may be anything finite: the env
    clips it)."""
    if spec.action_kind != "box":
        high = np.asarray(spec.nvec)
        if ((actions < 0) | (actions >= high)).any():
            raise ChunkError(f"actions outside 0..{[n - 1 for n in spec.nvec]}", "action_range")
