"""Videos of evaluation episodes: ``trustrl eval RUN_DIR --video``.

Gymnasium envs are recorded by Gymnasium's own ``RecordVideo`` wrapper over an env made
with ``render_mode="rgb_array"``: one mp4 per episode, written through moviepy. MuJoCo
envs render off-screen; without a display they need ``MUJOCO_GL=egl`` (Mesa's EGL on
the CPU, which ``scripts/setup`` installs; ``osmesa`` would need libOSMesa, not
installed here), which ``trustrl eval --video`` sets unless the variable is already set.

MuJoCo's locomotion envs (Hopper, Walker2d, HalfCheetah, Ant, Humanoid, Swimmer) each
define a tracking camera in their model, ``track`` (``mode="trackcom"``: it follows the
torso's centre of mass), but Gymnasium 1.x renders with a free camera that stays where
the episode began unless a camera is named, so the body walks out of the frame within
seconds. Recordings name it (``tracking_camera``); a ``camera_name`` or ``camera_id`` the
user gives in the env kwargs wins.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from trustrl.envs.gym import env_factory

if TYPE_CHECKING:
    from trustrl.learner.policy import MultiAgentPolicy, Policy


@dataclass(frozen=True)
class Recording:
    videos: list[Path]
    returns: list[float]
    lengths: list[int]


def record(
    policy: Policy | MultiAgentPolicy,
    env_id: str,
    folder: str | Path,
    episodes: int = 1,
    deterministic: bool = True,
    seed: int = 0,
    env_kwargs: dict[str, Any] | None = None,
    name_prefix: str = "eval",
    frame_stack: int = 0,
) -> Recording:
    """Run ``episodes`` episodes (reset seeds ``seed + i``, as ``evaluate`` does) and write
    each as ``<folder>/<name_prefix>-episode-<i>.mp4``. ``frame_stack``: the run's
    ``env.frame_stack``; Atari episodes are whole games, recorded at the console's
    frames (210 x 160, RGB), MinAtar's grids 16 pixels a cell."""
    if episodes < 1:
        raise ValueError(f"episodes must be >= 1, got {episodes}")
    from trustrl.learner.policy import MultiAgentPolicy

    folder = Path(folder)
    if isinstance(policy, MultiAgentPolicy):
        return _record_parallel(
            policy, env_id, folder, episodes, deterministic, seed, env_kwargs, name_prefix
        )
    from gymnasium.wrappers import RecordVideo

    env_kwargs = {**tracking_camera(env_id, env_kwargs), **(env_kwargs or {})}
    env = env_factory(env_id, env_kwargs, frame_stack=frame_stack, render_mode="rgb_array")()
    env = RecordVideo(env, str(folder), episode_trigger=lambda _: True, name_prefix=name_prefix)
    returns, lengths = [], []
    try:
        for episode in range(episodes):
            obs, info = env.reset(seed=seed + episode)
            total, length, done = 0.0, 0, False
            state = None  # a recurrent policy's (policy.memory): zeros at the start
            while not done:
                mask = info.get("action_mask")
                if policy.state_size:
                    action, state = policy.act(obs, deterministic, mask=mask, state=state)
                else:
                    action = policy.act(obs, deterministic, mask=mask)
                obs, reward, terminated, truncated, info = env.step(action)
                total += float(reward)
                length += 1
                done = terminated or truncated
            returns.append(total)
            lengths.append(length)
    finally:
        env.close()  # writes the last episode's file
    videos = [folder / f"{name_prefix}-episode-{i}.mp4" for i in range(episodes)]
    return Recording(videos, returns, lengths)


def tracking_camera(env_id: str, env_kwargs: dict[str, Any] | None = None) -> dict[str, Any]:
    """The env kwargs that render a Gymnasium MuJoCo env through its model's tracking
    camera (``camera_name="track"``, module docstring); none for other envs, or where
    the kwargs already name a camera. A model without a ``track`` camera renders as
    before (Gymnasium falls back to its free camera)."""
    import gymnasium as gym

    kwargs = env_kwargs or {}
    if "camera_name" in kwargs or "camera_id" in kwargs:
        return {}
    try:
        entry_point = gym.spec(env_id).entry_point
    except gym.error.Error:  # not a registered id (a package.module:callable, ALE, ...)
        return {}
    if not (isinstance(entry_point, str) and entry_point.startswith("gymnasium.envs.mujoco")):
        return {}
    return {"camera_name": "track"}


def _record_parallel(
    policy: MultiAgentPolicy,
    env_id: str,
    folder: Path,
    episodes: int,
    deterministic: bool,
    seed: int,
    env_kwargs: dict[str, Any] | None,
    name_prefix: str,
) -> Recording:
    """PettingZoo envs: ``RecordVideo`` wraps a ``gymnasium.Env`` and a ParallelEnv is not
    one, so the frames of ``render()`` (``render_mode="rgb_array"``) are collected here and
    written with the writer ``RecordVideo`` itself uses (moviepy's ImageSequenceClip), at
    the env's ``render_fps``: the same files either way."""
    from moviepy.video.io.ImageSequenceClip import ImageSequenceClip

    from trustrl.envs.pettingzoo import parallel_env_factory
    from trustrl.run.evaluation import play_parallel_episode

    folder.mkdir(parents=True, exist_ok=True)
    env = parallel_env_factory(env_id, {**(env_kwargs or {}), "render_mode": "rgb_array"})()
    fps = env.metadata.get("render_fps", 30)
    videos, returns, lengths = [], [], []
    try:
        for episode in range(episodes):
            frames: list[np.ndarray] = []

            def frame(frames: list[np.ndarray] = frames) -> None:
                frames.append(np.asarray(env.render()))

            totals, length = play_parallel_episode(
                policy, env, seed + episode, deterministic, frame
            )
            path = folder / f"{name_prefix}-episode-{episode}.mp4"
            ImageSequenceClip(frames, fps=fps).write_videofile(str(path), logger=None)
            videos.append(path)
            # The mean over agents of each agent's episode return, as evaluate reports.
            returns.append(float(np.mean(list(totals.values()))))
            lengths.append(length)
    finally:
        env.close()
    return Recording(videos, returns, lengths)
