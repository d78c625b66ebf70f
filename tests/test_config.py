"""Config validation, TOML loading and the merge order defaults < preset < file < overrides."""

from __future__ import annotations

import dataclasses
import math
import re
import tomllib
import types
import typing
from pathlib import Path
from typing import Any

import pytest
import tomli_w

from trustrl import config as cfg
from trustrl.config import (
    Config,
    ConfigError,
    EnvConfig,
    PolicyConfig,
    PPOConfig,
    RolloutConfig,
    RunnersConfig,
    TRPOConfig,
    config_from_dict,
    config_to_dict,
    resolve,
)


def nested(path: str, value: Any) -> dict[str, Any]:
    """'ppo.clip_coef', 0 -> {'ppo': {'clip_coef': 0}}."""
    *sections, name = path.split(".")
    table: dict[str, Any] = {name: value}
    for section in reversed(sections):
        table = {section: table}
    return table


SEPARATE = {"ppo": {"pi_lr": 1e-3, "vf_lr": 1e-3}}

# (field path, bad value, fragments the message must contain, other keys the case needs)
BAD_VALUES: list[tuple[str, Any, tuple[str, ...], dict[str, Any]]] = [
    ("env.num_envs", 0, ("env.num_envs", "got 0"), {}),
    (
        "env.num_envs",
        6,
        ("env.num_envs (6)", "multiple of runners.count (4)", "runners.envs_per_runner"),
        {"runners": {"count": 4}},
    ),
    ("runners.count", -1, ("runners.count must be an integer >= 0, got -1",), {}),
    ("runners.envs_per_runner", 0, ("runners.envs_per_runner", "got 0"), {"runners": {"count": 2}}),
    ("runners.timeout", 0.0, ("runners.timeout must be > 0, got 0.0",), {}),
    ("runners.failures", 0, ("runners.failures must be an integer >= 1, got 0",), {}),
    ("runners.max_version_lag", -1, ("runners.max_version_lag", "got -1"), {}),
    ("runners.async_batches", 0, ("runners.async_batches", "got 0"), {}),
    ("agent.observation_shape", [0], ("agent.observation_shape must be positive", "[0]"), {}),
    ("agent.action_kind", "continuous", ("agent.action_kind", "continuous"), {}),
    ("agent.action_choices", [2, 3], ("discrete actions is one number", "[2, 3]"), {}),
    ("agent.action_low", [2.0], ("agent.action_low [2.0] must be finite and below", "[1.0]"), {}),
    ("agent.action_high", [1.0, 2.0, float("inf")], ("must be finite", "inf"), {}),
    ("agent.max_chunk_length", 0, ("agent.max_chunk_length", "got 0"), {}),
    ("agent.queue_size", 0, ("agent.queue_size", "got 0"), {}),
    ("runners.async_collection", True, ("runners.async_collection needs runners.count > 0",), {}),
    ("env.num_envs", 2.5, ("env.num_envs", "2.5"), {}),
    ("env.backend", "threads", ("env.backend", '"threads"', "sync"), {}),
    ("env.obs_stats", "iteration", ("env.obs_stats", '"iteration"', "rollout", "step"), {}),
    ("env.kwargs", [1, 2], ("env.kwargs", "[1, 2]"), {}),
    ("env.obs_clip", 0, ("env.obs_clip", "got 0"), {}),
    ("env.obs_clip", math.nan, ("env.obs_clip", "nan"), {}),
    ("env.reward_clip", -2.0, ("env.reward_clip", "-2.0"), {}),
    ("env.nonfinite", "skip", ("env.nonfinite", "error, drop", '"skip"'), {}),
    ("env.frame_stack", -1, ("env.frame_stack must be an integer >= 0, got -1",), {}),
    ("rollout.num_steps", 0, ("rollout.num_steps", "got 0"), {}),
    ("rollout.gamma", 1.5, ("rollout.gamma", "1.5", "[0, 1]"), {}),
    ("rollout.gamma", -0.1, ("rollout.gamma", "-0.1"), {}),
    ("rollout.gae_lambda", 1.01, ("rollout.gae_lambda", "1.01"), {}),
    (
        "policy.cnn_channels",
        [8, 8],
        ("policy.cnn_channels, policy.cnn_kernels and policy.cnn_strides", "[8, 8], [3] and [1]"),
        {"policy": {"cnn_kernels": [3], "cnn_strides": [1]}},
    ),
    (
        "policy.cnn_kernels",
        [0],
        ("one entry per conv layer", "[8], [0] and [1]"),
        {"policy": {"cnn_channels": [8], "cnn_strides": [1]}},
    ),
    ("policy.cnn_strides", [2], ("policy.cnn_strides", "[], [] and [2]"), {}),
    ("policy.cnn_linear", -1, ("policy.cnn_linear must be a non-negative integer", "-1"), {}),
    ("policy.memory", "rnn", ("policy.memory", "none, lstm, gru", '"rnn"'), {}),
    ("policy.memory_size", 0, ("policy.memory_size must be an integer >= 1", "0"), {}),
    (
        "policy.post_memory_sizes",
        [64, 0],
        ("policy.post_memory_sizes must be positive integers", "(64, 0)"),
        {"policy": {"memory": "gru"}},
    ),
    ("policy.post_memory_sizes", [64], ("policy.post_memory_sizes [64] needs a memory core",), {}),
    (
        "policy.memory_gate_bias",
        float("nan"),
        ("policy.memory_gate_bias must be a number in [-10, 10]", "nan"),
        {"policy": {"memory": "lstm"}},
    ),
    (
        "rollout.sequence_length",
        64,
        ("rollout.sequence_length must be <= rollout.num_steps (32)", "64"),
        {"rollout": {"num_steps": 32}, "policy": {"memory": "gru"}},
    ),
    ("policy.hidden_sizes", [64, 0], ("policy.hidden_sizes", "(64, 0)"), {}),
    ("policy.activation", "gelu", ("policy.activation", '"gelu"', "tanh"), {}),
    ("policy.log_std_init", 3.0, ("policy.log_std_init", "3.0", "[-20, 2]"), {}),
    ("policy.log_std_init", -21.0, ("policy.log_std_init", "-21.0"), {}),
    ("ppo.learning_rate", 0.0, ("ppo.learning_rate", "0.0"), {}),
    ("ppo.learning_rate", -1e-3, ("ppo.learning_rate", "-0.001"), {}),
    ("ppo.pi_lr", 1e-3, ("ppo.pi_lr", "ppo.vf_lr", "pi_lr=0.001", "vf_lr=None"), {}),
    ("ppo.vf_lr", 2e-3, ("ppo.pi_lr", "ppo.vf_lr", "vf_lr=0.002"), {}),
    ("ppo.pi_lr", -1.0, ("ppo.pi_lr", "-1.0"), SEPARATE),
    ("ppo.vf_lr", 0.0, ("ppo.vf_lr", "0.0"), SEPARATE),
    ("ppo.update_epochs", 0, ("ppo.update_epochs", "got 0"), {}),
    ("ppo.vf_epochs", 0, ("ppo.vf_epochs", "got 0"), SEPARATE),
    ("ppo.vf_epochs", 3, ("ppo.vf_epochs", "vf_epochs=3", "pi_lr"), {}),
    ("ppo.num_minibatches", 0, ("ppo.num_minibatches", "got 0"), {}),
    (
        "ppo.num_minibatches",
        9,
        ("ppo.num_minibatches", "got 9", "= 8"),
        {"env": {"num_envs": 2}, "rollout": {"num_steps": 4}},
    ),
    ("ppo.clip_coef", 0.0, ("ppo.clip_coef", "0.0", "(0, 1)"), {}),
    ("ppo.clip_coef", 1.0, ("ppo.clip_coef", "1.0"), {}),
    ("ppo.vf_clip_coef", 0.0, ("ppo.vf_clip_coef", "0.0"), {}),
    ("ppo.ent_coef", -0.01, ("ppo.ent_coef", "-0.01"), {}),
    ("ppo.vf_coef", -1.0, ("ppo.vf_coef", "-1.0"), {}),
    ("ppo.max_grad_norm", 0.0, ("ppo.max_grad_norm", "0.0"), {}),
    ("ppo.target_kl", 0.0, ("ppo.target_kl", "0.0"), {}),
    ("ppo.target_kl", math.inf, ("ppo.target_kl", "inf"), {}),
    ("env_id", "  ", ("env_id", "'  '"), {}),
    ("trpo.max_kl", 0.0, ("trpo.max_kl", "0.0"), {}),
    ("trpo.cg_iters", 0, ("trpo.cg_iters", "got 0"), {}),
    ("trpo.cg_damping", -0.1, ("trpo.cg_damping", "-0.1"), {}),
    ("trpo.cg_residual_tol", -1e-10, ("trpo.cg_residual_tol", "-1e-10"), {}),
    ("trpo.line_search_steps", 0, ("trpo.line_search_steps", "got 0"), {}),
    ("trpo.line_search_shrink", 1.0, ("trpo.line_search_shrink", "1.0", "(0, 1)"), {}),
    ("trpo.vf_lr", 0.0, ("trpo.vf_lr", "0.0"), {}),
    ("trpo.train_vf_iters", 0, ("trpo.train_vf_iters", "got 0"), {}),
    ("trpo.minibatches", 0, ("trpo.minibatches", "got 0"), {}),
    (
        "trpo.minibatches",
        9,
        ("trpo.minibatches", "got 9", "= 8"),
        {"algo": "trpo", "env": {"num_envs": 2}, "rollout": {"num_steps": 4}},
    ),
    ("algo", "a2c", ("algo", '"a2c"', "ppo"), {}),
    ("seed", -1, ("seed", "-1"), {}),
    ("seed", True, ("seed", "an integer", "the boolean true"), {}),
    ("total_steps", 0, ("total_steps", "got 0"), {}),
    ("torch_threads", 0, ("torch_threads", "got 0"), {}),
    ("device", "tpu", ("device", '"tpu"', "auto, cpu, cuda"), {}),
    ("eval_episodes", -1, ("eval_episodes", "-1"), {}),
    ("checkpoint_every", 0, ("checkpoint_every", "got 0"), {}),
    ("checkpoint_keep", 0, ("checkpoint_keep", "got 0"), {}),
    ("eval_every", -1, ("eval_every", "-1"), {}),
    ("target_return", math.inf, ("target_return", "inf"), {}),
    ("target_return", float("nan"), ("target_return", "nan"), {}),
    ("multiagent.actor", "each", ("multiagent.actor", "shared, per_agent", '"each"'), {}),
    (
        "multiagent.critic_input",
        "all",
        ("multiagent.critic_input", "global, agent_state, agent_centric, local", '"all"'),
        {},
    ),
    ("ppo.grad_backend", "jax", ("ppo.grad_backend", "auto, numpy, torch", '"jax"'), {}),
]

