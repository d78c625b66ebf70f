"""The README's code blocks, as written: every Python block runs, the TOML block is a valid
config file, and every ``trustrl`` command line of the bash blocks parses."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from trustrl import cli
from trustrl.config import resolve

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README, flags=re.DOTALL)


def test_the_readme_has_the_blocks_these_tests_read() -> None:
    assert blocks("python") and blocks("toml") and blocks("bash")


@pytest.mark.parametrize("index", range(len(blocks("python"))))
def test_python_block_runs_as_written(tmp_path: Path, index: int) -> None:
    # A fresh interpreter in an empty folder: the block's imports, its run folder and
    # anything it prints are those a new user would see.
    code = blocks("python")[index]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr


def test_toml_block_is_a_valid_config(tmp_path: Path) -> None:
    for index, text in enumerate(blocks("toml")):
        path = tmp_path / f"block{index}.toml"
        path.write_text(text)
        resolve("Pendulum-v1", config_file=path)


def command_lines() -> list[list[str]]:
    """``trustrl`` command lines of the bash blocks, comments dropped; lines with
    placeholders (ENV_ID, RUN_DIR, [optional] parts) are usage, not commands."""
    lines = []
    for block in blocks("bash"):
        for line in block.splitlines():
            words = shlex.split(line, comments=True)
            if not words or words[0] != "trustrl":
                continue
            if any(w.isupper() or w.startswith("[") or "|" in w for w in words):
                continue
            lines.append(words[1:])
    return lines


def exit_code(argv: list[str]) -> int:
    try:
        return cli.main(argv)
    except SystemExit as exit_:  # argparse's and tyro's --help
        return exit_.code if isinstance(exit_.code, int) else 1


@pytest.mark.parametrize("argv", command_lines(), ids=" ".join)
def test_bash_command_lines_parse(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    command, rest = argv[0], argv[1:]
    if command.startswith("-"):  # trustrl --version
        assert exit_code(argv) == 0
        return
    assert command in cli.COMMANDS
    if command != "train" or "--help" in rest:
        assert exit_code(argv if command in ("train", "presets") else [command, "--help"]) == 0
        return
    if "--resume" in rest:
        return  # needs a run folder; test_cli covers resume
    if "mypackage" in " ".join(rest):
        return  # the README's stand-in for a user's own module
    known, config = cli.parse_train(rest)
    assert config.env_id == known.env_id
