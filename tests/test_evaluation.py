"""evaluate(): batched episodes give what running them one after another gives."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
import torch

from trustrl.config import PolicyConfig
from trustrl.envs.spaces import SpaceSpec
from trustrl.learner.policy import Policy
from trustrl.run.evaluation import PARALLEL, evaluate


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


def test_the_package_evaluate_is_the_function_once_the_trainer_is_imported() -> None:
    import trustrl

    assert trustrl.Trainer is not None and trustrl.train is not None
    assert callable(trustrl.evaluate) and trustrl.evaluate is evaluate


def box_policy() -> Policy:
    env = gym.make("Pendulum-v1")
    return Policy(SpaceSpec.from_spaces(env.observation_space, env.action_space))


def test_a_policy_in_the_wrong_env_says_what_it_expects_and_what_it_got() -> None:
    with pytest.raises(ValueError) as info:
        evaluate(box_policy(), "CartPole-v1", episodes=1)
    assert str(info.value) == (
        "this policy was trained for observations of shape (3,), Box(1,) actions; "
        "CartPole-v1 has observations of shape (4,), Discrete(2) actions"
    )


@pytest.mark.parametrize("shape", [(4,), (2, 4), (3, 1), (), (2, 3, 1)])
def test_act_and_value_with_a_wrong_observation_shape(shape: tuple[int, ...]) -> None:
    policy = box_policy()
    obs = np.zeros(shape, np.float32)
    for call in (policy.act, policy.value):
        with pytest.raises(ValueError) as info:
            call(obs)
        assert str(info.value) == (
            f"this policy expects observations of shape (3,) (or a batch (B, 3)), got shape {shape}"
        )


def test_value_reads_raw_observations_in_reward_units() -> None:
    policy = Policy(
        SpaceSpec((3,), "box", (1,), low=(-2.0,), high=(2.0,), env_action_shape=(1,)),
        PolicyConfig(hidden_sizes=(8,)),
        normalize_obs=True,
    )
    assert policy.obs_normalizer is not None
    policy.obs_normalizer.update(np.random.default_rng(0).normal(5.0, 2.0, (64, 3)))
    obs = np.random.default_rng(1).normal(5.0, 2.0, (6, 3)).astype(np.float32)
    with torch.no_grad():
        expected = policy.critic_value(policy.normalize(torch.from_numpy(obs))).numpy()
    values = policy.value(obs)
    assert values.shape == (6,) and values.dtype == np.float32
    np.testing.assert_array_equal(values, expected)
    single = policy.value(obs[2])
    assert isinstance(single, float) and single == pytest.approx(float(expected[2]))


def test_the_python_api_is_silent_when_quiet(tmp_path, capsys) -> None:
    import trustrl

    overrides = {
        "quiet": True,
        "total_steps": 6400,
        "target_return": 1.0,  # solved at the first evaluation: the line once printed
        "eval_episodes": 1,
        "run_dir": str(tmp_path / "run"),
        "env": {"num_envs": 2},
        "rollout": {"num_steps": 16},
    }
    trustrl.train(trustrl.resolve("CartPole-v1", overrides=overrides))
    out, err = capsys.readouterr()
    assert (out, err) == ("", "")


def test_evaluate_names_an_unknown_env_kwarg() -> None:
    from trustrl.config import ConfigError

    with pytest.raises(ConfigError, match="CartPole-v1 does not accept the keyword argument 'x'"):
        evaluate(box_policy(), "CartPole-v1", episodes=1, env_kwargs={"x": 1})
