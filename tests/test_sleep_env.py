"""The sleep benchmark env: deterministic, registered, and its step waits without computing."""

from __future__ import annotations

import time

import gymnasium as gym
import numpy as np

from benchmarks.sleep_env import ENV_ID, MAX_EPISODE_STEPS, SleepEnv, make


def rollout(env: gym.Env, seed: int, steps: int) -> list[np.ndarray]:
    observation, _ = env.reset(seed=seed)
    seen = [observation]
    for t in range(steps):
        observation, reward, terminated, truncated, _ = env.step(t % 3 == 0)
        assert reward == 1.0
        seen.append(observation)
        if terminated or truncated:
            observation, _ = env.reset()
            seen.append(observation)
    return seen


def test_same_seed_same_episode_and_spaces_hold():
    first = rollout(SleepEnv(step_time=0.0), seed=3, steps=300)
    second = rollout(SleepEnv(step_time=0.0), seed=3, steps=300)
    np.testing.assert_array_equal(np.stack(first), np.stack(second))
    space = SleepEnv().observation_space
    assert all(space.contains(observation) for observation in first)


def test_registered_with_a_time_limit():
    for env in (gym.make(f"benchmarks.sleep_env:{ENV_ID}", step_time=0.0), make(step_time=0.0)):
        assert env.spec is not None and env.spec.max_episode_steps == MAX_EPISODE_STEPS
        assert isinstance(env.action_space, gym.spaces.Discrete) and env.action_space.n == 2


def test_step_takes_wall_time_not_cpu():
    env = SleepEnv(step_time=2e-3)
    env.reset(seed=0)
    wall, cpu = time.perf_counter(), time.process_time()
    for t in range(50):
        _, _, terminated, _, _ = env.step(np.int64(t % 2))
        if terminated:
            env.reset()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    assert wall >= 50 * 2e-3
    assert cpu < 0.5 * wall
