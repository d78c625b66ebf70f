"""Atari (ALE/...) and MinAtar (MinAtar/...) ids: lazy registration, the Atari wrapper
stack (Gymnasium's AtariPreprocessing and FrameStackObservation, trustrl's fire reset and
episodic life), whole-game evaluation and videos, GymRows' ``continues``, the presets.
Fast: no training."""

from __future__ import annotations

import importlib.util
import pickle
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import gymnasium as gym
import numpy as np
import pytest

import trustrl
from trustrl.config import ConfigError, available_presets
from trustrl.envs import atari
from trustrl.envs.gym import (
    GymRows,
    check_env_id,
    env_factory,
    life_lost,
    make_row_env,
    make_vec_env,
    resolve_backend,
)
from trustrl.envs.spaces import SpaceSpec

HAS_ALE = all(importlib.util.find_spec(m) is not None for m in ("ale_py", "cv2"))
HAS_MINATAR = importlib.util.find_spec("minatar") is not None
needs_ale = pytest.mark.skipif(not HAS_ALE, reason="needs ale-py and opencv (trustrl[atari])")
needs_minatar = pytest.mark.skipif(not HAS_MINATAR, reason="needs minatar (trustrl[minatar])")

BREAKOUT = "ALE/Breakout-v5"
MINATAR_GAMES = ["Asterix", "Breakout", "Freeway", "Seaquest", "SpaceInvaders"]


def wrappers(env: gym.Env) -> list[gym.Env]:
    """The env's wrappers, outermost first."""
    found = []
    while isinstance(env, gym.Wrapper):
        found.append(env)
        env = env.env
    return found


def of_type(env: gym.Env, kind: type) -> Any:
    [found] = [w for w in wrappers(env) if isinstance(w, kind)]
    return found


def lives(env: gym.Env) -> int:
    return int(env.unwrapped.ale.lives())  # type: ignore[attr-defined]


def noop_until_end(env: gym.Env, limit: int = 5_000) -> tuple[int, float, bool, dict[str, Any]]:
    """NOOP until the episode ends: its length, return, terminated and last info."""
    total = 0.0
    for step in range(1, limit + 1):
        _, reward, terminated, truncated, info = env.step(0)
        total += float(reward)
        if terminated or truncated:
            return step, total, bool(terminated), info
    raise AssertionError(f"no end in {limit} NOOP steps")


@needs_ale
def test_the_atari_stack_is_gymnasiums_preprocessing_with_four_frames_stacked() -> None:
    for episodic_life in (True, False):
        env = env_factory(BREAKOUT, {}, episodic_life=episodic_life)()
        assert env.observation_space == gym.spaces.Box(0, 255, (4, 84, 84), np.uint8)
        obs, _ = env.reset(seed=0)
        assert obs.shape == (4, 84, 84) and obs.dtype == np.uint8
        assert isinstance(env, gym.wrappers.FrameStackObservation)
        pre = of_type(env, gym.wrappers.AtariPreprocessing)
        assert (pre.noop_max, pre.frame_skip, pre.screen_size) == (30, 4, (84, 84))
        assert pre.grayscale_obs and not pre.scale_obs and not pre.terminal_on_life_loss
        assert env.unwrapped._frameskip == 1  # type: ignore[attr-defined]
        assert env.unwrapped.ale.getFloat("repeat_action_probability") == 0.25  # type: ignore[attr-defined]
        kinds = [type(w) for w in wrappers(env)]
        assert (atari.EpisodicLife in kinds) == episodic_life
        assert env.metadata["render_fps"] == 15  # one frame per agent step: 60 Hz / 4
        env.close()


@needs_ale
def test_frame_stack_frame_skip_and_step_limit_are_configurable() -> None:
    env = env_factory(BREAKOUT, {"frameskip": 2, "max_episode_steps": 7}, frame_stack=2)()
    assert env.observation_space.shape == (2, 84, 84)
    assert of_type(env, gym.wrappers.AtariPreprocessing).frame_skip == 2
    env.reset(seed=0)
    length, _, terminated, _ = noop_until_end(env)
    assert (length, terminated) == (5, False)  # steps of 2 frames, the 2 of fire reset's too
    env.close()


