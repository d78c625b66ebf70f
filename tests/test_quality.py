"""benchmarks/quality.py without training: its plan and its table, from fake finished runs."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

import trustrl
from trustrl.config import config_to_dict
from trustrl.logging import ProgressFile

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def quality():
    spec = importlib.util.spec_from_file_location(
        "benchmarks_quality", ROOT / "benchmarks" / "quality.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while being built
    spec.loader.exec_module(module)
    return module


def finish(quality, root: Path, algo: str, env_id: str, seed: int, score: float, **extra) -> Path:
    """A run folder as the worker leaves it: quality.json (and a progress file)."""
    job = quality.Job(algo, env_id, seed, None, 10)
    folder = root / job.name
    folder.mkdir(parents=True)
    config = trustrl.resolve(env_id, "ppo" if algo == quality.SB3 else algo)
    record = {
        "job": {
            "algo": algo,
            "env_id": env_id,
            "seed": seed,
            "total_steps": None,
            "eval_every": 10,
        },
        "budget": extra.get("budget", config.total_steps),
        "env_steps": extra.get("env_steps", extra.get("budget", config.total_steps)),
        "setup_s": 5.0,
        "train_s": 1195.0,
        "wall_s": 1200.0,
        "final_eval": {"mean_return": score, "returns": [score] * 10},
        "eval_seed": quality.EVAL_SEED,
        "evals": extra.get("evals", []),
        "code": {"commit": "abcdef1234567", "dirty": False, "live": False},
        "config": config_to_dict(trustrl.resolve(env_id, "ppo", overrides={"eval_every": 10})),
    }
    quality.write_record(folder, record)
    progress = ProgressFile(folder / "progress.csv")
    for i in range(1, 4):
        progress.write({"env_steps": 1000.0 * i, "episode_return_mean": score * i / 3})
    progress.close()
    return folder


def test_dry_run_prints_the_plan_and_what_is_done(
    quality, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    finish(quality, tmp_path, "ppo", "CartPole-v1", 101, 500.0)
    (tmp_path / "ppo__CartPole-v1__102").mkdir()  # killed: no quality.json
    doc = tmp_path / "quality.md"
    argv = ["--dry-run", "--run-root", str(tmp_path), "--doc", str(doc), "--algos", "ppo"]
    assert quality.main([*argv, "--envs", "CartPole-v1,Hopper-v5", "--sb3"]) == 0
    lines = [" ".join(line.split()) for line in capsys.readouterr().out.splitlines()]
    assert "done ppo__CartPole-v1__101 49,920 env steps (the preset's)" in lines
    assert "partial: trained again ppo__CartPole-v1__102 49,920 env steps (the preset's)" in lines
    assert "to train ppo__Hopper-v5__103 999,424 env steps (the preset's)" in lines
    assert "to train sb3-ppo__Hopper-v5__101 1,000,000 env steps (the zoo's)" in lines
    assert lines[-1].startswith("6 to train, one at a time")
    assert not doc.exists()


def test_report_writes_the_table_from_finished_runs(
    quality, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(quality, "BOOTSTRAP_REPS", 500)  # the statistics, faster
    runs = tmp_path / "runs"
    # Seed 101 first reaches the zoo's 2410 at 600 s, seed 102 never, seed 103 at 900 s.
    evals = {101: [[1e5, 300.0, 900.0], [2e5, 600.0, 2500.0]], 102: [[1e5, 300.0, 1000.0]]}
    evals[103] = [[1e5, 300.0, 2000.0], [2e5, 900.0, 2410.0]]
    for seed, score in zip(quality.SEEDS, (2000.0, 3000.0, 2500.0), strict=True):
        finish(quality, runs, "ppo", "Hopper-v5", seed, score, evals=evals[seed])
    finish(quality, runs, "ppo", "Hopper-v5", 7, 9999.0)  # a tuning seed: not in the table
    # The zoo's budget, not the preset's whole iterations: matched by nominal budget.
    finish(
        quality, runs, quality.SB3, "Hopper-v5", 101, 2200.0, budget=1_000_000, env_steps=1_000_448
    )
    doc = tmp_path / "docs" / "quality.md"
    argv = ["--report-only", "--run-root", str(runs), "--doc", str(doc)]
    assert quality.main([*argv, "--plots", str(tmp_path / "docs" / "quality")]) == 0

    text = doc.read_text()
    assert (
        "| ppo | Hopper-v5 | 999,424 | **2,500.0** | 2,000.0 / 3,000.0 / 2,500.0 | 2,500.0 ["
        in text
    )
    assert "| 20.0 min | 2,410 (SB3 zoo); 2,609 (Tianshou); 2,052 (CleanRL) | 2,800 | **no** |" in (
        text
    )
    # SB3 trains whole rollouts past the budget: that is no early stop.
    assert "| sb3-ppo | Hopper-v5 | 1,000,000 (ran 1,000,448) | **2,200.0** |" in text
    assert (
        "| ppo | Hopper-v5 | 2,410 | 20,480 env steps | 10.0 min / not reached / 15.0 min | "
        "not every seed | 20.0 min (eval 2,200.0) |" in text
    )
    assert "| mappo-centric | **-10.04** |" in text  # from docs/multiagent.json
    assert "![Hopper-v5](quality/Hopper-v5.png)" in text
    assert (tmp_path / "docs" / "quality" / "Hopper-v5.png").read_bytes()[:4] == b"\x89PNG"

    data = json.loads(doc.with_suffix(".json").read_text())
    [cell] = [c for c in data["cells"] if c["algo"] == "ppo"]
    assert cell["seeds"] == [101, 102, 103] and cell["mean"] == pytest.approx(2500.0)
    assert cell["iqm"] == pytest.approx(2500.0)  # 3 seeds: IQM trims none
    assert 2000.0 <= cell["low"] < 2500.0 < cell["high"] <= 3000.0
    assert cell["time_to_zoo_s"] == [600.0, None, 900.0]


def test_cells_whose_runs_are_gone_are_carried_over_and_new_ones_replace_theirs(
    quality, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(quality, "BOOTSTRAP_REPS", 200)
    doc, plots = tmp_path / "docs" / "quality.md", tmp_path / "docs" / "quality"
    first = tmp_path / "first"
    for seed in quality.SEEDS:
        finish(quality, first, "ppo", "Hopper-v5", seed, 2000.0)
        finish(quality, first, "ppo", "Walker2d-v5", seed, 1000.0)
    argv = ["--report-only", "--doc", str(doc), "--plots", str(plots)]
    assert quality.main([*argv, "--run-root", str(first)]) == 0
    # A new machine: the first runs are gone; TRPO Hopper and a new PPO Walker2d are measured.
    second = tmp_path / "second"
    for seed in quality.SEEDS:
        finish(quality, second, "trpo", "Hopper-v5", seed, 3000.0)
        finish(quality, second, "ppo", "Walker2d-v5", seed, 4000.0)
    assert quality.main([*argv, "--run-root", str(second)]) == 0
    text = doc.read_text()
    assert "| ppo † | Hopper-v5 |" in text and "| trpo | Hopper-v5 |" in text
    assert "| ppo | Walker2d-v5 | 999,936 | **4,000.0** |" in text  # replaced, not carried
    assert "1,000.0" not in text
    assert "![Hopper-v5 (ppo)](quality/Hopper-v5.png)" in text  # the carried cell's curve
    assert "![Hopper-v5 (trpo)](quality/Hopper-v5__trpo.png)" in text
    data = json.loads(doc.with_suffix(".json").read_text())
    assert [(c["algo"], c["env_id"], c.get("carried", False)) for c in data["cells"]] == [
        ("ppo", "Hopper-v5", True),
        ("trpo", "Hopper-v5", False),
        ("ppo", "Walker2d-v5", False),
    ]
    # A third machine, where a retuned PPO Hopper preset runs 1,000,000 steps rather than
    # 999,424 (whole iterations of another size): the same cell, replaced; TRPO Hopper is
    # carried with the curve its record names.
    third = tmp_path / "third"
    for seed in quality.SEEDS:
        finish(quality, third, "ppo", "Hopper-v5", seed, 2500.0, budget=1_000_000)
    assert quality.main([*argv, "--run-root", str(third)]) == 0
    text = doc.read_text()
    assert "| ppo | Hopper-v5 | 1,000,000 | **2,500.0** |" in text and "2,000.0" not in text
    assert "| trpo † | Hopper-v5 |" in text
    assert "![Hopper-v5 (trpo)](quality/Hopper-v5__trpo.png)" in text
