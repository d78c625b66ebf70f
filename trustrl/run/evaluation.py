"""Evaluation: run a policy, normalizer frozen, for whole episodes."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import gymnasium as gym
import numpy as np

from trustrl.acting.inference import Inference
from trustrl.config import ConfigError
from trustrl.envs.gym import env_factory, env_kwargs_errors
from trustrl.envs.spaces import SpaceSpec
from trustrl.learner.policy import MultiAgentPolicy, Policy, check_agents


@dataclass(frozen=True)
class EvalResult:
    """Episode returns and lengths; for multi-agent envs ``returns`` holds each episode's
    mean over agents, and ``agents`` / ``groups`` each agent's own return and each group's
    mean over its agents (in competitive envs the overall mean says little)."""

    returns: list[float]
    lengths: list[int]
    agents: dict[str, list[float]] = field(default_factory=dict)
    groups: dict[str, list[float]] = field(default_factory=dict)

    @property
    def mean_return(self) -> float:
        return float(np.mean(self.returns))

    @property
    def std_return(self) -> float:
        return float(np.std(self.returns))

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "mean_return": self.mean_return,
            "std_return": self.std_return,
            "episodes": len(self.returns),
            "mean_length": float(np.mean(self.lengths)),
            "returns": self.returns,
        }
        for key, table in (("agents", self.agents), ("groups", self.groups)):
            if table:
                out[key] = {name: _summary(returns) for name, returns in table.items()}
        return out


def _summary(returns: list[float]) -> dict[str, Any]:
    return {
        "mean_return": float(np.mean(returns)),
        "std_return": float(np.std(returns)),
        "returns": returns,
    }


def evaluate(
    policy: Policy | MultiAgentPolicy,
    env_id: str,
    episodes: int = 10,
    deterministic: bool = True,
    seed: int = 0,
    env_kwargs: dict[str, Any] | None = None,
    frame_stack: int = 0,
) -> EvalResult:
    """Mean and spread of the episode return over ``episodes`` seeded episodes.

    ``frame_stack`` is the run's ``env.frame_stack``. Atari episodes are whole games
    (no episodic life, whatever the training used)."""
    if episodes < 1:
        raise ValueError(f"episodes must be >= 1, got {episodes}")
    if isinstance(policy, MultiAgentPolicy):
        means, episode_lengths, agents = evaluate_parallel(
            policy, env_id, episodes, deterministic, seed, env_kwargs
        )
        groups = {
            group.name: [
                float(np.mean([agents[a][e] for a in group.agents])) for e in range(episodes)
            ]
            for group in policy.groups
        }
        return EvalResult(means, episode_lengths, agents, groups)
    # Up to PARALLEL episodes at a time, one env each, so the policy runs once per step
    # on a batch rather than once per env step; each episode keeps its own seed, so the
    # results are those of running the episodes one after another. The policy acts
    # through the collector's numpy path on one weight snapshot (``Policy.act`` does
    # the same in torch, at several times the cost per step on a few rows).
    act = _Actor(policy, deterministic, seed)
    returns: list[float] = [0.0] * episodes
    lengths: list[int] = [0] * episodes
    make = env_factory(env_id, env_kwargs, frame_stack=frame_stack)
    with env_kwargs_errors(env_id, dict(env_kwargs or {})):
        envs = [make() for _ in range(min(episodes, PARALLEL))]
    try:
        check_spaces(policy.spec, envs[0], env_id)
        for first in range(0, episodes, PARALLEL):
            running = list(range(first, min(first + PARALLEL, episodes)))
            slots = dict(zip(running, envs, strict=False))
            current = {i: slots[i].reset(seed=seed + i) for i in running}
            # Each episode's recurrent state (policy.memory; no columns without): zeros first.
            states = {i: np.zeros(act.state_size, np.float32) for i in running}
            while running:
                obs = [current[i][0] for i in running]
                masks = [current[i][1].get("action_mask") for i in running]
                state = np.stack([states[i] for i in running])
                actions, state = act(_stack(obs), _stack_masks(masks), state)
                still = []
                for i, action, row in zip(running, actions, state, strict=True):
                    states[i] = row
                    obs_i, reward, terminated, truncated, info = slots[i].step(action)
                    returns[i] += float(reward)
                    lengths[i] += 1
                    current[i] = (obs_i, info)
                    if not (terminated or truncated):
                        still.append(i)
                running = still
    finally:
        for env in envs:
            env.close()
    return EvalResult(returns, lengths)


PARALLEL = 16  # episodes evaluated at once


def check_spaces(spec: SpaceSpec, env: gym.Env, env_id: str) -> None:
    """Refuse an env whose spaces the policy was not trained for, naming both."""
    try:
        env_spec = SpaceSpec.from_spaces(
            env.observation_space,
            env.action_space,
            image_keys=spec.image_keys,
            flat_keys=spec.flat_keys,
        )
    except ConfigError as exc:
        raise ValueError(f"{env_id}: {exc}") from None
    if not spec.compatible(env_spec):
        raise ValueError(
            f"this policy was trained for {spec.summary()}; {env_id} has {env_spec.summary()}"
        )


class _Actor:
    """``Policy.act`` on a batch of raw observations, in numpy (``Inference``)."""

    def __init__(self, policy: Policy, deterministic: bool, seed: int) -> None:
        self.inference = Inference.of(policy)
        self.state_size = self.inference.state_size  # columns of a recurrent state (0: none)
        self.spec = policy.spec
        self.deterministic = deterministic
        self.rng = np.random.default_rng(seed)  # the draws of a stochastic evaluation

    def __call__(
        self, obs: Any, info_mask: np.ndarray | None, state: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """Actions for a batch of raw observations, and the rows' next recurrent states
        (``state`` as given where the policy has no memory)."""
        inference = self.inference
        flat, obs_mask = self.spec.split(obs)
        mask = info_mask if info_mask is not None else obs_mask
        norm = inference.obs_normalizer
        x = norm.normalize_array(flat) if norm is not None else flat
        noise = None
        if not self.deterministic:
            noise = inference.noise(self.rng, 1, np.zeros(len(x), dtype=np.int64))[0]
        if inference.state_size:
            actions, _, _, state = inference.act_recurrent(x, mask, noise, state)
        elif noise is None:
            actions = inference.mode(x, mask)
        else:
            actions, _ = inference.act(x, mask, noise)
        return self.spec.to_env(actions), state


def _stack(obs: list[Any]) -> Any:
    if isinstance(obs[0], dict):
        return {k: _stack([o[k] for o in obs]) for k in obs[0]}
    if isinstance(obs[0], tuple):
        return tuple(_stack([o[i] for o in obs]) for i in range(len(obs[0])))
    return np.stack([np.asarray(o) for o in obs])


def _stack_masks(masks: list[Any]) -> np.ndarray | None:
    """The envs' info masks as one (B, A) array; None when no env hands one out."""
    if all(m is None for m in masks):
        return None
    size = len(next(m for m in masks if m is not None))
    return np.stack([np.ones(size, bool) if m is None else np.asarray(m, bool) for m in masks])