@needs_ale
def test_fire_reset_serves_the_ball_in_games_that_wait_for_fire() -> None:
    env = env_factory(BREAKOUT, {}, episodic_life=True)()
    of_type(env, atari.FireReset)
    env.reset(seed=1)
    length, _, terminated, info = noop_until_end(env)
    assert terminated and length < 100 and info["game_over"] is False  # the ball fell
    # Without it, Breakout waits for FIRE: NOOPs lose no life.
    plain = gym.wrappers.AtariPreprocessing(gym.make(BREAKOUT, frameskip=1))
    plain.reset(seed=1)
    for _ in range(300):
        plain.step(0)
    assert lives(plain) == 5
    # Games without FIRE get no fire reset.
    freeway = env_factory("ALE/Freeway-v5", {})()
    assert not any(isinstance(w, atari.FireReset) for w in wrappers(freeway))
    for env_ in (env, plain, freeway):
        env_.close()
    with pytest.raises(ValueError, match="FIRE as action 1"):
        atari.FireReset(gym.make("ALE/Freeway-v5"))


@needs_ale
def test_episodic_life_ends_the_episode_at_a_lost_life_and_the_game_goes_on() -> None:
    env = env_factory(BREAKOUT, {}, episodic_life=True)()
    _, info = env.reset(seed=2)
    assert "game_over" not in info  # reset infos never say it
    frames = info["episode_frame_number"]
    for expected in (4, 3, 2, 1):
        _, _, terminated, info = noop_until_end(env)
        assert terminated and info["game_over"] is False and lives(env) == expected
        _, info = env.reset()  # one no-op step and FIRE: the same game
        assert lives(env) == expected and info["episode_frame_number"] > frames
        frames = info["episode_frame_number"]
    _, _, terminated, info = noop_until_end(env)
    assert terminated and info["game_over"] is True and lives(env) == 0
    _, info = env.reset()  # the game is over: a new one
    assert lives(env) == 5 and info["episode_frame_number"] < 200
    # A seeded reset is a new game even with lives left.
    noop_until_end(env)
    env.reset(seed=3)
    assert lives(env) == 5
    env.close()


@needs_ale
def test_evaluation_envs_play_whole_games_serving_after_each_lost_life() -> None:
    env = env_factory(BREAKOUT, {})()
    env.reset(seed=4)
    length, _, terminated, info = noop_until_end(env)
    assert terminated and lives(env) == 0 and "game_over" not in info
    assert 5 * 15 < length < 5 * 100
    env.close()


class _Noop:
    """evaluation._Actor's place: NOOP for every row."""

    state_size = 0  # no memory

    def __init__(self, policy: Any, deterministic: bool, seed: int) -> None:
        pass

    def __call__(self, obs: np.ndarray, mask: Any, state: np.ndarray) -> Any:
        return np.zeros(len(obs), dtype=np.int64), state


@needs_ale
def test_evaluate_plays_atari_episodes_as_whole_games(monkeypatch: pytest.MonkeyPatch) -> None:
    from trustrl.run import evaluation

    env = env_factory(BREAKOUT, {})()
    spec = SpaceSpec.from_spaces(env.observation_space, env.action_space)
    env.close()
    monkeypatch.setattr(evaluation, "_Actor", _Noop)
    result = evaluation.evaluate(SimpleNamespace(spec=spec), BREAKOUT, episodes=1, seed=5)
    assert all(5 * 15 < n < 5 * 100 for n in result.lengths)  # five lives each


