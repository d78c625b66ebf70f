"""Update steps, one per algorithm, chosen once by name: the trainer never branches on it.

The registry is a module of its own (not this package's ``__init__``), so that the
updates, which import their package, are not imported by it in turn: no import cycle.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from trustrl.config import Config
from trustrl.learner.policy import Policy
from trustrl.learner.rollout import Rollout
from trustrl.learner.updates.device import OnDevice
from trustrl.learner.updates.ppo import PPOUpdate
from trustrl.learner.updates.trpo import TRPOUpdate


class Update(Protocol):
    def __call__(self, policy: Policy, rollout: Rollout, progress: float) -> dict[str, float]: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...
    def close(self) -> None:
        """Release what the update holds between calls (PPO's critic worker process)."""

    def register_agent(
        self, grown: list[tuple[torch.nn.Parameter, torch.nn.Parameter, int]]
    ) -> None: ...


REGISTRY: dict[str, Any] = {"ppo": PPOUpdate, "trpo": TRPOUpdate}


def make_update(config: Config, policy: Policy, device: torch.device | None = None) -> Update:
    """The update registered for ``config.algo``, configured by the section of that name;
    on ``device`` other than the CPU, run on a twin of the policy there (``OnDevice``)."""

    def make(target: Policy) -> Update:
        return REGISTRY[config.algo](target, getattr(config, config.algo), seed=config.seed)  # type: ignore[no-any-return]

    if device is None or device.type == "cpu":
        return make(policy)
    return OnDevice(make, policy, device)
