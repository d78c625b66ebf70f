"""Exact resume: a paused and resumed run is bit-identical to an uninterrupted one."""

from __future__ import annotations

import hashlib
import json
import math
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch

import trustrl
from trustrl import cli
from trustrl.run.checkpoint import CheckpointError
from trustrl.run.logging import TIME_COLUMNS, read_progress


def _overrides(env_id: str, total_steps: int, run_dir: Path, backend: str) -> dict[str, Any]:
    table: dict[str, Any] = {
        "quiet": True,
        "total_steps": total_steps,
        "eval_episodes": 0,
        "target_return": None,
        "checkpoint_every": 1000,
        "run_dir": str(run_dir),
        "env": {"backend": backend, "num_envs": 2},
        "rollout": {"num_steps": 64},
        "ppo": {"num_minibatches": 2, "update_epochs": 2},
    }
    return table


def _same_rows(a: list[dict[str, float]], b: list[dict[str, float]]) -> bool:
    if len(a) != len(b):
        return False
    for row_a, row_b in zip(a, b, strict=True):
        for key in row_a:
            if key in TIME_COLUMNS:
                continue
            x, y = row_a[key], row_b[key]
            if not (x == y or (math.isnan(x) and math.isnan(y))):
                return False
    return True


@pytest.mark.parametrize(
    ("env_id", "backend"),
    [("CartPole-v1", "vector"), ("Pendulum-v1", "sync"), ("Hopper-v5", "sync")],
)
def test_resume_is_bit_identical(tmp_path: Path, env_id: str, backend: str) -> None:
    steps = 128 * 8
    whole = trustrl.Trainer(
        trustrl.resolve(env_id, overrides=_overrides(env_id, steps, tmp_path / "a", backend))
    )
    whole.train()

    config = trustrl.resolve(env_id, overrides=_overrides(env_id, steps, tmp_path / "b", backend))
    first = trustrl.Trainer(config)
    first.train(iterations=3)  # pauses mid-run, mid-episode, with a checkpoint
    assert first.iteration == 3
    # The envs' state is arrays in the training state: no pickle is written or needed.
    checkpoint = tmp_path / "b" / "checkpoints" / "iter_00000003"
    assert not (checkpoint / "envs.pkl").exists()
    assert json.loads((checkpoint / "meta.json").read_text())["env_state"] is None
    resumed = trustrl.Trainer(config, tmp_path / "b", resume=True)
    assert resumed.envs_restored
    assert resumed.iteration == 3
    resumed.train()

    rows_a = read_progress(tmp_path / "a" / "progress.csv")
    rows_b = read_progress(tmp_path / "b" / "progress.csv")
    assert len(rows_a) == 8
    assert _same_rows(rows_a, rows_b)
    for (name, x), y in zip(
        whole.policy.state_dict().items(), resumed.policy.state_dict().values(), strict=True
    ):
        assert torch.equal(x, y), name


def test_uncapturable_envs_start_fresh_episodes(tmp_path: Path) -> None:
    config = trustrl.resolve(
        "CartPole-v1", overrides=_overrides("CartPole-v1", 128 * 4, tmp_path, "async")
    )
    trainer = trustrl.Trainer(config)
    trainer.train(iterations=2)
    meta = json.loads((tmp_path / "checkpoints" / "iter_00000002" / "meta.json").read_text())
    assert meta["env_state"] is None
    resumed = trustrl.Trainer(config, tmp_path, resume=True)
    assert not resumed.envs_restored
    resumed.train()
    assert len(read_progress(tmp_path / "progress.csv")) == 4


class _Marker:
    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.write_text, (self.path, "pwned"))


def _forge_env_pickle(folder: Path, marker: Path) -> None:
    """What an attacker who can write the run folder does: a pickle that runs code, with
    its own digest written into the neighbouring meta.json."""
    data = pickle.dumps(_Marker(marker))
    (folder / "envs.pkl").write_bytes(data)
    meta = json.loads((folder / "meta.json").read_text())
    meta["env_state"] = {"file": "envs.pkl", "sha256": hashlib.sha256(data).hexdigest()}
    (folder / "meta.json").write_text(json.dumps(meta))


