"""Thin chunks: an agent sends only what it saw and did, and the learner computes the rest.

A thin chunk of L steps holds the raw observations (L + 1 of them when the chunk is
bootstrapped, that is when it ends ``truncated`` or ``cut``: the last is the observation
to bootstrap from; L when it ends ``terminated``), the actions (as sampled: a Box action
before clipping), the raw rewards, the action masks if the policy takes them, and the
version that acted. ``thicken`` turns it into the full chunk an ``Agent`` would have
sent (client/agent.py), with that version's weights and its frozen observation
statistics: the observations normalized, the behaviour log-probabilities and values,
the bootstrap value, the observations' statistics, and the rewards scaled by the
learner's per-agent reward statistics (``Stream``), episode return and length included.

So an agent in any language needs a gRPC client and something that runs the ONNX model
the gateway hands out (with its sampling parameters), nothing of trustrl. No torch, no
Ray: the acting side's numpy inference.

Structured observations (images, Dict, Tuple, Discrete, MultiDiscrete, MultiBinary:
envs/layout.py) travel raw, entry by entry, as the env handed them out: a Dict's or a
Tuple's entries as ``obs/<key>`` arrays (the message's ``obs_entries``), a whole
observation that is one entry (a frame, a Discrete index) as ``obs``; each of shape
(rows, *entry shape). ``check_thin`` checks every entry against its space (shape,
dtype: a frame's own, uint8 or bool; values: finite vectors, one-hot indices within
their space, 0/1 binaries) and names the entry that does not fit; ``thicken`` packs them
into the rows the policy reads (``layout.pack``: uint8 rows stay bytes), normalizes the
vector columns only and takes their statistics. Why raw entries rather than packed rows:
they are what the client saw (no one-hot encoding or column order to reimplement in
another language), and a frame of the wrong dtype (a float frame where the policy takes
uint8) is refused naming the entry, which a packed float row could not tell.

A recurrent policy's thin chunk (``policy.memory``) also carries ``states``: the state
(the actor's and the critic's, as the gateway's ONNX model takes and gives it) that the
chunk's step 0 was acted from, and the state at every ``sequence_length`` steps after,
as a full chunk does. ``thicken`` replays the recurrence from them with the acting
version's weights, step by step, for the log-probabilities and values.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from trustrl.acting.inference import Inference
from trustrl.envs import layout
from trustrl.envs.layout import Entry
from trustrl.envs.spaces import SpaceSpec
from trustrl.normalize import MeanStd, RunningStats
from trustrl.remote.wire import (
    Chunk,
    ChunkError,
    check_actions,
    check_arrays,
    expect_mask_and_states,
)

THIN_ARRAYS = ("obs", "actions", "rewards", "action_mask")
ENTRY_PREFIX = "obs/"
"""A structured observation's entry ``key`` travels as the array ``obs/<key>``
(messages.ENTRY_PREFIX)."""
TRAVELS = ("float32", "float64", "int64", "int32", "int8", "uint8", "bool")
"""The dtypes an array travels in (messages.DTYPES)."""


@dataclass
class Stream:
    """The learner's per-agent state across one agent's thin chunks: the reward
    statistics (as an Agent keeps its own, client/agent.py) and the open episode."""

    scaler: MeanStd | None
    discounted: float = 0.0
    episode_return: float = 0.0
    episode_length: int = 0
    last_seq: int = -1


def check_thin(
    tensors: dict[str, np.ndarray],
    spec: SpaceSpec,
    ending: str,
    max_length: int,
    memory: dict[str, int] | None = None,
) -> int:
    """The number of steps of a thin chunk whose arrays fit ``spec`` (and ``memory``,
    external.memory_info, where the policy is recurrent); a ChunkError with the check's
    reason (wire.REASONS) for one that does not."""
    allowed = list(THIN_ARRAYS)
    if spec.obs_entries and not _whole(spec):
        allowed = [ENTRY_PREFIX + e["key"] for e in spec.obs_entries] + allowed[1:]
    if memory:
        allowed.append("states")
    unknown = sorted(set(tensors) - set(allowed))
    if unknown:
        raise ChunkError(
            f"a thin chunk (no logprob) of this policy holds {allowed}, not "
            f"{[name[:80] for name in unknown[:8]]}",
            "unknown_array",
        )
    rewards = tensors.get("rewards")
    if rewards is None:
        raise ChunkError("array 'rewards' is missing", "missing_array")
    length = len(rewards) if rewards.ndim else 0
    if not 1 <= length <= max_length:
        raise ChunkError(f"a chunk holds 1 to {max_length:,} steps, got {length}", "length")
    rows = length + (ending != "terminated")
    expected: dict[str, tuple[tuple[int, ...], Any]] = {
        "actions": ((length, *spec.action_shape), spec.action_dtype),
        "rewards": ((length,), np.float32),
    }
    if not spec.obs_entries:
        expected = {"obs": ((rows, *spec.obs_shape), np.float32), **expected}
    expect_mask_and_states(
        expected,
        tensors,
        spec,
        length,
        memory,
        "the ONNX model's state input, at step 0 and every {sequence_length} steps",
    )
    for entry in spec.obs_entries:
        check_entry(tensors, entry, rows, _whole(spec))
    check_arrays(tensors, expected)
    check_actions(spec, tensors["actions"])
    return length


def _whole(spec: SpaceSpec) -> bool:
    """Whether the observation is one entry (a frame, a Discrete...), sent as ``obs``."""
    return len(spec.obs_entries) == 1 and spec.obs_entries[0]["key"] == ""


def entry_dtypes(entry: Entry) -> tuple[str, ...]:
    """The dtypes an entry's raw observations may travel in: a frame its own (uint8,
    bool, or a float image's float), a vector float32 or its own, a Discrete or
    MultiDiscrete index any integer, a MultiBinary 0/1 integers or bool."""
    kind, dtype = entry["kind"], entry["dtype"]
    if kind == "image":
        return (dtype,)
    if kind == "vector":
        return tuple(dict.fromkeys(("float32", dtype if dtype in TRAVELS else "float32")))
    if kind == "onehot":
        return ("int64", "int32", "int8", "uint8")
    return ("int8", "uint8", "bool", "int32", "int64")


def check_entry(tensors: dict[str, np.ndarray], entry: Entry, rows: int, whole: bool) -> None:
    """One observation entry of a thin chunk: there, (rows, *its shape), of a dtype it
    travels in, and its values within its space; a ChunkError names the entry, what it
    expected and what it got."""
    key = entry["key"]
    name = "obs" if whole else ENTRY_PREFIX + key
    where = f"observation entry {key!r} ({name!r})" if key else "the observation ('obs')"
    shape = (rows, *entry["shape"])
    allowed = entry_dtypes(entry)
    what = f"{entry['kind']} {' or '.join(allowed)}{list(shape)}"
    if name not in tensors:
        raise ChunkError(f"{where} is missing: expected {what}", "missing_array")
    value = tensors[name]
    if value.dtype.name not in allowed or value.shape != shape:
        raise ChunkError(f"{where}: expected {what}, got {value.dtype}{list(value.shape)}", "array")
    if value.dtype.kind == "f" and not np.isfinite(value).all():
        raise ChunkError(f"{where} holds NaN or infinite values", "not_finite")
    if entry["kind"] == "binary" and ((value != 0) & (value != 1)).any():
        raise ChunkError(f"{where}: a MultiBinary observation is 0 or 1", "array")
    if entry["kind"] == "onehot" and value.size:
        index = value.reshape(rows, -1).astype(np.int64)
        low = np.asarray(entry["start"])
        high = low + np.asarray(entry["nvec"])
        outside = (index < low) | (index >= high)
        if outside.any():
            bad = int(index[outside][0])
            ranges = [f"{a}..{b - 1}" for a, b in zip(low.tolist(), high.tolist(), strict=True)]
            raise ChunkError(f"{where}: value {bad} is outside {', '.join(ranges)}", "array")


def raw_rows(tensors: dict[str, np.ndarray], spec: SpaceSpec) -> np.ndarray:
    """The raw observations of a checked thin chunk as rows: a flat Box's as float64, a
    structured observation's packed (``spec.obs_dtype``: frames stay bytes)."""
    if not spec.obs_entries:
        return tensors["obs"].reshape(-1, spec.obs_dim).astype(np.float64)
    if _whole(spec):
        raw: Any = tensors["obs"]
    else:
        raw = {e["key"]: tensors[ENTRY_PREFIX + e["key"]] for e in spec.obs_entries}
    try:
        return layout.pack(spec.obs_entries, raw, spec.obs_dim, spec.obs_dtype)
    except ValueError as exc:  # what check_entry let through (it checks the same)
        raise ChunkError(str(exc), "array") from None


