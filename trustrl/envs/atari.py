"""Atari (``ALE/...`` ids, ale-py) and MinAtar (``MinAtar/...`` ids, minatar): their
namespaces registered on first use, and the Atari preprocessing stack.

Neither package is imported before an id of its namespace is asked for (``import trustrl``
stays light); a missing package is one line naming the pip extra.

An ``ALE/...`` id is built as the anchors (CleanRL's ``ppo_atari.py``, SB3's
``AtariWrapper``) build it, from Gymnasium's own wrappers where it has them::

    gym.make(id, frameskip=1)          the wrapper below skips frames itself
    AtariPreprocessing(noop_max=30, frame_skip=4, screen_size=84, grayscale_obs=True,
                       scale_obs=False, terminal_on_life_loss=False)
    TimeLimit                          only for env.kwargs.max_episode_steps (agent steps)
    EpisodicLife                       training only: a lost life ends the episode
    FireReset                          games whose actions include FIRE
    FrameStackObservation(4)           (4, 84, 84) uint8, channels first

Gymnasium has no fire reset and no episodic life (its ``terminal_on_life_loss`` ends the
episode *and* the next ``reset()`` starts a new game, so an agent would never see a
late level), so those two are written here, after SB3's ``FireResetEnv`` and
``EpisodicLifeEnv``. Rewards are not clipped here: the collector clips them to their sign
(``env.clip_reward``) for training, so every reported return is the game's score.
"""

from __future__ import annotations

from typing import Any, SupportsFloat

import gymnasium as gym
import numpy as np

from trustrl.config import ConfigError

ALE = "ALE/"
MINATAR = "MinAtar/"
ATARI_FRAME_STACK = 4
"""Frames stacked for ALE ids when ``env.frame_stack`` is 0."""

# The namespace's prefix -> (the module that registers it, the package, trustrl's extra).
_NAMESPACES = {ALE: ("ale_py", "ale-py", "atari"), MINATAR: ("minatar", "minatar", "minatar")}
_registered: set[str] = set()


def is_ale_id(env_id: str) -> bool:
    return env_id.startswith(ALE)


def is_minatar_id(env_id: str) -> bool:
    return env_id.startswith(MINATAR)


def register_namespace(env_id: str) -> None:
    """Register the ``ALE/`` or ``MinAtar/`` ids with Gymnasium when ``env_id`` is one of
    them (once per process: an async backend's subprocess registers again); nothing for
    any other id."""
    prefix = next((p for p in _NAMESPACES if env_id.startswith(p)), None)
    if prefix is None or prefix in _registered:
        return
    module, package, extra = _NAMESPACES[prefix]
    try:
        if prefix == ALE:
            import ale_py

            gym.register_envs(ale_py)
        elif f"{MINATAR}Breakout-v1" not in gym.registry:  # registering twice warns
            from minatar.gym import register_envs

            register_envs()
    except ImportError as exc:
        raise ConfigError(
            f"env_id {env_id!r} needs the {package} package ({module} does not import: "
            f"{exc}); install it with pip install 'trustrl[{extra}]'"
        ) from None
    _registered.add(prefix)


def _action_meanings(env: gym.Env) -> list[str]:
    return list(env.unwrapped.get_action_meanings())  # type: ignore[attr-defined]


def _fires(env: gym.Env) -> bool:
    """Whether the game has FIRE where SB3's fire reset presses it (action 1)."""
    meanings = _action_meanings(env)
    return len(meanings) >= 3 and meanings[1] == "FIRE"


def _lives(env: gym.Env) -> int:
    return int(env.unwrapped.ale.lives())  # type: ignore[attr-defined]


class EpisodicLife(gym.Wrapper):
    """A lost life ends the episode for training (``terminated=True``) while the game
    goes on: ``info["game_over"]`` is False on such a step (and True where the game
    itself ended, or was cut off), and the ``reset()`` after it does not start a new game
    but takes one no-op step (as SB3's ``EpisodicLifeEnv``). A reset with a seed always
    starts a new game. The collector carries the game's return over such ends, so
    episodes are reported per game (``GroupStep.continues``)."""

    def __init__(self, env: gym.Env) -> None:
        super().__init__(env)
        self.lives = 0
        self.game_over = True

    def step(self, action: Any) -> tuple[Any, SupportsFloat, bool, bool, dict[str, Any]]:
        obs, reward, terminated, truncated, info = self.env.step(action)
        self.game_over = bool(terminated or truncated)
        lives = _lives(self.env)
        if 0 < lives < self.lives:  # some games report 0 lives before their real end
            terminated = True
        self.lives = lives
        return obs, reward, terminated, truncated, {**info, "game_over": self.game_over}

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[Any, dict[str, Any]]:
        if self.game_over or seed is not None or options:
            obs, info = self.env.reset(seed=seed, options=options)
        else:
            obs, _, terminated, truncated, info = self.env.step(0)
            if terminated or truncated:
                obs, info = self.env.reset()
        self.game_over = False
        self.lives = _lives(self.env)
        return obs, info


