"""What the policy needs to know about an environment's spaces, as plain data.

A ``SpaceSpec`` is built once from the Gymnasium spaces, travels in checkpoints as
JSON (so a checkpoint can say exactly which spaces it was trained for), and converts
observations into the flat float32 rows the networks read and sampled actions back
into what the environment accepts.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from functools import cached_property
from typing import Any, Literal

import gymnasium as gym
import numpy as np

from trustrl.config import ConfigError

ActionKind = Literal["discrete", "multidiscrete", "box"]


@dataclass(frozen=True)
class SpaceSpec:
    """An agent's observation and action spaces as plain, JSON-able data: what the policy
    is built for, what a checkpoint says it was trained on, and the conversions between
    what the env hands out or takes and the arrays the networks read and write."""

    obs_shape: tuple[int, ...]
    action_kind: ActionKind
    action_shape: tuple[int, ...]
    """() for Discrete, (k,) for MultiDiscrete and for Box actions (flattened)."""
    nvec: tuple[int, ...] = ()
    """Choices per discrete component: (n,) for Discrete, the nvec of MultiDiscrete."""
    low: tuple[float, ...] = ()
    high: tuple[float, ...] = ()
    env_action_shape: tuple[int, ...] = ()
    """Shape the env expects for one Box action (before flattening)."""
    dict_obs: bool = False
    """Observations are dicts with 'observation' and 'action_mask' keys."""
    masked: bool = False
    """The env supplies a discrete action mask (dict observation or info['action_mask'])."""

    @property
    def obs_dim(self) -> int:
        return math.prod(self.obs_shape)

    @property
    def mask_dim(self) -> int | None:
        return sum(self.nvec) if self.masked else None

    @property
    def action_dtype(self) -> type[np.float32] | type[np.int64]:
        """The dtype of sampled actions: float32 for a Box, int64 indices otherwise."""
        return np.float32 if self.action_kind == "box" else np.int64

    @classmethod
    def from_spaces(
        cls, observation_space: gym.Space, action_space: gym.Space, info_mask: bool = False
    ) -> SpaceSpec:
        dict_obs = isinstance(observation_space, gym.spaces.Dict)
        if isinstance(observation_space, gym.spaces.Dict):
            keys = set(observation_space.spaces)
            if keys != {"observation", "action_mask"}:
                raise ConfigError(
                    "dict observations must have exactly the keys 'observation' and "
                    f"'action_mask', got {sorted(keys)}"
                )
            observation_space = observation_space["observation"]
        if not isinstance(observation_space, gym.spaces.Box):
            raise ConfigError(
                f"observation space must be a Box (or a Dict of observation and action_mask), "
                f"got {observation_space}"
            )
        obs_shape = tuple(int(d) for d in observation_space.shape)
        masked = dict_obs or info_mask
        if isinstance(action_space, gym.spaces.Discrete):
            return cls(
                obs_shape, "discrete", (), (int(action_space.n),), dict_obs=dict_obs, masked=masked
            )
        if masked:
            raise ConfigError(
                f"action masks are supported for Discrete actions, got {action_space}"
            )
        if isinstance(action_space, gym.spaces.MultiDiscrete):
            if action_space.nvec.ndim != 1:
                raise ConfigError(
                    f"MultiDiscrete actions must be one-dimensional, got {action_space}"
                )
            nvec = tuple(int(n) for n in action_space.nvec)
            return cls(obs_shape, "multidiscrete", (len(nvec),), nvec)
        if isinstance(action_space, gym.spaces.Box):
            size = math.prod(action_space.shape)
            return cls(
                obs_shape,
                "box",
                (size,),
                low=tuple(float(x) for x in action_space.low.reshape(-1)),
                high=tuple(float(x) for x in action_space.high.reshape(-1)),
                env_action_shape=tuple(int(d) for d in action_space.shape),
            )
        raise ConfigError(
            f"action space must be Discrete, MultiDiscrete or Box, got {action_space}"
        )

    def summary(self) -> str:
        """The spaces in words, for messages: "observations of shape (4,), Discrete(2) actions"."""
        if self.action_kind == "discrete":
            actions = f"Discrete({self.nvec[0]})"
        elif self.action_kind == "multidiscrete":
            actions = f"MultiDiscrete({list(self.nvec)})"
        else:
            actions = f"Box{self.env_action_shape}"
        return f"observations of shape {self.obs_shape}, {actions} actions"

    def compatible(self, other: SpaceSpec) -> bool:
        """Whether a policy for ``self`` can act in an env of ``other`` (same shapes and
        action choices; Box bounds may differ, actions are clipped to the env's own)."""
        return (
            self.obs_shape == other.obs_shape
            and self.action_kind == other.action_kind
            and self.action_shape == other.action_shape
            and self.nvec == other.nvec
            and self.dict_obs == other.dict_obs
        )

    def is_single(self, raw: Any) -> bool:
        """Whether ``raw`` is one observation (True) or a batch (False); a ValueError naming
        both shapes when it is neither ``obs_shape`` nor ``(B, *obs_shape)``."""
        if self.dict_obs:
            if not isinstance(raw, dict) or "observation" not in raw:
                raise ValueError(
                    "this policy expects dict observations with 'observation' and "
                    f"'action_mask', got {type(raw).__name__}"
                )
            raw = raw["observation"]
        shape = np.shape(raw)
        if tuple(shape) == self.obs_shape:
            return True
        if tuple(shape[1:]) == self.obs_shape and len(shape) == len(self.obs_shape) + 1:
            return False
        raise ValueError(
            f"this policy expects observations of shape {self.obs_shape} (or a batch "
            f"(B, {', '.join(map(str, self.obs_shape))})), got shape {tuple(shape)}"
        )

    def split(
        self, raw: Any, info: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """A batch of raw observations -> (float32 (B, obs_dim), bool (B, A) mask or None),
        always new arrays (a vector env may reuse the buffers it returned)."""
        mask = None
        if self.dict_obs:
            mask = np.array(raw["action_mask"], dtype=bool)
            raw = raw["observation"]
        elif self.masked:
            mask = _info_mask(info, len(raw), self.mask_dim or 0)
        obs = np.array(raw, dtype=np.float32).reshape(len(raw), self.obs_dim)
        return obs, mask

    def to_env(self, actions: np.ndarray) -> np.ndarray:
        """Sampled actions (B, *action_shape) -> what a vector env accepts.

        Box samples are clipped to the bounds here, on their way into the env only: the
        rollout keeps the unclipped sample, whose log-probability is the one trained on.
        """
        array = np.asarray(actions)
        if self.action_kind == "box":
            # Two ufuncs: np.clip's Python wrapper costs more than the clip on a few rows.
            array = np.minimum(np.maximum(array, self._low_array), self._high_array)
            if len(self.env_action_shape) == 1:  # already (B, k)
                return array
            return array.reshape(len(array), *self.env_action_shape)
        return array

    @cached_property
    def _low_array(self) -> np.ndarray:
        return np.asarray(self.low, dtype=np.float32)

    @cached_property
    def _high_array(self) -> np.ndarray:
        return np.asarray(self.high, dtype=np.float32)

    def to_json(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> SpaceSpec:
        fields: dict[str, Any] = {
            k: tuple(v) if isinstance(v, list) else v for k, v in data.items()
        }
        return cls(**fields)


def _info_mask(info: dict[str, Any] | None, batch: int, size: int) -> np.ndarray:
    """info['action_mask'] from a vector env; rows without one allow every action."""
    mask = np.ones((batch, size), dtype=bool)
    if info and "action_mask" in info:
        present = info.get("_action_mask", np.ones(batch, dtype=bool))
        values = info["action_mask"]
        for row in np.flatnonzero(present):
            mask[row] = np.asarray(values[row], dtype=bool)
    return mask
