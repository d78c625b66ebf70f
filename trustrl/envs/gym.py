"""Environment construction: Gymnasium ids or ``package.module:callable``, three vector backends.

Every backend runs Gymnasium's NEXT_STEP autoreset (the only mode the numpy-vectorized
CartPole accepts); rollout.py explains how the collector keeps reset steps out of
training.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator
from typing import Any

import gymnasium as gym
import numpy as np

from trustrl.config import ConfigError
from trustrl.envs.atari import (
    AtariFactory,
    MinAtarFactory,
    is_ale_id,
    is_minatar_id,
    register_namespace,
)
from trustrl.envs.rows import (
    AgentGroup,
    EnvState,
    GroupObs,
    GroupStep,
    RowEnv,
    check_finite,
    is_entry_point,
    load_entry_point,
    nonfinite_rows,
)
from trustrl.envs.spaces import SpaceSpec

NEXT_STEP = gym.vector.AutoresetMode.NEXT_STEP


def check_env_id(env_id: str) -> None:
    """Refuse an unknown id early, with the nearest registered names."""
    if is_entry_point(env_id):
        try:
            load_entry_point(env_id)
        except ConfigError as original:
            from trustrl.envs.pettingzoo import parallel_env_factory

            try:
                parallel_env_factory(env_id)  # a PettingZoo family:name?
            except ConfigError:
                raise original from None
        return
    register_namespace(env_id)  # ALE/ and MinAtar/ ids: their package, on first use
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
    env_id: str,
    kwargs: dict[str, Any] | None = None,
    *,
    frame_stack: int = 0,
    episodic_life: bool = False,
    **extra: Any,
) -> Callable[[], gym.Env]:
    """A zero-argument callable that builds one environment (picklable for subprocesses).

    ``frame_stack`` and ``episodic_life`` are ``EnvConfig``'s: ALE ids get the Atari
    preprocessing (``trustrl.envs.atari``; episodic life for training envs only), any
    other env a FrameStackObservation where ``frame_stack`` > 0."""
    kwargs = {**(kwargs or {}), **extra}
    factory: Callable[[], gym.Env]
    if is_ale_id(env_id):
        return AtariFactory(env_id, kwargs, frame_stack, episodic_life)
    if is_entry_point(env_id):
        factory = _EntryPointFactory(load_entry_point(env_id), kwargs)
    elif is_minatar_id(env_id):
        factory = MinAtarFactory(env_id, kwargs)
    else:
        factory = _GymFactory(env_id, kwargs)
    return _FrameStackFactory(factory, frame_stack) if frame_stack else factory


class _GymFactory:
    def __init__(self, env_id: str, kwargs: dict[str, Any]) -> None:
        self.env_id, self.kwargs = env_id, kwargs

    def __call__(self) -> gym.Env:
        return gym.make(self.env_id, **self.kwargs)


class _FrameStackFactory:
    def __init__(self, make: Callable[[], gym.Env], stack_size: int) -> None:
        self.make, self.stack_size = make, stack_size

    def __call__(self) -> gym.Env:
        return gym.wrappers.FrameStackObservation(self.make(), self.stack_size)


class _EntryPointFactory:
    def __init__(self, target: Callable[..., Any], kwargs: dict[str, Any]) -> None:
        self.target, self.kwargs = target, kwargs

    def __call__(self) -> gym.Env:
        env = self.target(**self.kwargs)
        if not isinstance(env, gym.Env):
            raise ConfigError(f"{self.target!r} returned {type(env).__name__}, not a gymnasium.Env")
        return env


def has_vector_entry_point(env_id: str) -> bool:
    """Whether ``backend = "vector"`` can build the env. ALE ids have one in ale-py
    (AtariVectorEnv, its own preprocessing in C++), which trustrl does not use: they
    are built from Gymnasium's wrappers (``trustrl.envs.atari``), one env at a time."""
    if is_entry_point(env_id) or is_ale_id(env_id):
        return False
    register_namespace(env_id)
    return gym.spec(env_id).vector_entry_point is not None


