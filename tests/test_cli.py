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
from trustrl.run.logging import read_progress

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
    # The end summary: the evaluation, the commands to look at the run, the run folder last.
    evaluation = out.split("evaluation over 1 episodes (deterministic): ")[-1].split("\n")[0]
    assert out.rstrip().endswith(
        f"evaluation over 1 episodes (deterministic): {evaluation}\n"
        f"learning curve: trustrl plot {run_dir}\n"
        f"TensorBoard: tensorboard --logdir {run_dir / 'tensorboard'}\n"
        f"evaluate: trustrl eval {run_dir}\n"
        f"export: trustrl export {run_dir}\n"
        f"run folder: {run_dir}"
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


def test_runner_flags_from_before_the_section_still_parse() -> None:
    from trustrl.config import RunnersConfig

    old = ["--runners", "2", "--envs-per-runner", "3", "--async-collection"]
    old += ["--ray-address", "HOST:6379", "--runner-timeout=30", "--runner-failures", "5"]
    old += ["--max-version-lag", "2", "--async-batches", "1"]
    new = ["--runners.count", "2", "--runners.envs-per-runner", "3"]
    new += ["--runners.async-collection", "--runners.ray-address", "HOST:6379"]
    new += ["--runners.timeout", "30", "--runners.failures", "5"]
    new += ["--runners.max-version-lag", "2", "--runners.async-batches", "1"]
    expected = RunnersConfig(2, 3, "HOST:6379", 30.0, 5, True, 2, 1)
    for flags in (old, new):
        assert cli.parse_train(["CartPole-v1", *flags])[1].runners == expected
    off = cli.parse_train(["CartPole-v1", "--runners", "2", "--no-async-collection"])[1]
    assert off.runners == RunnersConfig(count=2)


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


def test_eval_plays_with_env_kwargs_over_the_runs(cli_run, capsys) -> None:
    run_dir = cli_run
    # Sutton and Barto's CartPole reward: 0 a step, -1 when the pole falls.
    args = ["eval", str(run_dir), "--json", "--episodes", "2"]
    code, out, err = run_cli([*args, "--env.kwargs", "sutton_barto_reward", "True"], capsys)
    assert code == 0, err
    result = json.loads(out)
    assert result["env_kwargs"] == {"sutton_barto_reward": True}
    assert all(r in (-1.0, 0.0) for r in result["returns"])
    code, out, _ = run_cli(args, capsys)
    assert json.loads(out)["env_kwargs"] == {} and min(json.loads(out)["returns"]) >= 1

    for words, message in (
        (["sutton_barto_reward"], "--env.kwargs takes KEY VALUE pairs, got an odd number"),
        (["no_such_argument", "1"], "does not accept the keyword argument 'no_such_argument'"),
        (["1x", "1"], "--env.kwargs: '1x' is not a keyword argument's name"),
    ):
        code, _, err = run_cli([*args, "--env.kwargs", *words], capsys)
        assert code == 2 and message in err and "Traceback" not in err
        assert len(err.strip().splitlines()) == 1


def test_env_kwargs_values_are_read_as_train_reads_them() -> None:
    assert cli._env_kwargs(["a", "1", "b", "0.0", "c", "True", "d", "text", "e", "true"]) == {
        "a": 1,
        "b": 0.0,
        "c": True,
        "d": "text",
        "e": "true",
    }
    assert isinstance(cli._env_kwargs(["a", "1"])["a"], int)


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
    assert "(default: 49920)" in text  # the CartPole preset, not the dataclass default


def test_top_level_usage(capsys) -> None:
    code, out, _ = run_cli([], capsys)
    assert code == 2 and f"usage: trustrl {{{','.join(cli.COMMANDS)}}} ..." in out
    assert {"train", "serve", "eval", "plot", "export", "presets", "tune"} <= set(cli.COMMANDS)
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
        ["train", "tests.envs:TextEnv", "--quiet", "--run-dir", str(tmp_path / "r")], capsys
    )
    assert code == 2
    assert err.startswith("trustrl: error: ") and "the observation is Text" in err
    assert "trustrl takes a Box (vectors and images), Discrete, MultiDiscrete" in err


# Issue 19: what a new user runs into.

TYPED_TOML = [
    ('[env]\nnormalize_obs = "no"\n', 'env.normalize_obs must be true or false, got the string "no"'),  # noqa: E501
    ("[ppo]\nnorm_adv = 0\n", "ppo.norm_adv must be true or false, got the integer 0"),
    ('total_steps = "1000"\n', 'total_steps must be an integer, got the string "1000"'),
    ("[policy]\nhidden_sizes = 64\n", "policy.hidden_sizes must be a list of integers, got the integer 64"),  # noqa: E501
]  # fmt: skip


