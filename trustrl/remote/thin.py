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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from trustrl.acting.inference import Inference
from trustrl.envs.spaces import SpaceSpec
from trustrl.normalize import MeanStd, RunningStats
from trustrl.remote.wire import Chunk, ChunkError, check_actions, check_arrays

THIN_ARRAYS = ("obs", "actions", "rewards", "action_mask")


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
    tensors: dict[str, np.ndarray], spec: SpaceSpec, ending: str, max_length: int
) -> int:
    """The number of steps of a thin chunk whose arrays fit ``spec``; a ChunkError with
    the check's reason (wire.REASONS) for one that does not."""
    unknown = sorted(set(tensors) - set(THIN_ARRAYS))
    if unknown:
        raise ChunkError(
            f"a thin chunk (no logprob) holds {list(THIN_ARRAYS)}, not {unknown}",
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
        "obs": ((rows, *spec.obs_shape), np.float32),
        "actions": ((length, *spec.action_shape), spec.action_dtype),
        "rewards": ((length,), np.float32),
    }
    if spec.mask_dim is not None and "action_mask" in tensors:
        expected["action_mask"] = ((length, spec.mask_dim), np.bool_)
    elif "action_mask" in tensors:
        raise ChunkError("action_mask sent for a policy without action masks", "mask")
    check_arrays(tensors, expected)
    check_actions(spec, tensors["actions"])
    return length


def thicken(
    tensors: dict[str, np.ndarray],
    header: dict[str, Any],
    spec: SpaceSpec,
    inference: Inference,
    agent_index: int,
    stream: Stream,
    gamma: float,
) -> Chunk:
    """The full chunk of a checked thin chunk (``check_thin``), acted by the version
    whose ``inference`` this is. ``header``: agent, source, seq, version, ending, sender.
    ``stream`` is updated unless the chunk's seq was seen (a chunk sent again)."""
    ending = header["ending"]
    rewards = tensors["rewards"].astype(np.float64)
    length = len(rewards)
    raw = tensors["obs"].reshape(-1, spec.obs_dim).astype(np.float64)
    norm = inference.obs_normalizer
    x = norm.normalize_array(raw) if norm is not None else raw.astype(np.float32)
    agent = np.full(len(x), agent_index)
    mask = tensors.get("action_mask")
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
        obs=np.ascontiguousarray(x[:length], dtype=np.float32),
        actions=np.ascontiguousarray(tensors["actions"]),
        logprob=logprob.astype(np.float32),
        values=values,
        rewards=scaled,
        action_mask=mask,
        obs_delta=RunningStats.of(raw[:length]) if norm is not None else None,
        episode_return=returns[0] if ending != "cut" else None,
        episode_length=returns[1] if ending != "cut" else None,
        sender=header["sender"],
    )


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
