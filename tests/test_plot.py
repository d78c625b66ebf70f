"""``trustrl plot``: learning curves from progress files, grouped over seeds."""

from __future__ import annotations

import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tomli_w

from trustrl import cli
from trustrl.config import config_to_dict, resolve
from trustrl.run.logging import ProgressFile
from trustrl.run.plot import PlotError, curves, find_runs, plot, plot_command

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def fake_run(folder: Path, seed: int, lr: float, returns: list[float], wall_step: float = 1.0):
    """A run folder as the trainer leaves it: config.toml and progress.csv."""
    folder.mkdir(parents=True)
    config = resolve(
        "CartPole-v1",
        overrides={"seed": seed, "run_dir": str(folder), "ppo": {"learning_rate": lr}},
    )
    (folder / "config.toml").write_text(tomli_w.dumps(config_to_dict(config)))
    progress = ProgressFile(folder / "progress.csv")
    for i, value in enumerate(returns, start=1):
        progress.write(
            {
                "iteration": i,
                "env_steps": 256.0 * i,
                "episode_return_mean": value,
                "eval_return_mean": value if i % 2 == 0 else float("nan"),
                "wall_time": wall_step * i,
            }
        )
    progress.close()
    return folder


@pytest.fixture
def two_groups(tmp_path: Path) -> Path:
    """Three seeds at lr 1e-3 and two at lr 3e-3."""
    root = tmp_path / "runs"
    for seed in (1, 2, 3):
        fake_run(root / f"a{seed}", seed, 1e-3, [10.0 * seed + i for i in range(6)])
    for seed in (1, 2):
        fake_run(root / f"b{seed}", seed, 3e-3, [100.0 + seed + 2 * i for i in range(6)], 1.5)
    return root


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_two_groups_give_two_curves_with_means_and_bands(two_groups: Path, tmp_path: Path) -> None:
    out, figure, found = plot([two_groups], tmp_path / "curves.png")
    assert png_size(out) == (800, 500)  # figsize 8 x 5 inches at 100 dpi
    [axes] = figure.axes
    assert len(axes.get_lines()) == 2 and len(axes.collections) == 2  # curves, bands
    labels = [text.get_text() for text in axes.get_legend().get_texts()]
    assert labels == [
        "ppo CartPole-v1: ppo.learning_rate=0.001 (3 seeds)",
        "ppo CartPole-v1: ppo.learning_rate=0.003 (2 seeds)",
    ]
    first, second = found
    np.testing.assert_allclose(first.x, 256.0 * np.arange(1, 7))
    np.testing.assert_allclose(first.mean, 20.0 + np.arange(6))  # seeds 10, 20, 30 + i
    assert np.all(first.low <= first.mean) and np.all(first.mean <= first.high)
    assert np.all(first.low >= 10.0) and np.all(first.high <= 35.0)
    assert np.all(first.high - first.low > 0)
    np.testing.assert_allclose(second.mean, 101.5 + 2 * np.arange(6))


def test_sparse_metric_and_wall_time_axis_are_aligned(two_groups: Path, tmp_path: Path) -> None:
    runs = find_runs([two_groups])
    evals = curves(runs, metric="eval_return_mean")
    np.testing.assert_allclose(evals[0].x, 256.0 * np.array([2, 4, 6]))
    wall = curves(runs, x="wall_time")
    np.testing.assert_allclose(wall[1].x, 1.5 * np.arange(1, 7))
    np.testing.assert_allclose(wall[1].mean, 101.5 + 2 * np.arange(6))


def test_smoothing_is_a_trailing_mean_per_run(two_groups: Path) -> None:
    [first, _] = curves(find_runs([two_groups]), smooth=3)
    # Seeds' values 10s + i, i = 0..5: trailing means over 1, 2, 3, 3, 3, 3 points.
    np.testing.assert_allclose(first.mean, 20.0 + np.array([0, 0.5, 1, 2, 3, 4]))
    with pytest.raises(PlotError, match="--smooth must be >= 1"):
        curves(find_runs([two_groups]), smooth=0)


def test_one_run_has_no_band_and_plots_into_its_folder(two_groups: Path) -> None:
    run = two_groups / "a1"
    out, figure, [curve] = plot([run])
    assert out == run / "curves.png" and png_size(out)[0] == 800
    assert curve.label.endswith("(1 seed)") and len(figure.axes[0].collections) == 0


def test_plot_command_writes_svg_and_refuses_what_it_cannot_use(
    two_groups: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    svg = tmp_path / "out" / "c.svg"
    assert cli.main(["plot", str(two_groups), "--out", str(svg), "--x", "wall_time"]) == 0
    assert "2 curves from 5 run(s)" in capsys.readouterr().out
    assert svg.read_text().lstrip().startswith("<?xml") and "<svg" in svg.read_text()
    assert cli.main(["plot", str(two_groups), "--metric", "nope"]) == 2
    assert "no column 'nope' in progress.csv" in capsys.readouterr().err
    assert cli.main(["plot", str(tmp_path / "missing")]) == 2
    assert cli.main(["plot", str(two_groups), "--out", str(tmp_path / "c.jpg")]) == 2
    with pytest.raises(PlotError, match=r"no progress\.csv"):
        find_runs([tmp_path / "out"])
    assert plot_command(Path("runs/a b")) == "trustrl plot 'runs/a b'"


def test_matplotlib_and_video_writers_are_imported_only_by_their_commands() -> None:
    code = (
        "import sys, trustrl\n"
        "from trustrl import cli\n"
        "heavy = ('matplotlib', 'moviepy', 'rliable')\n"
        "assert not [m for m in heavy if m in sys.modules], 'import trustrl'\n"
        "try:\n"
        "    cli.main(['train', '--help'])\n"
        "except SystemExit:\n"
        "    pass\n"
        "assert not [m for m in heavy if m in sys.modules], 'trustrl train --help'\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