@needs_ale
def test_gym_rows_report_lost_lives_as_continuing_games() -> None:
    rows = GymRows(make_vec_env(BREAKOUT, 2, "sync", {}, episodic_life=True))
    rows.reset(seed=6)
    continued, ended = np.zeros(2, int), np.zeros(2, bool)  # each env's first game
    for _ in range(1_000):
        _, [step] = rows.step([np.zeros(2, dtype=np.int64)])
        # None where every row's step is a reset (the info has no game_over then).
        continues = np.zeros(2, bool) if step.continues is None else step.continues
        assert not (continues & ~step.terminated).any()
        continued += continues & ~ended
        ended |= step.terminated & ~continues
        if ended.all():
            break
    assert ended.all() and continued.tolist() == [4, 4]  # four lost lives, then game over
    rows.close()
    whole = GymRows(make_vec_env(BREAKOUT, 1, "sync", {}))
    whole.reset(seed=6)
    _, [step] = whole.step([np.zeros(1, dtype=np.int64)])
    assert step.continues is None
    whole.close()


def test_life_lost_reads_game_over_where_the_info_has_it() -> None:
    terminated = np.array([True, True, True, False])
    info = {
        "game_over": np.array([False, True, False, False]),
        "_game_over": np.array([True, True, False, True]),
    }
    assert life_lost(info, terminated).tolist() == [True, False, False, False]
    assert life_lost({}, terminated) is None


@needs_ale
def test_training_envs_come_from_the_config() -> None:
    config = trustrl.resolve(BREAKOUT, overrides={"env": {"num_envs": 2}})
    rows = make_row_env(config)
    assert isinstance(rows.envs, gym.vector.SyncVectorEnv)  # auto: not ale-py's vector env
    sub = rows.envs.envs[0]
    assert any(isinstance(w, atari.EpisodicLife) for w in wrappers(sub))
    rows.close()
    off = trustrl.resolve(BREAKOUT, overrides={"env": {"num_envs": 1, "episodic_life": False}})
    rows = make_row_env(off)
    assert not any(isinstance(w, atari.EpisodicLife) for w in wrappers(rows.envs.envs[0]))
    rows.close()
    with pytest.raises(ConfigError, match="'vector' is not for ALE ids"):
        resolve_backend(BREAKOUT, "vector")


@needs_ale
def test_the_atari_factory_builds_in_subprocesses() -> None:
    factory = env_factory(BREAKOUT, {}, episodic_life=True)
    assert isinstance(pickle.loads(pickle.dumps(factory)), atari.AtariFactory)
    envs = make_vec_env(BREAKOUT, 2, "async", {}, episodic_life=True)
    try:
        obs, _ = envs.reset(seed=0)
        assert obs.shape == (2, 4, 84, 84) and obs.dtype == np.uint8
        *_, info = envs.step(np.zeros(2, dtype=np.int64))
        assert info["_game_over"].all() and not info["game_over"].any()
    finally:
        envs.close()


def test_frame_stack_stacks_any_envs_observations() -> None:
    env = env_factory("CartPole-v1", {}, frame_stack=3)()
    assert env.observation_space.shape == (3, 4)
    env.close()
    assert make_vec_env("CartPole-v1", 2, "sync", frame_stack=3).single_observation_space.shape == (
        3,
        4,
    )
    with pytest.raises(ConfigError, match="frame_stack"):
        make_vec_env("CartPole-v1", 2, "vector", frame_stack=3)
    with pytest.raises(ConfigError, match=r"env\.frame_stack must be an integer >= 0"):
        trustrl.resolve("CartPole-v1", overrides={"env": {"frame_stack": -1}})


@needs_ale
def test_an_unknown_ale_id_is_refused_with_the_nearest_names() -> None:
    with pytest.raises(ConfigError, match=r"'ALE/Foo-v5' is not a registered .* did you mean"):
        check_env_id("ALE/Foo-v5")


@pytest.mark.parametrize(
    ("env_id", "extra"), [(BREAKOUT, "atari"), ("MinAtar/Breakout-v1", "minatar")]
)
def test_a_missing_package_is_one_line_naming_the_extra(
    monkeypatch: pytest.MonkeyPatch, env_id: str, extra: str
) -> None:
    monkeypatch.setattr(atari, "_registered", set())
    for module in ("ale_py", "minatar", "minatar.gym"):
        monkeypatch.setitem(sys.modules, module, None)  # importing it now fails
    registry = {k: v for k, v in gym.registry.items() if not k.startswith(("ALE/", "MinAtar/"))}
    monkeypatch.setattr(gym.envs.registration, "registry", registry)
    monkeypatch.setattr(gym, "registry", registry)
    with pytest.raises(ConfigError, match=rf"pip install 'trustrl\[{extra}\]'") as error:
        check_env_id(env_id)
    assert "\n" not in str(error.value)


