"""``trustrl eval --video``: evaluation episodes as mp4 files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import trustrl
from trustrl import cli
from trustrl.run.evaluation import evaluate_parallel
from trustrl.run.video import record


def tiny_run(env_id: str, folder: Path, **overrides) -> Path:
    overrides = {
        "total_steps": 64,
        "quiet": True,
        "eval_episodes": 0,
        "run_dir": str(folder),
        "env": {"num_envs": 2},
        "rollout": {"num_steps": 32},
        **overrides,
    }
    trustrl.train(trustrl.resolve(env_id, overrides=overrides))
    return folder


def assert_mp4(path: Path) -> None:
    data = path.read_bytes()
    assert len(data) > 1000 and data[4:8] == b"ftyp", path  # an ISO base media file


def test_eval_video_records_a_cartpole_episode(tmp_path: Path, capsys) -> None:
    run = tiny_run("CartPole-v1", tmp_path / "run")
    out = tmp_path / "videos"
    assert cli.main(["eval", str(run), "--video", "--out", str(out), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["episodes"] == 1 and result["videos"] == [str(out / "eval-episode-0.mp4")]
    assert_mp4(out / "eval-episode-0.mp4")
    # The recorded episode is the evaluation's: same seed, same return.
    assert cli.main(["eval", str(run), "--episodes", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["returns"] == result["returns"]
    assert cli.main(["eval", str(run), "--out", str(out)]) == 2
    assert "add --video" in capsys.readouterr().err


def test_a_multiagent_mpe2_episode_is_recorded_from_its_frames(tmp_path: Path) -> None:
    run = tiny_run(
        "mpe2:simple_spread_v3",
        tmp_path / "run",
        total_steps=50,
        env={"num_envs": 2, "kwargs": {"max_cycles": 10}},
        rollout={"num_steps": 25},
        ppo={"update_epochs": 1, "vf_epochs": 1},
    )
    policy = trustrl.load_policy(run)
    recording = record(
        policy, "mpe2:simple_spread_v3", tmp_path / "v", episodes=2, env_kwargs={"max_cycles": 10}
    )
    assert recording.lengths == [10, 10] and len(recording.videos) == 2
    for video in recording.videos:
        assert_mp4(video)
    returns, _, _ = evaluate_parallel(
        policy, "mpe2:simple_spread_v3", 2, env_kwargs={"max_cycles": 10}
    )
    assert recording.returns == pytest.approx(returns)


def test_mujoco_renders_headless_through_egl(tmp_path: Path) -> None:
    """In a fresh process: MUJOCO_GL is read when MuJoCo's renderer is first imported."""
    run = tiny_run("Hopper-v5", tmp_path / "run")
    code = (
        "import sys, trustrl\n"
        "from trustrl.run.video import record\n"
        "r = record(trustrl.load_policy(sys.argv[1]), 'Hopper-v5', sys.argv[2],\n"
        "           env_kwargs={'max_episode_steps': 3})\n"
        "print(r.videos[0])\n"
    )
    env = {**os.environ, "MUJOCO_GL": "egl"}
    result = subprocess.run(
        [sys.executable, "-c", code, str(run), str(tmp_path / "v")],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert_mp4(Path(result.stdout.strip()))
