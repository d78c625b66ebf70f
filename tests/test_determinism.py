"""Same seed, same machine: identical progress files (but for the clocks) and weights."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from trustrl.config import Config, EnvConfig, PolicyConfig, PPOConfig, RolloutConfig
from trustrl.run.logging import TIME_COLUMNS
from trustrl.run.trainer import Trainer


def cartpole(seed: int) -> Config:
    return Config(
        env_id="CartPole-v1",
        seed=seed,
        total_steps=3 * 4 * 24,
        quiet=True,
        eval_episodes=1,
        env=EnvConfig(num_envs=4, backend="vector", kwargs={"max_episode_steps": 20}),
        rollout=RolloutConfig(num_steps=24),
        policy=PolicyConfig(hidden_sizes=(16, 16)),
        ppo=PPOConfig(learning_rate=3e-3, update_epochs=3, num_minibatches=2),
    )


def pendulum(seed: int) -> Config:
    return Config(
        env_id="Pendulum-v1",
        seed=seed,
        total_steps=3 * 2 * 24,
        quiet=True,
        eval_episodes=1,
        env=EnvConfig(
            num_envs=2,
            backend="sync",
            kwargs={"max_episode_steps": 16},
            normalize_obs=True,
            normalize_reward=True,
        ),
        rollout=RolloutConfig(num_steps=24),
        policy=PolicyConfig(hidden_sizes=(16,)),
        ppo=PPOConfig(pi_lr=3e-3, vf_lr=1e-2, update_epochs=3, num_minibatches=3),
    )


def run(config: Config, folder: Path) -> dict:
    Trainer(config, folder).train()
    with (folder / "progress.csv").open(newline="") as handle:
        rows = list(csv.DictReader(handle))
    final = folder / "checkpoints" / "final"
    return {
        # The exact text: equal strings are bit-identical floats.
        "progress": [{k: v for k, v in row.items() if k not in TIME_COLUMNS} for row in rows],
        "clocks": [{k: row[k] for k in TIME_COLUMNS} for row in rows],
        "weights": load_file(str(final / "policy.safetensors")),
        "state": load_file(str(final / "state.safetensors")),
        "eval": json.loads((folder / "eval.json").read_text()),
    }


def same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("make_config", [cartpole, pendulum], ids=["CartPole-vector", "Pendulum"])
def test_same_seed_same_run_other_seed_other_run(tmp_path: Path, make_config) -> None:
    first = run(make_config(7), tmp_path / "a")
    second = run(make_config(7), tmp_path / "b")
    other = run(make_config(8), tmp_path / "c")

    assert len(first["progress"]) == 3
    assert set(TIME_COLUMNS) <= set(first["clocks"][0])
    assert first["progress"] == second["progress"]
    assert same_tensors(first["weights"], second["weights"])
    assert same_tensors(first["state"], second["state"])
    assert first["eval"] == second["eval"]
    # Training did something: the policy moved away from its initialization, so equal
    # weights are not just two copies of the same init.
    assert first["progress"][0]["loss_v"] != first["progress"][-1]["loss_v"]

    assert other["progress"] != first["progress"]
    assert [r["loss_pi"] for r in other["progress"]] != [r["loss_pi"] for r in first["progress"]]
    assert not same_tensors(other["weights"], first["weights"])