def resolve_backend(env_id: str, backend: str) -> str:
    """auto: the env's own vectorized implementation where Gymnasium has one, else sync.

    sync is the right default for cheap envs on few cores: subprocesses pay a pipe
    round trip per step that costs more than a classic-control step itself.
    """
    if backend == "auto":
        return "vector" if has_vector_entry_point(env_id) else "sync"
    if backend == "vector" and is_ale_id(env_id):
        raise ConfigError(
            f"env.backend 'vector' is not for ALE ids ({env_id!r}): trustrl builds each "
            f"Atari env from Gymnasium's wrappers (use sync, async or auto)"
        )
    if backend == "vector" and not has_vector_entry_point(env_id):
        raise ConfigError(
            f"env.backend 'vector' needs an env with a vectorized implementation in Gymnasium; "
            f"{env_id!r} has none (use sync, async or auto)"
        )
    return backend


def make_vec_env(
    env_id: str,
    num_envs: int,
    backend: str = "auto",
    kwargs: dict[str, Any] | None = None,
    *,
    frame_stack: int = 0,
    episodic_life: bool = False,
) -> gym.vector.VectorEnv:
    """Training envs; ``frame_stack`` and ``episodic_life`` as in ``env_factory``."""
    check_env_id(env_id)
    backend = resolve_backend(env_id, backend)
    kwargs = dict(kwargs or {})
    if backend == "vector":
        if frame_stack:
            raise ConfigError(
                f"env.frame_stack wraps each env, which the env's own vectorized "
                f"implementation ({env_id}) has not: use env.backend sync or async"
            )
        return gym.make_vec(
            env_id, num_envs=num_envs, vectorization_mode="vector_entry_point", **kwargs
        )
    make = env_factory(env_id, kwargs, frame_stack=frame_stack, episodic_life=episodic_life)
    fns = [make for _ in range(num_envs)]
    # copy=False: the vector env hands out its own buffers, which its next step overwrites;
    # SpaceSpec.split copies what it keeps, at a fraction of the deepcopy copy=True makes.
    if backend == "async":
        return gym.vector.AsyncVectorEnv(
            fns, shared_memory=True, copy=False, autoreset_mode=NEXT_STEP
        )
    return gym.vector.SyncVectorEnv(fns, copy=False, autoreset_mode=NEXT_STEP)


# Environment state for exact resume, as arrays. Gymnasium has no state API; trustrl reads
# the state of the envs it knows: MuJoCo's physics (mj_getState), the classic-control
# state vectors, CartPole's numpy vector env, plus each env's RNG and time-limit counter.
# These go into the checkpoint as plain arrays and numbers, which loading cannot turn into
# code. Any other env resumes with fresh episodes unless its pickle is trusted explicitly
# (``train --resume --trust-env-state``): unpickling runs whatever the file says.


# Classic-control envs whose whole dynamic state is ``state`` and these attributes.
_CLASSIC_EXTRAS: dict[str, tuple[str, ...]] = {
    "CartPoleEnv": ("steps_beyond_terminated",),
    "PendulumEnv": ("last_u",),
    "AcrobotEnv": (),
    "MountainCarEnv": (),
    "Continuous_MountainCarEnv": (),
}
_CLASSIC_MODULE = "gymnasium.envs.classic_control."
_VECTOR_CARTPOLE = ("state", "steps", "prev_done", "steps_beyond_terminated")


def _sub_envs(envs: gym.vector.VectorEnv) -> list[gym.Env]:
    return list(getattr(envs, "envs", []))


def _rng_state(env: Any) -> dict[str, Any]:
    return dict(env.np_random.bit_generator.state)


def _set_rng_state(env: Any, state: dict[str, Any]) -> None:
    env.np_random.bit_generator.state = state


def _time_limit(env: gym.Env) -> gym.wrappers.TimeLimit | None:
    while isinstance(env, gym.Wrapper):
        if isinstance(env, gym.wrappers.TimeLimit):
            return env
        env = env.env
    return None


def _plain(value: Any) -> Any:
    """An attribute as checkpoint data: arrays copied, numbers and None as they are."""
    if isinstance(value, np.ndarray):
        return value.copy()
    if value is None or isinstance(value, bool | int | float):
        return value
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"{type(value).__name__} is not plain state")


