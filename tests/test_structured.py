"""Structured observations (trustrl/envs/layout.py): images, Dict, Tuple, Discrete,
MultiDiscrete and MultiBinary observations as one packed row, through the policy (torch
and its numpy twin), the collector, training, checkpoints and evaluation; bad input
refused naming the entry."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import pytest
import torch
from gymnasium import spaces

import trustrl
from tests import envs as E
from tests.collecting import collect
from trustrl.acting.collector import Collector
from trustrl.acting.inference import Inference
from trustrl.config import ConfigError, PolicyConfig
from trustrl.contract import GroupSnapshot
from trustrl.envs import layout
from trustrl.envs.rows import GroupStep
from trustrl.envs.spaces import SpaceSpec
from trustrl.learner.policy import Policy

# The acting side against torch: float32 convolutions and matmuls in another order.
TOLERANCE = 1e-4

GRID = spaces.Box(0, 1, (6, 6, 2), bool)
DICT = spaces.Dict(
    {
        "frame": spaces.Box(0, 255, (4, 40, 40), np.uint8),
        "vec": spaces.Box(-5.0, 5.0, (3,), np.float32),
        "k": spaces.Discrete(4, start=1),
        "bits": spaces.MultiBinary(2),
        "md": spaces.MultiDiscrete([2, 3]),
    }
)

GRID_DICT = spaces.Dict({"grid": GRID, "vec": spaces.Box(-5.0, 5.0, (3,), np.float32)})


def _batch(space: gym.Space, n: int, seed: int = 0) -> Any:
    space.seed(seed)
    samples = [space.sample() for _ in range(n)]
    if isinstance(space, spaces.Dict):
        return {k: np.stack([np.asarray(s[k]) for s in samples]) for k in space.spaces}
    if isinstance(space, spaces.Tuple):
        return tuple(np.stack([np.asarray(s[i]) for s in samples]) for i in range(len(space)))
    return np.stack([np.asarray(s) for s in samples])


# The layout.


def test_a_flat_box_has_no_layout_and_its_spec_reads_as_before() -> None:
    spec = SpaceSpec.from_spaces(spaces.Box(-1, 1, (3,), np.float32), spaces.Discrete(2))
    assert spec.obs_entries == () and spec.obs_dtype == np.float32 and spec.vector_dim == 3
    assert "obs_entries" not in spec.to_json()


def test_frames_are_bytes_and_a_mixed_dict_is_float_with_its_vectors_first() -> None:
    atari = SpaceSpec.from_spaces(spaces.Box(0, 255, (4, 84, 84), np.uint8), spaces.Discrete(4))
    assert atari.obs_dtype == np.uint8 and atari.obs_dim == 4 * 84 * 84 and atari.vector_dim == 0
    assert atari.obs_shape == (4, 84, 84)
    spec = SpaceSpec.from_spaces(DICT, spaces.Discrete(2))
    assert spec.obs_entries[0]["key"] == "vec"  # the normalizer's columns
    assert spec.obs_dtype == np.float32 and spec.vector_dim == 3
    assert spec.obs_dim == 3 + 4 * 40 * 40 + 4 + 2 + 5
    assert SpaceSpec.from_json(spec.to_json()) == spec
    assert spec.compatible(SpaceSpec.from_json(spec.to_json()))


def test_packing_writes_each_entry_to_its_columns() -> None:
    spec = SpaceSpec.from_spaces(DICT, spaces.Discrete(2))
    raw = _batch(DICT, 5)
    rows, mask = spec.split(raw)
    assert mask is None and rows.shape == (5, spec.obs_dim)
    columns, offset = {}, 0
    for entry in spec.obs_entries:
        columns[entry["key"]] = rows[:, offset : offset + entry["width"]]
        offset += entry["width"]
    np.testing.assert_array_equal(columns["vec"], raw["vec"])
    np.testing.assert_array_equal(columns["frame"], raw["frame"].reshape(5, -1))
    np.testing.assert_array_equal(columns["k"].argmax(1) + 1, raw["k"])
    assert (columns["k"].sum(1) == 1).all()
    np.testing.assert_array_equal(columns["bits"], raw["bits"])
    md = columns["md"]
    np.testing.assert_array_equal(md[:, :2].argmax(1), raw["md"][:, 0])
    np.testing.assert_array_equal(md[:, 2:].argmax(1), raw["md"][:, 1])


def test_discrete_and_tuple_observations_are_one_hot_bytes() -> None:
    lake = SpaceSpec.from_spaces(spaces.Discrete(16), spaces.Discrete(4))
    rows, _ = lake.split(np.array([0, 5, 15]))
    assert rows.dtype == np.uint8 and rows.shape == (3, 16)
    np.testing.assert_array_equal(rows.argmax(1), [0, 5, 15])
    assert lake.is_single(3) and not lake.is_single(np.array([1, 2]))
    blackjack = spaces.Tuple((spaces.Discrete(32), spaces.Discrete(11), spaces.Discrete(2)))
    spec = SpaceSpec.from_spaces(blackjack, spaces.Discrete(2))
    rows, _ = spec.split((np.array([3]), np.array([4]), np.array([1])))
    np.testing.assert_array_equal(np.flatnonzero(rows[0]), [3, 32 + 4, 43 + 1])


def test_channels_first_and_last_are_told_apart() -> None:
    assert not layout.channels_last((4, 84, 84))
    assert layout.channels_last((84, 84, 4))
    assert layout.channels_last((10, 10, 4))  # MinAtar
    assert layout.channels_last((210, 160, 3))


@pytest.mark.parametrize(
    ("space", "message"),
    [
        (spaces.Text(5), r"the observation is Text.*trustrl takes a Box"),
        (
            spaces.Dict({"a": spaces.Dict({"b": spaces.Discrete(2)})}),
            r"observation entry 'a' is Dict.*\(nested\)",
        ),
        (spaces.Graph(spaces.Box(0, 1, (2,)), None), r"the observation is Graph"),
    ],
)
def test_what_cannot_be_taken_is_refused_in_one_line(space: gym.Space, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        SpaceSpec.from_spaces(space, spaces.Discrete(2))


def test_image_keys_take_a_float_box_as_an_image_and_unknown_keys_are_refused() -> None:
    space = spaces.Dict({"depth": spaces.Box(0.0, 1.0, (8, 8, 1), np.float32)})
    spec = SpaceSpec.from_spaces(space, spaces.Discrete(2), image_keys=("depth",))
    assert spec.obs_entries[0]["kind"] == "image" and spec.image_keys == ("depth",)
    assert spec.vector_dim == 0
    with pytest.raises(ConfigError, match=r"env.image_keys names \['rgb'\].*'depth'"):
        SpaceSpec.from_spaces(space, spaces.Discrete(2), image_keys=("rgb",))


def test_flat_keys_take_a_bool_grid_flat_and_refuse_what_is_not_one() -> None:
    spec = SpaceSpec.from_spaces(GRID, spaces.Discrete(2), flat_keys=("",))
    (entry,) = spec.obs_entries
    assert entry["kind"] == "binary" and entry["width"] == 72 and not spec.has_images
    assert spec.obs_dtype == np.uint8 and spec.vector_dim == 0 and spec.flat_keys == ("",)
    grid = np.random.default_rng(0).random((3, 6, 6, 2)) < 0.5
    rows, _ = spec.split(grid)
    np.testing.assert_array_equal(rows, grid.reshape(3, -1).astype(np.uint8))
    mixed = SpaceSpec.from_spaces(GRID_DICT, spaces.Discrete(2), flat_keys=("grid",))
    assert [e["kind"] for e in mixed.obs_entries] == ["vector", "binary"]
    assert mixed.obs_dtype == np.float32 and mixed.vector_dim == 3
    assert mixed.flat_keys == ("grid",)
    uint8 = spaces.Box(0, 255, (6, 6, 2), np.uint8)
    with pytest.raises(ConfigError, match=r"is named in env.flat_keys but is Box\(0, 255"):
        SpaceSpec.from_spaces(uint8, spaces.Discrete(2), flat_keys=("",))
    with pytest.raises(ConfigError, match=r"env.flat_keys names \['rgb'\].*'grid'"):
        SpaceSpec.from_spaces(GRID_DICT, spaces.Discrete(2), flat_keys=("rgb",))
    with pytest.raises(ConfigError, match=r"env.image_keys and env.flat_keys both name"):
        SpaceSpec.from_spaces(
            GRID_DICT, spaces.Discrete(2), image_keys=("grid",), flat_keys=("grid",)
        )


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (
            {
                "grid": np.zeros((1, 6, 6, 2), np.float32),
                "vec": np.zeros((1, 2), np.float32),
                "count": np.zeros(1, np.int64),
            },
            r"observation entry 'grid': expected frames of dtype bool, got float32",
        ),
        (
            {
                "grid": np.zeros((1, 6, 5, 2), bool),
                "vec": np.zeros((1, 2), np.float32),
                "count": np.zeros(1, np.int64),
            },
            r"observation entry 'grid': expected a batch of shape \(B, 6, 6, 2\), got shape "
            r"\(1, 6, 5, 2\)",
        ),
        (
            {"grid": np.zeros((1, 6, 6, 2), bool), "count": np.zeros(1, np.int64)},
            r"observation dict is missing the key 'vec'",
        ),
        (
            {
                "grid": np.zeros((1, 6, 6, 2), bool),
                "vec": np.zeros((1, 2), np.float32),
                "count": np.array([99]),
            },
            r"observation entry 'count': value 99 is outside \[0, 8\]",
        ),
    ],
)
def test_a_wrong_entry_is_named_with_what_was_expected_and_received(
    raw: dict[str, np.ndarray], message: str
) -> None:
    spec = SpaceSpec.from_spaces(E.DotEnv("dict").observation_space, spaces.Discrete(2))
    with pytest.raises(ValueError, match=message):
        spec.split(raw)


# The policy: torch and the acting side's numpy twin.


@pytest.mark.parametrize(
    ("space", "flat"),
    [
        (spaces.Box(0, 255, (4, 40, 40), np.uint8), ()),  # channels first, the Nature CNN
        (GRID, ()),  # bool, channels last, MinAtar's network
        (GRID, ("",)),  # the same grid taken flat: an MLP on its cells (env.flat_keys)
        (spaces.Box(0, 255, (9, 9), np.uint8), ()),  # one channel
        (DICT, ()),
        (GRID_DICT, ("grid",)),
        (spaces.Tuple((spaces.Discrete(5), spaces.MultiBinary(3))), ()),
    ],
    ids=["uint8-first", "bool-grid", "bool-grid-flat", "2d", "dict", "dict-flat", "tuple"],
)
@pytest.mark.parametrize("normalize", [False, True])
def test_the_acting_side_computes_what_the_policy_computes(
    space: gym.Space, flat: tuple[str, ...], normalize: bool
) -> None:
    torch.manual_seed(0)
    spec = SpaceSpec.from_spaces(space, spaces.Discrete(3), flat_keys=flat)
    policy = Policy(spec, PolicyConfig(hidden_sizes=(32,)), normalize_obs=normalize)
    rows, _ = spec.split(_batch(space, 64))
    if policy.obs_normalizer is not None:  # statistics of their own: a real standardization
        policy.obs_normalizer.update(rows[:, : spec.vector_dim].astype(np.float64) * 3 + 1)
    inference = Inference(GroupSnapshot.of(policy))
    norm = inference.obs_normalizer
    x = norm.normalize_array(rows) if norm is not None else rows
    assert x.dtype == spec.obs_dtype or norm is not None
    with torch.no_grad():
        x_torch = policy.normalize(torch.from_numpy(rows.astype(np.float32)))
        np.testing.assert_allclose(x, x_torch.numpy(), atol=1e-6)
        logits = policy.dist_params(torch.from_numpy(x))
        values = policy.critic_value(torch.from_numpy(x))
    np.testing.assert_allclose(inference.value(x), values.numpy(), atol=TOLERANCE)
    out = inference.head_linear(inference.actor(x))
    out = out - np.log(np.exp(out).sum(1, keepdims=True))  # dist_params are log-softmaxed
    np.testing.assert_allclose(out, logits.numpy(), atol=TOLERANCE)
    # The user-facing act takes raw observations as the env hands them out.
    top = np.sort(logits.numpy(), 1)
    clear = top[:, -1] - top[:, -2] > TOLERANCE
    assert (policy.act(_batch(space, 64)) == logits.argmax(1).numpy())[clear].all()


def test_the_normalizer_covers_the_vectors_only_and_frames_stay_bytes() -> None:
    spec = SpaceSpec.from_spaces(DICT, spaces.Discrete(2))
    policy = Policy(spec, normalize_obs=True)
    assert policy.obs_normalizer is not None and policy.obs_normalizer.mean.shape == (3,)
    frames = SpaceSpec.from_spaces(GRID, spaces.Discrete(2))
    assert Policy(frames, normalize_obs=True).obs_normalizer is None  # nothing to normalize


def test_a_per_agent_body_shares_the_image_encoder() -> None:
    spec = SpaceSpec.from_spaces(GRID, spaces.Discrete(2))
    policy = Policy(spec, PolicyConfig(hidden_sizes=(8,)), num_agents=3, per_agent=True)
    rows, _ = spec.split(_batch(GRID, 6))
    agent = np.arange(6) % 3
    inference = Inference(GroupSnapshot.of(policy))
    with torch.no_grad():
        logits = policy.dist_params(torch.from_numpy(rows), agent=torch.from_numpy(agent))
    out = inference.head_linear(inference.actor(rows, agent), agent)
    out = out - np.log(np.exp(out).sum(1, keepdims=True))
    np.testing.assert_allclose(out, logits.numpy(), atol=TOLERANCE)


@pytest.mark.parametrize("per_agent", [False, True])
def test_a_shared_encoder_feeds_the_value_layer_the_actors_features(per_agent: bool) -> None:
    torch.manual_seed(0)
    spec = SpaceSpec.from_spaces(DICT, spaces.Discrete(3))
    config = PolicyConfig(hidden_sizes=(16,), share_encoder=True)
    policy = Policy(spec, config, num_agents=2, per_agent=per_agent)
    assert not list(policy.critic[0].parameters())  # no encoder of its own
    rows, _ = spec.split(_batch(DICT, 8))
    agent = np.arange(8) % 2
    x, a = torch.from_numpy(rows), torch.from_numpy(agent)
    with torch.no_grad():
        features = policy.features(x, a)
        values = policy.value_raw(x, agent=a)
        np.testing.assert_allclose(values, policy.critic[1](features).squeeze(-1))
        np.testing.assert_allclose(policy.value_raw(x, agent=a, features=features), values)
    inference = Inference(GroupSnapshot.of(policy))
    np.testing.assert_allclose(inference.value(rows, agent=agent), values.numpy(), atol=TOLERANCE)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"algo": "trpo"}, r"policy.share_encoder: TRPO .* cannot share an encoder"),
        (
            {"ppo": {"pi_lr": 1e-3, "vf_lr": 1e-3}},
            r"policy.share_encoder trains one encoder with both losses",
        ),
    ],
)
def test_a_shared_encoder_is_refused_where_the_losses_are_apart(
    tmp_path: Path, overrides: dict[str, Any], message: str
) -> None:
    config = _config(tmp_path, "bool", policy={"share_encoder": True}, **overrides)
    with pytest.raises(ConfigError, match=message):
        trustrl.Trainer(config)


def test_bad_cnn_settings_are_refused_naming_the_field() -> None:
    spec = SpaceSpec.from_spaces(GRID, spaces.Discrete(2))
    with pytest.raises(ConfigError, match=r"policy.cnn_\*: conv layers .* leave nothing"):
        Policy(spec, PolicyConfig(cnn_channels=(8,), cnn_kernels=(9,), cnn_strides=(1,)))
    with pytest.raises(ConfigError, match=r"policy.cnn_channels, policy.cnn_kernels"):
        PolicyConfig(cnn_channels=(8, 8), cnn_kernels=(3,), cnn_strides=(1,))


# Collecting: frames stay bytes, reward clipping, whole games with episodic life.


def test_a_rollout_keeps_frames_as_bytes() -> None:
    envs = gym.vector.SyncVectorEnv(
        [functools.partial(E.DotEnv, "first")] * 2,
        autoreset_mode=gym.vector.AutoresetMode.NEXT_STEP,
    )
    collector = Collector(envs, seed=0, gamma=0.99)
    policy = Policy(collector.spec)
    rollout, _ = collect(collector, policy, 16)
    assert rollout.obs.dtype == torch.uint8 and rollout.obs.shape == (16, 2, 72)
    assert set(np.unique(rollout.obs.numpy())) <= {0, 255}
    collector.close()


def test_a_shared_encoder_values_each_step_as_it_acts() -> None:
    envs = gym.vector.SyncVectorEnv(
        [functools.partial(E.DotEnv, "dict")] * 3,
        autoreset_mode=gym.vector.AutoresetMode.NEXT_STEP,
    )
    collector = Collector(envs, seed=0, gamma=0.99)
    policy = Policy(collector.spec, PolicyConfig(share_encoder=True), normalize_obs=True)
    rollout, _ = collect(collector, policy, 12)
    inference = Inference(GroupSnapshot.of(policy))
    batch = inference.value(rollout.obs.reshape(36, -1).numpy()).reshape(12, 3)
    np.testing.assert_allclose(rollout.values.numpy(), batch, atol=1e-5)
    collector.close()


class _Lives(gym.Env):
    """Reward 3 a step; a life lost every 3 steps (terminated, ``game_over`` False) and the
    game over at the third."""

    observation_space = spaces.Box(0, 255, (6, 6, 1), np.uint8)
    action_space = spaces.Discrete(2)

    def __init__(self) -> None:
        self.steps = 0

    def reset(self, *, seed: int | None = None, options: Any = None) -> tuple[Any, dict]:
        super().reset(seed=seed)
        if self.steps >= 9:
            self.steps = 0
        return np.zeros((6, 6, 1), np.uint8), {}

    def step(self, action: Any) -> tuple[Any, float, bool, bool, dict]:
        self.steps += 1
        life_lost = self.steps % 3 == 0
        info = {"game_over": self.steps >= 9} if life_lost else {}
        return np.zeros((6, 6, 1), np.uint8), 3.0, life_lost, False, info


def test_episodic_life_reports_whole_games_and_clip_reward_trains_on_signs() -> None:
    envs = gym.vector.SyncVectorEnv([_Lives], autoreset_mode=gym.vector.AutoresetMode.NEXT_STEP)
    collector = Collector(envs, seed=0, gamma=0.99, clip_reward=True)
    rollout, episodes = collect(collector, Policy(collector.spec), 24)
    # A game: 9 rewarded steps in three lives, each life's end a training termination.
    assert episodes.returns == [27.0, 27.0] and episodes.lengths == [9, 9]
    # A life is 3 steps and the reset step after it (not trained on): 6 lives in 24 steps.
    assert rollout.terminated.sum() == 6 and rollout.valid.sum() == 18
    trained = rollout.rewards[rollout.valid]
    assert set(trained.tolist()) == {1.0}  # sign(3)
    collector.close()


def test_group_step_continues_defaults_to_none() -> None:
    step = GroupStep(np.zeros(1), np.zeros(1, bool), np.zeros(1, bool))
    assert step.continues is None


# Training, checkpoints, evaluation.


def _config(tmp_path: Path, kind: str, **extra: Any) -> trustrl.Config:
    overrides: dict[str, Any] = {
        "total_steps": 6144,
        "seed": 1,
        "run_dir": str(tmp_path / kind),
        "quiet": True,
        "eval_episodes": 4,
        "env": {"num_envs": 4, "kwargs": {"kind": kind}, "normalize_obs": True},
        "rollout": {"num_steps": 64},
        "ppo": {"learning_rate": 1e-3},
        **extra,
    }
    return trustrl.resolve("tests.envs:DotEnv", overrides=overrides)


@pytest.mark.parametrize("kind", ["bool", "first", "dict", "tuple"])
def test_ppo_learns_structured_observations_checkpoints_and_resumes(
    tmp_path: Path, kind: str
) -> None:
    trainer = trustrl.Trainer(_config(tmp_path, kind))
    policy = trainer.train()
    assert trainer.eval_result is not None
    assert trainer.eval_result.mean_return >= 7.0, trainer.eval_result  # of 8; chance is 4
    loaded = trustrl.load_policy(tmp_path / kind)
    for name, value in policy.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value), name
    resumed = trustrl.Trainer(
        _config(tmp_path, kind, total_steps=6400), tmp_path / kind, resume=True
    )
    resumed.train()
    assert resumed.env_steps == 6400


def test_ppo_learns_a_bool_grid_taken_flat_and_evaluates_it(tmp_path: Path) -> None:
    """env.flat_keys: the grid's cells feed the MLP (no convolution), and the run's
    evaluations and a loaded policy lay the env's spaces out the same way."""
    env = {"num_envs": 4, "kwargs": {"kind": "bool"}, "flat_keys": [""]}
    trainer = trustrl.Trainer(_config(tmp_path, "bool", env=env))
    policy = trainer.train()
    assert not any(isinstance(m, torch.nn.Conv2d) for m in policy.modules())
    assert trainer.eval_result is not None and trainer.eval_result.mean_return >= 7.0
    loaded = trustrl.load_policy(tmp_path / "bool")
    assert loaded.spec.flat_keys == ("",)
    result = trustrl.evaluate(loaded, "tests.envs:DotEnv", 4, env_kwargs={"kind": "bool"})
    assert result.mean_return >= 7.0