@pytest.mark.parametrize(("text", "message"), TYPED_TOML)
def test_config_file_wrong_type_is_one_error_line_and_no_tyro_warning(
    tmp_path: Path, capsys, text: str, message: str
) -> None:
    config_file = tmp_path / "typed.toml"
    config_file.write_text(text)
    run_dir = tmp_path / "run"
    argv = ["train", "CartPole-v1", "--config", str(config_file), "--run-dir", str(run_dir)]
    code, out, err = run_cli(argv, capsys)
    assert code == 2 and out == ""
    assert err.strip().splitlines() == [f"trustrl: error: {message}"], err
    assert "Warning" not in err and not run_dir.exists()


@pytest.mark.parametrize(
    ("env_id", "backend"),
    [("CartPole-v1", "vector"), ("CartPole-v1", "sync"), ("tests.envs:MultiDiscreteEnv", "sync")],
)
def test_unknown_env_kwarg_is_named_with_the_env(
    tmp_path: Path, capsys, env_id: str, backend: str
) -> None:
    run_dir = tmp_path / "run"
    argv = ["train", env_id, "--env.kwargs", "foo", "3", "--env.backend", backend]
    code, _, err = run_cli([*argv, "--run-dir", str(run_dir), "--quiet"], capsys)
    assert code == 2, err
    assert err.strip() == (
        f"trustrl: error: env.kwargs: {env_id} does not accept the keyword argument 'foo' "
        "(given foo = 3); remove it or check the env's constructor"
    )
    assert not run_dir.exists()


def test_a_new_run_refuses_a_folder_that_is_not_empty(cli_run, tmp_path: Path, capsys) -> None:
    # An earlier run: refused, suggesting --resume; nothing of it is touched.
    run_dir = tmp_path / "run"
    shutil.copytree(cli_run, run_dir)
    before = sorted(p.relative_to(run_dir) for p in run_dir.rglob("*"))
    code, _, err = run_cli(["train", "CartPole-v1", *TINY, "--run-dir", str(run_dir)], capsys)
    assert code == 2
    assert "already holds a run" in err and f"trustrl train --resume {run_dir}" in err
    assert sorted(p.relative_to(run_dir) for p in run_dir.rglob("*")) == before
    # A folder of other files (source code): refused too.
    source = tmp_path / "src"
    source.mkdir()
    (source / "main.py").write_text("print('mine')\n")
    code, _, err = run_cli(["train", "CartPole-v1", *TINY, "--run-dir", str(source)], capsys)
    assert code == 2 and "is not empty and is not a trustrl run (main.py)" in err
    assert sorted(p.name for p in source.iterdir()) == ["main.py"]
    # --overwrite: the earlier run's files are replaced, other files left alone.
    (run_dir / "notes.txt").write_text("mine\n")
    (run_dir / "checkpoints" / "iter_00000099").mkdir()
    argv = ["train", "CartPole-v1", *TINY, "--run-dir", str(run_dir), "--overwrite"]
    code, _, err = run_cli(argv, capsys)
    assert code == 0, err
    assert not (run_dir / "checkpoints" / "iter_00000099").exists()
    assert (run_dir / "notes.txt").read_text() == "mine\n"
    assert [r["iteration"] for r in read_progress(run_dir / "progress.csv")] == [1, 2]
    # An empty folder is fine.
    empty = tmp_path / "empty"
    empty.mkdir()
    assert run_cli(["train", "CartPole-v1", *TINY, "--run-dir", str(empty)], capsys)[0] == 0


def test_trainer_refuses_a_folder_that_is_not_empty(tmp_path: Path) -> None:
    from trustrl.config import resolve
    from trustrl.run.checkpoint import CheckpointError
    from trustrl.run.trainer import Trainer

    (tmp_path / "data.csv").write_text("1,2\n")
    with pytest.raises(CheckpointError, match="is not empty"):
        Trainer(resolve("CartPole-v1", overrides={"run_dir": str(tmp_path)}))


def test_env_id_flag_and_positional(tmp_path: Path, capsys) -> None:
    run_dir = tmp_path / "run"
    code, _, err = run_cli(["train", "CartPole-v1", "--env-id", "Pendulum-v1", *TINY], capsys)
    assert code == 2
    assert "ENV_ID 'CartPole-v1' and --env-id 'Pendulum-v1' disagree" in err
    code, _, err = run_cli(
        ["train", "--env-id", "Pendulum-v1", *TINY, "--run-dir", str(run_dir)], capsys
    )
    assert code == 0, err
    assert read_config(run_dir)["env_id"] == "Pendulum-v1"


