"""Learning tests: the shipped presets train for real and must reach their targets.

Each test trains one seed after another with the default preset (``trustrl.resolve``
with no overrides but the run folder, ``quiet`` and the seed) and counts the seeds whose
deterministic evaluation reaches the threshold within the step budget. A test stops as
soon as its outcome is decided (enough successes, or too many failures to recover), so
a passing run trains no seed it does not need. Run with ``pytest -m slow -s`` to see the
per-seed results.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

import trustrl


def _train(env_id: str, seed: int, run_dir: Path) -> tuple[float, int, float]:
    """(deterministic evaluation mean, env steps trained, wall seconds) for one seed."""
    config = trustrl.resolve(
        env_id, overrides={"quiet": True, "run_dir": str(run_dir), "seed": seed}
    )
    start = time.perf_counter()
    trainer = trustrl.Trainer(config)
    trainer.train()
    assert trainer.eval_result is not None
    return trainer.eval_result.mean_return, trainer.env_steps, time.perf_counter() - start


def _count_successes(
    env_id: str,
    seeds: list[int],
    needed: int,
    threshold: float,
    max_steps: int,
    tmp_path: Path,
) -> tuple[int, list[str]]:
    """Train seed by seed until ``needed`` successes are reached or can no longer be."""
    successes, lines = 0, []
    for index, seed in enumerate(seeds):
        mean_return, steps, wall = _train(env_id, seed, tmp_path / f"seed{seed}")
        ok = mean_return >= threshold and steps <= max_steps
        successes += ok
        lines.append(
            f"{env_id} seed {seed}: eval mean {mean_return:.1f} after {steps:,} env steps "
            f"({wall:.1f} s) {'ok' if ok else 'FAILED'}"
        )
        print(lines[-1], flush=True)
        remaining = len(seeds) - index - 1
        if successes >= needed or successes + remaining < needed:
            break
    return successes, lines


@pytest.mark.slow
def test_cartpole_preset_solves_within_50k_steps(tmp_path: Path) -> None:
    config = trustrl.resolve("CartPole-v1")
    assert config.total_steps <= 50_000
    successes, lines = _count_successes("CartPole-v1", [1, 2, 3, 4, 5], 4, 475.0, 50_000, tmp_path)
    assert successes >= 4, "fewer than 4 of 5 seeds solved CartPole-v1:\n" + "\n".join(lines)


@pytest.mark.slow
def test_pendulum_preset_reaches_minus_250_within_150k_steps(tmp_path: Path) -> None:
    config = trustrl.resolve("Pendulum-v1")
    assert config.total_steps <= 150_000
    successes, lines = _count_successes("Pendulum-v1", [1, 2, 3], 3, -250.0, 150_000, tmp_path)
    assert successes == 3, "not all of 3 seeds reached -250 on Pendulum-v1:\n" + "\n".join(lines)
