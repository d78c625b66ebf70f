"""Environment construction: Gymnasium ids or ``package.module:callable``, three vector backends.

Every backend runs Gymnasium's NEXT_STEP autoreset (the only mode the numpy-vectorized
CartPole accepts); rollout.py explains how the collector keeps reset steps out of
training.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import gymnasium as gym
import numpy as np

from trustrl.config import ConfigError
from trustrl.spaces import SpaceSpec

NEXT_STEP = gym.vector.AutoresetMode.NEXT_STEP


def is_entry_point(env_id: str) -> bool:
    return ":" in env_id and not env_id.startswith(":")


def _load_entry_point(env_id: str) -> Callable[..., Any]:
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


def check_env_id(env_id: str) -> None:
    """Refuse an unknown id early, with the nearest registered names."""
    if is_entry_point(env_id):
        try:
            _load_entry_point(env_id)
        except ConfigError as original:
            from trustrl.multiagent import parallel_env_factory

            try:
                parallel_env_factory(env_id)  # a PettingZoo family:name?
            except ConfigError:
                raise original from None
        return
    if env_id in gym.registry:
        return
    import difflib

    close = difflib.get_close_matches(env_id, list(gym.registry), n=5, cutoff=0.5)
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    raise ConfigError(
        f"env_id {env_id!r} is not a registered Gymnasium environment nor a "
        f"package.module:callable{hint}"
    )


def env_factory(
    env_id: str, kwargs: dict[str, Any] | None = None, **extra: Any
) -> Callable[[], gym.Env]:
    """A zero-argument callable that builds one environment (picklable for subprocesses)."""
    kwargs = {**(kwargs or {}), **extra}
    if is_entry_point(env_id):
        target = _load_entry_point(env_id)
        return _EntryPointFactory(target, kwargs)
    return _GymFactory(env_id, kwargs)


class _GymFactory:
    def __init__(self, env_id: str, kwargs: dict[str, Any]) -> None:
        self.env_id, self.kwargs = env_id, kwargs

    def __call__(self) -> gym.Env:
        return gym.make(self.env_id, **self.kwargs)


class _EntryPointFactory:
    def __init__(self, target: Callable[..., Any], kwargs: dict[str, Any]) -> None:
        self.target, self.kwargs = target, kwargs

    def __call__(self) -> gym.Env:
        env = self.target(**self.kwargs)
        if not isinstance(env, gym.Env):
            raise ConfigError(f"{self.target!r} returned {type(env).__name__}, not a gymnasium.Env")
        return env


def has_vector_entry_point(env_id: str) -> bool:
    return not is_entry_point(env_id) and gym.spec(env_id).vector_entry_point is not None


def resolve_backend(env_id: str, backend: str) -> str:
    """auto: the env's own vectorized implementation where Gymnasium has one, else sync.

    sync is the right default for cheap envs on few cores: subprocesses pay a pipe
    round trip per step that costs more than a classic-control step itself.
    """
    if backend == "auto":
        return "vector" if has_vector_entry_point(env_id) else "sync"
    if backend == "vector" and not has_vector_entry_point(env_id):
        raise ConfigError(
            f"env.backend 'vector' needs an env with a vectorized implementation in Gymnasium; "
            f"{env_id!r} has none (use sync, async or auto)"
        )
    return backend


def make_vec_env(
    env_id: str, num_envs: int, backend: str = "auto", kwargs: dict[str, Any] | None = None
) -> gym.vector.VectorEnv:
    check_env_id(env_id)
    backend = resolve_backend(env_id, backend)
    kwargs = dict(kwargs or {})
    if backend == "vector":
        return gym.make_vec(
            env_id, num_envs=num_envs, vectorization_mode="vector_entry_point", **kwargs
        )
    fns = [env_factory(env_id, kwargs) for _ in range(num_envs)]
    # copy=False: the vector env hands out its own buffers, which its next step overwrites;
    # SpaceSpec.split copies what it keeps, at a fraction of the deepcopy copy=True makes.
    if backend == "async":
        return gym.vector.AsyncVectorEnv(
            fns, shared_memory=True, copy=False, autoreset_mode=NEXT_STEP
        )
    return gym.vector.SyncVectorEnv(fns, copy=False, autoreset_mode=NEXT_STEP)


# Environment state for exact resume. Gymnasium has no state API, so the vector env is
# pickled (the one place trustrl uses pickle; only `train --resume` reads it back, after
# checking its digest). MuJoCo envs pickle by re-running their constructor (EzPickle),
# which loses the simulation, so their physics and RNG state ride along explicitly.


def _sub_envs(envs: gym.vector.VectorEnv) -> list[gym.Env]:
    return list(getattr(envs, "envs", []))


def _mujoco_state(env: gym.Env) -> tuple[Any, Any, Any] | None:
    unwrapped: Any = env.unwrapped
    if not hasattr(unwrapped, "data") or not hasattr(unwrapped, "model"):
        return None
    import mujoco

    spec = mujoco.mjtState.mjSTATE_INTEGRATION
    state = np.empty(mujoco.mj_stateSize(unwrapped.model, spec))
    mujoco.mj_getState(unwrapped.model, unwrapped.data, state, spec)
    return state, unwrapped.np_random.bit_generator.state, _elapsed_steps(env)


def _elapsed_steps(env: gym.Env) -> int | None:
    while isinstance(env, gym.Wrapper):
        if isinstance(env, gym.wrappers.TimeLimit):
            return env._elapsed_steps
        env = env.env
    return None


def _set_mujoco_state(env: gym.Env, saved: tuple[Any, Any, Any]) -> None:
    import mujoco

    state, rng_state, elapsed = saved
    unwrapped: Any = env.unwrapped
    mujoco.mj_setState(unwrapped.model, unwrapped.data, state, mujoco.mjtState.mjSTATE_INTEGRATION)
    mujoco.mj_forward(unwrapped.model, unwrapped.data)
    unwrapped.np_random.bit_generator.state = rng_state
    wrapper: gym.Env = env
    while isinstance(wrapper, gym.Wrapper):
        if isinstance(wrapper, gym.wrappers.TimeLimit):
            wrapper._elapsed_steps = elapsed
        wrapper = wrapper.env


def capture_envs(envs: gym.vector.VectorEnv) -> bytes | None:
    """The vector env's full state as bytes, or None where it cannot be captured
    (subprocess envs, envs that do not pickle)."""
    if isinstance(envs, gym.vector.AsyncVectorEnv):
        return None
    import pickle

    from gymnasium.utils import EzPickle

    try:
        extras = [_mujoco_state(env) for env in _sub_envs(envs)]
        for env, extra in zip(_sub_envs(envs), extras, strict=True):
            # EzPickle rebuilds the env from its constructor arguments: its state is lost,
            # and only MuJoCo's is put back explicitly.
            if isinstance(env.unwrapped, EzPickle) and extra is None:
                return None
        return pickle.dumps((envs, extras), protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:  # any failure to serialize means "not capturable", never a lost run
        return None


def restore_envs(data: bytes) -> gym.vector.VectorEnv:
    """Inverse of capture_envs. Unpickles: call only on data whose digest was checked."""
    import pickle

    envs, extras = pickle.loads(data)  # trusted run folder, digest checked by the caller
    for env, saved in zip(_sub_envs(envs), extras, strict=True):
        if saved is not None:
            _set_mujoco_state(env, saved)
    return envs


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


class RowEnv(Protocol):
    num_envs: int

    @property
    def groups(self) -> list[AgentGroup]: ...
    def reset(self, seed: int) -> list[GroupObs]: ...
    def step(self, actions: list[np.ndarray]) -> tuple[list[GroupObs], list[GroupStep]]: ...
    def capture(self) -> bytes | None: ...
    def restore(self, data: bytes) -> None: ...
    def close(self) -> None: ...


def make_row_env(config: Any) -> RowEnv:
    """The environment of a run as rows: PettingZoo ids become ParallelRows, everything
    else a Gymnasium vector env (one group)."""
    from trustrl.multiagent import ParallelRows, is_parallel_env_id, parallel_env_factory

    kwargs = dict(config.env.kwargs)
    if is_parallel_env_id(config.env_id, kwargs):
        factory = parallel_env_factory(config.env_id, kwargs)
        return ParallelRows(factory, config.env.num_envs, config.multiagent.critic_input)
    return GymRows(make_vec_env(config.env_id, config.env.num_envs, config.env.backend, kwargs))


class GymRows:
    """A Gymnasium vector env as one group with one row per env."""

    def __init__(self, envs: gym.vector.VectorEnv) -> None:
        self.envs = envs
        self.num_envs = envs.num_envs
        self._groups: list[AgentGroup] | None = None

    @property
    def groups(self) -> list[AgentGroup]:
        if self._groups is None:
            raise RuntimeError("reset the env first: masks are detected from the reset info")
        return self._groups

    @property
    def spec(self) -> SpaceSpec:
        return self.groups[0].spec

    def reset(self, seed: int) -> list[GroupObs]:
        raw, info = self.envs.reset(seed=seed)
        if self._groups is None:
            # The spaces say everything but whether the env hands out masks in its info.
            spec = SpaceSpec.from_spaces(
                self.envs.single_observation_space,
                self.envs.single_action_space,
                "action_mask" in info,
            )
            self._groups = [AgentGroup("", ("",), spec)]
        obs, mask = self.spec.split(raw, info)
        return [GroupObs(obs, mask)]

    def step(self, actions: list[np.ndarray]) -> tuple[list[GroupObs], list[GroupStep]]:
        raw, reward, terminated, truncated, info = self.envs.step(self.spec.to_env(actions[0]))
        obs, mask = self.spec.split(raw, info)
        return [GroupObs(obs, mask)], [GroupStep(reward, terminated, truncated)]

    def capture(self) -> bytes | None:
        return capture_envs(self.envs)

    def restore(self, data: bytes) -> None:
        self.envs.close()
        self.envs = restore_envs(data)

    def close(self) -> None:
        self.envs.close()
