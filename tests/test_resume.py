"""Exact resume: a paused and resumed run is bit-identical to an uninterrupted one."""

from __future__ import annotations

import json
import math
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch

import trustrl
from trustrl.checkpoint import CheckpointError
from trustrl.logging import TIME_COLUMNS, read_progress


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


def test_env_state_digest_is_checked_before_unpickling(tmp_path: Path) -> None:
    config = trustrl.resolve(
        "CartPole-v1", overrides=_overrides("CartPole-v1", 128 * 4, tmp_path, "vector")
    )
    trustrl.Trainer(config).train(iterations=2)
    folder = tmp_path / "checkpoints" / "iter_00000002"
    marker = tmp_path / "marker"
    (folder / "envs.pkl").write_bytes(pickle.dumps(_Marker(marker)))

    policy = trustrl.Policy.load(tmp_path)  # loading a policy never reads envs.pkl
    assert policy is not None
    with pytest.raises(CheckpointError, match="digest"):
        trustrl.Trainer(config, tmp_path, resume=True)
    assert not marker.exists()