def test_ppo_learns_with_a_shared_encoder(tmp_path: Path) -> None:
    # Returns up to 8 unscaled: their value loss would swamp the shared encoder's policy
    # gradient (it stays at chance); scaled, as Atari's clipped rewards are, it learns.
    env = {"num_envs": 4, "kwargs": {"kind": "first"}, "normalize_reward": True}
    trainer = trustrl.Trainer(_config(tmp_path, "first", policy={"share_encoder": True}, env=env))
    trainer.train()
    assert trainer.eval_result is not None and trainer.eval_result.mean_return >= 7.0


def test_trpo_learns_from_frames(tmp_path: Path) -> None:
    trainer = trustrl.Trainer(_config(tmp_path, "uint8", algo="trpo", total_steps=8192))
    trainer.train()
    assert trainer.eval_result is not None and trainer.eval_result.mean_return >= 7.0


def test_frozen_lake_and_a_dict_policy_act_from_raw_observations(tmp_path: Path) -> None:
    config = trustrl.resolve(
        "FrozenLake-v1",
        overrides={
            "total_steps": 4096,
            "seed": 0,
            "run_dir": str(tmp_path / "lake"),
            "quiet": True,
            "eval_episodes": 2,
            "env": {"num_envs": 4, "kwargs": {"is_slippery": False}},
            "rollout": {"num_steps": 64},
        },
    )
    policy = trustrl.Trainer(config).train()
    action = policy.act(0)  # the env's own observation: a state index
    assert action in range(4)
    assert policy.act(np.array([0, 5])).shape == (2,)


def test_the_goal_reach_example_is_a_valid_env_and_trains(tmp_path: Path) -> None:
    from gymnasium.utils.env_checker import check_env

    from examples.goal_reach import GoalReach, success_rate

    check_env(GoalReach(), skip_render_check=True)
    config = trustrl.resolve(
        "examples.goal_reach:GoalReach",
        overrides={
            "total_steps": 2048,
            "run_dir": str(tmp_path / "goal"),
            "quiet": True,
            "eval_episodes": 1,
            "env": {"num_envs": 4, "normalize_obs": True},
        },
    )
    policy = trustrl.Trainer(config).train()
    assert 0.0 <= success_rate(policy, episodes=2, seed=0) <= 1.0
