"""The training loop: collect -> advantages -> update -> log -> checkpoint.

The trainer never branches on the algorithm: it calls the update registered for
``config.algo`` (see learner/updates/registry.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import math
import os
import shutil
import signal
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np
import tomli_w
import torch
from threadpoolctl import threadpool_limits

from trustrl.acting.collector import make_collector
from trustrl.config import Config, config_from_dict, config_to_dict
from trustrl.contract import CollectionStopped, EpisodeStats, PolicySnapshot, RolloutBatch, Runner
from trustrl.envs.rows import AgentGroup, NonFiniteError
from trustrl.learner.policy import MultiAgentPolicy, Policy
from trustrl.learner.rollout import Rollout
from trustrl.learner.updates.device import learner_device
from trustrl.learner.updates.registry import make_update
from trustrl.learner.warn import WarningHandler, warnings_to
from trustrl.run.checkpoint import (
    BackgroundWriter,
    CheckpointError,
    differences,
    load_checkpoint,
    prune,
    read_env_state,
    set_latest,
    snapshot,
    write_atomic,
    write_snapshot,
)
from trustrl.run.evaluation import EvalResult, evaluate
from trustrl.run.logging import ProgressBar, ProgressFile, TensorBoardWriter, truncate_progress


def default_run_dir(config: Config) -> Path:
    name = config.env_id.replace(":", "_").replace("/", "_")
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    return Path("runs") / f"{name}__{config.algo}__{config.seed}__{stamp}"


def check_writable(folder: Path) -> None:
    """Fail at start, not at the first checkpoint, when the run folder cannot be written."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / ".write-test"
        probe.write_text("ok")
        probe.unlink()
    except OSError as exc:
        raise CheckpointError(
            f"run folder {folder} is not writable: {exc.strerror or exc}"
        ) from None


@contextlib.contextmanager
def _set_aside_from_gc() -> Iterator[None]:
    """Leave the objects alive now out of the cyclic garbage collector's scans for the
    block (``gc.freeze``, then ``gc.unfreeze``).

    They are nearly all the imported modules' (torch alone brings about a million), and a
    full scan of them would otherwise land in the first iterations of every run. Objects
    still free themselves by reference counting; only cycles among them wait for the
    unfreeze. Where the caller froze objects already, they are the caller's to unfreeze:
    nothing is done.
    """
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


