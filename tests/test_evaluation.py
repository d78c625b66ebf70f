"""evaluate(): batched episodes give what running them one after another gives."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
import torch

from trustrl.config import PolicyConfig
from trustrl.evaluation import PARALLEL, evaluate
from trustrl.policy import Policy
from trustrl.spaces import SpaceSpec


def sequential(policy: Policy, env_id: str, episodes: int, seed: int) -> tuple[list, list]:
    env = gym.make(env_id)
    returns, lengths = [], []
    for episode in range(episodes):
        obs, _ = env.reset(seed=seed + episode)
        total, length, done = 0.0, 0, False
        while not done:
            obs, reward, terminated, truncated, _ = env.step(policy.act(obs))
            total += float(reward)
            length += 1
            done = terminated or truncated
        returns.append(total)
        lengths.append(length)
    env.close()
    return returns, lengths


@pytest.mark.parametrize("env_id", ["CartPole-v1", "Pendulum-v1"])
def test_batched_episodes_equal_sequential_ones(env_id: str) -> None:
    env = gym.make(env_id)
    spec = SpaceSpec.from_spaces(env.observation_space, env.action_space, False)
    env.close()
    torch.manual_seed(0)
    policy = Policy(spec, PolicyConfig(hidden_sizes=(8,)))
    with torch.no_grad():  # a policy whose CartPole episodes differ in length
        for p in policy.parameters():
            p.add_(torch.randn_like(p))
    episodes = PARALLEL + 3  # two chunks
    result = evaluate(policy, env_id, episodes=episodes, seed=7)
    returns, lengths = sequential(policy, env_id, episodes, 7)
    assert result.lengths == lengths
    np.testing.assert_allclose(result.returns, returns, rtol=1e-5)
    if env_id == "CartPole-v1":
        assert len(set(lengths)) > 1


def test_stochastic_evaluation_samples_and_is_reproducible_per_seed() -> None:
    env = gym.make("CartPole-v1")
    spec = SpaceSpec.from_spaces(env.observation_space, env.action_space, False)
    env.close()
    torch.manual_seed(0)
    policy = Policy(spec, PolicyConfig(hidden_sizes=(8,)))  # near-uniform over 2 actions
    first = evaluate(policy, "CartPole-v1", episodes=6, deterministic=False, seed=3)
    again = evaluate(policy, "CartPole-v1", episodes=6, deterministic=False, seed=3)
    greedy = evaluate(policy, "CartPole-v1", episodes=6, deterministic=True, seed=3)
    assert first.lengths == again.lengths
    assert first.lengths != greedy.lengths  # sampled, not the mode