def test_version(capsys) -> None:
    from trustrl import __version__

    assert run_cli(["--version"], capsys)[:2] == (0, f"trustrl {__version__}\n")
    script = Path(sys.executable).with_name("trustrl")
    done = subprocess.run([str(script), "--version"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout == f"trustrl {__version__}\n"


@pytest.mark.parametrize(("total", "planned"), [(100, 128), (64, 64), (65, 96), (1, 32)])
def test_total_steps_round_up_to_whole_iterations_and_say_so(
    tmp_path: Path, capsys, total: int, planned: int
) -> None:
    run_dir = tmp_path / "run"
    argv = ["train", "CartPole-v1", *TINY, "--total-steps", str(total), "--no-quiet"]
    code, out, err = run_cli([*argv, "--run-dir", str(run_dir)], capsys)
    assert code == 0, err
    note = f"note: total_steps {total:,} rounded up to {planned:,}: whole iterations of 2 envs x "
    note += "16 steps"
    assert (note in out) == (total != planned), out
    assert read_config(run_dir)["total_steps"] == planned
    rows = read_progress(run_dir / "progress.csv")
    assert rows[-1]["env_steps"] == planned
    assert f"({planned:,} of {planned:,} planned steps" in out


def test_resume_below_the_steps_done_is_refused(cli_run, tmp_path: Path, capsys) -> None:
    run_dir = tmp_path / "run"
    shutil.copytree(cli_run, run_dir)
    config_before = (run_dir / "config.toml").read_text()
    for total in ("32", "64"):
        code, _, err = run_cli(["train", "--resume", str(run_dir), "--total-steps", total], capsys)
        assert code == 2
        assert f"has trained 64 env steps already; total_steps {int(total):,} leaves nothing" in err
    assert (run_dir / "config.toml").read_text() == config_before


def test_resume_with_changed_settings_keeps_the_history(cli_run, tmp_path: Path, capsys) -> None:
    run_dir = tmp_path / "run"
    shutil.copytree(cli_run, run_dir)
    argv = ["train", "--resume", str(run_dir), "--total-steps", "96", "--ppo.clip-coef", "0.1"]
    code, out, err = run_cli([*argv, "--quiet"], capsys)
    assert code == 0, err
    assert "ppo.clip_coef: 0.2 -> 0.1 (recorded in config_history.json)" in out
    argv = ["train", "--resume", str(run_dir), "--total-steps", "128", "--rollout.gamma", "0.9"]
    assert run_cli([*argv, "--quiet"], capsys)[0] == 0
    history = json.loads((run_dir / "config_history.json").read_text())
    assert history == [
        {
            "from_iteration": 3,
            "env_steps_before": 64,
            "changes": {
                "ppo.clip_coef": {"old": 0.2, "new": 0.1},
                "total_steps": {"old": 64, "new": 96},
            },
        },
        {
            "from_iteration": 4,
            "env_steps_before": 96,
            "changes": {
                "rollout.gamma": {"old": 0.98, "new": 0.9},
                "total_steps": {"old": 96, "new": 128},
            },
        },
    ]
    assert read_config(run_dir)["rollout"]["gamma"] == 0.9  # config.toml: the latest part


def test_an_early_stop_finishes_the_progress_output(tmp_path: Path, capsys) -> None:
    run_dir = tmp_path / "run"
    argv = ["train", "CartPole-v1", *TINY, "--total-steps", "6400", "--target-return", "1"]
    code, out, err = run_cli([*argv, "--no-quiet", "--run-dir", str(run_dir)], capsys)
    assert code == 0, err
    # Not a terminal here: plain lines, never cut, and a last line saying what happened.
    line = next(x for x in out.splitlines() if "solved:" in x)
    assert line.startswith("CartPole-v1: solved: evaluation mean ")
    assert "after 32 env steps (32 of 6,400 planned steps, elapsed 0:00:" in line


def test_plain_progress_lines_off_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    import io

    from trustrl.run import logging as log

    stream = io.StringIO()
    monkeypatch.setattr(log, "PLAIN_SECONDS", 0.0)
    bar = log.ProgressBar(1000, "Hopper-v5", stream=stream)
    assert not bar.live
    for steps in (250, 500):
        bar.update(steps, 1234.0, 12.5)
    bar.close(500, "interrupted")
    lines = stream.getvalue().splitlines()
    assert lines[0].startswith("Hopper-v5: 250/1,000 steps, 1,234 sps, return 12.5, elapsed 0:00:0")
    assert lines[1].startswith("Hopper-v5: 500/1,000 steps")
    assert lines[2].startswith("Hopper-v5: interrupted (500 of 1,000 planned steps, elapsed ")


def test_the_live_bar_labels_its_times() -> None:
    import io

    from trustrl.run.logging import ProgressBar

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    stream = Terminal()
    bar = ProgressBar(1000, "CartPole-v1", stream=stream)
    assert bar.live
    bar.update(300, 100.0, 20.0)
    bar.close(300, "solved: evaluation mean 500.0 >= 475 after 300 env steps")
    text = stream.getvalue()
    assert "elapsed" in text and "left" in text
    assert "300/300 steps" in text  # the bar ends full, where the run ended
    assert "CartPole-v1: solved: evaluation mean 500.0 >= 475 after 300 env steps" in text


def test_multiagent_eval_reports_each_agent_and_group(tmp_path: Path, capsys) -> None:
    run_dir = tmp_path / "tag"
    argv = ["train", "mpe2:simple_tag_v3", "--total-steps", "64", "--env.num-envs", "1"]
    argv += ["--rollout.num-steps", "32", "--ppo.update-epochs", "1", "--eval-episodes", "0"]
    code, _, err = run_cli([*argv, "--quiet", "--run-dir", str(run_dir)], capsys)
    assert code == 0, err
    code, out, err = run_cli(["eval", str(run_dir), "--episodes", "2", "--json"], capsys)
    assert code == 0, err
    result = json.loads(out)
    assert set(result["groups"]) == {"adversary", "agent"}
    assert set(result["agents"]) == {"adversary_0", "adversary_1", "adversary_2", "agent_0"}
    for entry in [*result["groups"].values(), *result["agents"].values()]:
        assert len(entry["returns"]) == 2
        assert entry["mean_return"] == pytest.approx(np.mean(entry["returns"]))
    adversaries = [result["agents"][f"adversary_{i}"]["returns"] for i in range(3)]
    assert result["groups"]["adversary"]["returns"] == pytest.approx(np.mean(adversaries, 0))
    code, text, _ = run_cli(["eval", str(run_dir), "--episodes", "2"], capsys)
    assert "(mean over agents)" in text.splitlines()[0]
    for name in ("group adversary: ", "group agent: ", "agent adversary_0: ", "agent agent_0: "):
        assert f"  {name}" in text, text


def test_resume_flags_that_do_not_fit(cli_run, capsys) -> None:
    code, _, err = run_cli(["train", "--resume", str(cli_run), "--overwrite"], capsys)
    assert code == 2 and "--overwrite starts a new run; --resume continues one" in err
    code, _, err = run_cli(["train", "CartPole-v1", "--trust-env-state", *TINY], capsys)
    assert code == 2 and "--trust-env-state applies to --resume only" in err


def test_unknown_kwarg_of_a_pettingzoo_env(tmp_path: Path, capsys) -> None:
    config_file = tmp_path / "kwargs.toml"
    config_file.write_text("[env]\nkwargs = { foo = 3 }\n")  # replaces the preset's kwargs
    argv = ["train", "mpe2:simple_spread_v3", "--config", str(config_file), "--quiet"]
    code, _, err = run_cli([*argv, "--run-dir", str(tmp_path / "run")], capsys)
    assert code == 2, err
    assert "mpe2:simple_spread_v3 does not accept the keyword argument 'foo'" in err
    assert len(err.strip().splitlines()) == 1


def test_serve_says_what_it_needs(capsys, tmp_path: Path) -> None:
    code, _, err = run_cli(["serve", "--quiet"], capsys)
    assert code == 2 and "needs ENV_ID, or the spaces in the config's [agent] table" in err
    code, _, err = run_cli(["serve", "--resume", str(tmp_path)], capsys)
    assert code == 2 and "no config.toml there" in err
    code, _, err = run_cli(["serve", "--resume", str(tmp_path), "--trust-env-state"], capsys)
    assert code == 2 and "keeps no env state" in err
    code, _, err = run_cli(["serve", "CartPole-v1", "--agent.queue-size", "0"], capsys)
    assert code == 2 and "agent.queue_size" in err


def test_a_reader_that_goes_away_gets_no_traceback() -> None:
    """`trustrl train --help | head -1`: the pipe closes under the help text."""
    child = subprocess.Popen(
        [sys.executable, "-m", "trustrl.cli", "train", "--help"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert child.stdout is not None and child.stderr is not None
    child.stdout.read(10)
    child.stdout.close()  # the reader is gone before the help is written out
    stderr = child.stderr.read().decode()
    child.wait(60)
    assert "Traceback" not in stderr and "BrokenPipe" not in stderr, stderr