@contextlib.contextmanager
def _threads(count: int) -> Iterator[None]:
    """torch's intra-op threads and numpy's BLAS threads (the collector's inference and
    the numpy gradients) at ``count`` for the block, then back to what they were.

    OpenBLAS otherwise starts a thread per core even for 128 x 64 matmuls, several times
    slower; and the thread count in force when the weights are initialised is part of what
    the seed decides.
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        with threadpool_limits(count, user_api="blas"):
            yield
    finally:
        torch.set_num_threads(previous)


RUN_FILES = ("config.toml", "config_history.json", "progress.csv", "eval.json")
RUN_FOLDERS = ("checkpoints", "tensorboard")
FAILED_UPDATES_LIMIT = 3
"""Iterations in a row without one successful update step after which a run stops."""
LOSSES = ("loss_pi", "loss_v")
"""Every update reports these; both non-finite: no step of the iteration succeeded."""


class TrainingError(RuntimeError):
    """A run that cannot go on; the message says why and what was kept."""


@dataclass(frozen=True)
class Collected:
    """What ``Trainer.collect`` brought back and measured."""

    rollouts: list[Rollout]  # one per agent group, statistics merged, ready to update on
    episodes: EpisodeStats  # the episodes that ended during the rollout
    env_steps: int  # env steps taken (steps x envs)
    version_lag: int  # updates the learner made since the policy that acted


@dataclass(frozen=True)
class _Outputs:
    """Where a ``train`` call reports each iteration."""

    progress_file: ProgressFile
    tensorboard: TensorBoardWriter
    bar: ProgressBar


def whole_iterations(config: Config) -> tuple[Config, str | None]:
    """``config`` with total_steps rounded up to whole iterations, and a note saying so
    (None when it already was): the bar, config.toml and progress.csv then agree."""
    steps = config.num_iterations * config.batch_size
    if steps == config.total_steps:
        return config, None
    note = (
        f"total_steps {config.total_steps:,} rounded up to {steps:,}: whole iterations of "
        f"{config.env.num_envs} envs x {config.rollout.num_steps} steps"
    )
    return dataclasses.replace(config, total_steps=steps), note


BEFORE_RUN = ("agents.json", ".agents.json.lock")
"""What a new run's folder may hold already: the agents a gateway will let in, added
before the learner starts (``trustrl agents add``, remote/credentials.py)."""


def check_new_run_folder(folder: Path, overwrite: bool) -> None:
    """A new run starts in a missing or empty folder; ``overwrite`` allows one that holds
    an earlier run (its run files are removed) or other files (left as they are)."""
    if not folder.exists():
        return
    if not folder.is_dir():
        raise CheckpointError(f"run folder {folder} is a file")
    entries = sorted(p.name for p in folder.iterdir() if p.name not in BEFORE_RUN)
    if not entries or overwrite:
        return
    shown = ", ".join(entries[:5]) + (", ..." if len(entries) > 5 else "")
    if (folder / "config.toml").is_file() or (folder / "checkpoints").is_dir():
        raise CheckpointError(
            f"run folder {folder} already holds a run ({shown}); continue it with "
            f"`trustrl train --resume {folder}`, choose a new --run-dir, or pass --overwrite "
            "to replace it"
        )
    raise CheckpointError(
        f"run folder {folder} is not empty and is not a trustrl run ({shown}); choose a new "
        "--run-dir, or pass --overwrite to write the run files into it anyway"
    )


def remove_run_files(folder: Path) -> None:
    """What an earlier run wrote into ``folder`` (and nothing else)."""
    for name in RUN_FILES:
        (folder / name).unlink(missing_ok=True)
    for name in RUN_FOLDERS:
        if (folder / name).is_dir() and not (folder / name).is_symlink():
            shutil.rmtree(folder / name)


class Trainer:
    """One run: ``Trainer(config).train()``; ``resume=True`` continues the run in
    ``run_dir`` from its newest checkpoint.

    A new run refuses a run folder that is not empty unless ``overwrite``. A resume
    restores the environments mid-episode where their state was saved as arrays;
    environments saved only as a pickle are unpickled with ``trust_env_state`` alone
    (unpickling runs code from the run folder), and otherwise start fresh episodes.
    """

    def __init__(
        self,
        config: Config,
        run_dir: str | Path | None = None,
        resume: bool = False,
        *,
        overwrite: bool = False,
        trust_env_state: bool = False,
        runner: Runner | None = None,
    ) -> None:
        config, note = whole_iterations(config)
        self.notes = [note] if note else []
        """What the run changed or chose that its user should hear (printed unless quiet)."""
        self.config = config
        self.run_dir = Path(run_dir or config.run_dir or default_run_dir(config))
        if not resume:
            check_new_run_folder(self.run_dir, overwrite)
        # The seed and the thread count in force while the weights are initialised decide
        # them; the caller's thread counts are back on return (``train`` sets them again).
        with _threads(config.torch_threads):
            torch.manual_seed(config.seed)
            # Where the envs run: this process, or Ray runners (the same collector in
            # actors); or a runner given by the caller (external agents' chunks).
            self.collector: Runner = runner if runner is not None else _make_runner(config)
            self.groups = self.collector.groups
            self.policies = build_policies(config, self.groups)
            # One group (every single-agent env) is the Policy itself; several groups act
            # together as one MultiAgentPolicy, which is what checkpoints and users see.
            self.policy: Policy | MultiAgentPolicy = (
                self.policies[0]
                if len(self.groups) == 1 and self.groups[0].agents == ("",)
                else MultiAgentPolicy(self.groups, self.policies)
            )
            self.device = learner_device(config.device, self.policies)
            self.updates = [make_update(config, p, self.device) for p in self.policies]
        if self.device.type != "cpu":
            self.notes.append(
                f"the update runs on {self.device.type} ({torch.cuda.get_device_name()}); "
                "acting on the CPU"
            )
        self.agent_names = [a for g in self.groups for a in g.agents if a]
        # After the envs: a bad env id or space leaves no empty run folder behind.
        if overwrite and not resume and self.run_dir.is_dir():
            remove_run_files(self.run_dir)
        check_writable(self.run_dir)
        self.iteration = 0
        self.env_steps = 0
        self.wall_time = 0.0
        self.eval_result: EvalResult | None = None
        self.interrupted = False
        self.interrupt_requested = False
        """A Ctrl-C came during the last ``train`` call: it paused the run (``interrupted``),
        or landed in the iteration that ended it (the run finished all the same)."""
        self.outcome = ""
        """How the last ``train`` call ended, in words (finished, solved: ..., paused...)."""
        self.recent_returns: list[float] = []
        self.envs_restored = False
        self.config_changes: dict[str, list[Any]] = {}
        """On resume: the fields that differ from the checkpoint's config, [old, new]."""
        self.failed_updates = 0
        self.checkpoint_writer = BackgroundWriter()
        if resume:
            self._restore(trust_env_state)

    # State for checkpoints.

    def training_state(self) -> dict[str, Any]:
        return {
            "updates": [update.state_dict() for update in self.updates],
            "collector": self.collector.state_dict(),
            "torch_rng": torch.get_rng_state(),
            "recent_returns": list(self.recent_returns),
        }

    def save(self, name: str, background: bool = False) -> Path:
        """Checkpoint the run as ``checkpoints/<name>``. With ``background``, the files are
        written on the checkpoint thread while training goes on (the state is copied
        first); otherwise the checkpoint is complete on return. Either way a checkpoint
        waits for the one before it."""
        checkpoints = self.run_dir / "checkpoints"
        meta = {
            "config": config_to_dict(self.config),
            "iteration": self.iteration,
            # Weights change once per iteration: the version travels with rollouts later.
            "policy_version": self.iteration,
            "env_steps": self.env_steps,
            "wall_time": self.wall_time,
        }
        training, env_state = self.training_state(), self.collector.capture()
        if isinstance(env_state, dict):  # arrays: part of the training state
            training["env"], env_state = env_state, None
        state = snapshot(self.policy, meta, training, env_state)
        folder, keep = checkpoints / name, self.config.checkpoint_keep

        collector_state = training["collector"]

        def write() -> None:
            write_snapshot(folder, state)
            set_latest(checkpoints, name)
            prune(checkpoints, keep)
            self.collector.checkpointed(collector_state)

        self.checkpoint_writer.submit(write)
        if not background:
            self.checkpoint_writer.wait()
        return folder

    def _restore(self, trust_env_state: bool) -> None:
        folder, meta, policy, state = load_checkpoint(self.run_dir)
        saved = config_from_dict(meta["config"])
        if saved.env_id != self.config.env_id or saved.algo != self.config.algo:
            raise CheckpointError(
                f"{self.run_dir} holds a {saved.algo} run on {saved.env_id}, not "
                f"{self.config.algo} on {self.config.env_id}"
            )
        done = meta["env_steps"]
        if self.config.total_steps <= done:
            raise CheckpointError(
                f"{self.run_dir} has trained {done:,} env steps already; total_steps "
                f"{self.config.total_steps:,} leaves nothing to train (give --total-steps "
                f"above {done:,} to train on)"
            )
        differs = differences(policy.describe(), self.policy.describe())
        if differs:
            raise CheckpointError(
                f"{self.run_dir} holds a policy that differs from this config's: "
                f"{', '.join(differs)}"
            )
        self.config_changes = config_changes(saved, self.config)
        self.policy.load_state_dict(policy.state_dict())
        for update, update_state in zip(self.updates, state["updates"], strict=True):
            update.load_state_dict(update_state)
        torch.set_rng_state(state["torch_rng"])
        self.recent_returns = list(state["recent_returns"])
        self.iteration = meta["iteration"]
        self.env_steps = done
        self.wall_time = meta["wall_time"]
        self._restore_envs(folder, meta, state, trust_env_state)

    def _restore_envs(
        self, folder: Path, meta: dict[str, Any], state: dict[str, Any], trust_env_state: bool
    ) -> None:
        """The runner's state from checkpoint ``folder``, its envs mid-episode where their
        state was saved as arrays (or as a pickle, with ``trust_env_state``), otherwise
        fresh episodes."""
        env_state = state.get("env")
        pickled = meta.get("env_state")
        if env_state is None and pickled and trust_env_state:
            path = folder / pickled.get("file", "?")
            warnings.warn(
                f"--trust-env-state: unpickling {path}, which runs any code the file names; "
                f"do this only for a run folder you made or trust",
                UserWarning,
                stacklevel=4,
            )
            env_state = read_env_state(folder, meta)
        elif env_state is None and pickled:
            self.notes.append(
                f"the environments' state in {folder} is a pickle, which is not loaded "
                "without --trust-env-state (unpickling runs code from the run folder)"
            )
        if env_state is not None:
            try:
                self.collector.load_state_dict(state["collector"], env_state)
            except (ValueError, KeyError, TypeError) as exc:
                raise CheckpointError(
                    f"{folder}: the saved environment state does not fit this env ({exc})"
                ) from None
            self.envs_restored = True
        else:
            # Not captured (e.g. subprocess envs): fresh episodes, seeded apart from the
            # ones the run began with.
            self.collector.load_state_dict(state["collector"])
            self.collector.reset(self.config.seed + self.iteration)
            self.envs_restored = False

    # The loop.

    def train(self, iterations: int | None = None) -> Policy | MultiAgentPolicy:
        """Train to the end of the run, or pause after ``iterations`` more iterations with a
        checkpoint (a later ``Trainer(config, run_dir, resume=True).train()`` continues).

        The run's thread counts (``torch_threads``, for torch and numpy's BLAS) and the
        objects alive at the start set aside from the garbage collector hold until it
        returns; however it returns, they are the caller's again."""
        cfg = self.config
        with _threads(cfg.torch_threads):
            with _set_aside_from_gc():
                ended = self._train(iterations)
            if ended and cfg.eval_episodes > 0:
                if self.eval_result is None:
                    self.eval_result = self.evaluate()
                (self.run_dir / "eval.json").write_text(_json(self.eval_result.to_json()))
        return self.policy

    def _train(self, iterations: int | None) -> bool:
        """``train``'s iterations, with the files, bar and interrupt handler they use, each
        closed on return, as are the runner and the updates. True when the run ended
        (finished or solved), False when it paused, stopped or was interrupted."""
        cfg = self.config
        pause_at = math.inf if iterations is None else self.iteration + iterations
        with contextlib.ExitStack() as stack:
            for update in self.updates:
                stack.callback(update.close)
            stack.callback(self.collector.close)
            resumed = self._write_run_files()
            progress_file = ProgressFile(self.run_dir / "progress.csv", append=resumed)
            stack.callback(progress_file.close)
            # A resume hides the events written after its checkpoint (TensorBoard drops
            # those from purge_step on), and keeps the checkpoint's own row.
            purge_step = self.env_steps + 1 if resumed else None
            tensorboard = TensorBoardWriter(self.run_dir / "tensorboard", purge_step=purge_step)
            stack.callback(tensorboard.close)
            bar = ProgressBar(cfg.total_steps, cfg.env_id, enabled=not cfg.quiet)
            stack.callback(lambda: bar.close(self.env_steps, self.outcome))
            stop = _StopOnInterrupt(self.collector.stop)
            stack.callback(stop.restore)
            # Closed first: the last checkpoint is on disk (or its error raised) while the
            # runner it reports to is still open.
            stack.callback(self.checkpoint_writer.close)
            ended = self._iterate(pause_at, stop, _Outputs(progress_file, tensorboard, bar))
        # Read once the handler is gone: a Ctrl-C can land while the pause's checkpoint is
        # still being written (closed above), after the loop decided to pause.
        self.interrupt_requested = stop.requested
        self.interrupted = stop.requested and not ended
        if self.interrupted:
            self.outcome = "interrupted"
        return ended

    def _write_run_files(self) -> bool:
        """The run folder's config.toml and config history, and on resume its progress file
        cut back to the checkpoint; whether this continues a run."""
        resumed = self.iteration > 0
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if self.config_changes:
            record_config_changes(
                self.run_dir / "config_history.json",
                self.iteration,
                self.env_steps,
                self.config_changes,
            )
            self.config_changes = {}
        write_atomic(self.run_dir / "config.toml", tomli_w.dumps(config_to_dict(self.config)))
        if resumed:
            truncate_progress(self.run_dir / "progress.csv", self.iteration)
        return resumed

    def _iterate(self, pause_at: float, stop: _StopOnInterrupt, out: _Outputs) -> bool:
        """Iterations, each logged, until the run ends (True, with the final checkpoint) or
        pauses, stops or is interrupted between two (False, with a checkpoint)."""
        cfg = self.config
        for note in self.notes:
            out.bar.print(f"note: {note}")
        self.notes = []
        out.bar.update(self.env_steps, 0.0, None)
        self.outcome = "stopped by an error"
        run_start = time.perf_counter() - self.wall_time
        session_start, session_from = time.perf_counter(), self.env_steps
        warn = self._warning_handler(out.bar)
        while self.env_steps < cfg.total_steps:
            if stop.requested or self.iteration >= pause_at:
                self._pause(stopped=False)
                return False
            try:
                row, evaluation = self.run_iteration(warn)
            except CollectionStopped:  # nothing collected: the runner stopped waiting
                self._pause(stopped=True)
                return False
            now = time.perf_counter()
            self.wall_time = now - run_start
            sps = (self.env_steps - session_from) / max(now - session_start, 1e-9)
            row.update(sps=sps, wall_time=self.wall_time)
            out.progress_file.write(row)
            out.tensorboard.write(row, self.env_steps)
            out.bar.update(self.env_steps, sps, self.recent_mean)
            self._check_failed_updates()
            if self.iteration % cfg.checkpoint_every == 0:
                self.save(f"iter_{self.iteration:08d}", background=True)
            if self._solved(evaluation):
                break
        else:
            self.outcome = "finished"
        self.save("final")
        return True

    def run_iteration(
        self, warn: WarningHandler | None = None
    ) -> tuple[dict[str, float], EvalResult | None]:
        """One iteration: collect, update, evaluate where due. Returns the progress row
        (every column but the clocks, ``sps`` and ``wall_time``) and the evaluation if one
        ran. The update's warnings go to ``warn`` where given. Raises ``CollectionStopped``
        (nothing changed) where the runner stopped before it had a batch."""
        cfg = self.config
        progress = self.env_steps / cfg.total_steps
        iteration_start = time.perf_counter()
        try:
            collected = self.collect()
        except NonFiniteError as exc:
            raise TrainingError(f"{exc}; {self._last_checkpoint_note()}") from None
        update_start = time.perf_counter()
        with warnings_to(warn) if warn is not None else contextlib.nullcontext():
            metrics = self._update(progress, collected.rollouts)
        update_seconds = time.perf_counter() - update_start
        failed = not any(math.isfinite(metrics.get(k, math.nan)) for k in LOSSES)
        self.failed_updates = self.failed_updates + 1 if failed else 0
        self.iteration += 1
        self.env_steps += collected.env_steps
        self.recent_returns = (self.recent_returns + collected.episodes.returns)[-20:]
        evaluation = self._periodic_eval(self.recent_mean)
        row = {
            "iteration": float(self.iteration),
            "env_steps": float(self.env_steps),
            **episode_metrics(collected.episodes, self.agent_names),
            **metrics,
            "eval_return_mean": evaluation.mean_return if evaluation else math.nan,
            **self._runner_metrics(collected.version_lag, update_seconds, iteration_start),
        }
        return row, evaluation

    @property
    def recent_mean(self) -> float | None:
        """The mean return of the last 20 episodes (None before the first ended)."""
        return float(np.mean(self.recent_returns)) if self.recent_returns else None

    def _warning_handler(self, bar: ProgressBar) -> WarningHandler:
        """An update's warnings, tagged with the iteration: on the bar, or where the run is
        quiet through ``warnings.warn`` (the caller's warning filters decide)."""

        def show(message: str, category: type[Warning]) -> None:
            text = f"[iteration {self.iteration + 1}] warning: {message}"
            if self.config.quiet:
                warnings.warn(text, category, stacklevel=3)
            else:
                bar.print(text)

        return show

    def _pause(self, stopped: bool) -> None:
        """Checkpoint between two iterations (a Ctrl-C lands there, so the checkpoint is a
        clean boundary) and say why the run paused: stopped (the runner gave up waiting:
        external agents' ``stop``) or paused after the iterations asked for; a Ctrl-C is
        read once the handler is gone (``_train``), which then names it interrupted."""
        self.save(f"iter_{self.iteration:08d}")
        self.outcome = "stopped" if stopped else "paused"

    def _check_failed_updates(self) -> None:
        if self.failed_updates >= FAILED_UPDATES_LIMIT:
            raise TrainingError(
                f"no update step succeeded in the last {self.failed_updates} "
                f"iterations (every minibatch step had a non-finite loss or gradient; "
                f"see nonfinite_skips in {self.run_dir / 'progress.csv'}): stopping at "
                f"iteration {self.iteration}; {self._last_checkpoint_note()}"
            )

    def _solved(self, evaluation: EvalResult | None) -> bool:
        """Whether ``evaluation`` reached the target return (then the run ends with it)."""
        target = self.config.target_return
        if evaluation is None or target is None or evaluation.mean_return < target:
            return False
        self.eval_result = evaluation
        self.outcome = (
            f"solved: evaluation mean {evaluation.mean_return:.1f} >= {target:g} "
            f"after {self.env_steps:,} env steps"
        )
        return True

    def _last_checkpoint_note(self) -> str:
        self.checkpoint_writer.wait()  # the one in flight counts, once it is on disk
        checkpoints = self.run_dir / "checkpoints"
        latest = checkpoints / "latest"
        if latest.is_file():
            return f"the last good checkpoint is {checkpoints / latest.read_text().strip()}"
        return "no checkpoint was written"

    def collect(self) -> Collected:
        """One rollout through the runner contract: a snapshot out, a batch back, its
        statistics merged; what it brought (``Collected``)."""
        batch = self.collector.collect(self.snapshot())
        lag = self.config.runners.max_version_lag if self.config.runners.async_collection else 0
        rollouts = absorb(
            self.policies, batch, self.iteration, lag, self.config.rollout.sequence_length
        )
        return Collected(rollouts, batch.episodes, batch.env_steps, self.iteration - batch.version)

    def _runner_metrics(
        self, version_lag: int, update_seconds: float, iteration_start: float
    ) -> dict[str, float]:
        """For runs with Ray runners or external agents: the runner's own (restarts,
        dropped batches, idle fraction, and where it knows them its rows' version lags),
        else ``version_lag``, the batch's just trained on, and the learner's busy fraction
        (updating, not waiting)."""
        reported = self.collector.metrics()
        if not self.config.runners.count and not reported:
            return {}
        elapsed = max(time.perf_counter() - iteration_start, 1e-9)
        return {
            "version_lag_mean": float(version_lag),
            "version_lag_max": float(version_lag),
            **reported,  # a runner that knows its rows' lags (external agents) says so
            "learner_busy": update_seconds / elapsed,
        }

    def snapshot(self) -> PolicySnapshot:
        """What a runner acts with now: the policies' weights and statistics as numpy
        arrays, at version ``iteration`` (the number of updates so far)."""
        return PolicySnapshot.of(self.policies, self.iteration)

    def _update(self, progress: float, rollouts: list[Rollout]) -> dict[str, float]:
        """Each group's update on its rollout; several groups' metrics are averaged, and
        also kept per group under "<group>/<metric>"."""
        cfg = self.config
        results = []
        for policy, update, rollout in zip(self.policies, self.updates, rollouts, strict=True):
            rollout.compute_advantages(cfg.rollout.gamma, cfg.rollout.gae_lambda)
            results.append(update(policy, rollout, progress))
        if len(results) == 1:
            return results[0]
        merged = {key: float(np.nanmean([r[key] for r in results])) for key in results[0]}
        for group, result in zip(self.groups, results, strict=True):
            merged.update({f"{group.name}/{key}": value for key, value in result.items()})
        return merged

    def evaluate(self) -> EvalResult:
        """Deterministic evaluation on held-out seeds, normalizer frozen."""
        cfg = self.config
        return evaluate(
            self.policy,
            cfg.env_id,
            cfg.eval_episodes,
            deterministic=True,
            seed=cfg.seed + 1_000_000,
            env_kwargs=cfg.env.kwargs,
            frame_stack=cfg.env.frame_stack,
        )

    def _periodic_eval(self, recent_mean: float | None) -> EvalResult | None:
        cfg = self.config
        due = cfg.eval_every > 0 and cfg.eval_episodes > 0 and self.iteration % cfg.eval_every == 0
        near = (
            cfg.target_return is not None
            and cfg.eval_episodes > 0
            and recent_mean is not None
            and recent_mean >= cfg.target_return
        )
        return self.evaluate() if (due or near) else None


