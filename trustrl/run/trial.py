"""One trial of a ``trustrl tune`` study: a short training run with periodic deterministic
evaluations, reported as they come.

A trial is a ``Trainer`` run trained in slices (``train(iterations=...)`` pauses with a
checkpoint, and a ``Trainer(..., resume=True)`` continues it bit for bit), one slice per
evaluation, so that the study can read each evaluation from ``progress.csv`` and stop a
bad trial between two slices without a hook in the trainer's loop. Its events
(``Evaluation``, then one ``Ended``) come from ``trial_events`` wherever the trial runs:
in this process, in a fresh interpreter (``Subprocesses``, ``python -m trustrl.run.trial``,
one JSON line per event), or as a Ray task (``trustrl.remote.tune``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

from trustrl.config import Config, ConfigError, resolve
from trustrl.run.logging import read_progress

EVALUATIONS = 10
"""Evaluations per trial, at most (5 to 10, and one at the end). A trial's evaluation
after iteration i reports at step floor(EVALUATIONS * i / iterations), the tenths of its
budget it has trained, so that the pruner compares trials of different batch sizes at
the same point of their budgets; evaluating every ceil(iterations / EVALUATIONS)
iterations gives each evaluation a step of its own."""


@dataclass(frozen=True)
class TrialJob:
    """What one trial trains: the env's preset for the algorithm with ``overrides`` (the
    sampled values and the trial's own settings: seed, budget, folder), in ``run_dir``."""

    env_id: str
    algo: str
    overrides: dict[str, Any]
    run_dir: str
    number: int = 0
    """The trial's number in its study (for messages)."""

    def config(self) -> Config:
        """The trial's config, evaluating every ``iterations / EVALUATIONS`` iterations
        (rounded up) and checkpointing only where a slice pauses and at the end."""
        config = resolve(self.env_id, self.algo, overrides=self.overrides)
        iterations = config.num_iterations
        every = max(1, math.ceil(iterations / EVALUATIONS))
        return dataclasses.replace(config, eval_every=every, checkpoint_every=iterations + 1)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TrialJob:
        return cls(**data)


@dataclass(frozen=True)
class Evaluation:
    """A deterministic evaluation of a trial's policy."""

    step: int
    """Tenths of the trial's budget trained when it ran (1 to EVALUATIONS)."""
    value: float
    """Mean return over the evaluation's episodes."""
    env_steps: int


@dataclass(frozen=True)
class Ended:
    """How a trial ended: it trained its budget, failed (a config its values make
    invalid, or a run that could not go on: ``message`` says which), or was interrupted."""

    outcome: Literal["finished", "failed", "interrupted"]
    message: str = ""
    interrupt: bool = False
    """A Ctrl-C landed in the iteration that finished the trial: it counts, and the
    study stops after it."""


Event = Evaluation | Ended
Launcher = Callable[[TrialJob], Generator[Event, None, None]]
"""Runs a trial somewhere and yields its events; closing the iterator stops the trial."""


def event_to_json(event: Event) -> dict[str, Any]:
    kind = "evaluation" if isinstance(event, Evaluation) else "ended"
    return {kind: dataclasses.asdict(event)}


def event_from_json(data: dict[str, Any]) -> Event:
    if "evaluation" in data:
        return Evaluation(**data["evaluation"])
    return Ended(**data["ended"])


class StopFlag(Protocol):
    """Asked between two slices whether the trial should stop (``threading.Event``)."""

    def is_set(self) -> bool: ...


def trial_events(job: TrialJob, stop: StopFlag | None = None) -> Generator[Event, None, None]:
    """Train the trial slice by slice and yield each evaluation, then how it ended.

    ``stop`` set between two slices ends it as interrupted, as does a Ctrl-C during a
    slice (the trainer checkpoints at the iteration's end). A config error and a
    ``TrainingError`` end it as failed; anything else is raised. (Itself the launcher of
    trials in this process.)"""
    # Imported here: a study whose trials run elsewhere never loads torch.
    from trustrl.run.trainer import Trainer, TrainingError

    try:
        config = job.config()
        iterations = config.num_iterations
        trainer = Trainer(config, job.run_dir, overwrite=True)
        reported = 0  # iterations whose evaluations were yielded
        while True:
            if stop is not None and stop.is_set():
                yield Ended("interrupted")
                return
            trainer.train(iterations=config.eval_every)
            if trainer.interrupted:
                yield Ended("interrupted")
                return
            for row in read_progress(Path(job.run_dir) / "progress.csv"):
                value, iteration = row.get("eval_return_mean", math.nan), int(row["iteration"])
                if iteration > reported and math.isfinite(value):
                    step = EVALUATIONS * iteration // iterations
                    yield Evaluation(step, value, int(row["env_steps"]))
                    reported = iteration
            if trainer.env_steps >= config.total_steps:
                if reported < trainer.iteration and trainer.eval_result is not None:
                    result = trainer.eval_result.mean_return
                    yield Evaluation(EVALUATIONS, result, trainer.env_steps)
                yield Ended("finished", interrupt=trainer.interrupt_requested)
                return
            trainer = Trainer(config, job.run_dir, resume=True)
    except (ConfigError, TrainingError) as exc:
        yield Ended("failed", str(exc))
    except KeyboardInterrupt:
        yield Ended("interrupted")


