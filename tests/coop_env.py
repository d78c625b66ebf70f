"""Small PettingZoo parallel environments for the multi-agent tests.

Both are importable as entry points (``tests.coop_env:CoopCueEnv``, with the repository
root as the working directory) and are strict: an action for an agent that is not
acting, a missing action, or one outside the action space raises, so a collector that
sends actions to finished agents or forgets live ones fails loudly.

* ``ScriptedParallelEnv``: agents whose episodes end at chosen steps (terminated or
  truncated), observations and rewards that say who, which episode and which step, and
  an optional ``state()``. For the shape and masking tests.
* ``CoopCueEnv``: a cooperative game with a known optimum. For the learning tests.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np
from gymnasium import spaces
from pettingzoo.utils.env import ParallelEnv

ENDINGS = ("terminated", "truncated")


def parse_endings(endings: str | Sequence[tuple[int, str]]) -> list[tuple[int, str]]:
    """``"2:truncated,3:terminated"`` -> [(2, "truncated"), (3, "terminated")], one per agent."""
    if isinstance(endings, str):
        items = []
        for part in endings.split(","):
            length, _, ending = part.strip().partition(":")
            items.append((int(length), ending or "terminated"))
    else:
        items = [(int(length), str(ending)) for length, ending in endings]
    for length, ending in items:
        if length < 1 or ending not in ENDINGS:
            raise ValueError(f"bad ending {(length, ending)}")
    return items


def scripted_reward(agent: int, episode: int, step: int) -> float:
    """Reward of agent ``agent`` for the ``step``-th step (1-based) of ``episode``."""
    return 100.0 * agent + 10.0 * episode + step


class ScriptedParallelEnv(ParallelEnv):
    """Agents ``a0, a1, ...``, one per entry of ``endings``; agent i's episode lasts
    ``endings[i][0]`` steps and then ends with its flag (terminated or truncated). The
    env's episode ends when the last agent's does.

    Agent i observes ``[i, episode, step]`` (float32; step 0 right after a reset, k after
    the env's k-th step, so an agent's final observation is ``[i, e, length_i]``); its
    reward for step k is ``scripted_reward(i, e, k)``. ``episode`` counts from the last
    seeded reset. Actions (Discrete(2)) are checked and otherwise ignored.

    With ``with_state``, ``state()`` returns ``[1000 + episode, step]``; otherwise it
    raises NotImplementedError like PettingZoo's base class.
    """

    metadata: ClassVar[dict[str, Any]] = {"name": "scripted_parallel_v0", "render_modes": []}

    def __init__(
        self,
        endings: str | Sequence[tuple[int, str]] = "2:truncated,3:terminated,4:truncated",
        with_state: bool = False,
    ) -> None:
        self.endings = parse_endings(endings)
        self.with_state = with_state
        self.possible_agents = [f"a{i}" for i in range(len(self.endings))]
        self.agents: list[str] = []
        self._obs_space = spaces.Box(-1e6, 1e6, (3,), np.float32)
        self._act_space = spaces.Discrete(2)
        self.episode = -1
        self.step_count = 0
        self.steps_taken = 0  # step() calls in total
        self.actions_seen: list[dict[str, Any]] = []

    def observation_space(self, agent: str) -> spaces.Space:
        return self._obs_space

    def action_space(self, agent: str) -> spaces.Space:
        return self._act_space

    def _obs(self, agent: str) -> np.ndarray:
        index = self.possible_agents.index(agent)
        return np.array([index, self.episode, self.step_count], dtype=np.float32)

    def state(self) -> np.ndarray:
        if not self.with_state:
            return super().state()
        return np.array([1000.0 + self.episode, self.step_count], dtype=np.float32)

    def reset(
        self, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        self.episode = 0 if seed is not None else self.episode + 1
        self.step_count = 0
        self.agents = list(self.possible_agents)
        return {a: self._obs(a) for a in self.agents}, {a: {} for a in self.agents}

    def step(self, actions: dict[str, Any]) -> tuple[dict, dict, dict, dict, dict]:
        if not self.agents:
            raise RuntimeError("step() after every agent finished (autoreset broken)")
        if set(actions) != set(self.agents):
            raise ValueError(f"actions for {sorted(actions)}, but acting are {self.agents}")
        for agent, action in actions.items():
            if not self._act_space.contains(np.int64(action)):
                raise ValueError(f"action {action!r} of {agent} is not in {self._act_space}")
        self.actions_seen.append(dict(actions))
        self.step_count += 1
        self.steps_taken += 1
        obs, rewards, terminated, truncated, infos = {}, {}, {}, {}, {}
        for agent in self.agents:
            index = self.possible_agents.index(agent)
            length, ending = self.endings[index]
            obs[agent] = self._obs(agent)
            rewards[agent] = scripted_reward(index, self.episode, self.step_count)
            done = self.step_count >= length
            terminated[agent] = done and ending == "terminated"
            truncated[agent] = done and ending == "truncated"
            infos[agent] = {}
        self.agents = [a for a in self.agents if not (terminated[a] or truncated[a])]
        return obs, rewards, terminated, truncated, infos


class CoopCueEnv(ParallelEnv):
    """A cooperative game whose optimal joint policy and return are known.

    Every step all ``num_agents`` agents see the same cue ``c`` (one-hot of
    ``num_cues``, drawn uniformly each step) and each picks one of ``num_cues`` actions.
    Agent i's correct action is ``(c + i * agent_shift) % num_cues``; when every agent
    picks its correct action, every agent gets reward 1, otherwise 0. Episodes last
    ``episode_length`` steps and end truncated.

    Optimal per-agent episode return: ``episode_length``; a uniformly random joint policy
    gets ``episode_length / num_cues ** num_agents``. With ``agent_shift != 0`` agents must
    act differently on the same observation, so a shared actor needs the agent id.

    With ``continuous``, actions are Box(-1, 1, (1,)): answer ``k`` is the point
    ``-1 + 2 k / (num_cues - 1)``, and the team reward is ``1 - mean_i |a_i - target_i| / 2``
    (dense, 1 only for exact answers; the same optimum).
    """

    metadata: ClassVar[dict[str, Any]] = {"name": "coop_cue_v0", "render_modes": []}

    def __init__(
        self,
        num_agents: int = 3,
        num_cues: int = 3,
        episode_length: int = 5,
        agent_shift: int = 1,
        continuous: bool = False,
    ) -> None:
        self.num_cues = num_cues
        self.continuous = continuous
        self.episode_length = episode_length
        self.agent_shift = agent_shift
        self.possible_agents = [f"agent_{i}" for i in range(num_agents)]
        self.agents: list[str] = []
        self._obs_space = spaces.Box(0.0, 1.0, (num_cues,), np.float32)
        self._act_space: spaces.Space = (
            spaces.Box(-1.0, 1.0, (1,), np.float32) if continuous else spaces.Discrete(num_cues)
        )
        self.rng = np.random.default_rng()
        self.cue = 0
        self.step_count = 0

    @property
    def optimal_return(self) -> float:
        return float(self.episode_length)

    @property
    def random_return(self) -> float:
        return self.episode_length / self.num_cues ** len(self.possible_agents)

    def correct_action(self, agent: str, cue: int | None = None) -> int:
        index = self.possible_agents.index(agent)
        current = self.cue if cue is None else cue
        return (current + index * self.agent_shift) % self.num_cues

    def target_point(self, agent: str) -> float:
        return -1.0 + 2.0 * self.correct_action(agent) / (self.num_cues - 1)

    def observation_space(self, agent: str) -> spaces.Space:
        return self._obs_space

    def action_space(self, agent: str) -> spaces.Space:
        return self._act_space

    def _observations(self) -> dict[str, np.ndarray]:
        obs = np.zeros(self.num_cues, dtype=np.float32)
        obs[self.cue] = 1.0
        return {a: obs.copy() for a in self.agents}

    def reset(
        self, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        if seed is not None:
            self.rng = np.random.default_rng(seed)
        self.agents = list(self.possible_agents)
        self.step_count = 0
        self.cue = int(self.rng.integers(self.num_cues))
        return self._observations(), {a: {} for a in self.agents}

    def step(self, actions: dict[str, Any]) -> tuple[dict, dict, dict, dict, dict]:
        if set(actions) != set(self.agents):
            raise ValueError(f"actions for {sorted(actions)}, but acting are {self.agents}")
        for agent, action in actions.items():
            value = np.asarray(action, np.float32) if self.continuous else np.int64(action)
            if not self._act_space.contains(value):
                raise ValueError(f"action {action!r} of {agent} is not in {self._act_space}")
        if self.continuous:
            errors = [
                abs(float(np.asarray(actions[a]).reshape(-1)[0]) - self.target_point(a))
                for a in self.agents
            ]
            reward = 1.0 - float(np.mean(errors)) / 2.0
        else:
            success = all(int(actions[a]) == self.correct_action(a) for a in self.agents)
            reward = 1.0 if success else 0.0
        self.step_count += 1
        self.cue = int(self.rng.integers(self.num_cues))
        done = self.step_count >= self.episode_length
        obs = self._observations()
        rewards = dict.fromkeys(self.agents, reward)
        terminated = dict.fromkeys(self.agents, False)
        truncated = dict.fromkeys(self.agents, done)
        infos: dict[str, Any] = {a: {} for a in self.agents}
        if done:
            self.agents = []
        return obs, rewards, terminated, truncated, infos
