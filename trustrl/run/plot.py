"""Learning curves from run folders: ``trustrl plot RUN_DIR ...``; and the trials of a
``trustrl tune`` study: ``trustrl plot STUDY_DIR``.

Runs whose configs differ only in ``seed`` (and ``run_dir``, ``quiet``) are one group:
one curve, the mean over its runs, with a 95% bootstrap band over the runs. matplotlib
is imported here only, when a plot is drawn, and through its object API (``Figure``,
no ``pyplot``), so no process-wide backend is switched: PNG goes through Agg, SVG
through matplotlib's SVG writer, with or without a display.
"""

from __future__ import annotations

import math
import shlex
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from trustrl.run.logging import read_progress

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from trustrl.run.tune import TrialPoint

X_AXES = {"env_steps": "env steps", "wall_time": "wall time (s)"}
# Config keys that do not change what a run learns: runs that differ only in these
# (and the seed) are the same experiment.
NOT_GROUPED = ("seed", "run_dir", "quiet")
BOOTSTRAP_SAMPLES = 2000
GRID_POINTS = 400  # the most x values a group's mean is computed at


class PlotError(ValueError):
    """Nothing to plot, or an argument that cannot be used; the message says why."""


def plot_command(run_dir: str | Path) -> str:
    """The command that draws a run's learning curve (the end-of-run summary names it)."""
    return f"trustrl plot {shlex.quote(str(run_dir))}"


@dataclass(frozen=True)
class Run:
    path: Path
    config: dict[str, Any]
    rows: list[dict[str, float]]

    @property
    def group_key(self) -> str:
        return repr(sorted(_flatten(self.config, skip=NOT_GROUPED).items()))


@dataclass(frozen=True)
class Curve:
    """One group's curve: the mean over its runs at each x, and the 95% bootstrap band."""

    label: str
    runs: list[Path]
    x: np.ndarray
    mean: np.ndarray
    low: np.ndarray
    high: np.ndarray


def find_runs(paths: list[str | Path]) -> list[Run]:
    """Each path is a run folder (it holds ``progress.csv``) or a folder of runs, searched
    to any depth."""
    runs = []
    for path in map(Path, paths):
        if not path.is_dir():
            raise PlotError(f"{path} is not a folder")
        found = (
            [path / "progress.csv"]
            if (path / "progress.csv").is_file()
            else sorted(path.rglob("progress.csv"))
        )
        if not found:
            raise PlotError(f"{path}: no progress.csv in it or below it; is it a run folder?")
        for progress in found:
            config_file = progress.parent / "config.toml"
            config = tomllib.loads(config_file.read_text()) if config_file.is_file() else {}
            runs.append(Run(progress.parent, config, read_progress(progress)))
    return runs


def curves(
    runs: list[Run],
    metric: str = "episode_return_mean",
    x: str = "env_steps",
    smooth: int = 1,
    seed: int = 0,
) -> list[Curve]:
    """Group the runs and compute each group's mean and band (groups in first-seen order).
    ``smooth``: each run's values are first averaged over a trailing window of that many
    points (1: as logged)."""
    if x not in X_AXES:
        raise PlotError(f"--x must be one of {', '.join(X_AXES)}, got {x!r}")
    if smooth < 1:
        raise PlotError(f"--smooth must be >= 1, got {smooth}")
    groups: dict[str, list[Run]] = {}
    for run in runs:
        if run.rows and metric not in run.rows[0]:
            columns = ", ".join(run.rows[0])
            raise PlotError(f"{run.path}: no column {metric!r} in progress.csv; it has {columns}")
        groups.setdefault(run.group_key, []).append(run)
    labels = _labels([members[0].config for members in groups.values()])
    rng = np.random.default_rng(seed)
    out = []
    for label, members in zip(labels, groups.values(), strict=True):
        series = [_smoothed(*_series(run, x, metric), smooth) for run in members]
        kept = [(run.path, s) for run, s in zip(members, series, strict=True) if len(s[0])]
        if not kept:
            continue
        grid, values = _align([s for _, s in kept])
        low, high = _bootstrap_band(values, rng)
        seeds = len(kept)
        out.append(
            Curve(
                f"{label} ({seeds} seed{'s' if seeds > 1 else ''})",
                [path for path, _ in kept],
                grid,
                values.mean(axis=0),
                low,
                high,
            )
        )
    if not out:
        raise PlotError(f"no run has a finite {metric!r} value to plot")
    return out