@needs_minatar
@pytest.mark.parametrize("game", MINATAR_GAMES)
def test_minatar_ids_resolve_to_bool_grids(game: str) -> None:
    env_id = f"MinAtar/{game}-v1"
    check_env_id(env_id)
    env = env_factory(env_id, {})()
    obs, _ = env.reset(seed=0)
    space = env.observation_space
    assert space.shape[:2] == (10, 10) and space.dtype == np.bool_ and obs.dtype == np.bool_
    assert isinstance(env.action_space, gym.spaces.Discrete)
    env.close()


@needs_minatar
def test_minatar_video_frames_are_uint8_with_cells_a_player_can_see() -> None:
    env = env_factory("MinAtar/Breakout-v1", {}, render_mode="rgb_array")()
    env.reset(seed=0)
    frame = env.render()
    assert frame.shape == (160, 160, 3) and frame.dtype == np.uint8 and frame.max() > 0
    assert env.metadata["render_fps"] == 15
    env.close()
    envs = make_vec_env("MinAtar/Breakout-v1", 2, "async")  # registered in the subprocesses
    try:
        assert envs.reset(seed=0)[0].shape == (2, 10, 10, 4)
    finally:
        envs.close()


def _new_presets() -> list[str]:
    ids = [BREAKOUT, "ALE/Pong-v5"] if HAS_ALE else []
    ids += [f"MinAtar/{g}-v1" for g in MINATAR_GAMES] if HAS_MINATAR else []
    return [*ids, "FrozenLake-v1", "Taxi-v4"]


@pytest.mark.parametrize("env_id", _new_presets())
def test_the_pixel_and_toy_text_presets_resolve(env_id: str) -> None:
    assert env_id in available_presets("ppo")
    check_env_id(env_id)
    config = trustrl.resolve(env_id)
    assert not config.env.normalize_obs
    if env_id.startswith("ALE/"):
        assert config.env.clip_reward and config.env.episodic_life
        assert config.policy.hidden_sizes == () and config.policy.activation == "relu"
        assert (config.env.num_envs, config.rollout.num_steps) == (8, 128)
        assert (config.ppo.clip_coef, config.ppo.vf_clip_coef, config.ppo.ent_coef) == (
            0.1,
            0.1,
            0.01,
        )
        assert config.ppo.anneal_lr and config.ppo.learning_rate == 2.5e-4
        assert config.policy.share_encoder  # one CNN, as CleanRL's
    if env_id.startswith("MinAtar/"):
        assert config.policy.hidden_sizes == () and config.rollout.gamma == 0.999
        assert (config.env.num_envs, config.ppo.num_minibatches) == (64, 8)
        assert not config.policy.share_encoder  # gymnax's actor and critic are separate


@pytest.mark.parametrize(
    ("env_id", "kwargs", "size"),
    [(BREAKOUT, {"max_episode_steps": 20}, (210, 160)), ("MinAtar/Breakout-v1", {}, (160, 160))],
)
def test_videos_record_the_consoles_frames(
    tmp_path: Path, env_id: str, kwargs: dict[str, Any], size: tuple[int, int]
) -> None:
    if not (HAS_ALE if env_id.startswith("ALE/") else HAS_MINATAR):
        pytest.skip(f"needs the package of {env_id}")
    pytest.importorskip("moviepy")
    from moviepy import VideoFileClip

    from trustrl.run.video import record

    noop = SimpleNamespace(act=lambda obs, deterministic, mask=None: 0, state_size=0)
    recording = record(noop, env_id, tmp_path / "v", episodes=1, env_kwargs=kwargs)
    clip = VideoFileClip(str(recording.videos[0]))
    try:
        frame = clip.get_frame(0)
        assert frame.shape == (*size, 3) and frame.max() > 0 and clip.fps == 15
    finally:
        clip.close()