@pytest.mark.parametrize("backend", ["vector", "async"])
def test_resume_runs_no_code_from_the_run_folder(
    tmp_path: Path, backend: str, capsys: pytest.CaptureFixture[str]
) -> None:
    config = trustrl.resolve(
        "CartPole-v1", overrides=_overrides("CartPole-v1", 128 * 4, tmp_path / "run", backend)
    )
    trustrl.Trainer(config).train(iterations=2)
    marker = tmp_path / "marker"
    _forge_env_pickle(tmp_path / "run" / "checkpoints" / "iter_00000002", marker)

    resumed = trustrl.Trainer(config, tmp_path / "run", resume=True)
    assert not marker.exists()
    assert resumed.envs_restored == (backend == "vector")  # the arrays, not the pickle
    if backend == "async":  # no array state: the pickle is named, and left unread
        assert any("--trust-env-state" in note for note in resumed.notes)
    resumed.train()
    assert not marker.exists()
    assert cli.main(["train", "--resume", str(tmp_path / "run"), "--total-steps", "1024"]) == 0
    assert not marker.exists()


def test_trusted_env_pickle_is_unpickled_with_a_warning(tmp_path: Path) -> None:
    config = trustrl.resolve(
        "CartPole-v1", overrides=_overrides("CartPole-v1", 128 * 4, tmp_path / "run", "async")
    )
    trustrl.Trainer(config).train(iterations=2)
    marker = tmp_path / "marker"
    _forge_env_pickle(tmp_path / "run" / "checkpoints" / "iter_00000002", marker)
    warns = pytest.warns(UserWarning, match="runs any code the file names")
    with warns, pytest.raises(CheckpointError):  # the marker is no vector env
        trustrl.Trainer(config, tmp_path / "run", resume=True, trust_env_state=True)
    assert marker.exists()  # the opt-in does what it says


def test_env_state_digest_is_checked_before_unpickling(tmp_path: Path) -> None:
    """With --trust-env-state, a damaged pickle is still refused before it is read."""
    config = trustrl.resolve(
        "tests.envs:ScriptedEnv", overrides=_overrides("x", 128 * 4, tmp_path, "sync")
    )
    trustrl.Trainer(config).train(iterations=2)
    folder = tmp_path / "checkpoints" / "iter_00000002"
    assert (folder / "envs.pkl").is_file()  # not array state: pickled, for the opt-in
    marker = tmp_path / "marker"
    (folder / "envs.pkl").write_bytes(pickle.dumps(_Marker(marker)))

    policy = trustrl.load_policy(tmp_path)  # loading a policy never reads envs.pkl
    assert policy is not None
    with pytest.raises(CheckpointError, match="digest"), pytest.warns(UserWarning):
        trustrl.Trainer(config, tmp_path, resume=True, trust_env_state=True)
    assert not marker.exists()


def test_trusted_env_pickle_restores_an_env_without_array_state(tmp_path: Path) -> None:
    config = trustrl.resolve(
        "tests.envs:ScriptedEnv", overrides=_overrides("x", 128 * 4, tmp_path, "sync")
    )
    trustrl.Trainer(config).train(iterations=2)
    assert not trustrl.Trainer(config, tmp_path, resume=True).envs_restored
    with pytest.warns(UserWarning, match="--trust-env-state"):
        trusted = trustrl.Trainer(config, tmp_path, resume=True, trust_env_state=True)
    assert trusted.envs_restored


def test_saved_env_arrays_of_another_form_are_refused(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    config = trustrl.resolve(
        "CartPole-v1", overrides=_overrides("CartPole-v1", 128 * 4, tmp_path, "vector")
    )
    trustrl.Trainer(config).train(iterations=2)
    path = tmp_path / "checkpoints" / "iter_00000002" / "state.safetensors"
    tensors = load_file(str(path))
    key = "state.env.state"
    assert tensors[key].shape == (4, 2)  # CartPole's (4, num_envs) state
    tensors[key] = torch.zeros(7, 2, dtype=tensors[key].dtype)
    save_file(tensors, str(path))
    with pytest.raises(CheckpointError, match="saved environment state does not fit this env"):
        trustrl.Trainer(config, tmp_path, resume=True)