def draw(curve_list: list[Curve], metric: str, x: str, title: str | None = None) -> Figure:
    from matplotlib.figure import Figure

    figure = Figure(figsize=(8, 5), dpi=100, layout="constrained")
    axes = figure.add_subplot()
    for curve in curve_list:
        (line,) = axes.plot(curve.x, curve.mean, label=curve.label, linewidth=1.5)
        if len(curve.runs) > 1:
            axes.fill_between(curve.x, curve.low, curve.high, color=line.get_color(), alpha=0.2)
    axes.set_xlabel(X_AXES[x])
    axes.set_ylabel(metric)
    axes.set_title(title or "mean over seeds, shaded: 95% bootstrap interval", fontsize=10)
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8, loc="best")
    return figure


def plot(
    paths: list[str | Path],
    out: str | Path | None = None,
    metric: str = "episode_return_mean",
    x: str = "env_steps",
    title: str | None = None,
    smooth: int = 1,
) -> tuple[Path, Figure, list[Curve]]:
    """Draw the learning curves of the runs under ``paths`` into ``out`` (.png or .svg;
    default: ``curves.png`` in the run folder when there is one, else here)."""
    runs = find_runs(paths)
    if out is None:
        only = {run.path for run in runs}
        out = next(iter(only)) / "curves.png" if len(only) == 1 else Path("curves.png")
    out = Path(out)
    if out.suffix.lower() not in (".png", ".svg"):
        raise PlotError(f"--out must end in .png or .svg, got {out}")
    found = curves(runs, metric, x, smooth)
    figure = draw(found, metric, x, title)
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out)
    return out, figure, found


def _series(run: Run, x: str, metric: str) -> tuple[np.ndarray, np.ndarray]:
    """The run's (x, metric) points where the metric is finite (evaluations are sparse)."""
    points = [
        (row[x], row[metric])
        for row in run.rows
        if math.isfinite(row.get(metric, math.nan)) and math.isfinite(row.get(x, math.nan))
    ]
    array = np.array(points, dtype=np.float64).reshape(-1, 2)
    return array[:, 0], array[:, 1]


def _smoothed(xs: np.ndarray, ys: np.ndarray, window: int) -> tuple[np.ndarray, np.ndarray]:
    """The trailing mean over ``window`` points (fewer at the start)."""
    if window == 1 or len(ys) == 0:
        return xs, ys
    sums = np.cumsum(np.concatenate([[0.0], ys]))
    starts = np.maximum(np.arange(1, len(ys) + 1) - window, 0)
    return xs, (sums[1:] - sums[starts]) / (np.arange(1, len(ys) + 1) - starts)


