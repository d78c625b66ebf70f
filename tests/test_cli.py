"""The ``trustrl`` command, in process through ``trustrl.cli.main`` and once as a real
console script."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import numpy as np
import pytest

from trustrl import cli
from trustrl.logging import read_progress

TINY = [
    "--total-steps",
    "64",
    "--env.num-envs",
    "2",
    "--rollout.num-steps",
    "16",
    "--ppo.update-epochs",
    "1",
    "--eval-episodes",
    "1",
    "--quiet",
]


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of ``trustrl ARGV``, SystemExit included."""
    try:
        code = cli.main(argv)
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else 1
    out, err = capsys.readouterr()
    return code, out, err


def squash(text: str) -> str:
    """Text as read, whatever the terminal width: box borders and line breaks removed."""
    return " ".join(text.replace("│", " ").split())


def read_config(run_dir: Path) -> dict:
    return tomllib.loads((run_dir / "config.toml").read_text())


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A CartPole run trained through the CLI with flags over the preset."""
    run_dir = tmp_path_factory.mktemp("cli") / "run"
    code = cli.main(["train", "CartPole-v1", *TINY, "--seed", "5", "--run-dir", str(run_dir)])
    assert code == 0
    return run_dir


def test_train_flags_override_the_preset(cli_run) -> None:
    run_dir = cli_run
    config = read_config(run_dir)
    # Flags.
    assert config["total_steps"] == 64 and config["seed"] == 5
    assert config["env"]["num_envs"] == 2
    assert config["rollout"]["num_steps"] == 16
    assert config["ppo"]["update_epochs"] == 1
    assert config["eval_episodes"] == 1 and config["quiet"] is True
    assert config["run_dir"] == str(run_dir)
    # The CartPole preset where no flag overrides it.
    assert config["rollout"]["gamma"] == 0.98 and config["rollout"]["gae_lambda"] == 0.8
    assert config["ppo"]["learning_rate"] == 2e-3 and config["ppo"]["anneal_clip"] is True
    assert config["ppo"]["num_minibatches"] == 1
    assert config["target_return"] == 475.0
    # Defaults where neither does.
    assert config["env"]["backend"] == "auto" and config["ppo"]["clip_coef"] == 0.2
    rows = read_progress(run_dir / "progress.csv")
    assert [r["env_steps"] for r in rows] == [32, 64]
    assert (run_dir / "checkpoints" / "final" / "policy.safetensors").is_file()
    assert json.loads((run_dir / "eval.json").read_text())["episodes"] == 1


def test_train_prints_the_evaluation_and_run_folder(tmp_path: Path, capsys) -> None:
    run_dir = tmp_path / "run"
    code, out, err = run_cli(["train", "CartPole-v1", *TINY, "--run-dir", str(run_dir)], capsys)
    assert code == 0, err
    assert "Traceback" not in err
    # The end summary: the run folder, the evaluation, the commands to look at the run.
    assert out.rstrip().endswith(
        f"run folder: {run_dir}\n"
        "evaluation over 1 episodes (deterministic): "
        + out.split("evaluation over 1 episodes (deterministic): ")[-1].split("\n")[0]
        + "\nlook at it:\n"
        f"  tensorboard --logdir {run_dir / 'tensorboard'}\n"
        f"  trustrl eval {run_dir}\n"
        f"  trustrl export {run_dir}"
    )


def test_config_file_between_preset_and_flags(tmp_path: Path, capsys) -> None:
    config_file = tmp_path / "my.toml"
    config_file.write_text(
        "total_steps = 64\neval_episodes = 1\n"
        "[env]\nnum_envs = 2\n"
        "[rollout]\nnum_steps = 16\ngamma = 0.9\n"
        "[ppo]\nupdate_epochs = 1\nclip_coef = 0.1\n"
    )
    run_dir = tmp_path / "run"
    argv = ["train", "CartPole-v1", "--config", str(config_file), "--quiet"]
    argv += ["--rollout.gamma", "0.95", "--run-dir", str(run_dir)]
    code, _, err = run_cli(argv, capsys)
    assert code == 0, err
    config = read_config(run_dir)
    assert config["rollout"]["gamma"] == 0.95  # flag over file
    assert config["ppo"]["clip_coef"] == 0.1  # file over preset default
    assert config["rollout"]["num_steps"] == 16 and config["total_steps"] == 64  # file
    assert config["rollout"]["gae_lambda"] == 0.8  # preset


def test_config_file_unknown_key(tmp_path: Path, capsys) -> None:
    config_file = tmp_path / "bad.toml"
    config_file.write_text("[ppo]\nclip_coeff = 0.1\n")
    code, out, err = run_cli(
        ["train", "CartPole-v1", "--config", str(config_file), "--quiet"], capsys
    )
    assert code == 2
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("trustrl: error: unknown key ppo.clip_coeff")
    assert "clip_coef" in lines[0].split("allowed:")[1]


def test_config_file_bad_value(tmp_path: Path, capsys) -> None:
    config_file = tmp_path / "bad.toml"
    config_file.write_text("[ppo]\nclip_coef = 1.5\n")
    code, _, err = run_cli(["train", "CartPole-v1", "--config", str(config_file)], capsys)
    assert code == 2
    assert err.strip() == "trustrl: error: ppo.clip_coef must be in (0, 1), got 1.5"


def test_config_file_missing_or_not_toml(tmp_path: Path, capsys) -> None:
    code, _, err = run_cli(["train", "CartPole-v1", "--config", str(tmp_path / "no.toml")], capsys)
    assert code == 2 and "does not exist" in err
    broken = tmp_path / "broken.toml"
    broken.write_text("[ppo\n")
    code, _, err = run_cli(["train", "CartPole-v1", "--config", str(broken)], capsys)
    assert code == 2 and "is not valid TOML" in err and "Traceback" not in err


def test_flag_bad_value(capsys) -> None:
    code, out, err = run_cli(["train", "CartPole-v1", "--ppo.clip-coef", "1.5", "--quiet"], capsys)
    assert code != 0
    assert "clip_coef must be in (0, 1), got 1.5" in squash(err)
    assert "Traceback" not in out + err
    assert len(err.strip().splitlines()) <= 8, err


def test_console_script_bad_value(tmp_path: Path) -> None:
    """What a user sees from the installed ``trustrl`` command."""
    script = Path(sys.executable).with_name("trustrl")
    assert script.is_file(), script
    result = subprocess.run(
        [str(script), "train", "CartPole-v1", "--ppo.clip-coef", "1.5", "--quiet"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert result.stdout == ""
    assert "clip_coef must be in (0, 1), got 1.5" in squash(result.stderr)
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(
    ("env_id", "message"),
    [
        ("NoSuchEnv-v0", "env_id 'NoSuchEnv-v0' is not a registered Gymnasium environment"),
        ("CartPol-v1", "did you mean CartPole-v1"),
        ("tests.envs:NoSuchEnv", "module 'tests.envs' has no attribute 'NoSuchEnv'"),
        ("no_such_module_xyz:make", "cannot import module 'no_such_module_xyz'"),
    ],
)
def test_unknown_env_id(tmp_path: Path, capsys, env_id: str, message: str) -> None:
    code, _, err = run_cli(["train", env_id, "--run-dir", str(tmp_path / "r")], capsys)
    assert code == 2
    assert err.startswith("trustrl: error: ") and message in err, err
    assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "r").exists()


def test_eval_json(cli_run, capsys) -> None:
    run_dir = cli_run
    code, out, err = run_cli(["eval", str(run_dir), "--json", "--episodes", "2"], capsys)
    assert code == 0, err
    lines = out.strip().splitlines()
    assert len(lines) == 1
    result = json.loads(lines[0])
    assert {"mean_return", "std_return", "episodes", "returns"} <= set(result)
    assert result["episodes"] == 2 and len(result["returns"]) == 2
    assert result["mean_return"] == pytest.approx(np.mean(result["returns"]))
    assert result["std_return"] == pytest.approx(np.std(result["returns"]))
    assert all(r >= 1 and math.isfinite(r) for r in result["returns"])
    assert result["env_id"] == "CartPole-v1"
    assert Path(result["checkpoint"]) == run_dir / "checkpoints" / "final"

    # The same policy, deterministic: the same numbers again; the text form says them.
    code, again, _ = run_cli(["eval", str(run_dir), "--json", "--episodes", "2"], capsys)
    assert json.loads(again) == result
    code, text, _ = run_cli(["eval", str(run_dir), "--episodes", "2"], capsys)
    assert code == 0
    assert text.startswith(f"CartPole-v1: {result['mean_return']:.2f} ± ")
    assert "over 2 episodes" in text


def test_eval_refuses_bad_arguments(cli_run, tmp_path: Path, capsys) -> None:
    run_dir = cli_run
    code, _, err = run_cli(["eval", str(run_dir), "--episodes", "0"], capsys)
    assert code == 2 and "--episodes must be >= 1, got 0" in err
    code, _, err = run_cli(["eval", str(tmp_path / "nothing")], capsys)
    assert code == 2 and "does not exist" in err and "Traceback" not in err


def test_resume_through_cli(cli_run, tmp_path: Path, capsys) -> None:
    run_dir = tmp_path / "run"
    shutil.copytree(cli_run, run_dir)
    code, out, err = run_cli(
        ["train", "--resume", str(run_dir), "--total-steps", "96", "--quiet"], capsys
    )
    assert code == 0, err
    assert f"resuming {run_dir} at iteration 2 (64 env steps)" in out
    assert [r["iteration"] for r in read_progress(run_dir / "progress.csv")] == [1, 2, 3]
    assert read_config(run_dir)["total_steps"] == 96

    code, _, err = run_cli(["train", "--resume", str(tmp_path)], capsys)
    assert code == 2 and "no config.toml there" in err


def test_entry_point_env(tmp_path: Path, capsys) -> None:
    run_dir = tmp_path / "run"
    code, _, err = run_cli(
        ["train", "tests.envs:MaskedDictEnv", *TINY, "--run-dir", str(run_dir)], capsys
    )
    assert code == 0, err
    code, out, err = run_cli(["eval", str(run_dir), "--json", "--episodes", "1"], capsys)
    assert code == 0, err
    assert json.loads(out)["env_id"] == "tests.envs:MaskedDictEnv"


def test_train_help(capsys) -> None:
    code, out, _ = run_cli(["train", "--help"], capsys)
    assert code == 0
    text = squash(out)  # help text may be wrapped anywhere
    for flag in ("--ppo.clip-coef", "--env.num-envs", "--rollout.num-steps", "--total-steps"):
        assert flag in text, flag
    assert "--ppo.clip-coef FLOAT Surrogate clipping range epsilon." in text
    assert "Discount factor." in text
    assert "trustrl train ENV_ID" in text


def test_train_help_shows_the_preset(capsys) -> None:
    code, out, _ = run_cli(["train", "CartPole-v1", "--help"], capsys)
    assert code == 0
    text = squash(out)
    assert "--total-steps INT Environment steps to train for" in text
    assert "(default: 50000)" in text  # the CartPole preset, not the dataclass default


def test_top_level_usage(capsys) -> None:
    code, out, _ = run_cli([], capsys)
    assert code == 2 and "usage: trustrl {train,eval,export,presets}" in out
    code, out, _ = run_cli(["--help"], capsys)
    assert code == 0
    code, _, err = run_cli(["fly"], capsys)
    assert code == 2 and "unknown command 'fly'" in err
    code, out, _ = run_cli(["presets"], capsys)
    assert code == 0 and "CartPole-v1" in out.split()
    code, _, err = run_cli(["train", "--quiet"], capsys)
    assert code == 2 and "needs ENV_ID" in err


def test_unsupported_env_spaces_are_a_clear_error(tmp_path: Path, capsys) -> None:
    code, _, err = run_cli(
        ["train", "FrozenLake-v1", "--quiet", "--run-dir", str(tmp_path / "r")], capsys
    )
    assert code == 2
    assert err.startswith("trustrl: error: ") and "observation space must be a Box" in err
