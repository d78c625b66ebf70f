"""trustrl: trust-region policy optimization (PPO, TRPO, multi-agent PPO).

The heavy parts (torch, gymnasium, TensorBoard) are imported on first use, so
``import trustrl`` stays fast::

    import trustrl

    config = trustrl.resolve("CartPole-v1", overrides={"total_steps": 50_000})
    policy = trustrl.train(config)
    print(trustrl.evaluate(policy, "CartPole-v1", episodes=10).mean_return)
    action = policy.act(observation)
"""

from __future__ import annotations

from typing import Any

from trustrl.config import (
    Config,
    ConfigError,
    EnvConfig,
    PolicyConfig,
    PPOConfig,
    RolloutConfig,
    RunnersConfig,
    TRPOConfig,
    resolve,
)

__version__ = "0.1.0"

_LAZY = {
    "Agent": "trustrl.client.agent",
    "Trainer": "trustrl.run.trainer",
    "train": "trustrl.run.trainer",
    "Policy": "trustrl.learner.policy",
    "evaluate": "trustrl.run.evaluation",
    "load_policy": "trustrl.run.checkpoint",
}

__all__ = [
    "Config",
    "ConfigError",
    "EnvConfig",
    "PPOConfig",
    "PolicyConfig",
    "RolloutConfig",
    "RunnersConfig",
    "TRPOConfig",
    "resolve",
    *_LAZY,
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'trustrl' has no attribute {name!r}")
