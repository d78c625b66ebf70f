"""Checkpoints: round trip with the normalizer, pickle refusal, damage, pruning, resume."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pickle
import shutil
import signal
import threading
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import torch

import trustrl
from trustrl import cli
from trustrl.config import Config, EnvConfig, PolicyConfig, PPOConfig, RolloutConfig
from trustrl.run.checkpoint import CheckpointError, load_checkpoint
from trustrl.run.logging import read_progress
from trustrl.run.trainer import Trainer

ITERATIONS = 5
BATCH = 2 * 16


def config(iterations: int = ITERATIONS, checkpoint_every: int = 1) -> Config:
    return Config(
        env_id="CartPole-v1",
        seed=3,
        total_steps=iterations * BATCH,
        quiet=True,
        eval_episodes=0,
        checkpoint_every=checkpoint_every,
        env=EnvConfig(num_envs=2, backend="sync", normalize_obs=True),
        rollout=RolloutConfig(num_steps=16),
        policy=PolicyConfig(hidden_sizes=(16,)),
        ppo=PPOConfig(learning_rate=3e-3, update_epochs=2, num_minibatches=2),
    )


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, trustrl.Policy]:
    run_dir = tmp_path_factory.mktemp("run")
    policy = Trainer(config(), run_dir).train()
    return run_dir, policy


def cartpole_observations() -> torch.Tensor:
    """Observations from real episodes plus wide random ones (where the normalizer bites)."""
    env = gym.make("CartPole-v1")
    obs, _ = env.reset(seed=0)
    env.action_space.seed(0)
    rows = [obs]
    for _ in range(30):
        obs, _, terminated, truncated, _ = env.step(env.action_space.sample())
        rows.append(obs)
        if terminated or truncated:
            obs, _ = env.reset()
    env.close()
    wide = np.random.default_rng(0).normal(0.0, 2.0, (30, 4)).astype(np.float32)
    return torch.as_tensor(np.concatenate([np.stack(rows), wide]))


def dist_params(policy: trustrl.Policy, obs: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return policy.dist_params(policy.normalize(obs))


def test_only_the_last_three_iteration_checkpoints_are_kept(trained) -> None:
    run_dir, _ = trained
    names = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert names == ["final", "iter_00000003", "iter_00000004", "iter_00000005", "latest"]
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "final"


def test_load_gives_the_trained_policy_normalizer_included(trained) -> None:
    run_dir, policy = trained
    normalizer = policy.obs_normalizer
    assert normalizer is not None and normalizer.count.item() == ITERATIONS * BATCH
    obs = cartpole_observations()
    expected_params = dist_params(policy, obs)
    expected_actions = policy.act(obs.numpy())
    checkpoints = run_dir / "checkpoints"
    for path in (run_dir, checkpoints, checkpoints / "final", checkpoints / "iter_00000005"):
        loaded = trustrl.load_policy(path)
        assert loaded.obs_normalizer is not None, path
        assert torch.equal(loaded.obs_normalizer.mean, normalizer.mean), path
        assert torch.equal(loaded.obs_normalizer.var, normalizer.var), path
        assert torch.equal(loaded.obs_normalizer.count, normalizer.count), path
        assert torch.equal(dist_params(loaded, obs), expected_params), path
        assert np.array_equal(loaded.act(obs.numpy()), expected_actions), path
        for single in obs[:5].numpy():
            assert loaded.act(single) == policy.act(single)
    # trustrl.load_policy is the same loader.
    assert torch.equal(dist_params(trustrl.load_policy(run_dir), obs), expected_params)

    # The normalizer matters: the same weights without its statistics act differently.
    bare = trustrl.load_policy(run_dir)
    assert bare.obs_normalizer is not None
    bare.obs_normalizer.mean.zero_()
    bare.obs_normalizer.var.fill_(1.0)
    assert not torch.allclose(dist_params(bare, obs), expected_params)
    # An older checkpoint is a different policy (the loader reads the folder it is given).
    older = trustrl.load_policy(checkpoints / "iter_00000003")
    assert not torch.equal(dist_params(older, obs), expected_params)


class MakesMarker:
    """Unpickling this creates ``marker`` (what a malicious .pt file could do)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def test_pickle_files_are_refused_and_never_unpickled(
    trained, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir, _ = trained
    marker = tmp_path / "unpickled.marker"
    evil_pt = tmp_path / "model.pt"
    torch.save(MakesMarker(marker), evil_pt)
    evil_pkl = tmp_path / "model.pkl"
    evil_pkl.write_bytes(pickle.dumps(MakesMarker(marker)))

    # Sanity: these files really do create the marker when unpickled.
    check = tmp_path / "check.marker"
    torch.save(MakesMarker(check), tmp_path / "check.pt")
    torch.load(tmp_path / "check.pt", weights_only=False)
    assert check.exists()

    for evil in (evil_pt, evil_pkl):
        with pytest.raises(CheckpointError, match="not a trustrl checkpoint folder"):
            trustrl.load_policy(evil)
        assert cli.main(["eval", str(evil), "--episodes", "1"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("trustrl: error: ") and str(evil) in err, err
        assert "Traceback" not in err

    # A folder of pickles is not a checkpoint either.
    folder = tmp_path / "pickles"
    folder.mkdir()
    shutil.copy(evil_pt, folder / "policy.pt")
    with pytest.raises(CheckpointError, match="no checkpoint found"):
        trustrl.load_policy(folder)

    # A pickle posing as policy.safetensors in a real checkpoint folder.
    fake = tmp_path / "fake"
    shutil.copytree(run_dir / "checkpoints" / "final", fake)
    shutil.copy(evil_pt, fake / "policy.safetensors")
    with pytest.raises(CheckpointError, match=r"policy\.safetensors is damaged or truncated"):
        trustrl.load_policy(fake)
    assert cli.main(["eval", str(fake), "--episodes", "1"]) == 2
    assert "damaged or truncated" in capsys.readouterr().err

    # An environment pickle (envs.pkl, written only for envs without array state, read
    # only by `train --resume --trust-env-state`): loading a policy or evaluating never
    # touches it, even when its digest matches.
    tampered = tmp_path / "tampered"
    shutil.copytree(run_dir / "checkpoints" / "final", tampered)
    assert not (tampered / "envs.pkl").exists()  # CartPole's state is arrays
    forge_env_state(tampered, MakesMarker(marker))
    trustrl.load_policy(tampered)
    assert cli.main(["eval", str(tampered), "--episodes", "1", "--json"]) == 0
    capsys.readouterr()

    assert not marker.exists(), "a pickle was unpickled"


def forge_env_state(folder: Path, payload: object) -> None:
    """Replace envs.pkl with ``payload`` pickled, and make meta.json's digest match it."""
    data = pickle.dumps(payload)
    (folder / "envs.pkl").write_bytes(data)
    meta = json.loads((folder / "meta.json").read_text())
    meta["env_state"] = {"file": "envs.pkl", "sha256": hashlib.sha256(data).hexdigest()}
    (folder / "meta.json").write_text(json.dumps(meta))


@pytest.fixture
def checkpoint_copy(trained, tmp_path: Path) -> Path:
    run_dir, _ = trained
    folder = tmp_path / "ckpt"
    shutil.copytree(run_dir / "checkpoints" / "final", folder)
    trustrl.load_policy(folder)  # intact before the test damages it
    return folder


def test_missing_policy_file(checkpoint_copy: Path) -> None:
    (checkpoint_copy / "policy.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"policy\.safetensors is missing"):
        trustrl.load_policy(checkpoint_copy)


def test_truncated_policy_file(checkpoint_copy: Path) -> None:
    path = checkpoint_copy / "policy.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"policy\.safetensors is damaged or truncated"):
        trustrl.load_policy(checkpoint_copy)


def test_truncated_state_file_refuses_resume(checkpoint_copy: Path) -> None:
    path = checkpoint_copy / "state.safetensors"
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=r"state\.safetensors is damaged or truncated"):
        load_checkpoint(checkpoint_copy)


def test_future_format_version(checkpoint_copy: Path) -> None:
    meta_path = checkpoint_copy / "meta.json"
    meta = json.loads(meta_path.read_text())
    assert meta["format_version"] == 1
    meta["format_version"] = 99
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="format version 99") as error:
        trustrl.load_policy(checkpoint_copy)
    assert "reads version 1" in str(error.value)


def test_unreadable_meta(checkpoint_copy: Path) -> None:
    (checkpoint_copy / "meta.json").write_text('{"format_version": 1, "poli')
    with pytest.raises(CheckpointError, match=r"meta\.json is unreadable"):
        trustrl.load_policy(checkpoint_copy)


def test_missing_path() -> None:
    with pytest.raises(CheckpointError, match="does not exist"):
        trustrl.load_policy("/nonexistent/trustrl/run")


def test_resume_continues_counters_and_appends_progress(tmp_path: Path) -> None:
    Trainer(config(iterations=2), tmp_path).train()
    assert [r["iteration"] for r in read_progress(tmp_path / "progress.csv")] == [1, 2]

    trainer = Trainer(config(iterations=4), tmp_path, resume=True)
    assert (trainer.iteration, trainer.env_steps) == (2, 2 * BATCH)
    saved = trustrl.load_policy(tmp_path).state_dict()
    restored = trainer.policy.state_dict()
    assert saved.keys() == restored.keys()
    assert all(torch.equal(saved[k], restored[k]) for k in saved)
    trainer.train()
    assert trainer.iteration == 4

    text = (tmp_path / "progress.csv").read_text()
    assert text.count("iteration,") == 1, "header written twice"
    rows = read_progress(tmp_path / "progress.csv")
    assert [r["iteration"] for r in rows] == [1, 2, 3, 4]
    assert [r["env_steps"] for r in rows] == [BATCH * n for n in (1, 2, 3, 4)]
    assert rows[3]["wall_time"] >= rows[1]["wall_time"]
    meta = json.loads((tmp_path / "checkpoints" / "final" / "meta.json").read_text())
    assert (meta["iteration"], meta["env_steps"]) == (4, 4 * BATCH)
    # The normalizer kept counting across the resume.
    policy = trustrl.load_policy(tmp_path)
    assert policy.obs_normalizer is not None
    assert policy.obs_normalizer.count.item() == 4 * BATCH

    # Resuming a finished run of another env is refused.
    other = Config(env_id="Acrobot-v1", total_steps=64, quiet=True, eval_episodes=0)
    with pytest.raises(CheckpointError, match="CartPole-v1"):
        Trainer(other, tmp_path, resume=True)


def test_resume_after_interrupt_starts_from_the_newest_checkpoint(tmp_path: Path) -> None:
    """A finished run resumed for longer, interrupted, resumed again: no stale 'final'."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("the trainer handles Ctrl-C only in the main thread")
    Trainer(config(iterations=2, checkpoint_every=10), tmp_path).train()
    trainer = Trainer(config(iterations=6, checkpoint_every=10), tmp_path, resume=True)
    collect = trainer.collector.collect

    def collect_then_interrupt(snapshot, train=True):
        batch = collect(snapshot, train)
        if trainer.iteration == 2:  # while collecting for iteration 3
            os.kill(os.getpid(), signal.SIGINT)
        return batch

    trainer.collector.collect = collect_then_interrupt  # type: ignore[method-assign]
    trainer.train()
    assert trainer.interrupted and trainer.iteration == 3
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "iter_00000003"

    again = Trainer(config(iterations=4, checkpoint_every=10), tmp_path, resume=True)
    assert again.iteration == 3, "resumed from the stale final checkpoint"
    again.train()
    rows = read_progress(tmp_path / "progress.csv")
    assert [r["iteration"] for r in rows] == [1, 2, 3, 4]


def test_a_ctrl_c_in_the_last_iteration_finishes_the_run_and_is_told(tmp_path: Path) -> None:
    """The run ends with its budget (final checkpoint, not a pause); the Ctrl-C is still
    told, for a caller that runs more after it (a study's next trial)."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("the trainer handles Ctrl-C only in the main thread")
    trainer = Trainer(config(iterations=3, checkpoint_every=10), tmp_path)
    collect = trainer.collector.collect

    def collect_then_interrupt(snapshot, train=True):
        batch = collect(snapshot, train)
        if trainer.iteration == 2:  # while collecting for the last iteration
            os.kill(os.getpid(), signal.SIGINT)
        return batch

    trainer.collector.collect = collect_then_interrupt  # type: ignore[method-assign]
    trainer.train()
    assert trainer.outcome == "finished" and trainer.iteration == 3
    assert not trainer.interrupted and trainer.interrupt_requested
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "final"


def test_a_ctrl_c_while_a_pause_checkpoint_is_written_counts_as_an_interrupt(
    tmp_path: Path,
) -> None:
    """The loop already chose to pause; the Ctrl-C lands as the checkpoint is closed."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("the trainer handles Ctrl-C only in the main thread")
    trainer = Trainer(config(iterations=4, checkpoint_every=10), tmp_path)
    close = trainer.checkpoint_writer.close

    def interrupt_then_close() -> None:
        os.kill(os.getpid(), signal.SIGINT)
        close()

    trainer.checkpoint_writer.close = interrupt_then_close  # type: ignore[method-assign]
    trainer.train(iterations=2)
    assert trainer.iteration == 2 and trainer.interrupted and trainer.interrupt_requested
    assert trainer.outcome == "interrupted"


@pytest.mark.parametrize(
    "change",
    [
        {"policy": PolicyConfig(hidden_sizes=(32,))},
        {"env": EnvConfig(num_envs=2, backend="sync", normalize_obs=False)},
    ],
    ids=["hidden_sizes", "normalize_obs"],
)
def test_resume_with_other_network_settings_is_refused_clearly(tmp_path: Path, change) -> None:
    Trainer(config(iterations=1), tmp_path).train()
    changed = dataclasses.replace(config(iterations=2), **change)
    with pytest.raises(CheckpointError, match=r"hidden_sizes|normalize_obs"):
        Trainer(changed, tmp_path, resume=True)


def test_unwritable_run_folder_is_refused_at_start(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    with pytest.raises(CheckpointError, match="not writable"):
        Trainer(config(), blocker / "run")


def test_full_disk_at_save_keeps_the_previous_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import errno

    import trustrl.run.checkpoint as checkpoint

    trainer = Trainer(config(iterations=4, checkpoint_every=1), tmp_path)
    trainer.train(iterations=2)
    before = (tmp_path / "checkpoints" / "latest").read_text().strip()
    assert before == "iter_00000002"

    def disk_full(*args: object, **kwargs: object) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(checkpoint, "save_file", disk_full)
    resumed = Trainer(config(iterations=4, checkpoint_every=1), tmp_path, resume=True)
    with pytest.raises(CheckpointError, match="No space left on device"):
        resumed.train()
    monkeypatch.undo()
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == before
    assert not list((tmp_path / "checkpoints").glob(".tmp-*")), "a half-written folder remains"
    trustrl.load_policy(tmp_path)  # the previous checkpoint still loads
    assert load_checkpoint(tmp_path)[1]["iteration"] == 2


def test_background_checkpoints_hold_their_own_iteration(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Periodic checkpoints are written on a thread while training goes on: each must hold
    the weights of the iteration it is named for, not those of a later one."""
    import time

    import trustrl.run.trainer as trainer_module

    slow_write = trainer_module.write_snapshot

    def write_late(*args: object) -> Path:
        time.sleep(0.3)  # the next iterations run meanwhile
        return slow_write(*args)

    monkeypatch.setattr(trainer_module, "write_snapshot", write_late)
    trainer = Trainer(dataclasses.replace(config(iterations=3), checkpoint_keep=3), tmp_path)
    weights: list[dict[str, torch.Tensor]] = []
    update = trainer._update

    def recording_update(progress: float, rollouts: list) -> dict[str, float]:
        metrics = update(progress, rollouts)
        weights.append({k: v.clone() for k, v in trainer.policy.state_dict().items()})
        return metrics

    monkeypatch.setattr(trainer, "_update", recording_update)
    trainer.train()
    assert len(weights) == 3
    assert not torch.equal(weights[0]["actor.0.weight"], weights[2]["actor.0.weight"])
    for iteration, expected in enumerate(weights, 1):
        policy = trustrl.load_policy(tmp_path / "checkpoints" / f"iter_{iteration:08d}")
        for key, value in policy.state_dict().items():
            assert torch.equal(value, expected[key]), (iteration, key)
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "final"


def test_ctrl_c_checkpoints_and_prints_the_resume_command(tmp_path: Path) -> None:
    import subprocess
    import sys
    import time

    run_dir = tmp_path / "run"
    command = [sys.executable, "-m", "trustrl.cli", "train", "CartPole-v1", "--quiet"]
    command += ["--run-dir", str(run_dir), "--total-steps", "10000000", "--eval-episodes", "0"]
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + 120
    while not (run_dir / "progress.csv").exists() or not read_progress(run_dir / "progress.csv"):
        assert process.poll() is None and time.monotonic() < deadline, "training did not start"
        time.sleep(0.2)
    process.send_signal(signal.SIGINT)
    output, _ = process.communicate(timeout=120)
    assert process.returncode == 130, output
    assert f"trustrl train --resume {run_dir}" in output
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    iteration = load_checkpoint(run_dir)[1]["iteration"]
    assert latest == f"iter_{iteration:08d}"
    assert len(read_progress(run_dir / "progress.csv")) == iteration