def play_parallel_episode(
    policy: MultiAgentPolicy,
    env: Any,
    seed: int,
    deterministic: bool,
    after_step: Callable[[], None] | None = None,
) -> tuple[dict[str, float], int]:
    """One episode of a PettingZoo ParallelEnv from ``reset(seed)``: each agent's return
    and the episode's length. ``after_step`` runs after the reset and after every step
    (a video's frame)."""
    observations, _ = env.reset(seed=seed)
    totals = dict.fromkeys(env.possible_agents, 0.0)
    length = 0
    states: dict[str, np.ndarray] = {}  # each agent's recurrent state (policy.memory)
    if after_step is not None:
        after_step()
    while env.agents:
        # Only agents still in the episode act (finished ones may still be in the
        # observation dict of the step that ended them).
        present = {a: observations[a] for a in env.agents}
        if policy.state_size:
            actions, states = policy.act(present, deterministic, states)
        else:
            actions = policy.act(present, deterministic)
        observations, rewards, _, _, _ = env.step(actions)
        for agent, reward in rewards.items():
            totals[agent] += float(reward)
        length += 1
        if after_step is not None:
            after_step()
    return totals, length


def evaluate_parallel(
    policy: MultiAgentPolicy,
    env_id: str,
    episodes: int,
    deterministic: bool = True,
    seed: int = 0,
    env_kwargs: dict[str, Any] | None = None,
) -> tuple[list[float], list[int], dict[str, list[float]]]:
    """Per episode: the mean over agents of each agent's return, the episode length, and
    each agent's own return (by agent name)."""
    from trustrl.envs.pettingzoo import parallel_env_factory  # PettingZoo on use

    env = parallel_env_factory(env_id, env_kwargs)()
    returns, lengths = [], []
    per_agent: dict[str, list[float]] = {a: [] for a in env.possible_agents}
    try:
        check_agents(policy, env, env_id)
        for episode in range(episodes):
            totals, length = play_parallel_episode(policy, env, seed + episode, deterministic)
            returns.append(float(np.mean(list(totals.values()))))
            lengths.append(length)
            for agent, total in totals.items():
                per_agent[agent].append(total)
    finally:
        env.close()
    return returns, lengths, per_agent
