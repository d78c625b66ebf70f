"""The shipped presets: every one resolves for an env that exists, the ids listed are the
ones a user types, named presets are selected by name, and an env without a preset is
announced on the command line only."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

import pytest

import trustrl
from trustrl import cli
from trustrl.config import ConfigError, list_presets, preset_name, preset_table
from trustrl.envs.gym import check_env_id

ROOT = Path(__file__).resolve().parent.parent
SPREAD = "mpe2:simple_spread_v3"
MUJOCO = [
    "Hopper-v5",
    "HalfCheetah-v5",
    "Walker2d-v5",
    "Ant-v5",
    "Humanoid-v5",
    "Swimmer-v5",
    "Reacher-v5",
    "InvertedPendulum-v5",
    "InvertedDoublePendulum-v5",
    "Pusher-v5",
]


def test_every_preset_resolves_for_an_env_that_exists() -> None:
    presets = list_presets()
    assert {info.algo for info in presets} == {"ppo", "trpo"}
    for info in presets:
        check_env_id(info.env_id)
        config = trustrl.resolve(info.env_id, info.algo)
        assert config.env_id == info.env_id and config.algo == info.algo
        for name in info.named:
            assert trustrl.resolve(info.env_id, info.algo, preset=name).env_id == info.env_id


def test_every_preset_file_is_named_after_its_env_and_says_where_it_comes_from() -> None:
    for info in list_presets():
        folder = resources.files("trustrl").joinpath("presets", info.algo)
        files = [folder / f"{preset_name(info.env_id)}.toml"]
        files += [folder / preset_name(info.env_id) / f"{n}.toml" for n in info.named]
        for file in files:
            assert file.is_file(), file
            header = file.read_text().split("\n", 1)[0]
            assert header.startswith("# ") and info.env_id.split(":")[-1] in file.read_text()


@pytest.mark.parametrize("algo", ["ppo", "trpo"])
def test_the_mujoco_v5_family_has_presets(algo: str) -> None:
    listed = {info.env_id for info in list_presets(algo)}
    assert set(MUJOCO) <= listed
    for env_id in MUJOCO:
        config = trustrl.resolve(env_id, algo)
        assert config.env.normalize_obs and config.env.normalize_reward


def test_presets_list_the_ids_users_type() -> None:
    ids = [info.env_id for info in list_presets("ppo")]
    assert SPREAD in ids and preset_name(SPREAD) not in ids
    [spread] = [info for info in list_presets("ppo") if info.env_id == SPREAD]
    assert spread.named == ("relayrl-kernel",)
    assert preset_table("ppo", SPREAD) is not None  # the env_id key is not a setting
    assert "env_id" not in preset_table("ppo", SPREAD)


def test_simple_spread_default_is_the_benchmarks_settings_with_the_agent_centric_critic() -> None:
    """The default is what docs/multiagent.md measured best (mappo-centric): the kernel's
    preset overlaid with benchmarks/simple_spread.toml and critic_input agent_centric."""
    measured = trustrl.resolve(
        SPREAD,
        preset="relayrl-kernel",
        config_file=ROOT / "benchmarks" / "simple_spread.toml",
        overrides={"eval_episodes": 10, "multiagent": {"critic_input": "agent_centric"}},
    )
    assert trustrl.resolve(SPREAD) == measured
    kernel = trustrl.resolve(SPREAD, preset="relayrl-kernel")
    assert (kernel.ppo.update_epochs, kernel.multiagent.actor) == (80, "per_agent")


def test_an_unknown_preset_name_is_refused_with_the_choices() -> None:
    with pytest.raises(
        ConfigError,
        match="no preset 'fast' for ppo on mpe2:simple_spread_v3; choose from relayrl-kernel",
    ):
        trustrl.resolve(SPREAD, preset="fast")
    with pytest.raises(ConfigError, match="it has none"):
        trustrl.resolve("CartPole-v1", preset="relayrl-kernel")


def test_presets_command_lists_ids_and_named_presets(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["presets"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[1:]]
    assert ["ppo", SPREAD, "relayrl-kernel"] in rows
    assert ["trpo", "Walker2d-v5"] in rows
    assert cli.main(["presets", "--algo", "trpo"]) == 0
    assert SPREAD not in capsys.readouterr().out


def test_train_preset_flag_selects_the_named_preset(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "kernel"
    argv = ["train", SPREAD, "--preset", "relayrl-kernel", "--total-steps", "200"]
    argv += ["--env.num-envs", "2", "--rollout.num-steps", "25", "--ppo.update-epochs", "1"]
    argv += ["--ppo.vf-epochs", "1", "--eval-episodes", "0", "--quiet", "--run-dir", str(run_dir)]
    assert cli.main(argv) == 0
    saved = trustrl.config.config_from_dict(trustrl.config.read_toml(run_dir / "config.toml"))
    assert (saved.multiagent.actor, saved.rollout.gae_lambda) == ("per_agent", 0.97)
    capsys.readouterr()
    assert cli.main(["train", SPREAD, "--preset", "nope", "--quiet"]) == 2
    assert "no preset 'nope'" in capsys.readouterr().err


def test_an_env_without_a_preset_is_announced_on_stderr_by_the_cli_only(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tiny = ["--total-steps", "64", "--env.num-envs", "2", "--rollout.num-steps", "16"]
    tiny += ["--ppo.update-epochs", "1", "--eval-episodes", "0"]
    assert cli.main(["train", "MountainCar-v0", *tiny, "--run-dir", str(tmp_path / "a")]) == 0
    err = capsys.readouterr().err
    assert "no preset for ppo on MountainCar-v0: using trustrl's defaults" in err
    assert cli.main(["train", "CartPole-v1", *tiny, "--run-dir", str(tmp_path / "b")]) == 0
    assert "no preset" not in capsys.readouterr().err
    quiet = [*tiny, "--quiet", "--run-dir", str(tmp_path / "c")]
    assert cli.main(["train", "MountainCar-v0", *quiet]) == 0
    assert "no preset" not in capsys.readouterr().err
    trustrl.resolve("MountainCar-v0")
    assert capsys.readouterr() == ("", "")