def _align(series: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """The runs on one x grid, (G,) and (runs, G): their own when they all share it (same
    seeds' env steps), else interpolated over the range every run covers (wall times, or
    a run that stopped early at its target)."""
    first = series[0][0]
    if all(len(xs) == len(first) and np.array_equal(xs, first) for xs, _ in series):
        grid = first
    else:
        start = max(xs[0] for xs, _ in series)
        end = min(xs[-1] for xs, _ in series)
        grid = np.unique(np.concatenate([xs[(xs >= start) & (xs <= end)] for xs, _ in series]))
        if len(grid) == 0:
            grid = np.array([end])
    if len(grid) > GRID_POINTS:
        grid = np.linspace(grid[0], grid[-1], GRID_POINTS)
    return grid, np.stack([np.interp(grid, xs, ys) for xs, ys in series])


def _bootstrap_band(values: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """2.5th and 97.5th percentiles of the mean over runs resampled with replacement;
    values: (runs, G)."""
    runs = len(values)
    if runs == 1:
        return values[0], values[0]
    picks = rng.integers(0, runs, size=(BOOTSTRAP_SAMPLES, runs))
    means = values[picks].mean(axis=1)  # (samples, G)
    low, high = np.percentile(means, [2.5, 97.5], axis=0)
    return low, high


def _flatten(table: dict[str, Any], prefix: str = "", skip: tuple[str, ...] = ()) -> dict:
    flat: dict[str, Any] = {}
    for key, value in table.items():
        if not prefix and key in skip:
            continue
        if isinstance(value, dict) and key != "kwargs":
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _labels(configs: list[dict[str, Any]]) -> list[str]:
    """``<algo> <env>``, plus the settings that tell apart the groups of that algorithm and
    env (a TRPO and a PPO group differ in every preset setting; their names say enough)."""
    flats = [_flatten(c, skip=NOT_GROUPED) for c in configs]
    names = [f"{c.get('algo', '?')} {c.get('env_id', '?')}" for c in configs]
    labels = []
    for name, flat in zip(names, flats, strict=True):
        peers = [f for n, f in zip(names, flats, strict=True) if n == name]
        keys = sorted({k for f in peers for k in f})
        differ = [k for k in keys if len({repr(f.get(k)) for f in peers}) > 1]
        extra = ", ".join(f"{k}={flat.get(k)}" for k in differ[:3])
        more = f", +{len(differ) - 3} more" if len(differ) > 3 else ""
        labels.append(f"{name}: {extra}{more}" if extra else name)
    return labels


def draw_study(points: list[TrialPoint], title: str) -> Figure:
    """A study's trials: each completed trial's
    objective, each pruned trial's last evaluation (hollow), the failed ones as marks
    on the axis, and the best objective so far as a step line."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    figure = Figure(figsize=(8, 5), dpi=100, layout="constrained")
    axes = figure.add_subplot()
    axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    complete = [p for p in points if p.state == "complete"]
    pruned = [p for p in points if p.state == "pruned" and math.isfinite(p.value)]
    failed = [p for p in points if p.state == "failed"]
    if complete:
        axes.plot([p.number for p in complete], [p.value for p in complete], "o", label="completed")
        best, running = [], -math.inf
        for point in points:
            if point.state == "complete":
                running = max(running, point.value)
            best.append(running)
        axes.step(
            [p.number for p in points],
            best,
            where="post",
            color="black",
            linewidth=1.2,
            label="best so far",
        )
    if pruned:
        axes.plot(
            [p.number for p in pruned],
            [p.value for p in pruned],
            "o",
            markerfacecolor="none",
            label="pruned (last evaluation)",
        )
    if failed:
        axes.plot(
            [p.number for p in failed],
            [0.0] * len(failed),
            "x",
            color="red",
            transform=axes.get_xaxis_transform(),
            clip_on=False,
            label="failed",
        )
    axes.set_xlabel("trial")
    axes.set_ylabel("objective (mean of the last evaluations)")
    axes.set_title(title, fontsize=10)
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8, loc="best")
    return figure


def plot_study(
    study_dir: str | Path, out: str | Path | None = None, title: str | None = None
) -> tuple[Path, Figure, list[TrialPoint]]:
    """Draw the trials of the ``trustrl tune`` study in ``study_dir`` into ``out`` (.png
    or .svg; default ``study.png`` in the study folder)."""
    from trustrl.run.tune import study_points

    spec, points = study_points(study_dir)
    if not points:
        raise PlotError(f"{study_dir}: the study has no finished trial yet")
    out = Path(out) if out is not None else Path(study_dir) / "study.png"
    if out.suffix.lower() not in (".png", ".svg"):
        raise PlotError(f"--out must end in .png or .svg, got {out}")
    default_title = (
        f"{spec['algo']} {spec['env_id']}: {len(points)} trials of {spec['budget']:,} env steps"
    )
    figure = draw_study(points, title or default_title)
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out)
    return out, figure, points
