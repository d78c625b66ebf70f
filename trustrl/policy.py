"""The actor-critic: observation normalizer, actor MLP with an action head, critic MLP.

The normalizer lives inside the policy (see normalize.py), so one ``state_dict``
holds everything needed to act. Actor and critic are separate networks: TRPO and the
separate-optimizer PPO setting step them independently, and a critic loss can never
reach actor weights.
"""

from __future__ import annotations

import math
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from trustrl.config import PolicyConfig
from trustrl.distributions import (
    ActionHead,
    CategoricalHead,
    DiagGaussianHead,
    MultiCategoricalHead,
)
from trustrl.normalize import RunningMeanStd
from trustrl.spaces import SpaceSpec

ACTIVATIONS: dict[str, type[nn.Module]] = {"tanh": nn.Tanh, "relu": nn.ReLU}


def mlp(in_features: int, hidden_sizes: tuple[int, ...], activation: str) -> nn.Sequential:
    layers: list[nn.Module] = []
    for width in hidden_sizes:
        layers += [nn.Linear(in_features, width), ACTIVATIONS[activation]()]
        in_features = width
    return nn.Sequential(*layers)


def orthogonal_init(module: nn.Module, gain: float) -> None:
    """Orthogonal weights, zero biases (Saxe et al. 2014; Andrychowicz et al. 2021, C57)."""
    for layer in module.modules():
        if isinstance(layer, nn.Linear):
            nn.init.orthogonal_(layer.weight, gain=gain)
            nn.init.zeros_(layer.bias)


def make_head(spec: SpaceSpec, in_features: int, config: PolicyConfig) -> nn.Module:
    if spec.action_kind == "discrete":
        return CategoricalHead(in_features, spec.nvec[0])
    if spec.action_kind == "multidiscrete":
        return MultiCategoricalHead(in_features, spec.nvec)
    return DiagGaussianHead(in_features, spec.action_shape[0], config.log_std_init)


class Policy(nn.Module):
    """Actor-critic over flat float32 observations (B, obs_dim)."""

    def __init__(
        self,
        spec: SpaceSpec,
        config: PolicyConfig | None = None,
        normalize_obs: bool = False,
        obs_clip: float = 10.0,
    ) -> None:
        super().__init__()
        config = config or PolicyConfig()
        self.spec = spec
        self.config = config
        self.obs_normalizer = RunningMeanStd(spec.obs_dim, clip=obs_clip) if normalize_obs else None
        hidden = config.hidden_sizes
        self.actor = mlp(spec.obs_dim, hidden, config.activation)
        self.head: ActionHead = make_head(spec, hidden[-1], config)  # type: ignore[assignment]
        self.critic = nn.Sequential(
            mlp(spec.obs_dim, hidden, config.activation), nn.Linear(hidden[-1], 1)
        )
        if config.ortho_init:
            orthogonal_init(self.actor, math.sqrt(2))
            orthogonal_init(self.critic[0], math.sqrt(2))
            # A near-uniform initial policy keeps every action explorable.
            orthogonal_init(self.head.linear, 0.01)  # type: ignore[attr-defined]
            orthogonal_init(self.critic[1], 1.0)

    # The pieces the updates use.

    def normalize(self, obs: Tensor) -> Tensor:
        return self.obs_normalizer(obs) if self.obs_normalizer is not None else obs

    def dist_params(self, obs: Tensor, mask: Tensor | None = None) -> Tensor:
        return self.head.forward(self.actor(obs), mask)

    def value(self, obs: Tensor) -> Tensor:
        return self.critic(obs).squeeze(-1)

    def actor_parameters(self) -> list[nn.Parameter]:
        return [*self.actor.parameters(), *self.head.parameters()]  # type: ignore[attr-defined]

    def critic_parameters(self) -> list[nn.Parameter]:
        return list(self.critic.parameters())

    @torch.inference_mode()
    def step(
        self, obs: Tensor, mask: Tensor | None = None, generator: torch.Generator | None = None
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Collector inference on normalized obs: (actions, logprob, value)."""
        params = self.dist_params(obs, mask)
        actions = self.head.sample(params, generator)
        return actions, self.head.log_prob(params, actions), self.value(obs)

    # The user-facing API.

    @torch.inference_mode()
    def act(self, obs: Any, deterministic: bool = True, mask: Any = None) -> Any:
        """Action(s) for the env from raw observation(s).

        ``obs`` is one observation (as the env returns it, a dict with 'observation' and
        'action_mask' included) or a batch; the answer has the same batching. A mask may
        also be given directly (e.g. from ``info["action_mask"]``).
        """
        spec = self.spec
        single = _is_single(obs, spec)
        if single:
            obs = _add_batch_dim(obs)
            if mask is not None:
                mask = np.asarray(mask)[None]
        flat, dict_mask = spec.split(obs)
        if mask is None:
            mask = dict_mask
        mask_t = torch.as_tensor(np.asarray(mask, dtype=bool)) if mask is not None else None
        x = self.normalize(torch.as_tensor(flat))
        params = self.dist_params(x, mask_t)
        actions = self.head.mode(params) if deterministic else self.head.sample(params)
        env_actions = spec.to_env(actions)
        return env_actions[0] if single else env_actions

    def describe(self) -> dict[str, Any]:
        """What it takes to rebuild this module (stored in checkpoints as JSON)."""
        return {
            "spec": self.spec.to_json(),
            "policy": {
                k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self.config).items()
            },
            "normalize_obs": self.obs_normalizer is not None,
            "obs_clip": self.obs_normalizer.clip if self.obs_normalizer is not None else 10.0,
        }

    @classmethod
    def from_description(cls, description: dict[str, Any]) -> Policy:
        policy_table = dict(description["policy"])
        policy_table["hidden_sizes"] = tuple(policy_table["hidden_sizes"])
        return cls(
            SpaceSpec.from_json(description["spec"]),
            PolicyConfig(**policy_table),
            normalize_obs=description["normalize_obs"],
            obs_clip=description["obs_clip"],
        )

    @classmethod
    def load(cls, path: str | Path) -> Policy:
        """A trained policy from a run folder or checkpoint folder (never unpickles)."""
        from trustrl.checkpoint import load_policy

        return load_policy(path)


def _is_single(obs: Any, spec: SpaceSpec) -> bool:
    if spec.dict_obs:
        return np.asarray(obs["observation"]).ndim == len(spec.obs_shape)
    return np.asarray(obs).ndim == len(spec.obs_shape)


def _add_batch_dim(obs: Any) -> Any:
    if isinstance(obs, dict):
        return {k: np.asarray(v)[None] for k, v in obs.items()}
    return np.asarray(obs)[None]
