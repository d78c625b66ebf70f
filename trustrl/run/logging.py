"""Where metrics go: the progress file (CSV), TensorBoard, and the live progress bar."""

from __future__ import annotations

import csv
import math
import time
from pathlib import Path
from typing import Any, TextIO

# The two clocks: the only columns that differ between same-seed runs.
TIME_COLUMNS = ("sps", "wall_time")


class ProgressFile:
    """One CSV row per iteration, flushed as written so a killed run keeps its curve."""

    def __init__(self, path: Path, append: bool = False) -> None:
        self.path = path
        self.columns: list[str] | None = None
        if append and path.exists() and path.stat().st_size > 0:
            with path.open(newline="") as handle:
                self.columns = next(csv.reader(handle), None)
        self.handle: TextIO = path.open("a" if append else "w", newline="")
        self.writer = csv.writer(self.handle)

    def write(self, row: dict[str, float]) -> None:
        if self.columns is None:
            self.columns = list(row)
            self.writer.writerow(self.columns)
        self.writer.writerow([_format(row.get(c, math.nan)) for c in self.columns])
        self.handle.flush()

    def close(self) -> None:
        self.handle.close()


def _format(value: float) -> str:
    if isinstance(value, int) or (
        isinstance(value, float) and value.is_integer() and abs(value) < 1e15
    ):
        return str(int(value))
    return repr(float(value))


def truncate_progress(path: Path, last_iteration: int) -> None:
    """Drop rows past ``last_iteration`` (written after the checkpoint a run resumes from)."""
    if not path.exists():
        return
    with path.open(newline="") as handle:
        rows = list(csv.reader(handle))
    if not rows:
        return
    column = rows[0].index("iteration")
    kept = [rows[0]] + [r for r in rows[1:] if float(r[column]) <= last_iteration]
    tmp = path.with_suffix(".tmp")
    with tmp.open("w", newline="") as handle:
        csv.writer(handle).writerows(kept)
    tmp.replace(path)


def read_progress(path: str | Path) -> list[dict[str, float]]:
    with Path(path).open(newline="") as handle:
        return [{k: float(v) for k, v in row.items()} for row in csv.DictReader(handle)]


FLUSH_SECONDS = 5.0


class TensorBoardWriter:
    """TensorBoard events with the same names as the progress file, x = env steps.

    Rows reach the event file every FLUSH_SECONDS and at close; in between they wait
    here, with their wall times. So the writer itself starts at the first flush: importing
    TensorBoard's writer costs about 0.2 s, a tenth of a fast CartPole run, which a run
    that ends sooner pays at its close instead of before its first iteration.
    """

    def __init__(self, folder: Path, purge_step: int | None = None) -> None:
        self.folder = folder
        self.purge_step = purge_step
        self.writer: Any = None
        self.pending: list[tuple[dict[str, float], int, float]] = []
        self.flushed = time.monotonic()

    def write(self, row: dict[str, float], step: int) -> None:
        self.pending.append((row, step, time.time()))
        # A flush waits for the writer thread, a real share of a fast CartPole run's
        # iteration (docs/performance.md). Every FLUSH_SECONDS and at close is enough for a live
        # TensorBoard; a resume purges events past its checkpoint anyway.
        if time.monotonic() - self.flushed >= FLUSH_SECONDS:
            self.flush()

    def flush(self) -> None:
        if self.writer is None:
            # Heavy: imported where used.
            from tensorboard.compat.proto.summary_pb2 import Summary
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(self.folder), purge_step=self.purge_step)
            self.summary = Summary
        file_writer = self.writer.file_writer  # created by the constructor
        for row, step, wall_time in self.pending:
            # One event holding every scalar of the row, the form add_scalar gives each
            # one (simple_value): one protobuf per iteration instead of one per metric,
            # which cost a fast CartPole run 5% of its time.
            values = [
                self.summary.Value(tag=key, simple_value=value)
                for key, value in row.items()
                if isinstance(value, int | float) and math.isfinite(value)
            ]
            file_writer.add_summary(self.summary(value=values), step, wall_time)
        self.pending.clear()
        self.writer.flush()
        self.flushed = time.monotonic()

    def close(self) -> None:
        self.flush()
        self.writer.close()


PLAIN_SECONDS = 10.0
"""Seconds between plain progress lines when the output is not a terminal."""


class ProgressBar:
    """Env steps, steps per second, recent episode return, elapsed time and time left.

    On a terminal, a live bar; otherwise (a pipe, a file, a CI log) a plain line every
    PLAIN_SECONDS, which a log keeps whole. ``close`` ends either with what happened.
    """

    def __init__(
        self, total_steps: int, description: str, enabled: bool = True, stream: Any = None
    ) -> None:
        self.enabled = enabled
        self.total = total_steps
        self.description = description
        self.steps, self.sps, self.ret = 0, "-", "-"
        self.started = time.monotonic()
        self.printed = -math.inf
        self.live = False
        if not enabled:
            return
        from rich.console import Console

        self.console = Console(file=stream, highlight=False)
        self.live = self.console.is_terminal
        if not self.live:
            return
        from rich.progress import (
            BarColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self.progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(bar_width=16),
            TextColumn("{task.completed:,}/{task.total:,} steps"),
            TextColumn("{task.fields[sps]} sps"),
            TextColumn("return {task.fields[ret]}"),
            TextColumn("elapsed"),
            TimeElapsedColumn(),
            TextColumn("left"),
            TimeRemainingColumn(),
            console=self.console,
            refresh_per_second=4,
        )
        self.task = self.progress.add_task(description, total=total_steps, sps="-", ret="-")
        self.progress.start()

    def update(self, env_steps: int, sps: float, recent_return: float | None) -> None:
        if not self.enabled:
            return
        self.steps, self.sps = env_steps, f"{sps:,.0f}"
        self.ret = f"{recent_return:.1f}" if recent_return is not None else "-"
        if self.live:
            self.progress.update(self.task, completed=env_steps, sps=self.sps, ret=self.ret)
        elif env_steps > 0 and time.monotonic() - self.printed >= PLAIN_SECONDS:
            self.printed = time.monotonic()
            self.console.print(self._line(), soft_wrap=True)

    def _line(self) -> str:
        elapsed = time.monotonic() - self.started
        return (
            f"{self.description}: {self.steps:,}/{self.total:,} steps, {self.sps} sps, "
            f"return {self.ret}, elapsed {_clock(elapsed)}"
        )

    def close(self, env_steps: int | None = None, outcome: str | None = None) -> None:
        """Stop the display; with ``outcome``, finish it saying what happened (a run that
        stopped early shows where, not a bar frozen part way)."""
        if not self.enabled:
            return
        if self.live:
            if env_steps is not None:
                self.progress.update(self.task, completed=env_steps, total=max(env_steps, 1))
            self.progress.stop()
        if outcome:
            steps = self.steps if env_steps is None else env_steps
            elapsed = _clock(time.monotonic() - self.started)
            self.console.print(
                f"{self.description}: {outcome} ({steps:,} of {self.total:,} planned steps, "
                f"elapsed {elapsed})",
                soft_wrap=True,
            )

    def print(self, *objects: Any) -> None:
        """Plain text above the bar (no rich markup: "[iteration 3] ..." stays as it is)."""
        if self.enabled:
            self.console.print(*objects, soft_wrap=True, markup=False)


def _clock(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}"