def _env_arrays(env: gym.Env) -> dict[str, Any] | None:
    """One env's state as arrays, or None when trustrl does not know its state."""
    unwrapped: Any = env.unwrapped
    kind = type(unwrapped)
    limit = _time_limit(env)
    state: dict[str, Any] = {
        "rng": _rng_state(unwrapped),
        "elapsed_steps": limit._elapsed_steps if limit is not None else None,
    }
    if hasattr(unwrapped, "model") and hasattr(unwrapped, "data") and "mujoco" in kind.__module__:
        import mujoco

        spec = mujoco.mjtState.mjSTATE_INTEGRATION
        physics = np.empty(mujoco.mj_stateSize(unwrapped.model, spec))
        mujoco.mj_getState(unwrapped.model, unwrapped.data, physics, spec)
        return {**state, "kind": "mujoco", "physics": physics}
    extras = _CLASSIC_EXTRAS.get(kind.__name__)
    if extras is not None and kind.__module__.startswith(_CLASSIC_MODULE):
        names = ("state", *extras)
        return {**state, "kind": kind.__name__, **{n: _plain(getattr(unwrapped, n)) for n in names}}
    return None


def _fits(name: str, saved: Any, current: Any) -> Any:
    """``saved`` if it has the kind (and for arrays the shape and dtype) of ``current``:
    a checkpoint's numbers cannot make the env step with state of another form."""
    if isinstance(current, np.ndarray):
        ok = (
            isinstance(saved, np.ndarray)
            and saved.shape == current.shape
            and saved.dtype == current.dtype
        )
    else:
        ok = current is None or saved is None or type(saved) is type(current)
    if not ok:
        raise ValueError(f"saved {name} does not fit this env's ({saved!r} vs {current!r})")
    return saved


def _set_env_arrays(env: gym.Env, saved: dict[str, Any]) -> None:
    unwrapped: Any = env.unwrapped
    kind = saved["kind"]
    if kind == "mujoco":
        import mujoco

        spec = mujoco.mjtState.mjSTATE_INTEGRATION
        current = np.empty(mujoco.mj_stateSize(unwrapped.model, spec))
        physics = _fits("physics", saved["physics"], current)
        mujoco.mj_setState(unwrapped.model, unwrapped.data, physics, spec)
        mujoco.mj_forward(unwrapped.model, unwrapped.data)
    else:
        if type(unwrapped).__name__ != kind:
            raise ValueError(f"saved state of a {kind}, env is a {type(unwrapped).__name__}")
        for name in ("state", *_CLASSIC_EXTRAS[kind]):
            setattr(unwrapped, name, _fits(name, saved[name], getattr(unwrapped, name)))
    _set_rng_state(unwrapped, saved["rng"])
    limit = _time_limit(env)
    if limit is not None:
        limit._elapsed_steps = _fits("elapsed_steps", saved["elapsed_steps"], 0)


def capture_arrays(envs: gym.vector.VectorEnv) -> dict[str, Any] | None:
    """The vector env's state as arrays and numbers, or None where trustrl does not know
    every part of it."""
    unwrapped: Any = envs.unwrapped
    if type(unwrapped).__name__ == "CartPoleVectorEnv" and unwrapped.state is not None:
        return {
            "kind": "CartPoleVectorEnv",
            "rng": _rng_state(unwrapped),
            **{name: _plain(getattr(unwrapped, name)) for name in _VECTOR_CARTPOLE},
        }
    if not isinstance(envs, gym.vector.SyncVectorEnv):
        return None
    try:
        subs = [_env_arrays(env) for env in _sub_envs(envs)]
    except TypeError:
        return None
    if any(sub is None for sub in subs):
        return None
    return {"kind": "sync", "autoreset": envs._autoreset_envs.copy(), "envs": subs}