def thicken(
    tensors: dict[str, np.ndarray],
    header: dict[str, Any],
    spec: SpaceSpec,
    inference: Inference,
    agent_index: int,
    stream: Stream,
    gamma: float,
    sequence_length: int = 0,
) -> Chunk:
    """The full chunk of a checked thin chunk (``check_thin``), acted by the version
    whose ``inference`` this is. ``header``: agent, source, seq, version, ending, sender.
    ``stream`` is updated unless the chunk's seq was seen (a chunk sent again)."""
    ending = header["ending"]
    rewards = tensors["rewards"].astype(np.float64)
    length = len(rewards)
    raw = raw_rows(tensors, spec)
    norm = inference.obs_normalizer  # over the vector columns (all of a flat row)
    x = norm.normalize_array(raw) if norm is not None else raw.astype(spec.obs_dtype)
    agent = np.full(len(x), agent_index)
    mask = tensors.get("action_mask")
    states = tensors.get("states")
    if states is not None:
        logprob, values = _replay(
            inference, x, tensors["actions"], mask, states, agent_index, sequence_length
        )
    else:
        logprob = inference.log_prob_of(x[:length], tensors["actions"], mask, agent[:length])
        values = inference.value(x, None, agent).astype(np.float32)
    if ending == "terminated":
        values = np.append(values, np.float32(0.0))
    scaled, returns = _scale(rewards, ending, stream, gamma, header["seq"])
    return Chunk(
        agent=header["agent"],
        source=header["source"],
        seq=header["seq"],
        version=header["version"],
        ending=ending,
        obs=np.ascontiguousarray(x[:length], dtype=spec.obs_dtype),
        actions=np.ascontiguousarray(tensors["actions"]),
        logprob=logprob.astype(np.float32),
        values=values,
        rewards=scaled,
        action_mask=mask,
        obs_delta=RunningStats.of(raw[:length, : spec.vector_dim].astype(np.float64))
        if norm is not None
        else None,
        episode_return=returns[0] if ending != "cut" else None,
        episode_length=returns[1] if ending != "cut" else None,
        sender=header["sender"],
        states=states,
    )


