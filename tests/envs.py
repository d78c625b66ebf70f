"""Small deterministic Gymnasium environments for the integration tests.

Each is importable as a ``tests.envs:Name`` entry point (``trustrl train tests.envs:Name``
with the repository root as the working directory). They are deliberately strict: an
action outside the action space, or one that the current action mask forbids, raises,
so a training run that sends a wrong action to the environment fails loudly.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import gymnasium as gym
import numpy as np
from gymnasium import spaces

ENDINGS = ("terminated", "truncated", "both")


def parse_schedule(schedule: str | Sequence[tuple[int, str]]) -> list[tuple[int, str]]:
    """``"3:terminated,2:truncated"`` (or a list of (length, ending)) -> [(3, ...), (2, ...)]."""
    if isinstance(schedule, str):
        items = []
        for part in schedule.split(","):
            length, _, ending = part.strip().partition(":")
            items.append((int(length), ending or "terminated"))
    else:
        items = [(int(length), str(ending)) for length, ending in schedule]
    for length, ending in items:
        if length < 1 or ending not in (*ENDINGS, "never"):
            raise ValueError(f"bad schedule entry {(length, ending)}")
    return items


def scripted_reward(tag: int, episode: int, step: int) -> float:
    """Reward of the ``step``-th step (1-based) of ``episode`` in env ``tag``."""
    return 100.0 * tag + 10.0 * episode + step


class ScriptedEnv(gym.Env):
    """Episodes of scripted lengths and endings; observations say where we are.

    The observation is ``[tag, episode, step]`` (float32): ``step`` is 0 right after a
    reset and k after the k-th step of the episode, so the final observation of an
    episode of length L is ``[tag, e, L]``. Episode ``e`` (counted from the last seeded
    reset, cycling through ``schedule``) ends after its length with ``terminated``,
    ``truncated`` or ``both`` flags set, or never ("never": a TimeLimit must end it).
    The reward of step k is ``scripted_reward(tag, e, k)``. Actions are ignored.
    """

    metadata: ClassVar[dict[str, Any]] = {"render_modes": []}

    def __init__(self, schedule: str | Sequence[tuple[int, str]] = "3:terminated", tag: int = 0):
        self.schedule = parse_schedule(schedule)
        self.tag = tag
        self.observation_space = spaces.Box(-1e6, 1e6, (3,), np.float32)
        self.action_space = spaces.Discrete(2)
        self.episode = -1
        self.step_count = 0
        self.steps_taken = 0  # env.step calls in total (resets excluded)

    def _obs(self) -> np.ndarray:
        return np.array([self.tag, self.episode, self.step_count], dtype=np.float32)

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        super().reset(seed=seed)
        self.episode = 0 if seed is not None else self.episode + 1
        self.step_count = 0
        return self._obs(), {}

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        if not self.action_space.contains(action):
            raise ValueError(f"action {action!r} is not in {self.action_space}")
        length, ending = self.schedule[self.episode % len(self.schedule)]
        if self.step_count >= length and ending != "never":
            raise RuntimeError("step() called after the episode ended (autoreset broken)")
        self.step_count += 1
        self.steps_taken += 1
        over = self.step_count == length
        terminated = over and ending in ("terminated", "both")
        truncated = over and ending in ("truncated", "both")
        reward = scripted_reward(self.tag, self.episode, self.step_count)
        return self._obs(), reward, terminated, truncated, {}


def make_scripted(
    schedule: str | Sequence[tuple[int, str]] = "3:terminated",
    tag: int = 0,
    max_episode_steps: int | None = None,
) -> gym.Env:
    """A ScriptedEnv, wrapped in a TimeLimit when ``max_episode_steps`` is given."""
    env: gym.Env = ScriptedEnv(schedule, tag)
    if max_episode_steps is not None:
        env = gym.wrappers.TimeLimit(env, max_episode_steps=max_episode_steps)
    return env


def allowed_actions(step: int, n: int) -> np.ndarray:
    """The mask pattern of the masked envs: a different non-empty subset at every step."""
    mask = np.zeros(n, dtype=bool)
    mask[step % n] = True
    mask[(3 * step + 2) % n] = True
    return mask


class MaskedInfoEnv(gym.Env):
    """Discrete(n) with the allowed actions in ``info["action_mask"]``.

    The observation is ``[step, one-hot of the allowed actions...]`` so a policy can
    learn; the reward is 1 for the action ``step % n`` (always allowed). A forbidden
    action raises. Episodes terminate after ``length`` steps.
    """

    metadata: ClassVar[dict[str, Any]] = {"render_modes": []}

    def __init__(self, n: int = 5, length: int = 6):
        self.n, self.length = n, length
        self.observation_space = spaces.Box(-1e3, 1e3, (1 + n,), np.float32)
        self.action_space = spaces.Discrete(n)
        self.step_count = 0

    def _obs(self) -> np.ndarray:
        mask = allowed_actions(self.step_count, self.n)
        return np.concatenate([[self.step_count], mask]).astype(np.float32)

    def _info(self) -> dict[str, Any]:
        return {"action_mask": allowed_actions(self.step_count, self.n).astype(np.int8)}

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        super().reset(seed=seed)
        self.step_count = 0
        return self._obs(), self._info()

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        if not self.action_space.contains(action):
            raise ValueError(f"action {action!r} is not in {self.action_space}")
        if not allowed_actions(self.step_count, self.n)[int(action)]:
            raise ValueError(f"action {int(action)} is masked out at step {self.step_count}")
        reward = 1.0 if int(action) == self.step_count % self.n else 0.0
        self.step_count += 1
        terminated = self.step_count >= self.length
        return self._obs(), reward, terminated, False, self._info()


class MaskedDictEnv(gym.Env):
    """Discrete(n) with a Dict observation {"observation", "action_mask"}.

    Same dynamics and mask pattern as MaskedInfoEnv, the mask carried in the observation
    (int8, as PettingZoo's classic envs do). A forbidden action raises.
    """

    metadata: ClassVar[dict[str, Any]] = {"render_modes": []}

    def __init__(self, n: int = 4, length: int = 5):
        self.n, self.length = n, length
        self.observation_space = spaces.Dict(
            {
                "observation": spaces.Box(-1e3, 1e3, (2,), np.float32),
                "action_mask": spaces.Box(0, 1, (n,), np.int8),
            }
        )
        self.action_space = spaces.Discrete(n)
        self.step_count = 0

    def _obs(self) -> dict[str, np.ndarray]:
        return {
            "observation": np.array([self.step_count, self.step_count % 2], dtype=np.float32),
            "action_mask": allowed_actions(self.step_count, self.n).astype(np.int8),
        }

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        super().reset(seed=seed)
        self.step_count = 0
        return self._obs(), {}

    def step(self, action: Any) -> tuple[dict[str, np.ndarray], float, bool, bool, dict]:
        if not self.action_space.contains(action):
            raise ValueError(f"action {action!r} is not in {self.action_space}")
        if not allowed_actions(self.step_count, self.n)[int(action)]:
            raise ValueError(f"action {int(action)} is masked out at step {self.step_count}")
        reward = 1.0 if int(action) == self.step_count % self.n else 0.0
        self.step_count += 1
        terminated = self.step_count >= self.length
        return self._obs(), reward, terminated, False, {}


class MultiDiscreteEnv(gym.Env):
    """MultiDiscrete([3, 4]) actions; reward 1 per component matching a target from the obs.

    The observation is a one-hot of the two targets (3 + 4 values); episodes terminate
    after ``length`` steps. An action outside the space raises.
    """

    metadata: ClassVar[dict[str, Any]] = {"render_modes": []}
    nvec = (3, 4)

    def __init__(self, length: int = 8):
        self.length = length
        self.observation_space = spaces.Box(0.0, 1.0, (sum(self.nvec),), np.float32)
        self.action_space = spaces.MultiDiscrete(self.nvec)
        self.step_count = 0

    def _targets(self) -> tuple[int, int]:
        return self.step_count % 3, (self.step_count * 3 + 1) % 4

    def _obs(self) -> np.ndarray:
        obs = np.zeros(sum(self.nvec), dtype=np.float32)
        a, b = self._targets()
        obs[a] = 1.0
        obs[3 + b] = 1.0
        return obs

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        super().reset(seed=seed)
        self.step_count = 0
        return self._obs(), {}

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        action = np.asarray(action)
        if action.shape != (2,) or not self.action_space.contains(action.astype(np.int64)):
            raise ValueError(f"action {action!r} is not in {self.action_space}")
        a, b = self._targets()
        reward = float(int(action[0]) == a) + float(int(action[1]) == b)
        self.step_count += 1
        return self._obs(), reward, self.step_count >= self.length, False, {}


class ImageBoxEnv(gym.Env):
    """Box(-1, 1, (2,)) actions and an image-shaped Box observation (3, 4, 4).

    Pixel [0, 0, 0:2] holds the action the env last received (so a test can read back
    what reached the env), pixel [1, 0, 0] the step count, the rest a fixed pattern. The
    reward is -|a - target|^2 for target (0.5, -0.5). An action outside [-1, 1] (or of the
    wrong shape) raises. Episodes are truncated after ``length`` steps.
    """

    metadata: ClassVar[dict[str, Any]] = {"render_modes": []}
    target = np.array([0.5, -0.5], dtype=np.float32)

    def __init__(self, length: int = 10):
        self.length = length
        self.observation_space = spaces.Box(-100.0, 100.0, (3, 4, 4), np.float32)
        self.action_space = spaces.Box(-1.0, 1.0, (2,), np.float32)
        self.step_count = 0
        self.last_action = np.zeros(2, dtype=np.float32)

    def _obs(self) -> np.ndarray:
        obs = np.linspace(-1.0, 1.0, 48, dtype=np.float32).reshape(3, 4, 4)
        obs[0, 0, 0:2] = self.last_action
        obs[1, 0, 0] = self.step_count
        return obs

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        super().reset(seed=seed)
        self.step_count = 0
        self.last_action = np.zeros(2, dtype=np.float32)
        return self._obs(), {}

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        action = np.asarray(action, dtype=np.float32)
        if action.shape != (2,) or not np.all(np.abs(action) <= 1.0):
            raise ValueError(f"action {action!r} is not in {self.action_space}")
        self.last_action = action.copy()
        self.step_count += 1
        reward = -float(np.sum((action - self.target) ** 2))
        return self._obs(), reward, False, self.step_count >= self.length, {}


class NonFiniteEnv(gym.Env):
    """Box(4) observations, Discrete(2) actions, episodes of 10 steps; at the env's
    ``at``-th step (counted over its whole life, from 1; 0: the first reset) it hands out
    ``value`` in observation entry ``entry`` or as the reward (``where``), once, or in
    every step from then on with ``every``."""

    metadata: ClassVar[dict[str, Any]] = {"render_modes": []}

    def __init__(
        self,
        where: str = "observation",
        at: int = 5,
        entry: int = 2,
        value: float = float("nan"),
        every: bool = False,
    ):
        self.where, self.at, self.entry, self.value, self.every = where, at, entry, value, every
        self.observation_space = spaces.Box(-10.0, 10.0, (4,), np.float32)
        self.action_space = spaces.Discrete(2)
        self.steps = 0  # over the env's life
        self.episode_step = 0

    def _hit(self) -> bool:
        return self.steps >= self.at if self.every else self.steps == self.at

    def _obs(self, hit: bool) -> np.ndarray:
        obs = np.full(4, self.episode_step / 10, dtype=np.float32)
        if self.where == "observation" and hit:
            obs[self.entry] = self.value
        return obs

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        super().reset(seed=seed)
        self.episode_step = 0
        return self._obs(self.at == 0 and self.steps == 0), {}

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        self.steps += 1
        self.episode_step += 1
        hit = self._hit()
        reward = self.value if self.where == "reward" and hit else float(action)
        return self._obs(hit), reward, self.episode_step >= 10, False, {}


class DotEnv(gym.Env):
    """A structured-observation task a policy solves in a few thousand steps: a dot is
    drawn in one half of a small grid and the action says which half (Discrete(2)):
    reward 1 when right, 0 otherwise; episodes of ``length`` steps.

    ``kind`` picks the observation: "uint8" a (6, 6, 1) uint8 frame (0 or 255), "bool" a
    (6, 6, 2) bool grid (channels last, as MinAtar's), "first" a (2, 6, 6) uint8 frame
    (channels first, as FrameStackObservation's), "dict" a Dict of the bool grid
    ("grid"), a float vector ("vec", noise) and a Discrete ("count", the step), "tuple"
    a Tuple of a Discrete (the dot's half, 0 or 1) and a MultiBinary(3) (noise).
    """

    metadata: ClassVar[dict[str, Any]] = {"render_modes": ["rgb_array"], "render_fps": 4}

    def __init__(self, kind: str = "uint8", length: int = 8, render_mode: str | None = None):
        self.kind, self.length, self.render_mode = kind, length, render_mode
        grid = spaces.Box(0, 1, (6, 6, 2), bool)
        self.observation_space: spaces.Space = {
            "uint8": spaces.Box(0, 255, (6, 6, 1), np.uint8),
            "bool": grid,
            "first": spaces.Box(0, 255, (2, 6, 6), np.uint8),
            "dict": spaces.Dict(
                {
                    "grid": grid,
                    "vec": spaces.Box(-1.0, 1.0, (2,), np.float32),
                    "count": spaces.Discrete(length + 1),
                }
            ),
            "tuple": spaces.Tuple((spaces.Discrete(2), spaces.MultiBinary(3))),
        }[kind]
        self.action_space = spaces.Discrete(2)
        self.side = 0
        self.row = 0
        self.steps = 0

    def _grid(self) -> np.ndarray:
        grid = np.zeros((6, 6), dtype=np.uint8)
        grid[self.row, self.side * 3 + self.row % 3] = 1
        return grid

    def _obs(self) -> Any:
        self.side = int(self.np_random.integers(2))
        self.row = int(self.np_random.integers(6))
        grid = self._grid()
        if self.kind == "uint8":
            return (grid * 255)[:, :, None]
        if self.kind == "first":
            return np.stack([grid * 255, np.zeros_like(grid)])
        if self.kind == "tuple":
            return (self.side, self.np_random.integers(0, 2, 3).astype(np.int8))
        bools = np.stack([grid.astype(bool), np.zeros((6, 6), bool)], -1)
        if self.kind == "bool":
            return bools
        return {
            "grid": bools,
            "vec": self.np_random.uniform(-1, 1, 2).astype(np.float32),
            "count": self.steps,
        }

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[Any, dict[str, Any]]:
        super().reset(seed=seed)
        self.steps = 0
        return self._obs(), {}

    def step(self, action: Any) -> tuple[Any, float, bool, bool, dict[str, Any]]:
        reward = float(int(action) == self.side)
        self.steps += 1
        return self._obs(), reward, False, self.steps >= self.length, {}

    def render(self) -> np.ndarray:
        return np.repeat(self._grid()[:, :, None] * 255, 3, -1)


class TextEnv(gym.Env):
    """A Text observation, which trustrl does not take."""

    metadata: ClassVar[dict[str, Any]] = {"render_modes": []}

    def __init__(self) -> None:
        self.observation_space = spaces.Text(8)
        self.action_space = spaces.Discrete(2)

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[str, dict[str, Any]]:
        super().reset(seed=seed)
        return "hello", {}

    def step(self, action: Any) -> tuple[str, float, bool, bool, dict[str, Any]]:
        return "hello", 0.0, False, False, {}