def restore_arrays(envs: gym.vector.VectorEnv, saved: dict[str, Any]) -> None:
    """Put ``capture_arrays``'s state back into envs built from the same config."""
    unwrapped: Any = envs.unwrapped
    if saved["kind"] == "CartPoleVectorEnv":
        if type(unwrapped).__name__ != "CartPoleVectorEnv":
            raise ValueError("saved state of CartPole's vector env, env is another")
        for name in _VECTOR_CARTPOLE:
            setattr(unwrapped, name, _fits(name, saved[name], getattr(unwrapped, name)))
        _set_rng_state(unwrapped, saved["rng"])
        return
    subs = _sub_envs(envs)
    if not isinstance(envs, gym.vector.SyncVectorEnv) or len(subs) != len(saved["envs"]):
        raise ValueError("saved state of other vector envs")
    for env, sub in zip(subs, saved["envs"], strict=True):
        _set_env_arrays(env, sub)
    envs._autoreset_envs[:] = _fits("autoreset", saved["autoreset"], envs._autoreset_envs)


def capture_pickle(envs: Any) -> bytes | None:
    """The envs pickled, for ``--trust-env-state`` only; None where pickling loses the
    state (EzPickle rebuilds an env from its constructor arguments) or fails."""
    import pickle

    from gymnasium.utils import EzPickle

    if isinstance(envs, gym.vector.AsyncVectorEnv):
        return None
    if any(isinstance(env.unwrapped, EzPickle) for env in _sub_envs(envs)):
        return None
    try:
        return pickle.dumps(envs, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:  # any failure to serialize means "not capturable", never a lost run
        return None


def unpickle_envs(data: bytes) -> Any:
    """Inverse of capture_pickle. Runs the code the data names: only for a run folder the
    user said to trust (``--trust-env-state``)."""
    import pickle

    return pickle.loads(data)


def make_row_env(config: Any) -> RowEnv:
    """The environment of a run as rows: PettingZoo ids become ParallelRows, everything
    else a Gymnasium vector env (one group)."""
    from trustrl.envs.pettingzoo import ParallelRows, is_parallel_env_id, parallel_env_factory

    kwargs = dict(config.env.kwargs)
    drop = config.env.nonfinite == "drop"
    with env_kwargs_errors(config.env_id, kwargs):
        if is_parallel_env_id(config.env_id, kwargs):
            if drop:
                raise ConfigError(
                    "env.nonfinite = 'drop' is for Gymnasium envs; a PettingZoo env's "
                    "non-finite values stop the run ('error')"
                )
            factory = parallel_env_factory(config.env_id, kwargs)
            return ParallelRows(
                factory, config.env.num_envs, config.multiagent.critic_input, config.env_id
            )
        check_env_id(config.env_id)
        if drop and resolve_backend(config.env_id, config.env.backend) == "vector":
            raise ConfigError(
                "env.nonfinite = 'drop' resets single envs, which the env's own vectorized "
                "implementation cannot: use env.backend sync or async"
            )
        envs = make_vec_env(
            config.env_id,
            config.env.num_envs,
            config.env.backend,
            kwargs,
            frame_stack=config.env.frame_stack,
            episodic_life=config.env.episodic_life,
        )
        return GymRows(
            envs,
            config.env_id,
            drop_nonfinite=drop,
            image_keys=config.env.image_keys,
            flat_keys=config.env.flat_keys,
        )


@contextlib.contextmanager
def env_kwargs_errors(env_id: str, kwargs: dict[str, Any]) -> Iterator[None]:
    """An env constructor refusing one of ``env.kwargs`` -> a ConfigError naming the
    argument and the env (the constructor's TypeError says only which argument)."""
    try:
        yield
    except TypeError as exc:
        found = re.search(r"unexpected keyword argument '(\w+)'", str(exc))
        if not kwargs or found is None or found.group(1) not in kwargs:
            raise
        name = found.group(1)
        raise ConfigError(
            f"env.kwargs: {env_id} does not accept the keyword argument {name!r} "
            f"(given {name} = {kwargs[name]!r}); remove it or check the env's constructor"
        ) from None


def life_lost(info: dict[str, Any], terminated: np.ndarray) -> np.ndarray | None:
    """``GroupStep.continues`` from a vector env's step info: the rows whose termination
    is a lost life with the game going on (``info["game_over"]`` False, as
    ``atari.EpisodicLife`` reports it); None when no env reports ``game_over``."""
    if "game_over" not in info:
        return None
    game_over = np.asarray(info["game_over"], dtype=bool)
    present = np.asarray(info.get("_game_over", np.ones_like(game_over)), dtype=bool)
    return present & ~game_over & np.asarray(terminated, dtype=bool)


class GymRows:
    """A Gymnasium vector env as one group with one row per env."""

    def __init__(
        self,
        envs: gym.vector.VectorEnv,
        name: str = "the env",
        drop_nonfinite: bool = False,
        image_keys: tuple[str, ...] = (),
        flat_keys: tuple[str, ...] = (),
    ) -> None:
        self.envs = envs
        self.image_keys = tuple(image_keys)
        self.flat_keys = tuple(flat_keys)
        self.num_envs = envs.num_envs
        self.name = name
        self.drop_nonfinite = drop_nonfinite
        self.env_steps = 0  # vector steps since the envs were built, for messages
        self.dropped = 0  # episodes dropped so far (drop_nonfinite)
        self.seed = 0
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
        self.seed = seed
        raw, info = self.envs.reset(seed=seed)
        if self._groups is None:
            # The spaces say everything but whether the env hands out masks in its info.
            spec = SpaceSpec.from_spaces(
                self.envs.single_observation_space,
                self.envs.single_action_space,
                "action_mask" in info,
                self.image_keys,
                self.flat_keys,
            )
            self._groups = [AgentGroup("", ("",), spec)]
        obs, mask = self.spec.split(raw, info)
        observed = [GroupObs(obs, mask)]
        check_finite(self.name, observed, None, self.env_steps, self.groups)
        return observed

    def step(self, actions: list[np.ndarray]) -> tuple[list[GroupObs], list[GroupStep]]:
        raw, reward, terminated, truncated, info = self.envs.step(self.spec.to_env(actions[0]))
        self.env_steps += 1
        obs, mask = self.spec.split(raw, info)
        step = GroupStep(reward, terminated, truncated, continues=life_lost(info, terminated))
        observed, steps = [GroupObs(obs, mask)], [step]
        if self.drop_nonfinite:
            self._drop_nonfinite(observed[0], steps[0])
        check_finite(self.name, observed, steps, self.env_steps, self.groups)
        return observed, steps

    def _drop_nonfinite(self, seen: GroupObs, step: GroupStep) -> None:
        """Rows with a non-finite observation or reward: their env is reset at once, and
        the step is reported as the one after an episode end (``GroupStep.dropped``).
        The resets are seeded from the run's seed and the drops so far (reproducible)."""
        bad = nonfinite_rows(seen.obs, np.asarray(step.reward, dtype=np.float64))
        if not bad.any():
            return
        seed = self.seed + 1_000_003 * (self.dropped + 1)  # env i resets with seed + i
        self.dropped += int(bad.sum())
        raw, info = self.envs.reset(seed=seed, options={"reset_mask": bad})
        obs, mask = self.spec.split(raw, info)
        seen.obs[bad] = obs[bad]
        if seen.mask is not None and mask is not None:
            seen.mask[bad] = mask[bad]
        step.reward = np.where(bad, 0.0, step.reward)
        step.terminated = np.asarray(step.terminated) & ~bad
        step.truncated = np.asarray(step.truncated) & ~bad
        if step.continues is not None:
            step.continues = step.continues & ~bad
        step.dropped = bad

    def capture(self) -> EnvState:
        return capture_arrays(self.envs) or capture_pickle(self.envs)

    def restore(self, data: dict[str, Any] | bytes) -> None:
        """Arrays from ``capture``, or a pickle the caller chose to trust."""
        if isinstance(data, dict):
            restore_arrays(self.envs, data)
            return
        envs = unpickle_envs(data)
        if not isinstance(envs, gym.vector.VectorEnv):
            raise ValueError(f"the pickle holds {type(envs).__name__}, not a vector env")
        self.envs.close()
        self.envs = envs

    def close(self) -> None:
        self.envs.close()