# Fields that take any value of their type (flags, free strings): nothing to refuse.
UNVALIDATED = {
    "env.normalize_obs",
    "env.normalize_reward",
    "env.episodic_life",
    "env.clip_reward",
    "env.image_keys",  # checked against the observation space when the env is built
    "env.flat_keys",  # likewise
    "policy.share_encoder",  # refused by TRPO and separate optimizers when they are built
    "policy.ortho_init",
    "policy.encoder",  # a registered name: the registry refuses others when the policy is built
    "ppo.anneal_lr",
    "ppo.anneal_clip",
    "ppo.norm_adv",
    "ppo.critic_process",
    "trpo.anneal_kl",
    "trpo.norm_adv",
    "multiagent.agent_id",
    "multiagent.value_norm",
    "run_dir",
    "quiet",
    "runners.ray_address",
}


def field_paths() -> set[str]:
    paths = set()
    for f in dataclasses.fields(Config):
        section = cfg.SECTIONS.get(f.name)
        if section is None:
            paths.add(f.name)
        else:
            paths.update(f"{f.name}.{g.name}" for g in dataclasses.fields(section))
    return paths


def test_bad_value_table_covers_every_validated_field() -> None:
    covered = {path for path, *_ in BAD_VALUES}
    assert covered == field_paths() - UNVALIDATED


