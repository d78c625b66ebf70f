"""The row contract every environment is presented through, single- or multi-agent.

A run's environment is groups of rows (``RowEnv``): a group is a set of agents sharing
spaces (and so one policy), its rows are (env, agent) pairs, agent index fastest. The
Gymnasium adapter (``envs.GymRows``: one group of one agent) and the PettingZoo adapter
(``multiagent.ParallelRows``) both implement it; the collector knows only this module.
Observations and rewards are checked for non-finite values where they enter it.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from trustrl.config import ConfigError
from trustrl.envs.spaces import SpaceSpec


def is_entry_point(env_id: str) -> bool:
    return ":" in env_id and not env_id.startswith(":")


def load_entry_point(env_id: str) -> Callable[..., Any]:
    module_name, _, attr = env_id.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(
            f"env_id {env_id!r}: cannot import module {module_name!r} ({exc})"
        ) from None
    target: Any = module
    for part in attr.split("."):
        if not hasattr(target, part):
            raise ConfigError(
                f"env_id {env_id!r}: module {module_name!r} has no attribute {attr!r}"
            )
        target = getattr(target, part)
    if not callable(target):
        raise ConfigError(f"env_id {env_id!r}: {attr!r} is not callable")
    return target


EnvState = dict[str, Any] | bytes | None
"""What a row env's ``capture`` gives: arrays (safe to load), a pickle (to be trusted
first), or None (not capturable: resume starts fresh episodes)."""


# Rows: every environment, single- or multi-agent, is presented to the collector as groups
# of rows. A group is a set of agents sharing spaces (and so one policy); its rows are
# (env, agent) pairs, agent index fastest. A Gymnasium vector env is one group of one agent.


@dataclass(frozen=True)
class AgentGroup:
    name: str
    agents: tuple[str, ...]
    spec: SpaceSpec
    critic_dim: int | None = None
    """Width of the critic's global-state input; None: the critic reads the observation."""

    @property
    def num_agents(self) -> int:
        return len(self.agents)


@dataclass
class GroupObs:
    """What a group's rows observe before a step."""

    obs: np.ndarray  # (rows, obs_dim) float32
    mask: np.ndarray | None = None  # (rows, A) bool
    critic_obs: np.ndarray | None = None  # (rows, critic_dim) float32
    alive: np.ndarray | None = None  # (rows,) bool; None: every row's agent is acting


@dataclass
class GroupStep:
    """What a step returned for a group's rows (NEXT_STEP autoreset semantics)."""

    reward: np.ndarray  # (rows,)
    terminated: np.ndarray  # (rows,) bool
    truncated: np.ndarray  # (rows,) bool
    dropped: np.ndarray | None = None
    """(rows,) bool: the row's episode was dropped at this step for a non-finite value
    (env.nonfinite = "drop"); the env was reset, and this step returned the first
    observation of a new episode, as the step after an episode end does."""
    continues: np.ndarray | None = None
    """(rows,) bool: the row's termination is a life loss and the game goes on (episodic
    life, ``atari.EpisodicLife``); the episode's return carries on for reporting. None:
    no row's env said so at this step (every termination ends the game)."""


class NonFiniteError(RuntimeError):
    """An env handed out a NaN or infinite observation or reward."""


def check_finite(
    env: str,
    observed: list[GroupObs],
    steps: list[GroupStep] | None,
    env_step: int,
    groups: list[AgentGroup],
) -> None:
    """Stop at the first non-finite observation or reward an env hands out, naming the env,
    the row, the env step and the entries: one NaN otherwise ruins a run silently (every
    loss turns NaN, every update step is skipped, the normalizer's statistics turn NaN).

    Per step only a sum per array (NaN and infinities make it non-finite); the search
    runs when it is not (a sum that overflows from finite values is searched and passes).
    """
    for index, seen in enumerate(observed):
        total = float(seen.obs.sum())
        if steps is not None:
            total += float(steps[index].reward.sum())
        if seen.critic_obs is not None:
            total += float(seen.critic_obs.sum())
        if not math.isfinite(total):
            _raise_nonfinite(env, seen, steps[index] if steps else None, env_step, groups[index])


def _raise_nonfinite(
    env: str, seen: GroupObs, step: GroupStep | None, env_step: int, group: AgentGroup
) -> None:
    arrays = {"observation": seen.obs, "critic state": seen.critic_obs}
    if step is not None:
        arrays["reward"] = np.asarray(step.reward, dtype=np.float64)[:, None]
    for what, array in arrays.items():
        if array is None:
            continue
        bad = _nonfinite_entries(array)
        if seen.alive is not None:
            bad &= seen.alive[:, None]  # a finished agent's row repeats old data
        rows = np.flatnonzero(bad.any(1))
        if len(rows) == 0:
            continue
        row = int(rows[0])
        entries = np.flatnonzero(bad[row])
        values = array.reshape(len(array), -1)[row, entries]
        where = "reset" if step is None else f"env step {env_step:,}"
        agents = group.agents
        agent = f", agent {agents[row % len(agents)]}" if agents != ("",) else ""
        detail = ", ".join(
            f"[{e}] = {v}" for e, v in zip(entries[:8], values[:8], strict=False)
        ) + (", ..." if len(entries) > 8 else "")
        more = f" (and {len(rows) - 1} more rows)" if len(rows) > 1 else ""
        raise NonFiniteError(
            f"{env} returned a non-finite {what} at {where}, row {row}{agent}: "
            f"{'entries ' if what != 'reward' else ''}{detail}{more}"
        )


def _nonfinite_entries(array: np.ndarray) -> np.ndarray:
    """(rows, entries) bool: where a (rows, ...) array is NaN or infinite."""
    return ~np.isfinite(array.reshape(len(array), -1))


def nonfinite_rows(*arrays: np.ndarray) -> np.ndarray:
    """(rows,) bool: the rows with a NaN or infinity in any of the (rows, ...) arrays."""
    bad = np.zeros(len(arrays[0]), dtype=bool)
    for array in arrays:
        if not np.isfinite(array.sum()):
            bad |= _nonfinite_entries(array).any(1)
    return bad


class RowEnv(Protocol):
    num_envs: int

    @property
    def groups(self) -> list[AgentGroup]: ...
    def reset(self, seed: int) -> list[GroupObs]: ...
    def step(self, actions: list[np.ndarray]) -> tuple[list[GroupObs], list[GroupStep]]: ...
    def capture(self) -> EnvState: ...
    def restore(self, data: dict[str, Any] | bytes) -> None: ...
    def close(self) -> None: ...
