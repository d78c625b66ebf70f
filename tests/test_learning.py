"""Learning tests: the shipped presets train for real and must reach their targets.

Every run uses the default preset (``trustrl.resolve`` with no overrides but the run
folder, ``quiet`` and the seed) and judges the deterministic evaluation the trainer ends
with. Run with ``pytest -m slow tests/test_learning.py -s`` to see per-seed results.

* CartPole-v1 must be solved on at least 4 of 5 seeds: one test trains seed after seed
  and counts, stopping as soon as the outcome is decided (4 successes, or too many
  failures to reach 4), so a passing run trains no seed it does not need.
* Pendulum-v1 must reach -250 on 3 of 3 seeds: every seed has to pass, so each seed is
  its own test, and ``pytest -n 2`` (scripts/test) spreads them over both cores.
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


def _report(env_id: str, seed: int, mean_return: float, steps: int, wall: float, ok: bool) -> str:
    line = (
        f"{env_id} seed {seed}: eval mean {mean_return:.1f} after {steps:,} env steps "
        f"({wall:.1f} s) {'ok' if ok else 'FAILED'}"
    )
    print(line, flush=True)
    return line


@pytest.mark.slow
def test_cartpole_preset_solves_within_50k_steps_on_4_of_5_seeds(tmp_path: Path) -> None:
    seeds, needed, threshold, max_steps = [1, 2, 3, 4, 5], 4, 475.0, 50_000
    assert trustrl.resolve("CartPole-v1").total_steps <= max_steps
    successes, lines = 0, []
    for index, seed in enumerate(seeds):
        mean_return, steps, wall = _train("CartPole-v1", seed, tmp_path / f"seed{seed}")
        ok = mean_return >= threshold and steps <= max_steps
        successes += ok
        lines.append(_report("CartPole-v1", seed, mean_return, steps, wall, ok))
        remaining = len(seeds) - index - 1
        if successes >= needed or successes + remaining < needed:
            break
    assert successes >= needed, (
        f"{successes} of {len(seeds)} seeds solved CartPole-v1, {needed} needed:\n"
        + "\n".join(lines)
    )


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_pendulum_preset_reaches_minus_250_within_150k_steps(seed: int, tmp_path: Path) -> None:
    threshold, max_steps = -250.0, 150_000
    assert trustrl.resolve("Pendulum-v1").total_steps <= max_steps
    mean_return, steps, wall = _train("Pendulum-v1", seed, tmp_path)
    ok = mean_return >= threshold and steps <= max_steps
    line = _report("Pendulum-v1", seed, mean_return, steps, wall, ok)
    assert ok, line