@pytest.mark.parametrize(
    ("path", "value", "fragments", "extra"),
    BAD_VALUES,
    ids=[f"{path}={value!r}" for path, value, *_ in BAD_VALUES],
)
def test_bad_value_is_refused_with_an_actionable_message(
    path: str, value: Any, fragments: tuple[str, ...], extra: dict[str, Any]
) -> None:
    table = cfg.merge(extra, nested(path, value))
    with pytest.raises(ConfigError) as info:
        config_from_dict(table)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"


def test_config_error_is_a_value_error_raised_on_construction() -> None:
    assert issubclass(ConfigError, ValueError)
    with pytest.raises(ValueError, match=r"rollout\.gamma must be in \[0, 1\], got 2"):
        RolloutConfig(gamma=2)
    with pytest.raises(ConfigError, match=r"ppo\.clip_coef"):
        PPOConfig(clip_coef=1.5)
    with pytest.raises(ConfigError, match=r"env\.num_envs"):
        EnvConfig(num_envs=-3)
    with pytest.raises(ConfigError, match=r"policy\.activation"):
        PolicyConfig(activation="sigmoid")  # type: ignore[arg-type]


# Wrongly typed values: every field checks its type before its range, and the message
# names the field, the value, its type and what the field takes.
WRONG_TYPES = [
    ("rollout.gamma", "high", 'rollout.gamma must be a number, got the string "high"'),
    ("ppo.clip_coef", "0.2", 'ppo.clip_coef must be a number, got the string "0.2"'),
    ("env.normalize_obs", "no", 'env.normalize_obs must be true or false, got the string "no"'),
    ("ppo.norm_adv", 0, "ppo.norm_adv must be true or false, got the integer 0"),
    ("policy.hidden_sizes", 64, "policy.hidden_sizes must be a list of integers, got the integer 64"),  # noqa: E501
    ("env.num_envs", 8.0, "env.num_envs must be an integer, got the number 8.0"),
    ("ppo.target_kl", "x", 'ppo.target_kl must be a number (or left unset), got the string "x"'),
    (
        "env.kwargs",
        {"a": [1]},
        "env.kwargs must be a table of names to values (numbers, true or false, strings), "
        "got a = the list [1]",
    ),
]  # fmt: skip


