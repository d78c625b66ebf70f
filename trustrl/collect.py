"""The collector: steps a policy through a vector env into a rollout.

It owns everything that lives between iterations on the acting side (the env, the
current observation, which rows are mid-reset, episode accumulators, the reward
scaler and the sampling generator) and nothing of the learner's. It is handed the
policy to act with; in-process that is the trainer's own policy object, and a Ray
runner will hold its own copy, refreshed from the learner's weights.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import gymnasium as gym
import numpy as np
import torch

from trustrl.normalize import RunningMeanStd
from trustrl.policy import Policy
from trustrl.rollout import Rollout
from trustrl.spaces import SpaceSpec


@dataclass
class EpisodeStats:
    """Episodes that finished during one collect call, in raw (unscaled) reward."""

    returns: list[float] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)


class Collector:
    def __init__(
        self,
        envs: gym.vector.VectorEnv,
        seed: int,
        gamma: float,
        normalize_reward: bool = False,
        reward_clip: float = 10.0,
    ) -> None:
        self.envs = envs
        self.num_envs = envs.num_envs
        self.gamma = gamma
        self.generator = torch.Generator().manual_seed(seed)
        self.reward_scaler = RunningMeanStd((), clip=reward_clip) if normalize_reward else None
        n = self.num_envs
        self.discounted_return = np.zeros(n)  # (N,), for reward scaling
        self.episode_return = np.zeros(n)  # (N,), raw reward so far
        self.episode_length = np.zeros(n, dtype=np.int64)  # (N,)
        self.resetting = np.zeros(n, dtype=bool)  # (N,), the next step of this env is a reset
        raw, info = envs.reset(seed=seed)
        # The spaces say everything but whether the env hands out masks in its info.
        self.spec = SpaceSpec.from_spaces(
            envs.single_observation_space, envs.single_action_space, "action_mask" in info
        )
        self.obs, self.mask = self.spec.split(raw, info)  # (N, obs_dim), (N, A) or None

    def reset(self, seed: int) -> None:
        """Start fresh episodes in every env (unfinished episodes are dropped)."""
        raw, info = self.envs.reset(seed=seed)
        self.obs, self.mask = self.spec.split(raw, info)
        self.resetting[:] = False
        self.discounted_return[:] = 0.0
        self.episode_return[:] = 0.0
        self.episode_length[:] = 0

    def collect(self, policy: Policy, rollout: Rollout, train: bool = True) -> EpisodeStats:
        """Fill every row of ``rollout``; with ``train``, update the normalizers as we go."""
        stats = EpisodeStats()
        spec = self.spec
        normalizer = policy.obs_normalizer if train else None
        with torch.inference_mode():
            for t in range(rollout.num_steps):
                obs = torch.from_numpy(self.obs)
                if normalizer is not None:
                    normalizer.update(obs)
                x = policy.normalize(obs)
                mask = torch.from_numpy(self.mask) if self.mask is not None else None
                actions, logprob, value = policy.step(x, mask, self.generator)
                valid = ~self.resetting

                rollout.obs[t] = x
                rollout.actions[t] = actions
                rollout.logprob[t] = logprob
                rollout.values[t] = value
                rollout.valid[t] = torch.from_numpy(valid)
                if rollout.action_mask is not None and mask is not None:
                    rollout.action_mask[t] = mask

                raw, reward, terminated, truncated, info = self.envs.step(spec.to_env(actions))
                reward = np.where(valid, reward, 0.0)
                done = (terminated | truncated) & valid
                self._track_episodes(reward, valid, done, stats)
                rollout.rewards[t] = torch.from_numpy(self._scale(reward, valid, done, train))
                rollout.terminated[t] = torch.from_numpy((terminated & valid).astype(np.float32))
                rollout.truncated[t] = torch.from_numpy(
                    (truncated & valid & ~terminated).astype(np.float32)
                )
                self.resetting = done
                self.obs, self.mask = spec.split(raw, info)

            rollout.last_value.copy_(policy.value(policy.normalize(torch.from_numpy(self.obs))))
        return stats

    def _track_episodes(
        self, reward: np.ndarray, valid: np.ndarray, done: np.ndarray, stats: EpisodeStats
    ) -> None:
        self.episode_return += reward
        self.episode_length += valid
        for row in np.flatnonzero(done):
            stats.returns.append(float(self.episode_return[row]))
            stats.lengths.append(int(self.episode_length[row]))
        self.episode_return[done] = 0.0
        self.episode_length[done] = 0

    def _scale(
        self, reward: np.ndarray, valid: np.ndarray, done: np.ndarray, train: bool
    ) -> np.ndarray:
        """Reward / std(discounted return) (Engstrom et al. 2020's reward scaling)."""
        if self.reward_scaler is None:
            return reward.astype(np.float32)
        self.discounted_return = self.discounted_return * self.gamma + reward
        if train:
            self.reward_scaler.update(torch.from_numpy(self.discounted_return[valid]))
        self.discounted_return[done] = 0.0
        return self.reward_scaler.scale(torch.from_numpy(reward)).numpy().astype(np.float32)

    def state_dict(self) -> dict[str, Any]:
        return {
            "generator": self.generator.get_state(),
            "reward_scaler": self.reward_scaler.state_dict() if self.reward_scaler else None,
            "discounted_return": self.discounted_return.copy(),
            "episode_return": self.episode_return.copy(),
            "episode_length": self.episode_length.copy(),
            "resetting": self.resetting.copy(),
            "obs": self.obs.copy(),
            "mask": self.mask.copy() if self.mask is not None else None,
        }

    def load_state_dict(
        self, state: dict[str, Any], envs: gym.vector.VectorEnv | None = None
    ) -> None:
        """Restore the acting side. With ``envs`` (restored mid-episode), the episodes in
        flight continue exactly; without, the current envs keep their fresh episodes."""
        self.generator.set_state(state["generator"])
        if self.reward_scaler is not None and state["reward_scaler"] is not None:
            self.reward_scaler.load_state_dict(state["reward_scaler"])
        if envs is None:
            return
        self.envs.close()
        self.envs = envs
        self.discounted_return = state["discounted_return"].copy()
        self.episode_return = state["episode_return"].copy()
        self.episode_length = state["episode_length"].copy()
        self.resetting = state["resetting"].copy()
        self.obs = state["obs"].copy()
        self.mask = state["mask"].copy() if state["mask"] is not None else None

    def close(self) -> None:
        self.envs.close()
