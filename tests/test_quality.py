"""benchmarks/quality.py without training: its plan and its table, from fake finished runs."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

import trustrl
from trustrl.config import config_to_dict


@pytest.fixture(scope="module")
def quality(benchmark_script):
    return benchmark_script("quality")


def finish(quality, root: Path, algo: str, env_id: str, seed: int, score: float, **extra) -> Path:
    """A run folder as the worker leaves it: quality.json (and a progress file whose
    training curve rises to ``score``, or follows ``extra["curve"]``)."""
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
        "preset_budget": extra.get("preset_budget", extra.get("budget", config.total_steps)),
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
    curve = extra.get("curve", [score * i / 3 for i in range(1, 4)])
    with (folder / "progress.csv").open("w", newline="") as handle:  # as trustrl writes it
        writer = csv.writer(handle)
        writer.writerow(["iteration", "env_steps", "episode_return_mean"])
        for i, value in enumerate(curve, start=1):
            writer.writerow([i, 1000 * i, "nan" if value is None else repr(float(value))])
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


def test_humanoid_trains_the_tables_1m_not_its_presets_budget(
    quality, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--dry-run", "--run-root", str(tmp_path), "--envs", "Humanoid-v5,Ant-v5"]
    assert quality.main([*argv, "--seeds", "101"]) == 0
    lines = [" ".join(line.split()) for line in capsys.readouterr().out.splitlines()]
    # Whole iterations not above 1M: 1953 x 512 for PPO, 488 x 2 x 1024 for TRPO.
    assert (
        "to train ppo__Humanoid-v5__101 999,936 env steps "
        "(the table's 1,000,000; the preset's: 9,999,872)" in lines
    )
    assert (
        "to train trpo__Humanoid-v5__101 999,424 env steps "
        "(the table's 1,000,000; the preset's: 1,998,848)" in lines
    )
    assert "to train ppo__Ant-v5__101 999,424 env steps (the preset's)" in lines
    # --total-steps is every run's budget, Humanoid's too.
    assert quality.main([*argv, "--seeds", "101", "--total-steps", "5000"]) == 0
    lines = [" ".join(line.split()) for line in capsys.readouterr().out.splitlines()]
    assert "to train ppo__Humanoid-v5__101 5,000 env steps" in lines


def test_every_mujoco_preset_is_in_the_suite_with_its_published_figures(quality) -> None:
    from trustrl.config import available_presets

    for algo in quality.ALGOS:
        shipped = {
            env_id
            for env_id in available_presets(algo)
            if env_id.endswith("-v5") and not env_id.startswith("ALE/")  # Atari: docs/pixels.md
        }
        assert shipped <= set(quality.MUJOCO), sorted(shipped - set(quality.MUJOCO))
    for env_id in quality.MUJOCO:
        for algo in quality.ALGOS:
            figures = quality.published(algo, env_id)
            if (algo, env_id) == ("trpo", "Pusher-v5"):  # no source reports it
                assert not figures and (algo, env_id) not in quality.TARGETS
                continue
            assert figures, (algo, env_id)
            if env_id not in ("Hopper-v5", "HalfCheetah-v5", "Walker2d-v5"):  # issue 22's
                assert quality.TARGETS[(algo, env_id)] == max(figures.values()), (algo, env_id)


def test_a_curve_falls_from_its_peak_by_its_smoothed_end(quality, tmp_path: Path) -> None:
    def drop(curve: list[float | None]) -> float | None:
        folder = finish(
            quality, tmp_path, "ppo", "Hopper-v5", len(list(tmp_path.iterdir())), 0.0, curve=curve
        )
        return quality.curve_drop(folder / "progress.csv")

    assert drop([0.0, 500.0, 1000.0]) == 0.0  # still rising
    # 10-iteration means: the peak 1000 (ten at 1000), the end 500 (the last ten at 500).
    assert drop([0.0] * 5 + [1000.0] * 10 + [500.0] * 10) == pytest.approx(0.5)
    # One bad iteration at the end moves the 10-iteration mean by a tenth of its fall.
    assert drop([1000.0] * 20 + [0.0]) == pytest.approx(0.1)
    assert drop([None, 1000.0, None, 1000.0]) == 0.0  # iterations without a finished episode
    # Below zero (Reacher's costs): the fall as a share of the rise, -40 to -5, ending at
    # -12: 7 of 35.
    assert drop([-40.0] * 10 + [-5.0] * 10 + [-12.0] * 10) == pytest.approx(0.2)
    assert quality.curve_drop(tmp_path / "missing.csv") is None


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
        "| ppo | Hopper-v5 | 999,424 | **2,500.0** | 2,000.0 / 3,000.0 / 2,500.0 | 2,000.0 | "
        "2,500.0 [" in text
    )
    assert (
        "| yes | 20.0 min | 2,410 (SB3 zoo); 2,609 (Tianshou); 2,382.9 (CleanRL); "
        "~2,330 (PPO paper) | 2,800 | **no** |" in text
    )
    # SB3 trains whole rollouts past the budget: that is no early stop.
    assert "| sb3-ppo | Hopper-v5 | 1,000,000 (ran 1,000,448) | **2,200.0** |" in text
    assert (
        "| ppo | Hopper-v5 | 2,410 (SB3 zoo) | 20,480 env steps | "
        "10.0 min / not reached / 15.0 min | not every seed | 20.0 min (eval 2,200.0) |" in text
    )
    assert "| mappo-centric | **-10.04** |" in text  # from docs/multiagent.json
    assert "Compute: the table's 4 runs took 1.3 h of one core in all" in text  # 4 x 20 min
    assert "![Hopper-v5](quality/Hopper-v5.png)" in text
    assert (tmp_path / "docs" / "quality" / "Hopper-v5.png").read_bytes()[:4] == b"\x89PNG"

    data = json.loads(doc.with_suffix(".json").read_text())
    [cell] = [c for c in data["cells"] if c["algo"] == "ppo"]
    assert cell["seeds"] == [101, 102, 103] and cell["mean"] == pytest.approx(2500.0)
    assert cell["iqm"] == pytest.approx(2500.0)  # 3 seeds: IQM trims none
    assert 2000.0 <= cell["low"] < 2500.0 < cell["high"] <= 3000.0
    assert cell["bar"] == 2410 and cell["time_to_bar_s"] == [600.0, None, 900.0]
    assert cell["worst"] == 2000.0 and cell["curve_drops"] == [0.0, 0.0, 0.0]


def test_the_table_names_a_fallen_curve_a_cell_without_figures_and_a_shortened_budget(
    quality, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(quality, "BOOTSTRAP_REPS", 200)
    runs = tmp_path / "runs"
    fallen = [-60.0] * 10 + [-30.0] * 10 + [-45.0] * 10  # Pusher: up 30, then half back
    for seed in quality.SEEDS:
        curve = fallen if seed == 102 else None
        extra = {"curve": curve} if curve else {}
        finish(quality, runs, "trpo", "Pusher-v5", seed, -35.0 - seed % 100, **extra)
        finish(
            quality,
            runs,
            "ppo",
            "Humanoid-v5",
            seed,
            600.0,
            budget=999_936,
            preset_budget=9_999_872,
            evals=[[20_480, 300.0, 500.0], [40_960, 420.0, 800.0]],
        )
    doc = tmp_path / "docs" / "quality.md"
    argv = ["--report-only", "--run-root", str(runs), "--doc", str(doc), "--multiagent", ""]
    assert quality.main([*argv, "--plots", str(tmp_path / "docs" / "quality")]) == 0
    text = doc.read_text()
    assert "| trpo | Pusher-v5 | 999,424 | **-37.0** | -36.0 / -37.0 / -38.0 | -38.0 | " in text
    assert "| **no**: 102 (50% below) | 20.0 min | none published at 1M | - | - |" in text
    assert "No source reports trpo Pusher-v5 at 1M: no target." in text
    assert "| ppo | Humanoid-v5 | 999,936; the preset's: 9,999,872 | **600.0** |" in text
    assert "| 787.1 (Tianshou); 716.1 (CleanRL) | 787.1 | **no** |" in text
    assert "ppo Humanoid-v5 (999,936 here, the preset's 9,999,872)" in text
    # No zoo figure: time to quality counts to the target; no target, no row.
    assert "| ppo | Humanoid-v5 | 787.1 (target) | " in text
    assert "| 7.0 min / 7.0 min / 7.0 min | 7.0 min | - |" in text
    assert "| trpo | Pusher-v5 | -" not in text.split("## Time to quality")[1]


def test_cells_whose_runs_are_gone_are_carried_over_and_new_ones_replace_theirs(
    quality, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(quality, "BOOTSTRAP_REPS", 200)
    doc, plots = tmp_path / "docs" / "quality.md", tmp_path / "docs" / "quality"
    first = tmp_path / "first"
    for seed in quality.SEEDS:
        finish(quality, first, "ppo", "Hopper-v5", seed, 2000.0)
        finish(quality, first, "ppo", "Walker2d-v5", seed, 1000.0)
    budget = {"budget": 1_000_000, "env_steps": 1_000_448}
    finish(quality, first, quality.SB3, "Hopper-v5", 101, 2200.0, **budget)  # one seed
    argv = ["--report-only", "--doc", str(doc), "--plots", str(plots)]
    assert quality.main([*argv, "--run-root", str(first)]) == 0
    assert "## What was tried\n\nNothing yet." in doc.read_text()
    # What was tried is written by hand between the markers: every report keeps it.
    tried = (
        "\n".join(
            ["<!-- tried:start -->", "## What was tried", "", "Walker2d, seed 201: 3,910.", ""]
        )
        + "<!-- tried:end -->"
    )
    doc.write_text(doc.read_text().split("<!-- tried:start -->")[0] + tried + "\n")
    # A new machine: the first runs are gone; TRPO Hopper and a new PPO Walker2d are measured.
    second = tmp_path / "second"
    for seed in quality.SEEDS:
        finish(quality, second, "trpo", "Hopper-v5", seed, 3000.0)
        finish(quality, second, "ppo", "Walker2d-v5", seed, 4000.0)
    assert quality.main([*argv, "--run-root", str(second)]) == 0
    text = doc.read_text()
    assert "| ppo † | Hopper-v5 |" in text and "| trpo | Hopper-v5 |" in text
    assert "| sb3-ppo † | Hopper-v5 | 1,000,000 (ran 1,000,448) | **2,200.0** |" in text
    # A carried cell keeps its curves' test as measured, beside the suite's figures now.
    assert "| yes | 20.0 min | 2,410 (SB3 zoo); 2,609 (Tianshou); 2,382.9 (CleanRL); ~2,330" in text
    assert "| ppo | Walker2d-v5 | 999,936 | **4,000.0** |" in text  # replaced, not carried
    assert text.endswith(tried + "\n") and text.count("What was tried") == 1
    assert "1,000.0" not in text
    assert "![Hopper-v5 (ppo)](quality/Hopper-v5.png)" in text  # the carried cell's curve
    assert "![Hopper-v5 (trpo)](quality/Hopper-v5__trpo.png)" in text
    data = json.loads(doc.with_suffix(".json").read_text())
    assert [(c["algo"], c["env_id"], c.get("carried", False)) for c in data["cells"]] == [
        ("ppo", "Hopper-v5", True),
        ("trpo", "Hopper-v5", False),
        (quality.SB3, "Hopper-v5", True),  # the peer's one seed is not the table's three
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
    # A carried record counted to the zoo figure (older ones named it so): kept.
    old = json.loads(doc.with_suffix(".json").read_text())
    for cell in old["cells"]:
        cell["zoo"], cell["time_to_zoo_s"] = cell.pop("bar"), cell.pop("time_to_bar_s")
    doc.with_suffix(".json").write_text(json.dumps(old))
    assert quality.main([*argv, "--run-root", str(third)]) == 0
    assert "| trpo | Hopper-v5 | 3,618 (SB3 zoo) | " in doc.read_text()
    data = json.loads(doc.with_suffix(".json").read_text())
    [trpo] = [c for c in data["cells"] if c["algo"] == "trpo"]
    assert trpo["bar"] == 3618 and "zoo" not in trpo
    assert "![Hopper-v5 (trpo)](quality/Hopper-v5__trpo.png)" in text


def test_a_killed_run_resumes_from_its_checkpoint_and_adds_up_its_wall_time(
    quality, tmp_path: Path
) -> None:
    # A run of 4 iterations killed after its second: its config says 4, its checkpoint 2.
    job = quality.Job("ppo", "CartPole-v1", 101, 4 * 512, 512)
    folder = tmp_path / job.name
    overrides = {"seed": 101, "run_dir": str(folder), "quiet": True, "checkpoint_every": 1}
    overrides |= {"env": {"num_envs": 1}, "rollout": {"num_steps": 512}, "eval_every": 0}
    first = trustrl.Trainer(
        trustrl.resolve("CartPole-v1", "ppo", overrides=overrides | {"total_steps": 2 * 512})
    )
    first.train()
    config_path = folder / "config.toml"
    config_path.write_text(config_path.read_text().replace(f"{2 * 512}", f"{4 * 512}", 1))
    assert "total_steps = 2048" in config_path.read_text()
    assert quality.status(job, tmp_path) == "partial: resumed"
    quality.work(job, folder, {"commit": "", "dirty": False, "live": True})
    record = json.loads((folder / quality.DONE).read_text())
    assert record["env_steps"] == 4 * 512
    assert record["train_s"] >= first.wall_time
    assert record["config"]["env"]["num_envs"] == 1  # the run's own config, not the preset's
    iterations = [int(row["iteration"]) for row in csv.DictReader((folder / "progress.csv").open())]
    assert iterations == [1, 2, 3, 4]  # continued, not trained again
    assert quality.status(job, tmp_path) == "done"
    # An SB3 run has no checkpoint to continue from; nor has a run killed before its first.
    (tmp_path / "sb3-ppo__Hopper-v5__101").mkdir()
    assert quality.status(quality.Job(quality.SB3, "Hopper-v5", 101, None, 0), tmp_path) == (
        "partial: trained again"
    )