@pytest.mark.parametrize(("path", "value", "message"), WRONG_TYPES)
def test_wrong_type_names_field_value_type_and_expected(
    path: str, value: Any, message: str
) -> None:
    with pytest.raises(ConfigError) as info:
        config_from_dict(nested(path, value))
    assert str(info.value) == message


def _hint(path: str) -> Any:
    *section, name = path.split(".")
    owner = cfg.SECTIONS[section[0]] if section else Config
    return typing.get_type_hints(owner)[name]


def wrong_values(hint: Any) -> list[Any]:
    """Values of every other kind than the field's type takes."""
    base = typing.get_args(hint)
    kinds = set(base) if typing.get_origin(hint) in (typing.Union, types.UnionType) else {hint}
    kinds.discard(type(None))
    (kind,) = kinds
    origin = typing.get_origin(kind)
    if kind is bool:
        return ["no", "true", 0, 1, 1.0, [True]]
    if kind is int:
        return ["3", 3.0, True, [3]]
    if kind is float:
        return ["0.1", True, False, [0.1]]
    if kind is str or origin is typing.Literal:
        return [3, 0.5, True, ["a"]]
    if origin is tuple and typing.get_args(kind)[0] is str:
        return [64, "64", [64], [True]]
    if origin is tuple and typing.get_args(kind)[0] is float:
        return [64, "64", [True], ["64"]]
    if origin is tuple:
        return [64, "64", [64.0], [True], ["64"]]
    if origin is dict:
        return [[1, 2], "a=1", 3, {"a": [1]}, {"a": {"b": 1}}]
    raise AssertionError(f"no wrong values for {hint}")


@pytest.mark.parametrize("path", sorted(field_paths()))
def test_every_field_checks_its_type_first(path: str) -> None:
    for value in wrong_values(_hint(path)):
        with pytest.raises(ConfigError) as info:
            config_from_dict(nested(path, value))
        message = str(info.value)
        assert message.startswith(f"{path} must be "), message
        if not isinstance(value, dict):
            assert message.endswith(f"got {cfg.describe_value(value)}"), message


