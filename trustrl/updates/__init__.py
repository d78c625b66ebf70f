"""Update steps, one per algorithm, chosen once by name: the trainer never branches on it."""

from __future__ import annotations

from typing import Any, Protocol

import torch

from trustrl.config import Config
from trustrl.policy import Policy
from trustrl.rollout import Rollout


class Update(Protocol):
    def __call__(self, policy: Policy, rollout: Rollout, progress: float) -> dict[str, float]: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...
    def close(self) -> None:
        """Release what the update holds between calls (PPO's critic worker process)."""

    def register_agent(
        self, grown: list[tuple[torch.nn.Parameter, torch.nn.Parameter, int]]
    ) -> None: ...


def make_update(config: Config, policy: Policy) -> Update:
    """The update registered for ``config.algo``, configured by the section of that name."""
    from trustrl.updates.ppo import PPOUpdate
    from trustrl.updates.trpo import TRPOUpdate

    registry: dict[str, Any] = {"ppo": PPOUpdate, "trpo": TRPOUpdate}
    return registry[config.algo](policy, getattr(config, config.algo), seed=config.seed)
