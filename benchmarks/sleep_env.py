"""A benchmark env whose step takes a fixed wall time without using CPU.

It stands for a slow simulator or a robot: each ``step`` sleeps ``step_time`` seconds
(1 ms by default), so env steps per second measure how well the rollout side overlaps
waiting, not how fast anything computes. A scaling benchmark with k runners should
approach k times the one-runner speed however few cores the machine has.

The task is small and deterministic (a given seed gives the same episode for the same
actions): a point on a line pushed left or right by the action, with a two-dimensional
drifting context that the observation carries along. Reward 1 per step while the point
stays within [-1, 1]; the episode terminates when it leaves, and is truncated at 200
steps by the registered time limit.

Registered with Gymnasium as ``Sleep-v0`` when this module is imported. From the repo
root, both libraries build the same env (with its time limit) from a string, importing
this module themselves, as Ray workers need: RLlib with
``gymnasium.make("benchmarks.sleep_env:Sleep-v0")``, trustrl with the entry point
``benchmarks.sleep_env:make`` (``trustrl train benchmarks.sleep_env:make ...``).
"""

from __future__ import annotations

import time
from typing import Any, ClassVar

import gymnasium as gym
import numpy as np

ENV_ID = "Sleep-v0"
MAX_EPISODE_STEPS = 200


class SleepEnv(gym.Env[np.ndarray, np.int64]):
    """Box(4) observations (position, velocity, context), Discrete(2) actions; each step
    sleeps ``step_time`` seconds."""

    metadata: ClassVar[dict[str, Any]] = {"render_modes": []}

    def __init__(self, step_time: float = 1e-3):
        if step_time < 0:
            raise ValueError(f"step_time must be >= 0, got {step_time}")
        self.step_time = step_time
        self.observation_space = gym.spaces.Box(-2.0, 2.0, shape=(4,), dtype=np.float32)
        self.action_space = gym.spaces.Discrete(2)
        self._state = np.zeros(4, dtype=np.float64)  # (position, velocity, context x, y)

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        super().reset(seed=seed)
        self._state = self.np_random.uniform(-0.05, 0.05, size=4)
        return self._state.astype(np.float32), {}

    def step(self, action: np.int64) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        if self.step_time > 0:
            time.sleep(self.step_time)  # the simulator's wall time; no CPU is used
        position, velocity, cx, cy = self._state
        velocity = 0.9 * velocity + (0.02 if int(action) == 1 else -0.02) + 0.01 * cx
        position = position + velocity
        cx, cy = 0.995 * cx - 0.1 * cy, 0.1 * cx + 0.995 * cy  # a slow rotation
        self._state = np.array([position, velocity, cx, cy])
        terminated = abs(position) > 1.0
        observation = np.clip(self._state, -2.0, 2.0).astype(np.float32)
        return observation, 1.0, bool(terminated), False, {}


if ENV_ID not in gym.registry:
    gym.register(ENV_ID, entry_point=SleepEnv, max_episode_steps=MAX_EPISODE_STEPS)


def make(**kwargs: Any) -> gym.Env:
    """The registered env (time limit included): trustrl's entry point for it."""
    return gym.make(ENV_ID, **kwargs)
