"""Thin chunks (remote/thin.py): what an agent saw and did, completed by the learner with
the acting version's weights and frozen statistics, is the chunk the Python ``Agent``
computes itself, field by field (discrete and Box actions, observation normalization,
per-agent reward scaling, chunks cut mid-episode, time limits and terminations)."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest

import trustrl
from trustrl.client.agent import Agent, LocalLink
from trustrl.contract import GroupSnapshot, PolicySnapshot
from trustrl.learner.policy import Policy
from trustrl.normalize import MeanStd
from trustrl.remote import thin
from trustrl.remote.external import external_groups, learner_config, learner_info
from trustrl.remote.inbox import Inbox
from trustrl.remote.wire import ChunkError, encode_snapshot

CHUNK = 48


def snapshot_of(config: trustrl.Config, groups: list) -> PolicySnapshot:
    spec = groups[0].spec
    policy = Policy(spec, config.policy, normalize_obs=True, obs_clip=config.env.obs_clip)
    group = GroupSnapshot.of(policy)
    # Statistics far from (0, 1), so that normalizing with the wrong ones shows.
    rng = np.random.default_rng(1)
    group.weights["obs_normalizer.mean"][:] = rng.normal(size=spec.obs_dim)
    group.weights["obs_normalizer.var"][:] = rng.uniform(0.2, 3.0, size=spec.obs_dim)
    group.weights["obs_normalizer.count"][...] = 100.0
    return PolicySnapshot(4, (group,))


def play(env_id: str, steps: int, normalize_reward: bool) -> tuple:
    """An Agent's chunks for ``steps`` steps of ``env_id``, and what it saw and did."""
    config = trustrl.resolve(
        env_id, overrides={"quiet": True, "env": {"normalize_reward": normalize_reward}}
    )
    config, _ = learner_config(config)
    groups = external_groups(config)
    info = learner_info(config, groups)
    inbox = Inbox(groups, info)
    snapshot = snapshot_of(config, groups)
    inbox.publish(snapshot.version, encode_snapshot(snapshot))
    agent = Agent(LocalLink(inbox), seed=3, max_chunk_length=CHUNK)
    env = gym.make(env_id)
    episodes: list[dict] = []
    obs, _ = env.reset(seed=0)
    episode = {"obs": [obs], "rewards": []}
    action = agent.act(obs)
    for _ in range(steps):
        obs, reward, terminated, truncated, _ = env.step(action)
        episode["rewards"].append(reward)
        if terminated or truncated:
            time_limit = truncated and not terminated
            agent.end_episode(reward, truncated=time_limit, obs=obs if time_limit else None)
            episode["ending"], episode["final"] = (
                "truncated" if time_limit else "terminated",
                obs,
            )
            episodes.append(episode)
            obs, _ = env.reset()
            episode = {"obs": [obs], "rewards": []}
            action = agent.act(obs)
        else:
            episode["obs"].append(obs)
            action = agent.act(obs, reward=reward)
    episodes.append(episode)  # still open: its chunks cut so far were shipped
    assert agent.flush(30)
    agent.close()
    chunks = [chunk for _, _, chunk in inbox.queue]
    return groups[0].spec, snapshot, info, episodes, chunks


def thin_chunks(episodes: list[dict], chunks: list) -> list[tuple[dict, dict]]:
    """(arrays, header) of the thin chunk that stands for each of the agent's chunks."""
    out, index = [], 0
    for episode in episodes:
        acted, rewards = episode["obs"], episode["rewards"]
        for start in range(0, len(rewards), CHUNK):
            if index == len(chunks):
                break  # the open episode's last steps, not shipped
            chunk = chunks[index]
            index += 1
            stop = start + len(chunk)
            if chunk.ending == "cut":
                rows = acted[start : stop + 1]
            elif chunk.ending == "truncated":
                rows = [*acted[start:stop], episode["final"]]
            else:
                rows = acted[start:stop]
            arrays = {
                "obs": np.asarray(rows, np.float32),
                "actions": chunk.actions,
                "rewards": np.asarray(rewards[start:stop], np.float32),
            }
            header = {
                "agent": "",
                "source": "robot/s",
                "seq": chunk.seq,
                "version": chunk.version,
                "ending": chunk.ending,
                "sender": "robot",
            }
            out.append((arrays, header))
    assert index == len(chunks)
    return out