@dataclass
class InProcess:
    """Each trial in this process, one at a time (``--jobs 1``). ``stop`` takes effect
    between two slices; during one, Ctrl-C is the trainer's own."""

    stop_requested: threading.Event = field(default_factory=threading.Event)

    def __call__(self, job: TrialJob) -> Generator[Event, None, None]:
        return trial_events(job, self.stop_requested)

    def stop(self) -> None:
        self.stop_requested.set()


@dataclass
class Subprocesses:
    """Each trial in a fresh interpreter (``python -m trustrl.run.trial``: fork and exec,
    safe beside threads), in a session of its own so that a terminal's Ctrl-C reaches the
    study alone, which passes it on once (``stop``). The child reads its job from its
    standard input and exits at once when that closes (the study's process is gone);
    its events come back one JSON line each, its stderr goes to ``<run_dir>.log``."""

    children: set[subprocess.Popen[str]] = field(default_factory=set)
    stopping: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __call__(self, job: TrialJob) -> Generator[Event, None, None]:
        log_path = Path(job.run_dir).with_suffix(".log")
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with log_path.open("w") as log:
            child = subprocess.Popen(
                [sys.executable, "-m", "trustrl.run.trial"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                start_new_session=True,
            )
        with self.lock:
            self.children.add(child)
            if self.stopping:  # started as the study was interrupted
                child.send_signal(signal.SIGINT)
        try:
            yield from self._events(child, job, log_path)
        finally:
            with self.lock:
                self.children.discard(child)
            if child.poll() is None:
                child.kill()
            child.wait()
            for pipe in (child.stdin, child.stdout):
                if pipe is not None:
                    pipe.close()

    def _events(
        self, child: subprocess.Popen[str], job: TrialJob, log_path: Path
    ) -> Iterator[Event]:
        assert child.stdin is not None and child.stdout is not None
        child.stdin.write(json.dumps(job.to_json()) + "\n")
        child.stdin.flush()
        for line in child.stdout:
            event = event_from_json(json.loads(line))
            yield event
            if isinstance(event, Ended):
                child.wait()
                return
        code = child.wait()
        if self.stopping:
            yield Ended("interrupted")
        else:
            yield Ended("failed", f"the trial's process exited with code {code}; see {log_path}")

    def stop(self) -> None:
        """Interrupt every running trial (each checkpoints at its iteration's end)."""
        with self.lock:
            self.stopping = True
            for child in self.children:
                if child.poll() is None:
                    child.send_signal(signal.SIGINT)


class _InterruptSeen:
    """Whether a SIGINT reached this process, whichever Python handler took it: the
    trainer's during a slice (one that lands as a slice ends is taken there and not acted
    on), or this process's own between slices. Each signal's number is written to a
    wakeup pipe (``signal.set_wakeup_fd``; this child's process is its own) before any
    handler runs."""

    def __init__(self) -> None:
        self.pipe, write = os.pipe()
        os.set_blocking(self.pipe, False)
        os.set_blocking(write, False)
        signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        self.seen = False

    def is_set(self) -> bool:
        with contextlib.suppress(BlockingIOError):
            while data := os.read(self.pipe, 512):
                self.seen = self.seen or signal.SIGINT in data
        return self.seen


def _exit_when_stdin_closes() -> None:
    """The study's process holds this child's standard input open while it waits for its
    events; when it closes (the study was killed), nobody will read them: exit now."""
    sys.stdin.read()
    os._exit(1)


def main() -> int:
    """A trial in this process for ``Subprocesses``: the job on the first line of stdin,
    the events on stdout."""
    job = TrialJob.from_json(json.loads(sys.stdin.readline()))
    threading.Thread(target=_exit_when_stdin_closes, daemon=True).start()
    stop = _InterruptSeen()
    # Between slices a SIGINT only asks to stop (read by ``stop``); during one, the
    # trainer's own handler checkpoints at the iteration's end.
    signal.signal(signal.SIGINT, lambda signum, frame: None)
    # The events keep standard output to themselves; anything else printed there (the
    # trainer's interrupt note) goes to the log with stderr.
    with os.fdopen(os.dup(sys.stdout.fileno()), "w") as events:
        sys.stdout.flush()
        os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
        for event in trial_events(job, stop):
            print(json.dumps(event_to_json(event)), file=events, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
