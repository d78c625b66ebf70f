"""A memory test: a cue shown at the first step, needed ``k`` steps later.

At reset the observation's first entry shows the cue (+1 or -1); then ``k`` blank steps;
then the second entry asks for the answer, and the action taken on that observation ends
the episode with reward 1 if it names the cue (action 0 for -1, 1 for +1), else 0. A
memoryless policy sees nothing of the cue when it answers: it is at chance (0.5). A
recurrent policy (``policy.memory``) with ``rollout.sequence_length`` above ``k`` can learn
it.

    PYTHONPATH=. .venv/bin/trustrl train examples.cue:cue8 --config examples/cue.toml
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np


class Cue(gym.Env[np.ndarray, np.int64]):
    observation_space = gym.spaces.Box(-1.0, 1.0, (2,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def __init__(self, k: int = 8) -> None:
        self.k = k
        self.cue = 0
        self.t = 0

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        super().reset(seed=seed)
        self.cue = int(self.np_random.integers(2))
        self.t = 0
        return np.array([2.0 * self.cue - 1.0, 0.0], np.float32), {}

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        self.t += 1
        if self.t <= self.k:  # blank steps; the last of them shows the question
            asking = 1.0 if self.t == self.k else 0.0
            return np.array([0.0, asking], np.float32), 0.0, False, False, {}
        return np.zeros(2, np.float32), float(int(action) == self.cue), True, False, {}


def cue8(**kwargs: Any) -> Cue:
    return Cue(8, **kwargs)


def cue32(**kwargs: Any) -> Cue:
    return Cue(32, **kwargs)