class _StopOnInterrupt:
    """First Ctrl-C: finish the iteration, checkpoint, return. Second: stop at once.
    ``on_request`` runs at the first (a runner's ``stop``: one that waits for external
    agents stops waiting)."""

    def __init__(self, on_request: Callable[[], None] | None = None) -> None:
        self.requested = False
        self.on_request = on_request
        self.previous: Any = None
        if threading.current_thread() is threading.main_thread():
            self.previous = signal.signal(signal.SIGINT, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        if self.on_request is not None:
            self.on_request()
        print("\ninterrupt: checkpointing after this iteration (Ctrl-C again to abort)", flush=True)

    def restore(self) -> None:
        if self.previous is not None:
            signal.signal(signal.SIGINT, self.previous)


def _make_runner(config: Config) -> Runner:
    """The run's own runner: a collector in this process, or Ray runners."""
    if config.runners.count == 0:
        return make_collector(config, config.seed, config.num_envs)
    from trustrl.remote.runners import RayRunners  # Ray only when asked for

    return RayRunners(config)


def build_policies(config: Config, groups: list[AgentGroup]) -> list[Policy]:
    """One policy per agent group, as ``config`` describes it (weights from torch's
    global generator: seed it first)."""
    ma = config.multiagent
    return [
        Policy(
            group.spec,
            config.policy,
            config.env.normalize_obs,
            config.env.obs_clip,
            num_agents=group.num_agents,
            per_agent=ma.actor == "per_agent" and group.num_agents > 1,
            agent_id=ma.agent_id and group.num_agents > 1,
            critic_dim=group.critic_dim,
            value_norm=ma.value_norm,
        )
        for group in groups
    ]


def absorb(
    policies: list[Policy],
    batch: RolloutBatch,
    version: int,
    max_lag: int = 0,
    sequence_length: int = 0,
) -> list[Rollout]:
    """The learner's side of the contract: merge the batch's observation statistics into
    the policies' normalizers (exactly, count, mean and M2) and wrap its arrays as the
    rollouts the update trains on. The batch must come from the snapshot of ``version``
    or, with asynchronous collection, one at most ``max_lag`` updates older. A recurrent
    policy's rollout trains on chunks of ``sequence_length`` steps (rollout.sequence_length,
    the length its runner cut them with)."""
    if not 0 <= version - batch.version <= max_lag:
        raise ValueError(
            f"a rollout of policy version {batch.version} reached the learner at {version} "
            f"(runners.max_version_lag {max_lag})"
        )
    rollouts = []
    for policy, group in zip(policies, batch.groups, strict=True):
        for normalizer, delta in (
            (policy.obs_normalizer, group.obs_delta),
            (policy.critic_normalizer, group.critic_delta),
        ):
            if normalizer is not None and delta is not None:
                normalizer.merge(delta)
        if policy.state_size and group.states is None:
            raise ValueError(
                f"a rollout from {batch.runner} carries no recurrent states for a policy with "
                f"memory ({policy.config.memory})"
            )
        rollouts.append(Rollout.from_batch(group, policy.num_agents, sequence_length))
    return rollouts


def episode_metrics(episodes: EpisodeStats, agents: list[str] | None = None) -> dict[str, float]:
    """Statistics over the episodes that finished during the iteration (nan if none).

    For multi-agent envs an episode is one agent's: the statistics are over agents and
    episodes, and each agent also gets "<agent>/episode_return".
    """
    nan = math.nan
    returns = np.asarray(episodes.returns)
    found = len(returns) > 0
    metrics = {
        "episode_return_mean": float(returns.mean()) if found else nan,
        "episode_return_std": float(returns.std()) if found else nan,
        "episode_return_min": float(returns.min()) if found else nan,
        "episode_return_max": float(returns.max()) if found else nan,
        "episode_length_mean": float(np.mean(episodes.lengths)) if found else nan,
        "episodes": float(len(returns)),
        "dropped_episodes": float(episodes.dropped),
    }
    names = np.asarray(episodes.agents)
    for agent in agents or []:
        mine = returns[names == agent] if found else returns
        metrics[f"{agent}/episode_return"] = float(mine.mean()) if len(mine) else nan
    return metrics


def config_changes(old: Config, new: Config) -> dict[str, list[Any]]:
    """Fields whose value differs, by dotted name: [old, new] (None: unset)."""

    def flat(table: dict[str, Any], prefix: str = "") -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in table.items():
            if isinstance(value, dict) and key != "kwargs":
                out.update(flat(value, f"{prefix}{key}."))
            else:
                out[f"{prefix}{key}"] = value
        return out

    a, b = flat(dataclasses.asdict(old)), flat(dataclasses.asdict(new))
    a.pop("quiet"), b.pop("quiet")  # how the run reports, not what it does
    return {
        key: [_jsonable(a.get(key)), _jsonable(b.get(key))]
        for key in sorted(set(a) | set(b))
        if a.get(key) != b.get(key)
    }


def _jsonable(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def record_config_changes(
    path: Path, iteration: int, env_steps: int, changes: dict[str, list[Any]]
) -> None:
    """Append to the run's config history: which fields changed, and from which iteration
    on (config.toml describes only the latest part of a resumed run)."""
    import json

    history = json.loads(path.read_text()) if path.is_file() else []
    history.append(
        {
            "from_iteration": iteration + 1,
            "env_steps_before": env_steps,
            "changes": {key: {"old": old, "new": new} for key, (old, new) in changes.items()},
        }
    )
    write_atomic(path, json.dumps(history, indent=1) + os.linesep)


def _json(data: dict[str, Any]) -> str:
    import json

    return json.dumps(data, indent=1) + os.linesep


def train(config: Config, run_dir: str | Path | None = None) -> Policy | MultiAgentPolicy:
    """Train a policy for ``config`` and return it (the run folder is written as by the CLI)."""
    return Trainer(config, run_dir).train()