class FireReset(gym.Wrapper):
    """Press FIRE (then action 2) after every reset, for games that wait for FIRE to
    start (as SB3's ``FireResetEnv``).

    ``after_life_loss``: also when a life is lost and the game goes on, after one no-op
    step, the same actions the episodic-life reset takes, their rewards added to the
    step's. Whole games (evaluation, video) use it: a policy trained with episodic life
    never had to serve after a lost life, and Breakout would wait for FIRE until the
    frame limit."""

    def __init__(self, env: gym.Env, after_life_loss: bool = False) -> None:
        super().__init__(env)
        if not _fires(env):
            raise ValueError(f"FireReset needs FIRE as action 1, not {_action_meanings(env)}")
        self.after_life_loss = after_life_loss
        self.lives = 0

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[Any, dict[str, Any]]:
        obs, info = self.env.reset(seed=seed, options=options)
        for action in (1, 2):
            obs, _, terminated, truncated, _ = self.env.step(action)
            if terminated or truncated:
                obs, info = self.env.reset()
        self.lives = _lives(self.env)
        return obs, info  # the reset's info: a step's would say game_over at a reset

    def step(self, action: Any) -> tuple[Any, SupportsFloat, bool, bool, dict[str, Any]]:
        obs, reward, terminated, truncated, info = self.env.step(action)
        lives = _lives(self.env)
        if self.after_life_loss and lives < self.lives and not (terminated or truncated):
            total = float(reward)
            for restart in (0, 1, 2):
                obs, reward, terminated, truncated, info = self.env.step(restart)
                total += float(reward)
                if terminated or truncated:
                    break
            reward, lives = total, _lives(self.env)
        self.lives = lives
        return obs, reward, terminated, truncated, info


def make_atari(
    env_id: str,
    kwargs: dict[str, Any] | None = None,
    frame_stack: int = 0,
    episodic_life: bool = False,
) -> gym.Env:
    """An ``ALE/...`` env with the preprocessing of the module's docstring.

    ``kwargs`` go to ``gym.make`` (``repeat_action_probability``, ``mode``,
    ``render_mode``, ...), except ``frameskip``, which sets the wrapper's frame skip (4),
    and ``max_episode_steps``, which counts steps of ``frameskip`` frames, the fire
    reset's included (Gymnasium's would count single frames here), over a whole game.
    ``frame_stack`` 0 stacks 4 frames; ``episodic_life`` is for training only."""
    register_namespace(env_id)
    kwargs = dict(kwargs or {})
    frame_skip = kwargs.pop("frameskip", 4)
    limit = kwargs.pop("max_episode_steps", None)
    env: gym.Env = gym.make(env_id, frameskip=1, **kwargs)
    env = gym.wrappers.AtariPreprocessing(
        env,
        noop_max=30,
        frame_skip=frame_skip,
        screen_size=84,
        grayscale_obs=True,
        scale_obs=False,
        terminal_on_life_loss=False,
    )
    if limit is not None:
        env = gym.wrappers.TimeLimit(env, max_episode_steps=limit)
    if episodic_life:
        env = EpisodicLife(env)
    if _fires(env):
        env = FireReset(env, after_life_loss=not episodic_life)
    env = gym.wrappers.FrameStackObservation(env, frame_stack or ATARI_FRAME_STACK)
    # One rendered frame per agent step: real time is the console's 60 Hz / frame skip.
    env.metadata = {**env.metadata, "render_fps": max(1, round(60 / frame_skip))}
    return env


class AtariFactory:
    """Builds one ``ALE/...`` env (picklable for subprocesses, which register the ids
    themselves)."""

    def __init__(
        self, env_id: str, kwargs: dict[str, Any], frame_stack: int, episodic_life: bool
    ) -> None:
        self.env_id, self.kwargs = env_id, kwargs
        self.frame_stack, self.episodic_life = frame_stack, episodic_life

    def __call__(self) -> gym.Env:
        return make_atari(self.env_id, self.kwargs, self.frame_stack, self.episodic_life)


MINATAR_CELL = 16
"""Pixels per grid cell in a MinAtar video frame (10 x 10 cells -> 160 x 160)."""


class MinAtarFrames(gym.Wrapper):
    """MinAtar's ``rgb_array`` render as a video frame: uint8 (it renders floats in
    [0, 1], which video writers take for black) and each cell ``MINATAR_CELL`` pixels
    wide (it renders one pixel a cell)."""

    def __init__(self, env: gym.Env) -> None:
        super().__init__(env)
        self.metadata = {**env.metadata, "render_fps": 15}

    def render(self) -> Any:
        frame = self.env.render()
        if not isinstance(frame, np.ndarray) or frame.ndim != 3:
            return frame
        if frame.dtype != np.uint8:
            frame = np.clip(np.rint(np.asarray(frame, np.float64) * 255), 0, 255)
            frame = frame.astype(np.uint8)
        return np.repeat(np.repeat(frame, MINATAR_CELL, axis=0), MINATAR_CELL, axis=1)


class MinAtarFactory:
    """Builds one ``MinAtar/...`` env (picklable; registers the ids in the process that
    builds), with video frames a player can see when it renders ``rgb_array``."""

    def __init__(self, env_id: str, kwargs: dict[str, Any]) -> None:
        self.env_id, self.kwargs = env_id, kwargs

    def __call__(self) -> gym.Env:
        register_namespace(self.env_id)
        if self.kwargs.get("render_mode") != "rgb_array":
            return gym.make(self.env_id, **self.kwargs)
        # The checker would warn of the float frames and missing fps MinAtarFrames fixes.
        return MinAtarFrames(gym.make(self.env_id, disable_env_checker=True, **self.kwargs))
