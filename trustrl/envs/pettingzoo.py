"""PettingZoo parallel environments as rows: one row per (env, agent), agents grouped by spaces.

``ParallelRows`` steps ``num_envs`` copies of a PettingZoo ``ParallelEnv`` and presents
each group of agents with equal observation and action spaces as ``num_envs x agents``
rows, with the same NEXT_STEP autoreset semantics as Gymnasium's vector envs, so the
one collector serves both:

* an agent that finishes while others play on keeps its row, marked not alive (never
  trained on), showing its final observation, so the value computed there is the
  bootstrap a truncated agent needs;
* when no agent is left, the env's next step is a reset step: every row of that env
  gets the new episode's first observation, reward 0 and no done flag.

The critic input of a group is the agent's own observation (``local``, IPPO), a global
state (``global``, MAPPO): the env's ``state()`` when it has one, else all agents'
observations concatenated in ``possible_agents`` order, or that global state followed
by the agent's own observation (``agent_state``, MAPPO's agent-specific global state:
the critic is handed which part of the state is its agent's own view), or every agent's
observation with the agent's own first and the others after it in ``possible_agents``
order (``agent_centric``: all that the agents see, in a layout that is the same for
every agent of a group, so the critic's first layer serves them all alike).
"""

from __future__ import annotations

import importlib
import math
import pickle
from collections.abc import Callable
from typing import Any

import gymnasium as gym
import numpy as np

from trustrl.config import ConfigError
from trustrl.envs.rows import AgentGroup, GroupObs, GroupStep, check_finite, is_entry_point
from trustrl.envs.spaces import SpaceSpec


def parallel_env_factory(env_id: str, kwargs: dict[str, Any] | None = None) -> Callable[[], Any]:
    """A zero-argument callable building one PettingZoo ParallelEnv, or None-like failure.

    ``family:name`` (``mpe2:simple_spread_v3``) imports ``family.name`` and calls its
    ``parallel_env``; ``package.module:callable`` calls the callable (an AEC env it
    returns is converted with PettingZoo's ``aec_to_parallel``).
    """
    kwargs = dict(kwargs or {})
    module_name, _, attr = env_id.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"env_id {env_id!r}: cannot import {module_name!r} ({exc})") from None
    target: Any = getattr(module, attr, None)
    if target is None:
        try:
            target = importlib.import_module(f"{module_name}.{attr}")
        except ImportError:
            raise ConfigError(f"env_id {env_id!r}: {module_name!r} has no {attr!r}") from None
    if hasattr(target, "parallel_env"):
        target = target.parallel_env
    if not callable(target):
        raise ConfigError(f"env_id {env_id!r}: {attr!r} is not callable")
    return _ParallelFactory(target, kwargs)


class _ParallelFactory:
    def __init__(self, target: Callable[..., Any], kwargs: dict[str, Any]) -> None:
        self.target, self.kwargs = target, kwargs

    def __call__(self) -> Any:
        from pettingzoo.utils.conversions import aec_to_parallel
        from pettingzoo.utils.env import AECEnv

        env = self.target(**self.kwargs)
        if isinstance(env, AECEnv):
            env = aec_to_parallel(env)
        return env


def is_parallel_env_id(env_id: str, kwargs: dict[str, Any] | None = None) -> bool:
    """Whether ``env_id`` names a PettingZoo environment (it is built once to tell)."""
    if not is_entry_point(env_id):
        return False
    try:
        factory = parallel_env_factory(env_id, kwargs)
    except ConfigError:
        return False
    target = factory.target  # type: ignore[attr-defined]
    if isinstance(target, type) and issubclass(target, gym.Env):
        return False
    try:
        from pettingzoo.utils.env import ParallelEnv
    except ImportError:
        return False
    env = factory()
    try:
        return isinstance(env, ParallelEnv)
    finally:
        env.close()


def _group_name(agents: list[str], index: int) -> str:
    prefixes = {agent.rsplit("_", 1)[0] for agent in agents}
    return prefixes.pop() if len(prefixes) == 1 else f"group{index}"


def _has_state(env: Any) -> bool:
    try:
        env.state()
    except (NotImplementedError, AttributeError):
        return False
    return True


