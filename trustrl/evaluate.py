"""Evaluation: run a policy, normalizer frozen, for whole episodes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from trustrl.envs import env_factory
from trustrl.policy import Policy

if TYPE_CHECKING:
    from trustrl.multiagent import MultiAgentPolicy


@dataclass(frozen=True)
class EvalResult:
    returns: list[float]
    lengths: list[int]

    @property
    def mean_return(self) -> float:
        return float(np.mean(self.returns))

    @property
    def std_return(self) -> float:
        return float(np.std(self.returns))

    def to_json(self) -> dict[str, Any]:
        return {
            "mean_return": self.mean_return,
            "std_return": self.std_return,
            "episodes": len(self.returns),
            "mean_length": float(np.mean(self.lengths)),
            "returns": self.returns,
        }


def evaluate(
    policy: Policy | MultiAgentPolicy,
    env_id: str,
    episodes: int = 10,
    deterministic: bool = True,
    seed: int = 0,
    env_kwargs: dict[str, Any] | None = None,
) -> EvalResult:
    """Mean and spread of the episode return over ``episodes`` seeded episodes."""
    if episodes < 1:
        raise ValueError(f"episodes must be >= 1, got {episodes}")
    from trustrl.multiagent import MultiAgentPolicy, evaluate_parallel

    if isinstance(policy, MultiAgentPolicy):
        # The mean over agents of each agent's episode return, per episode.
        return EvalResult(
            *evaluate_parallel(policy, env_id, episodes, deterministic, seed, env_kwargs)
        )
    env = env_factory(env_id, env_kwargs)()
    returns: list[float] = []
    lengths: list[int] = []
    try:
        for episode in range(episodes):
            obs, info = env.reset(seed=seed + episode)
            total, length, done = 0.0, 0, False
            while not done:
                action = policy.act(obs, deterministic=deterministic, mask=info.get("action_mask"))
                obs, reward, terminated, truncated, info = env.step(action)
                total += float(reward)
                length += 1
                done = bool(terminated or truncated)
            returns.append(total)
            lengths.append(length)
    finally:
        env.close()
    return EvalResult(returns, lengths)