@pytest.mark.parametrize("path", sorted(field_paths()))
def test_every_field_checks_its_type_in_python_too(path: str) -> None:
    *section, name = path.split(".")
    owner = cfg.SECTIONS[section[0]] if section else Config
    value = wrong_values(_hint(path))[0]
    with pytest.raises(ConfigError, match=re.escape(f"{path} must be ")):
        owner(**{name: value})


@pytest.mark.parametrize("path", ["ppo.learning_rate", "rollout.gamma", "env.obs_clip"])
def test_bool_is_not_a_number(path: str) -> None:
    with pytest.raises(ConfigError, match=path):
        config_from_dict(nested(path, True))


@pytest.mark.parametrize(
    ("section", "value"),
    [
        (section, value)
        for section in sorted(cfg.SECTIONS)
        for value in (3, "fast", [1, 2])
        # An integer at runners is the count of a config from before the [runners] section.
        if (section, value) != ("runners", 3)
    ],
)
def test_section_of_wrong_type_is_refused(section: str, value: Any) -> None:
    message = re.escape(f"[{section}] must be a table, got {value!r}")
    with pytest.raises(ConfigError, match=message):
        config_from_dict({section: value})


def test_section_of_wrong_type_in_file(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text("ppo = 3\n")
    with pytest.raises(ConfigError, match=r"\[ppo\] must be a table, got 3"):
        resolve("CartPole-v1", config_file=path)


# Fields of choices: the type check refuses any other value, in one line that names the
# field, the value and the choices.
CHOICE_FIELDS = sorted(p for p in field_paths() if typing.get_origin(_hint(p)) is typing.Literal)


def test_choice_fields_are_found() -> None:
    assert {"algo", "env.backend", "policy.activation", "agent.action_kind"} <= set(CHOICE_FIELDS)


@pytest.mark.parametrize("path", CHOICE_FIELDS)
def test_bad_choice_is_one_line_naming_field_value_and_choices(path: str) -> None:
    choices = ", ".join(typing.get_args(_hint(path)))
    with pytest.raises(ConfigError) as info:
        config_from_dict(nested(path, "nonsense"))
    assert str(info.value) == f'{path} must be one of {choices}, got the string "nonsense"'


# The [runners] section, and its keys at the top level of configs written before it.
OLD_RUNNER_KEYS = {
    "runners": 2,
    "envs_per_runner": 3,
    "ray_address": "10.0.0.1:6379",
    "runner_timeout": 30.0,
    "runner_failures": 5,
    "async_collection": True,
    "max_version_lag": 2,
    "async_batches": 1,
}
RUNNERS = RunnersConfig(
    count=2,
    envs_per_runner=3,
    ray_address="10.0.0.1:6379",
    timeout=30.0,
    failures=5,
    async_collection=True,
    max_version_lag=2,
    async_batches=1,
)


def test_old_top_level_runner_keys_load_into_the_section() -> None:
    config = config_from_dict({"env_id": "Pendulum-v1", **OLD_RUNNER_KEYS})
    assert config.runners == RUNNERS
    table = config_to_dict(config)  # written back in the section only
    assert table["runners"] == dataclasses.asdict(RUNNERS)
    assert not set(table) & (set(OLD_RUNNER_KEYS) - {"runners"})
    assert config_from_dict(table) == config


def test_run_folder_from_before_the_section_resumes_with_its_runner_keys() -> None:
    from trustrl import cli

    run_dir = Path(__file__).parent / "reference" / "fixtures" / "ppo_cartpole"
    assert {"runners", "runner_timeout", "async_collection"} <= set(
        cfg.read_toml(run_dir / "config.toml")
    )
    _, config = cli._resumed(str(run_dir), ["--total-steps", "20000"])
    assert config.runners == RunnersConfig() and config.total_steps == 20_000


def test_config_file_with_old_runner_keys_over_a_preset(tmp_path: Path) -> None:
    path = tmp_path / "old.toml"
    path.write_text("runners = 2\nasync_collection = true\n")
    overrides = {"runners": {"max_version_lag": 3}}
    runners = resolve("CartPole-v1", config_file=path, overrides=overrides).runners
    assert runners == RunnersConfig(count=2, async_collection=True, max_version_lag=3)


def test_old_and_new_runner_key_together_are_refused() -> None:
    message = "runner_timeout and runners.timeout are both set; keep runners.timeout"
    with pytest.raises(ConfigError, match=f"^{re.escape(message)}$"):
        config_from_dict({"runner_timeout": 1.0, "runners": {"timeout": 2.0}})


def test_minibatches_are_checked_by_the_algorithm_section_in_use() -> None:
    small = {"env": {"num_envs": 2}, "rollout": {"num_steps": 4}}
    message = "ppo.num_minibatches must be <= environments x rollout.num_steps = 8, got 9"
    with pytest.raises(ConfigError, match=f"^{re.escape(message)}$"):
        PPOConfig(num_minibatches=9).check_batch(8)
    TRPOConfig(minibatches=8).check_batch(8)
    # TRPO does not read ppo.num_minibatches, nor PPO trpo.minibatches.
    config_from_dict({**small, "algo": "trpo", "ppo": {"num_minibatches": 9}})
    config_from_dict({**small, "trpo": {"minibatches": 9}})


# TOML files.


@pytest.mark.parametrize(
    ("text", "names"),
    [
        ("[ppo]\nlerning_rate = 1e-3\n", ["ppo.lerning_rate"]),
        ("sed = 3\n", ["sed"]),
        ("[optim]\nlr = 1\n", ["optim"]),
        ("[env]\nnum_env = 4\nbackend = 'sync'\n", ["env.num_env"]),
        ("[rollout]\nlambda = 0.9\ngama = 0.9\n", ["rollout.gama", "rollout.lambda"]),
        ("[policy]\nhidden = [8]\n", ["policy.hidden"]),
    ],
)
def test_unknown_keys_in_file_are_errors(tmp_path: Path, text: str, names: list[str]) -> None:
    path = tmp_path / "run.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        resolve("CartPole-v1", config_file=path)
    message = str(info.value)
    assert message.startswith("unknown key")
    for name in names:
        assert name in message
    if len(names) > 1:
        assert message.startswith("unknown keys")
    assert "allowed:" in message


def test_missing_and_invalid_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        resolve("CartPole-v1", config_file=tmp_path / "nope.toml")
    broken = tmp_path / "broken.toml"
    broken.write_text("[ppo\nclip_coef = 0.1\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        resolve("CartPole-v1", config_file=broken)


def test_merge_order_defaults_preset_file_overrides(tmp_path: Path) -> None:
    preset = cfg.preset_table("ppo", "CartPole-v1")
    assert preset is not None and "CartPole-v1" in cfg.available_presets("ppo")
    # The facts about the preset this test relies on.
    assert preset["rollout"]["num_steps"] == 32 != RolloutConfig().num_steps
    assert preset["rollout"]["gamma"] == 0.98
    assert preset["ppo"]["update_epochs"] == 20
    assert preset["ppo"]["learning_rate"] == 2e-3 != PPOConfig().learning_rate
    assert "max_grad_norm" not in preset["ppo"]

    path = tmp_path / "run.toml"
    path.write_text(
        "seed = 5\n"
        "[env]\nnum_envs = 4\n"
        "[rollout]\ngamma = 0.97\n"
        "[ppo]\nupdate_epochs = 7\nclip_coef = 0.1\n"
    )
    overrides = {"seed": 9, "ppo": {"update_epochs": 3}}
    config = resolve("CartPole-v1", config_file=path, overrides=overrides)

    assert config.ppo.max_grad_norm == PPOConfig().max_grad_norm  # default
    assert config.env.backend == EnvConfig().backend  # default
    assert config.rollout.num_steps == 32  # preset over default
    assert config.rollout.gae_lambda == 0.8  # preset, untouched by the file's [rollout]
    assert config.ppo.learning_rate == 2e-3  # preset, untouched by the file's [ppo]
    assert config.total_steps == 49_920  # preset
    assert config.rollout.gamma == 0.97  # file over preset
    assert config.env.num_envs == 4  # file over preset
    assert config.ppo.clip_coef == 0.1  # file over preset
    assert config.ppo.update_epochs == 3  # overrides over file over preset
    assert config.seed == 9  # overrides over file
    assert config.env_id == "CartPole-v1" and config.algo == "ppo"

    # Without file and overrides: the preset over the defaults.
    plain = resolve("CartPole-v1")
    assert plain.ppo.update_epochs == 20 and plain.rollout.gamma == 0.98
    assert plain.seed == Config().seed


def test_env_without_preset_gets_defaults() -> None:
    assert cfg.preset_table("ppo", "NoSuchEnv-v0") is None
    config = resolve("NoSuchEnv-v0", overrides={"rollout": {"num_steps": 64}})
    assert config.env_id == "NoSuchEnv-v0"
    assert config.rollout.num_steps == 64
    assert config.ppo == PPOConfig()


def test_env_kwargs_are_replaced_not_merged() -> None:
    merged = cfg.merge({"env": {"kwargs": {"a": 1}, "num_envs": 2}}, {"env": {"kwargs": {"b": 2}}})
    assert merged == {"env": {"kwargs": {"b": 2}, "num_envs": 2}}


def rich_config() -> Config:
    return Config(
        env_id="Pendulum-v1",
        seed=3,
        total_steps=12_345,
        run_dir="runs/x",
        quiet=True,
        target_return=-200.0,
        eval_every=5,
        env=EnvConfig(
            num_envs=2, backend="sync", kwargs={"g": 9.8, "name": "x"}, normalize_obs=True
        ),
        rollout=RolloutConfig(num_steps=16, gamma=0.9, gae_lambda=1.0),
        policy=PolicyConfig(hidden_sizes=(32, 16, 8), activation="relu", log_std_init=-1.0),
        ppo=PPOConfig(
            pi_lr=1e-3, vf_lr=1e-2, vf_epochs=8, target_kl=0.02, vf_clip_coef=0.3, ent_coef=0.01
        ),
    )


@pytest.mark.parametrize("config", [Config(), rich_config()], ids=["defaults", "rich"])
def test_dict_round_trip(config: Config) -> None:
    table = config_to_dict(config)
    assert config_from_dict(table) == config
    # TOML-ready: no None values, tuples as lists, and a TOML round trip holds too.
    assert isinstance(table["policy"]["hidden_sizes"], list)
    assert config_from_dict(tomllib.loads(tomli_w.dumps(table))) == config


def test_to_dict_drops_unset_values() -> None:
    table = config_to_dict(Config())
    assert "target_kl" not in table["ppo"] and "pi_lr" not in table["ppo"]
    assert "run_dir" not in table and "target_return" not in table
    assert table["ppo"]["clip_coef"] == 0.2


@pytest.mark.parametrize("algo", ["ppo", "trpo"])
def test_every_preset_trains_whole_iterations(algo: str) -> None:
    """total_steps is rounded up to whole iterations (with a note); a preset says exactly
    what runs."""
    for name in cfg.available_presets(algo):
        env_id = name.replace("mpe2_", "mpe2:") if name.startswith("mpe2_") else name
        config = resolve(env_id, algo)
        assert config.total_steps % config.batch_size == 0, (algo, name)


def test_derived_sizes() -> None:
    config = config_from_dict(
        {"total_steps": 1000, "env": {"num_envs": 4}, "rollout": {"num_steps": 32}}
    )
    assert config.batch_size == 128
    assert config.num_iterations == 8  # rounded up: never fewer steps than asked
    assert config_from_dict({"total_steps": 10}).num_iterations == 1
    spread = {"env": {"num_envs": 4}, "rollout": {"num_steps": 32}}
    runners = config_from_dict({**spread, "runners": {"count": 2, "envs_per_runner": 3}})
    assert (runners.num_envs, runners.runner_envs, runners.batch_size) == (6, 3, 192)
    each = config_from_dict(
        {**spread, "runners": {"count": 2, "async_collection": True, "async_batches": 1}}
    )
    assert each.runners.rollouts_per_update == 1 and each.batch_size == 64
    assert PPOConfig(pi_lr=1e-3, vf_lr=1e-3).separate_optimizers
    assert not PPOConfig().separate_optimizers


def test_configs_are_frozen() -> None:
    config = Config()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.ppo.clip_coef = 0.5  # type: ignore[misc]