@pytest.mark.parametrize(
    ("env_id", "normalize_reward"), [("CartPole-v1", False), ("Pendulum-v1", True)]
)
def test_a_thin_chunk_becomes_the_chunk_the_agent_would_have_sent(
    env_id: str, normalize_reward: bool
) -> None:
    from trustrl.acting.inference import Inference

    spec, snapshot, info, episodes, chunks = play(env_id, 700, normalize_reward)
    ending = "truncated" if env_id == "Pendulum-v1" else "terminated"
    assert {c.ending for c in chunks} >= {"cut", ending}
    inference = Inference(snapshot.groups[0])
    scaler = MeanStd((), clip=float(info["reward_clip"])) if normalize_reward else None
    stream = thin.Stream(scaler)
    for (arrays, header), sent in zip(thin_chunks(episodes, chunks), chunks, strict=True):
        length = thin.check_thin(arrays, spec, header["ending"], 10_000)
        assert length == len(sent)
        made = thin.thicken(arrays, header, spec, inference, 0, stream, float(info["gamma"]))
        np.testing.assert_allclose(made.obs, sent.obs, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(made.logprob, sent.logprob, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(made.values, sent.values, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(made.rewards, sent.rewards, rtol=1e-5, atol=1e-6)
        assert made.obs_delta is not None and sent.obs_delta is not None
        np.testing.assert_allclose(made.obs_delta.mean, sent.obs_delta.mean, rtol=1e-6)
        np.testing.assert_allclose(made.obs_delta.m2, sent.obs_delta.m2, rtol=1e-6)
        assert made.episode_length == sent.episode_length
        if sent.episode_return is None:
            assert made.episode_return is None
        else:
            assert made.episode_return == pytest.approx(sent.episode_return, rel=1e-5)
        assert (made.sender, made.source) == ("robot", "robot/s")


def test_a_chunk_sent_again_leaves_the_reward_statistics_as_they_were() -> None:
    stream = thin.Stream(MeanStd((), clip=10.0))
    rewards = np.array([1.0, 2.0, 3.0])
    thin._scale(rewards, "cut", stream, 0.99, seq=0)
    count = float(stream.scaler.count)  # type: ignore[union-attr]
    thin._scale(rewards, "cut", stream, 0.99, seq=0)
    assert float(stream.scaler.count) == count  # type: ignore[union-attr]
    assert stream.last_seq == 0 and stream.episode_length == 3


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"obs": np.zeros((5, 4), np.float32)}, "array"),  # cut: needs 6 rows
        ({"obs": np.zeros((6, 4), np.float64)}, "array"),
        ({"actions": np.full(5, 2)}, "action_range"),
        ({"rewards": np.full(5, np.nan, np.float32)}, "not_finite"),
        ({"rewards": np.zeros(0, np.float32)}, "length"),
        ({"values": np.zeros(6, np.float32)}, "unknown_array"),
        ({"action_mask": np.ones((5, 2), bool)}, "mask"),
        ({"rewards": None}, "missing_array"),
        ({"obs": None}, "missing_array"),
    ],
    ids=lambda value: value if isinstance(value, str) else "-".join(value),
)
def test_a_thin_chunk_that_does_not_fit_is_refused_with_its_reason(
    change: dict, reason: str
) -> None:
    config = trustrl.resolve("CartPole-v1", overrides={"quiet": True})
    spec = external_groups(config)[0].spec
    arrays = {
        "obs": np.zeros((6, 4), np.float32),
        "actions": np.zeros(5, np.int64),
        "rewards": np.ones(5, np.float32),
    }
    for name, value in change.items():
        if value is None:
            del arrays[name]
        else:
            arrays[name] = value
    with pytest.raises(ChunkError) as refused:
        thin.check_thin(arrays, spec, "cut", 10_000)
    assert refused.value.reason == reason
