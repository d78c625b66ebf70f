"""``trustrl tune --ray-address ADDR``: a study's trials as Ray tasks on a cluster.

Each trial is one Ray task of one CPU, a generator (``run/trial.py``'s ``trial_events``)
whose evaluations stream back to the study's process as they come, so that the study
alone writes its SQLite database and prunes between two evaluations by cancelling the
task. The nodes need trustrl installed; a trial's run folder is written on the node that
ran it (its path is the study's, so a shared file system keeps them together).
"""

from __future__ import annotations

import threading
from collections.abc import Generator
from types import TracebackType
from typing import Any

from trustrl.remote.cluster import RayCluster, import_ray
from trustrl.run.trial import Ended, Event, TrialJob, trial_events

# One thread per trial task: torch's and the BLAS's (torch_threads does the rest).
THREAD_VARS = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}


def _trial_task(job: TrialJob) -> Generator[Event, None, None]:
    """The trial in a Ray worker; its events stream back one object each."""
    yield from trial_events(job)


class RayTrials:
    """Launch trials as Ray tasks; a context manager that joins the cluster at
    ``ray_address`` (None: starts a private loopback instance, as ``RayCluster`` does)
    and leaves it at the end. ``stop`` cancels the running trials."""

    def __init__(self, ray_address: str | None, *, num_cpus: int | None = None) -> None:
        self.cluster = RayCluster(ray_address, num_cpus=num_cpus, env_vars=THREAD_VARS)
        self.running: set[Any] = set()
        self.stopping = False
        self.lock = threading.Lock()
        self._task: Any = None

    def __enter__(self) -> RayTrials:
        self.cluster.start()
        ray = import_ray()
        self._task = ray.remote(num_cpus=1, max_retries=0)(_trial_task)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.cluster.shutdown()

    def __call__(self, job: TrialJob) -> Generator[Event, None, None]:
        if self._task is None:
            raise RuntimeError("RayTrials launches trials inside its `with` block")
        ray = import_ray()
        stream = self._task.remote(job)
        with self.lock:
            self.running.add(stream)
            if self.stopping:  # submitted as the study was interrupted
                ray.cancel(stream, force=True)
        ended = False
        try:
            for ref in stream:
                event = ray.get(ref)
                yield event
                if isinstance(event, Ended):
                    ended = True
                    return
            yield Ended("failed", "the trial's Ray task ended without saying how")
        except ray.exceptions.RayError as exc:
            if self.stopping:
                yield Ended("interrupted")
            else:
                yield Ended("failed", f"the trial's Ray task failed: {exc}")
        finally:
            with self.lock:
                self.running.discard(stream)
            if not ended:  # pruned or stopped: the task is still training
                ray.cancel(stream, force=True)

    def stop(self) -> None:
        """Cancel every running trial (a resume runs them again)."""
        ray = import_ray()
        with self.lock:
            self.stopping = True
            for stream in self.running:
                ray.cancel(stream, force=True)
