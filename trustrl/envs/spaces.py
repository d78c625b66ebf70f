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
from trustrl.envs import layout
from trustrl.envs.layout import Entry

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
    obs_entries: tuple[Entry, ...] = ()
    """A structured observation's layout (envs/layout.py): an image, Dict, Tuple, Discrete,
    MultiDiscrete or MultiBinary observation as entries of one row; () for a flat Box,
    whose row is the float32 vector."""

    @property
    def obs_dim(self) -> int:
        """Columns of an observation's row: the flat vector, or every entry's columns."""
        if self.obs_entries:
            return sum(e["width"] for e in self.obs_entries)
        return math.prod(self.obs_shape)

    @property
    def obs_dtype(self) -> np.dtype:
        """The dtype of an observation's row: uint8 where every entry fits a byte (frames,
        one-hots), float32 otherwise."""
        return layout.row_dtype(self.obs_entries) if self.obs_entries else np.dtype(np.float32)

    @property
    def vector_dim(self) -> int:
        """The row's leading columns that are float vectors: what the observation
        normalizer covers (all of a flat Box's row, none of a frame's)."""
        return layout.vector_width(self.obs_entries) if self.obs_entries else self.obs_dim

    @property
    def image_keys(self) -> tuple[str, ...]:
        """The float entries taken as images (``env.image_keys``), to lay out an env's
        spaces as this spec did."""
        return tuple(
            e["key"]
            for e in self.obs_entries
            if e["kind"] == "image" and e["dtype"] not in ("uint8", "bool")
        )

    @property
    def flat_keys(self) -> tuple[str, ...]:
        """The bool grids taken flat (``env.flat_keys``), to lay out an env's spaces as
        this spec did."""
        return tuple(
            e["key"] for e in self.obs_entries if e["kind"] == "binary" and e["dtype"] == "bool"
        )

    @property
    def has_images(self) -> bool:
        return any(e["kind"] == "image" for e in self.obs_entries)

    @property
    def mask_dim(self) -> int | None:
        return sum(self.nvec) if self.masked else None

    @property
    def action_dtype(self) -> type[np.float32] | type[np.int64]:
        """The dtype of sampled actions: float32 for a Box, int64 indices otherwise."""
        return np.float32 if self.action_kind == "box" else np.int64

    @classmethod
    def from_spaces(
        cls,
        observation_space: gym.Space,
        action_space: gym.Space,
        info_mask: bool = False,
        image_keys: tuple[str, ...] = (),
        flat_keys: tuple[str, ...] = (),
    ) -> SpaceSpec:
        """The spec of an env's spaces; ``image_keys`` names float Box entries to take as
        images (``env.image_keys``; "" for a whole Box observation), ``flat_keys`` bool
        grids to take flat (``env.flat_keys``)."""
        dict_obs = isinstance(observation_space, gym.spaces.Dict) and set(
            observation_space.spaces
        ) == {"observation", "action_mask"}
        if dict_obs:  # the action-mask convention: the observation is its "observation"
            observation_space = observation_space["observation"]  # type: ignore[index]
        entries = tuple(layout.entries_of(observation_space, image_keys, flat_keys))
        if not entries:
            obs_shape = tuple(int(d) for d in observation_space.shape)  # type: ignore[union-attr]
        elif len(entries) == 1 and entries[0]["key"] == "":
            obs_shape = tuple(entries[0]["shape"])
        else:
            obs_shape = (sum(e["width"] for e in entries),)
        masked = dict_obs or info_mask
        if isinstance(action_space, gym.spaces.Discrete):
            return cls(
                obs_shape,
                "discrete",
                (),
                (int(action_space.n),),
                dict_obs=dict_obs,
                masked=masked,
                obs_entries=entries,
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
            return cls(obs_shape, "multidiscrete", (len(nvec),), nvec, obs_entries=entries)
        if isinstance(action_space, gym.spaces.Box):
            size = math.prod(action_space.shape)
            return cls(
                obs_shape,
                "box",
                (size,),
                low=tuple(float(x) for x in action_space.low.reshape(-1)),
                high=tuple(float(x) for x in action_space.high.reshape(-1)),
                env_action_shape=tuple(int(d) for d in action_space.shape),
                obs_entries=entries,
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
        if self.obs_entries and not (len(self.obs_entries) == 1 and not self.obs_entries[0]["key"]):
            observed = "observations of entries " + ", ".join(
                f"{e['key']}: {e['kind']} {tuple(e['shape'])}" for e in self.obs_entries
            )
        elif self.obs_entries:
            entry = self.obs_entries[0]
            observed = f"{entry['kind']} observations of shape {self.obs_shape} ({entry['dtype']})"
        else:
            observed = f"observations of shape {self.obs_shape}"
        return f"{observed}, {actions} actions"

    def compatible(self, other: SpaceSpec) -> bool:
        """Whether a policy for ``self`` can act in an env of ``other`` (same shapes and
        action choices; Box bounds may differ, actions are clipped to the env's own)."""
        return (
            self.obs_shape == other.obs_shape
            and self.action_kind == other.action_kind
            and self.action_shape == other.action_shape
            and self.nvec == other.nvec
            and self.dict_obs == other.dict_obs
            and layout.same(self.obs_entries, other.obs_entries)
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
        if self.obs_entries:
            return layout.is_single(self.obs_entries, raw)
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
        """A batch of raw observations -> (rows (B, obs_dim) of ``obs_dtype``, bool (B, A)
        mask or None), always new arrays (a vector env may reuse the buffers it returned).
        A structured observation is packed into its row (envs/layout.py), each entry
        checked against its space."""
        mask = None
        if self.dict_obs:
            mask = np.array(raw["action_mask"], dtype=bool)
            raw = raw["observation"]
        elif self.masked:
            mask = _info_mask(info, _batch_size(self, raw), self.mask_dim or 0)
        if self.obs_entries:
            return layout.pack(self.obs_entries, raw, self.obs_dim, self.obs_dtype), mask
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
        data = {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}
        if not self.obs_entries:  # a flat Box's spec reads as it always did
            del data["obs_entries"]
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> SpaceSpec:
        fields: dict[str, Any] = {
            k: tuple(v) if isinstance(v, list) else v for k, v in data.items()
        }
        return cls(**fields)


def _batch_size(spec: SpaceSpec, raw: Any) -> int:
    if spec.obs_entries:
        return len(layout.pick(raw, spec.obs_entries[0]["key"]))
    return len(raw)


def _info_mask(info: dict[str, Any] | None, batch: int, size: int) -> np.ndarray:
    """info['action_mask'] from a vector env; rows without one allow every action."""
    mask = np.ones((batch, size), dtype=bool)
    if info and "action_mask" in info:
        present = info.get("_action_mask", np.ones(batch, dtype=bool))
        values = info["action_mask"]
        for row in np.flatnonzero(present):
            mask[row] = np.asarray(values[row], dtype=bool)
    return mask