def _replay(
    inference: Inference,
    x: np.ndarray,
    actions: np.ndarray,
    mask: np.ndarray | None,
    states: np.ndarray,
    agent_index: int,
    every: int,
) -> tuple[np.ndarray, np.ndarray]:
    """A recurrent policy's log-probabilities (L,) and values (rows,) of a thin chunk's
    normalized rows ``x`` (L, or L + 1 with the bootstrap's), step by step from the
    ``states`` the agent sent, one at every ``every`` steps (the learner's
    ``rollout.sequence_length``: the chunk's sequence starts)."""
    length = len(actions)
    agent = np.array([agent_index])
    head = inference.head
    logprob = np.empty(length, np.float32)
    values = np.empty(len(x), np.float32)
    state = states[0][None]
    for t in range(len(x)):
        if t < length and t % every == 0:
            state = states[t // every][None]
        if t == length:  # the bootstrap row: the value of the state the chunk ended in
            values[t] = inference.value_recurrent(x[t : t + 1], state, None, agent)[0]
            break
        row_mask = mask[t : t + 1] if mask is not None else None
        _, out, value, state = inference.act_recurrent(
            x[t : t + 1], row_mask, None, state, None, agent
        )
        params = head.params(out, row_mask)
        logprob[t] = head.log_prob(params, actions[t : t + 1], agent)[0]
        values[t] = value[0]
    return logprob, values


def _scale(
    rewards: np.ndarray, ending: str, stream: Stream, gamma: float, seq: int
) -> tuple[np.ndarray, tuple[float, int]]:
    """The rewards scaled as an Agent scales its own (its discounted return's spread),
    and the episode's raw return and length so far; the stream moves on only for a
    chunk not seen before."""
    fresh = seq > stream.last_seq
    discounted = stream.discounted
    folds = []
    for reward in rewards.tolist():
        discounted = discounted * gamma + reward
        folds.append(discounted)
    if stream.scaler is None:
        scaled = rewards.astype(np.float32)
    elif fresh:
        scaled = np.asarray(stream.scaler.update_and_scale(folds, rewards.tolist()), np.float32)
    else:  # scaled by the statistics as they are, which the first delivery moved on
        scaled = np.asarray(stream.scaler.update_and_scale([None] * len(folds), rewards.tolist()))
        scaled = scaled.astype(np.float32)
    episode = (stream.episode_return + float(rewards.sum()), stream.episode_length + len(rewards))
    if fresh:
        stream.last_seq = seq
        ended = ending != "cut"
        stream.discounted = 0.0 if ended else discounted
        stream.episode_return, stream.episode_length = (0.0, 0) if ended else episode
    return scaled, episode