class ParallelRows:
    """``num_envs`` PettingZoo parallel envs as groups of rows (see the module docstring)."""

    def __init__(
        self,
        factory: Callable[[], Any],
        num_envs: int,
        critic_input: str = "global",
        name: str = "the env",
    ) -> None:
        self.factory = factory
        self.name = name
        self.env_steps = 0  # steps since the envs were built, for messages
        self.num_envs = num_envs
        self.critic_input = critic_input
        self.envs = [factory() for _ in range(num_envs)]
        self._groups: list[AgentGroup] | None = None

    def _build_groups(self) -> list[AgentGroup]:
        env = self.envs[0]
        agents = list(env.possible_agents)
        by_spaces: dict[tuple[str, str], list[str]] = {}
        for agent in agents:
            key = (repr(env.observation_space(agent)), repr(env.action_space(agent)))
            by_spaces.setdefault(key, []).append(agent)
        self.agents = agents
        self.obs_dims = {a: math.prod(env.observation_space(a).shape) for a in agents}
        all_obs_dim = sum(self.obs_dims.values())
        self.state_mode = "none"
        self.state_dim = 0
        if self.critic_input in ("global", "agent_state"):
            if _has_state(env):
                self.state_mode = "state"
                self.state_dim = int(np.asarray(env.state()).size)
            else:
                self.state_mode = "concat"
                self.state_dim = all_obs_dim
        groups = []
        for index, members in enumerate(by_spaces.values()):
            obs_space = env.observation_space(members[0])
            act_space = env.action_space(members[0])
            spec = SpaceSpec.from_spaces(obs_space, act_space, members[0] in self._info_masks)
            if spec.obs_entries:
                raise ConfigError(
                    f"{members[0]}'s observations are {spec.summary().split(',')[0]}: "
                    "multi-agent groups take flat Box observations (images, Dict, Tuple and "
                    "Discrete observations are for single-agent envs)"
                )
            critic_dim = {
                "local": None,
                "global": self.state_dim,
                "agent_state": self.state_dim + spec.obs_dim,
                "agent_centric": all_obs_dim,
            }[self.critic_input]
            groups.append(AgentGroup(_group_name(members, index), tuple(members), spec, critic_dim))
        return groups

    @property
    def groups(self) -> list[AgentGroup]:
        if self._groups is None:
            raise RuntimeError("reset the env first")
        return self._groups

    # Per-row state, in (env, agent) order per group.

    def _allocate(self) -> None:
        self.obs = {a: np.zeros((self.num_envs, self.obs_dims[a]), np.float32) for a in self.agents}
        self.alive = {a: np.zeros(self.num_envs, dtype=bool) for a in self.agents}
        self.masks: dict[str, np.ndarray] = {}
        self.ended = np.zeros(self.num_envs, dtype=bool)
        self.state = np.zeros((self.num_envs, self.state_dim), np.float32)

    def _write(self, e: int, env: Any, observations: dict[str, Any], infos: dict[str, Any]) -> None:
        for agent, value in observations.items():
            if isinstance(value, dict):
                self.masks.setdefault(
                    agent, np.ones((self.num_envs, len(value["action_mask"])), dtype=bool)
                )[e] = value["action_mask"]
                value = value["observation"]
            self.obs[agent][e] = np.asarray(value, dtype=np.float32).reshape(-1)
            mask = infos.get(agent, {}).get("action_mask") if isinstance(infos, dict) else None
            if mask is not None:
                self.masks.setdefault(agent, np.ones((self.num_envs, len(mask)), dtype=bool))[e] = (
                    mask
                )
        if self.state_mode == "state":
            self.state[e] = np.asarray(env.state(), dtype=np.float32).reshape(-1)
        elif self.state_mode == "concat":
            self.state[e] = np.concatenate([self.obs[a][e] for a in self.agents])

    def _observed(self) -> list[GroupObs]:
        out = []
        for group in self.groups:
            members = group.agents
            # (num_envs, agents, ...) -> rows in (env, agent) order.
            obs = np.stack([self.obs[a] for a in members], 1).reshape(-1, group.spec.obs_dim)
            alive = np.stack([self.alive[a] for a in members], 1).reshape(-1)
            mask = None
            if group.spec.masked:
                width = group.spec.mask_dim or 0
                mask = np.stack([self.masks[a] for a in members], 1).reshape(-1, width)
            critic = None
            if self.critic_input == "agent_centric":
                critic = np.stack(
                    [
                        np.concatenate(
                            [self.obs[a], *(self.obs[b] for b in self.agents if b != a)], 1
                        )
                        for a in members
                    ],
                    1,
                ).reshape(len(obs), -1)
            elif group.critic_dim is not None:
                critic = np.repeat(self.state, len(members), axis=0)
                if self.critic_input == "agent_state":
                    critic = np.concatenate([critic, obs], axis=1)
            out.append(GroupObs(obs, mask, critic, alive))
        return out

    def reset(self, seed: int) -> list[GroupObs]:
        first = self._groups is None
        if first:
            _, infos = self.envs[0].reset(seed=seed)
            self._info_masks = {a for a, info in infos.items() if "action_mask" in (info or {})}
            self._groups = self._build_groups()
            self._allocate()
        for e, env in enumerate(self.envs):
            self._reset_env(e, env, seed + e)
        observed = self._observed()
        check_finite(self.name, observed, None, self.env_steps, self.groups)
        return observed

    def _reset_env(self, e: int, env: Any, seed: int | None) -> None:
        observations, infos = env.reset(seed=seed)
        for agent in self.agents:
            self.alive[agent][e] = agent in observations
        self._write(e, env, observations, infos)
        self.ended[e] = False

    def step(self, actions: list[np.ndarray]) -> tuple[list[GroupObs], list[GroupStep]]:
        n = self.num_envs
        per_agent: dict[str, np.ndarray] = {}
        for group, group_actions in zip(self.groups, actions, strict=True):
            env_actions = group.spec.to_env(group_actions)
            env_actions = env_actions.reshape(n, group.num_agents, *env_actions.shape[1:])
            for i, agent in enumerate(group.agents):
                per_agent[agent] = env_actions[:, i]
        rewards = {a: np.zeros(n) for a in self.agents}
        terminated = {a: np.zeros(n, dtype=bool) for a in self.agents}
        truncated = {a: np.zeros(n, dtype=bool) for a in self.agents}
        for e, env in enumerate(self.envs):
            if self.ended[e]:
                # NEXT_STEP autoreset: this step only resets; the action is ignored.
                self._reset_env(e, env, None)
                continue
            acting = {a: per_agent[a][e] for a in env.agents}
            observations, rew, term, trunc, infos = env.step(acting)
            for agent in acting:
                rewards[agent][e] = rew.get(agent, 0.0)
                terminated[agent][e] = bool(term.get(agent, False))
                truncated[agent][e] = bool(trunc.get(agent, False))
            self._write(e, env, observations, infos)
            for agent in self.agents:
                self.alive[agent][e] = agent in env.agents
            if not env.agents:
                self.ended[e] = True
        steps = []
        for group in self.groups:
            members = group.agents
            steps.append(
                GroupStep(
                    np.stack([rewards[a] for a in members], 1).reshape(-1),
                    np.stack([terminated[a] for a in members], 1).reshape(-1),
                    np.stack([truncated[a] for a in members], 1).reshape(-1),
                )
            )
        self.env_steps += 1
        observed = self._observed()
        check_finite(self.name, observed, steps, self.env_steps, self.groups)
        return observed, steps

    def capture(self) -> bytes | None:
        from gymnasium.utils import EzPickle

        # EzPickle envs (MPE among them) pickle as their constructor call: state is lost.
        if any(isinstance(getattr(env, "unwrapped", env), EzPickle) for env in self.envs):
            return None
        try:
            return pickle.dumps(
                {k: v for k, v in self.__dict__.items() if k != "factory"},
                protocol=pickle.HIGHEST_PROTOCOL,
            )
        except Exception:  # any failure to serialize means "not capturable"
            return None

    def restore(self, data: dict[str, Any] | bytes) -> None:
        """Inverse of capture. Unpickles: only for a run folder the user said to trust
        (``--trust-env-state``)."""
        if not isinstance(data, bytes):
            raise ValueError("PettingZoo envs have no array state to restore")
        self.close()
        self.__dict__.update(pickle.loads(data))

    def close(self) -> None:
        for env in self.envs:
            env.close()
