"""benchmarks/pixels.py without training: its report and its record, from fake finished runs."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

import pytest


@pytest.fixture(scope="module")
def pixels(benchmark_script):
    return benchmark_script("pixels")


def result(
    game: str, seed: int, deterministic: float, stochastic: float, no_sticky: float | None = None
) -> dict:
    """A finished run's result.json; ``no_sticky``: both its evaluations on games without
    sticky actions scored that."""
    out = {
        "game": game,
        "seed": seed,
        "sticky": 0.1,
        "deterministic": {"mean_return": deterministic, "episodes": 100},
        "stochastic": {"mean_return": stochastic, "episodes": 100},
    }
    if no_sticky is not None:
        score = {"mean_return": no_sticky, "episodes": 100}
        out["no_sticky"] = {"deterministic": score, "stochastic": score}
    return out


def finish(folder: Path, game: str, seed: int, iterations: int, **scores: Any) -> None:
    """A run folder as the suite leaves it: result.json and trustrl's progress.csv, whose
    return is i / 10 at iteration i (none in the first two: no game finished yet)."""
    folder.mkdir(parents=True)
    (folder / "result.json").write_text(json.dumps(result(game, seed, **scores)))
    with (folder / "progress.csv").open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["iteration", "env_steps", "episode_return_mean", "entropy", "wall_time"])
        for i in range(1, iterations + 1):
            ret = "nan" if i <= 2 else repr(i / 10)
            writer.writerow([i, 8192 * i, ret, repr(1.0 - i / (2 * iterations)), repr(1.5 * i)])


def test_the_report_keeps_earlier_runs_and_each_new_runs_thinned_curve(
    pixels, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    record, doc = tmp_path / "minatar.json", tmp_path / "pixels.md"
    earlier = [
        result("Breakout", 1, deterministic=30.0, stochastic=29.0),
        result("Asterix", 2, deterministic=1.0, stochastic=1.0),  # run again below
    ]
    record.write_text(json.dumps(earlier))
    markers = "<!-- pixels-table:start -->\nold\n<!-- pixels-table:end -->\n"
    doc.write_text(f"# Pixels\n\n{markers}after\n")
    monkeypatch.setattr(pixels, "RECORD", record)
    monkeypatch.setattr(pixels, "DOC", doc)
    runs = tmp_path / "runs"
    finish(runs / "Asterix__2", "Asterix", 2, 1220, deterministic=40.0, stochastic=26.0)
    finish(
        runs / "Breakout__2", "Breakout", 2, 50, deterministic=20.0, stochastic=25.0, no_sticky=31
    )

    pixels.main(["--run-root", str(runs), "--report-only", "--write-docs"])

    text = doc.read_text()
    assert "old" not in text and text.endswith("<!-- pixels-table:end -->\nafter\n")
    # Breakout: the record's seed 1 (29.0) with the run root's seed 2 (25.0): 27.0, below 28;
    # without sticky actions only seed 2 was measured (31.0): above, for that one seed.
    assert (
        "| Breakout | 0.1 | 2 (1, 2) | 25.0 (20.0) | 27.0 (25.0) | 31.0 (31.0), seeds 2 "
        "| 31.0 (31.0), seeds 2 | 28 | no | yes, seeds 2 | 1 min |"
    ) in text
    assert (
        "| Asterix | 0.1 | 1 (2) | 40.0 (40.0) | 26.0 (26.0) | - | - | 15 | yes | - | 30 min |"
        in text
    )
    assert "| SpaceInvaders | | 0 | not yet measured | | | | 131 | | | |" in text
    kept = {(r["game"], r["seed"]): r for r in json.loads(record.read_text())}
    assert set(kept) == {("Asterix", 2), ("Breakout", 1), ("Breakout", 2)}
    assert kept["Breakout", 1] == earlier[0]  # carried as it was: no curve to add
    asterix = kept["Asterix", 2]["curve"]
    assert len(asterix) == 94  # every 13th of 1,220 iterations: at most 100
    assert asterix[-1] == [1220 * 8192, 122.0, 0.5]  # the last iteration, always
    assert [row[0] // 8192 for row in asterix[:2]] == [11, 24]  # counted back from the last
    short = kept["Breakout", 2]["curve"]
    assert len(short) == 50 and short[0] == [8192, None, 0.99] and short[2][1] == 0.3
    assert kept["Asterix", 2]["wall_seconds"] == 1830.0


def test_a_finished_run_is_evaluated_without_sticky_actions_once(
    pixels, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run finished before the evaluations without sticky actions existed gets them when
    the suite next starts; one that has them, or trained without sticky actions, does not."""
    calls: list[tuple[str, bool, bool]] = []

    def evaluate(folder: Path, deterministic: bool, sticky_off: bool = False) -> dict:
        calls.append((folder.name, deterministic, sticky_off))
        return {"mean_return": 40.0 if deterministic else 35.0, "episodes": 100}

    monkeypatch.setattr(pixels, "evaluate", evaluate)
    monkeypatch.setattr(pixels, "train", lambda *args: pytest.fail(f"trained {args}"))
    monkeypatch.setattr(pixels, "RECORD", tmp_path / "minatar.json")
    runs = tmp_path / "runs"
    finish(runs / "Breakout__1", "Breakout", 1, 5, deterministic=20.0, stochastic=18.0)
    finish(runs / "Breakout__2", "Breakout", 2, 5, deterministic=20.0, stochastic=18.0, no_sticky=9)
    plain = runs / "Breakout__sticky0__1"
    finish(plain, "Breakout", 1, 5, deterministic=10.0, stochastic=8.0)
    done = json.loads((plain / "result.json").read_text())
    (plain / "result.json").write_text(json.dumps({**done, "sticky": 0.0}))

    for more in (["--seeds", "1,2"], ["--seeds", "1", "--sticky", "0"]):  # all finished
        pixels.main(["--run-root", str(runs), "--games", "Breakout", *more])

    assert calls == [("Breakout__1", True, True), ("Breakout__1", False, True)]
    first = json.loads((runs / "Breakout__1" / "result.json").read_text())
    assert first["stochastic"]["mean_return"] == 18.0  # the games it trained on, kept
    assert first["no_sticky"]["deterministic"]["mean_return"] == 40.0
    assert first["no_sticky"]["stochastic"]["mean_return"] == 35.0
    assert not list(runs.glob("*/result.json.tmp"))
    kept = json.loads((runs / "Breakout__2" / "result.json").read_text())
    assert kept["no_sticky"]["stochastic"]["mean_return"] == 9
    assert "no_sticky" not in json.loads((plain / "result.json").read_text())
