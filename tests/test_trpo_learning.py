"""TRPO learns: the shipped presets, trained for real (slow; run with ``-m slow``).

CartPole-v1 is solved (deterministic evaluation mean >= 475) within 100k env steps, and
Pendulum-v1 reaches a deterministic evaluation mean >= -400 within 200k env steps, on
each of seeds 1, 2 and 3. Both runs stop at their target, so they last only as long as
learning takes (about 20 s and 35 s a seed on one core).
"""

from __future__ import annotations

import csv
import math
from pathlib import Path

import pytest

import trustrl
from trustrl.run.trainer import Trainer


def train(env_id: str, seed: int, total_steps: int, run_dir: Path, **overrides: object) -> Trainer:
    config = trustrl.resolve(
        env_id,
        algo="trpo",
        overrides={
            "quiet": True,
            "run_dir": str(run_dir),
            "seed": seed,
            "total_steps": total_steps,
            "torch_threads": 1,
            "eval_episodes": 10,
            **overrides,
        },
    )
    trainer = Trainer(config)
    trainer.train()
    return trainer


def progress(run_dir: Path) -> list[dict[str, float]]:
    with (run_dir / "progress.csv").open() as handle:
        return [{k: float(v) for k, v in row.items()} for row in csv.DictReader(handle)]


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_trpo_solves_cartpole(seed: int, tmp_path: Path) -> None:
    trainer = train("CartPole-v1", seed, 99_328, tmp_path, target_return=475.0)  # 97 x 1024
    assert trainer.eval_result is not None
    rows = progress(tmp_path)
    first_try = sum(row["line_search_steps"] == 1 for row in rows) / len(rows)
    print(
        f"CartPole-v1 seed {seed}: eval {trainer.eval_result.mean_return:.1f} after "
        f"{trainer.env_steps} steps, {trainer.wall_time:.1f} s, line search accepted the "
        f"first try in {first_try:.0%} of {len(rows)} iterations"
    )
    assert trainer.eval_result.mean_return >= 475.0
    assert trainer.env_steps <= 99_328
    # The trust region held on every iteration.
    assert all(row["approx_kl"] <= trainer.config.trpo.max_kl * (1 + 1e-6) for row in rows)


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_trpo_improves_pendulum(seed: int, tmp_path: Path) -> None:
    # Stop once a deterministic evaluation reaches -250, well past the -400 asked for.
    trainer = train("Pendulum-v1", seed, 198_656, tmp_path, target_return=-250.0)  # 97 x 2048
    assert trainer.eval_result is not None
    rows = progress(tmp_path)
    print(
        f"Pendulum-v1 seed {seed}: eval {trainer.eval_result.mean_return:.1f} after "
        f"{trainer.env_steps} steps, {trainer.wall_time:.1f} s"
    )
    assert trainer.env_steps <= 198_656
    # It improved: the first episodes were far worse (a random policy scores about -1200).
    first = next(
        row["episode_return_mean"] for row in rows if not math.isnan(row["episode_return_mean"])
    )
    assert first < -700.0
    assert trainer.eval_result.mean_return >= -400.0
