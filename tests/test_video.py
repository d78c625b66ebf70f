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


# Where the body is in the frame: a fresh process (MUJOCO_GL=egl) places the body 5 m along
# x, paints the tracked part magenta and prints the centroid of the magenta pixels as
# fractions of the frame's width and height (null: not in the frame).
WHERE_IS_THE_BODY = """
import json, sys
import gymnasium as gym, mujoco, numpy as np
from trustrl.run.video import tracking_camera
env_id, tracked = sys.argv[1], sys.argv[2] == "1"
env = gym.make(env_id, render_mode="rgb_array", width=160, height=160,
               **(tracking_camera(env_id) if tracked else {}))
env.reset(seed=0)
u = env.unwrapped
torso = mujoco.mj_name2id(u.model, mujoco.mjtObj.mjOBJ_BODY, "torso")
# The torso; the Swimmer's whole body (its camera follows the body's centre of mass, and
# its torso is the head of a 3 m chain, by design off the centre).
bodies = [torso]
if env_id.startswith("Swimmer"):
    bodies = [b for b in range(u.model.nbody) if u.model.body_rootid[b] == torso]
geoms = np.flatnonzero(np.isin(u.model.geom_bodyid, bodies))
u.model.geom_rgba[geoms] = [1.0, 0.0, 1.0, 1.0]
u.model.geom_matid[geoms] = -1
qpos, qvel = u.data.qpos.copy(), u.data.qvel.copy()
qpos[0] += 5.0
u.set_state(qpos, qvel)
frame = env.render().astype(int)
mask = (frame[..., 0] > 120) & (frame[..., 1] < 90) & (frame[..., 2] > 120)
ys, xs = np.nonzero(mask)
print(json.dumps([xs.mean() / 160, ys.mean() / 160] if mask.sum() > 10 else None))
"""


def _body_in_frame(env_id: str, tracked: bool) -> list[float] | None:
    env = {**os.environ, "MUJOCO_GL": "egl"}
    result = subprocess.run(
        [sys.executable, "-c", WHERE_IS_THE_BODY, env_id, "1" if tracked else "0"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    "env_id", ["Hopper-v5", "Walker2d-v5", "HalfCheetah-v5", "Ant-v5", "Humanoid-v5", "Swimmer-v5"]
)
def test_videos_follow_a_mujoco_body_that_has_moved_away(env_id: str) -> None:
    where = _body_in_frame(env_id, tracked=True)
    assert where is not None, f"{env_id}: the body is not in the frame"
    x, y = where
    assert 0.3 <= x <= 0.7 and 0.3 <= y <= 0.7, f"{env_id}: the body is at {where}"


def test_without_the_tracking_camera_a_hopper_walks_out_of_the_frame() -> None:
    """What the recordings did before: the camera stayed where the episode began."""
    assert _body_in_frame("Hopper-v5", tracked=False) is None
