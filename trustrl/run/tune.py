"""``trustrl tune``: hyperparameter studies on Optuna.

A study samples a search space (``run/space.py``) with Optuna's TPE sampler; each trial
trains the env's preset with the sampled values for a short budget on a seed of its own
(``run/trial.py``), reports its periodic deterministic evaluations, and is stopped early
by the median rule (``run/pruning.py``: Optuna's, per seed) when it falls below the median
of the trials before it at the same point of the budget. Its objective is the mean of its
last evaluations. With ``--seeds-per-trial K`` a trial trains its values on K seeds, one
after another, and its objective is the worst seed's: a study then favours settings that
learn on every seed, not one lucky draw.

The study lives in its folder::

    study.db      Optuna's own storage (SQLite): trials, values, parameters, the settings
    study.lock    held while a ``trustrl tune`` runs on the study (one at a time)
    trials/       trial_NNNN/: each trial's run folder (with K seeds, seed_S/ in it for
                  each); a run folder's .log beside it: a child's stderr
    best.toml     the best trial's settings as a preset for ``trustrl train --config``

Only the process that runs the study writes ``study.db``; trials run in it (one job),
in child processes or as Ray tasks, and send their evaluations back. So a study resumes
after a Ctrl-C, a crash or a SIGKILL with every finished trial kept: a trial that was
running is marked failed (stopped) and queued again with its values and seed.
Optuna is imported only here, and only when a study is opened.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import signal
import textwrap
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import tomli_w

from trustrl.config import (
    Config,
    ConfigError,
    merge,
    preset_name,
    preset_table,
    read_toml,
    resolve,
)
from trustrl.run.pruning import seed_median_pruner
from trustrl.run.space import (
    SearchSpace,
    SpaceError,
    check_space,
    default_space,
    overrides,
    read_space,
    space_from_dict,
)
from trustrl.run.trial import EVALUATIONS, Ended, InProcess, Launcher, Subprocesses, TrialJob

if TYPE_CHECKING:
    import optuna

INSTALL_HINT = "pip install 'trustrl[tune]'"
STUDY_NAME = "trustrl"
DEFAULT_BUDGET = 300_000
"""A trial's env steps when --budget is not given: the preset's total_steps, at most this."""
LAST_EVALUATIONS = 3
"""A trial's objective: the mean of its last this many evaluations."""
IMPORTANCE_MIN_TRIALS = 4
"""Completed trials below which parameter importances are not computed."""
SPEC_KEYS = (
    "env_id",
    "algo",
    "budget",
    "seed",
    "eval_episodes",
    "space",
    "config",
    "seeds_per_trial",
)
"""What a study is: settings a resumed study must keep (--trials and --jobs may change)."""


class TuneError(ValueError):
    """A study that cannot run as asked; the message says why."""


class TrialFailed(Exception):
    """A trial whose config was invalid or whose run could not go on: a FAIL that counts
    as one of the study's trials (Optuna records it and goes on)."""


class TrialInterrupted(Exception):
    """A trial stopped by Ctrl-C: the study stops, and a resume runs the trial again."""


def import_optuna() -> ModuleType:
    try:
        import optuna
    except ImportError as error:
        raise TuneError(f"trustrl tune needs Optuna, which is not installed: {INSTALL_HINT}") from (
            error
        )
    return optuna


@dataclass(frozen=True)
class TuneSettings:
    """A study's settings. ``SPEC_KEYS`` are what the study is (kept in ``study.db`` and
    held to on resume); ``trials``, ``jobs``, ``startup_trials`` and ``warmup`` say how
    this session runs it."""

    env_id: str
    algo: str
    budget: int
    """Env steps per trial (rounded up to whole iterations by each trial)."""
    seed: int
    """Trial k trains with seed ``seed + k`` (seeds ``seed + k * K`` to ``seed + k * K + K
    - 1`` with ``seeds_per_trial`` K); the sampler is seeded from it too."""
    eval_episodes: int
    """Episodes of each periodic deterministic evaluation."""
    space: SearchSpace
    study_dir: Path
    trials: int = 30
    """Trials the study holds when it is done (completed, pruned or failed; trials stopped
    by an interruption are run again and do not count)."""
    jobs: int = 1
    startup_trials: int = 5
    """Trials that finish before any is pruned."""
    warmup: int = 3
    """Tenths of its budget a trial trains before it may be pruned (n_warmup_steps)."""
    config: dict[str, Any] = dataclasses.field(default_factory=dict)
    """``--config``'s settings (a config file's table), over the env's preset and under
    the sampled values: what the study tunes around ({}: the preset alone)."""
    seeds_per_trial: int = 1
    """Seeds each trial trains its values on, one after another; its objective is the
    worst seed's (the mean of that seed's last evaluations)."""

    def spec(self) -> dict[str, Any]:
        return {
            "env_id": self.env_id,
            "algo": self.algo,
            "budget": self.budget,
            "seed": self.seed,
            "eval_episodes": self.eval_episodes,
            "space": self.space.to_dict(),
            "config": self.config,
            "seeds_per_trial": self.seeds_per_trial,
        }

    def session(self) -> dict[str, int]:
        """How the study runs, kept for the next session (which may change it)."""
        return {"trials": self.trials, "startup": self.startup_trials, "warmup": self.warmup}

    def trial_seeds(self, number: int, first: int | None = None) -> list[int]:
        """The seeds trial ``number`` trains on: its own ``seeds_per_trial`` of them, from
        ``first`` where given (a retry keeps the seeds of the trial it repeats)."""
        if first is None:
            first = self.seed + number * self.seeds_per_trial
        return list(range(first, first + self.seeds_per_trial))

    def where(self, step: int) -> str:
        """A reported step in words: tenths of the budget, and the seed's place in the
        trial where it trains several (seed j's evaluations report at steps 10 j + 1 to
        10 j + 10)."""
        if self.seeds_per_trial == 1:
            return f"{step}/{EVALUATIONS} of its budget"
        index, tenths = divmod(step - 1, EVALUATIONS)
        return (
            f"{tenths + 1}/{EVALUATIONS} of its budget on its seed {index + 1} of "
            f"{self.seeds_per_trial}"
        )

    def objective_words(self) -> str:
        last = f"the mean of its last {LAST_EVALUATIONS} deterministic evaluations"
        if self.seeds_per_trial == 1:
            return last
        return f"the worst of its {self.seeds_per_trial} seeds, each {last}"

    def trial_overrides(self, values: dict[str, Any], seed: int, run_dir: Path) -> dict[str, Any]:
        """A trial's settings over the preset: ``config``, then the sampled values, and its
        seed, budget, folder, one thread, no stop at a target return (every trial trains
        its budget), the last checkpoint only."""
        own = {
            "seed": seed,
            "total_steps": self.budget,
            "run_dir": str(run_dir),
            "quiet": True,
            "torch_threads": 1,
            "eval_episodes": self.eval_episodes,
            "target_return": None,
            "checkpoint_keep": 1,
            "ppo": {"critic_process": False},
        }
        return merge(merge(self.config, own), overrides(values))


def default_study_dir(env_id: str, algo: str) -> Path:
    return Path("studies") / f"{preset_name(env_id)}__{algo}"


def has_box_actions(config: Config) -> bool:
    """Whether any of the env's agents acts with a Box (one env built to look)."""
    from trustrl.envs.gym import make_row_env

    probe = dataclasses.replace(
        config, env=dataclasses.replace(config.env, num_envs=1, backend="sync")
    )
    rows = make_row_env(probe)
    try:
        rows.reset(seed=0)  # the groups are known after a reset
        return any(group.spec.action_kind == "box" for group in rows.groups)
    finally:
        rows.close()


def plan(
    study_dir: Path | None,
    env_id: str | None,
    algo: str | None = None,
    *,
    budget: int | None = None,
    seed: int | None = None,
    eval_episodes: int | None = None,
    space: SearchSpace | str | Path | None = None,
    config: str | Path | None = None,
    seeds_per_trial: int | None = None,
    trials: int | None = None,
    jobs: int = 1,
    startup_trials: int | None = None,
    warmup: int | None = None,
) -> TuneSettings:
    """The settings of a new study, or of the study in ``study_dir`` with what it was
    made with filling what is not given (None); a given setting that differs from the
    study's is refused, naming both. ``space``: a space, or a space file's path (None:
    the algorithm's default space). ``config``: a config file the trials train with over
    the env's preset, under the sampled values (``trustrl train --config``'s)."""
    if study_dir is None:
        if env_id is None:
            raise TuneError("trustrl tune needs ENV_ID, or --study-dir of a study to resume")
        study_dir = default_study_dir(env_id, algo or "ppo")
    stored = stored_spec(study_dir)
    space_file: str | None = None
    chosen: SearchSpace | None = None
    if isinstance(space, str | Path):
        space_file = str(space)
        chosen = read_space(space_file, algo or (stored["algo"] if stored else "ppo"))
    else:
        chosen = space
    table: dict[str, Any] | None = None
    if config is not None:
        try:
            table = read_toml(config)
        except ConfigError as exc:
            raise TuneError(str(exc)) from None
    given: dict[str, Any] = {"env_id": env_id, "algo": algo, "budget": budget, "seed": seed}
    given |= {"eval_episodes": eval_episodes, "config": table, "seeds_per_trial": seeds_per_trial}
    if stored is not None:
        for key in SPEC_KEYS:
            mine = chosen.to_dict() if key == "space" and chosen is not None else given.get(key)
            if mine is not None and mine != stored[key]:
                shown = f"the {key} given" if key in ("space", "config") else f"{mine!r}"
                raise TuneError(
                    f"the study in {study_dir} was made with {key} = {stored[key]!r}, not "
                    f"{shown}: leave it out to resume the study, or choose a new --study-dir"
                )
        env_id, algo = stored["env_id"], stored["algo"]
        budget, seed = stored["budget"], stored["seed"]
        eval_episodes = stored["eval_episodes"]
        table = stored["config"]
        seeds_per_trial = stored["seeds_per_trial"]
        chosen = space_from_dict(stored["space"], algo)
        # How the study runs (its size, its pruner) may change; what is not given stays.
        session = stored.get("session") or {}
        trials = trials if trials is not None else session.get("trials")
        startup_trials = startup_trials if startup_trials is not None else session.get("startup")
        warmup = warmup if warmup is not None else session.get("warmup")
    assert env_id is not None
    algo = algo or "ppo"
    base = base_config(env_id, algo, table or {}, config)
    if chosen is None:
        chosen = default_space(base, has_box_actions(base))
    try:
        check_space(chosen, base)
    except SpaceError as exc:
        raise SpaceError(f"space file {space_file}: {exc}" if space_file else str(exc)) from None
    settings = TuneSettings(
        env_id=env_id,
        algo=algo,
        budget=budget if budget is not None else min(base.total_steps, DEFAULT_BUDGET),
        seed=seed if seed is not None else 1000,
        eval_episodes=eval_episodes if eval_episodes is not None else 5,
        space=chosen,
        study_dir=study_dir,
        trials=trials if trials is not None else 30,
        jobs=jobs,
        startup_trials=startup_trials if startup_trials is not None else 5,
        warmup=warmup if warmup is not None else 3,
        config=table or {},
        seeds_per_trial=seeds_per_trial if seeds_per_trial is not None else 1,
    )
    for name in ("budget", "trials", "jobs", "eval_episodes", "seeds_per_trial"):
        if getattr(settings, name) < 1:
            raise TuneError(
                f"--{name.replace('_', '-')} must be >= 1, got {getattr(settings, name)}"
            )
    for name in ("seed", "startup_trials", "warmup"):
        if getattr(settings, name) < 0:
            raise TuneError(
                f"--{name.replace('_', '-')} must be >= 0, got {getattr(settings, name)}"
            )
    return settings


def base_config(env_id: str, algo: str, table: dict[str, Any], path: str | Path | None) -> Config:
    """The config a study's trials start from: the env's preset with ``table`` (the
    ``--config`` file ``path``'s settings) over it, checked as ``trustrl train`` would."""
    try:
        base = resolve(env_id, algo, overrides=table)
    except ConfigError as exc:
        raise TuneError(f"config file {path}: {exc}" if path else str(exc)) from None
    if (base.env_id, base.algo) != (env_id, algo):
        raise TuneError(
            f"config file {path}: it sets env_id/algo to {base.env_id}/{base.algo}, where the "
            f"study tunes {algo} on {env_id}; leave them out of the file"
        )
    return base


def storage_url(study_dir: Path) -> str:
    return f"sqlite:///{(study_dir / 'study.db').resolve()}"


def _storage(optuna: ModuleType, study_dir: Path) -> Any:
    # A writer waits up to a minute for SQLite's lock (a plot reading the study) rather
    # than failing at once.
    return optuna.storages.RDBStorage(
        storage_url(study_dir), engine_kwargs={"connect_args": {"timeout": 60}}
    )


def stored_spec(study_dir: Path) -> dict[str, Any] | None:
    """The settings the study in ``study_dir`` was made with (None: no study there)."""
    if not (study_dir / "study.db").is_file():
        return None
    optuna = import_optuna()
    try:
        study = optuna.load_study(study_name=STUDY_NAME, storage=_storage(optuna, study_dir))
    except KeyError:  # a database without the study: made, then killed at once
        return None
    spec = study_spec(study)
    return {**spec, "session": study.user_attrs.get("session")} if spec else None


def study_spec(study: optuna.Study) -> dict[str, Any] | None:
    """What a study was made with (``TuneSettings.spec``); a study made before
    ``--config`` and ``--seeds-per-trial`` existed tuned around the preset alone, one
    seed a trial."""
    spec = study.user_attrs.get("spec")
    return {"config": {}, "seeds_per_trial": 1, **spec} if spec else None


@contextlib.contextmanager
def study_lock(study_dir: Path) -> Iterator[None]:
    """Hold ``study.lock`` for the block: one ``trustrl tune`` at a time on a study, so
    that a trial found running when it starts is one whose process is gone."""
    import fcntl

    with (study_dir / "study.lock").open("a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            owner = handle.read().strip() or "?"
            raise TuneError(
                f"the study in {study_dir} is in use by another trustrl tune (process "
                f"{owner}); wait for it, or stop it"
            ) from None
        handle.truncate(0)
        handle.write(f"{os.getpid()}\n")
        handle.flush()
        yield


def open_study(settings: TuneSettings, optuna: ModuleType) -> tuple[optuna.Study, Any]:
    """The study in its folder, made or loaded, with its sampler and pruner, and its
    storage; its settings recorded (a new study) or checked (``plan`` did, for the CLI)."""
    storage = _storage(optuna, settings.study_dir)
    # Seeded apart from earlier sessions of the study: a resumed sampler with the same
    # seed would draw the first sessions' random startup values again.
    done = 0
    with contextlib.suppress(KeyError):
        done = len(optuna.load_study(study_name=STUDY_NAME, storage=storage).trials)
    study = optuna.create_study(
        storage=storage,
        study_name=STUDY_NAME,
        direction="maximize",
        load_if_exists=True,
        sampler=optuna.samplers.TPESampler(seed=settings.seed + done),
        pruner=seed_median_pruner(optuna, settings.startup_trials, settings.warmup),
    )
    spec = study_spec(study)
    if spec is None:
        study.set_user_attr("spec", settings.spec())
    elif spec != settings.spec():
        raise TuneError(f"the study in {settings.study_dir} was made with other settings: {spec}")
    study.set_user_attr("session", settings.session())
    return study, storage


def counted(trials: list[Any], optuna: ModuleType) -> int:
    """Trials that count towards the study's size: completed, pruned, and failed other
    than by an interruption."""
    state = optuna.trial.TrialState
    return sum(
        1
        for t in trials
        if t.state in (state.COMPLETE, state.PRUNED)
        or (t.state == state.FAIL and "stopped" not in t.user_attrs)
    )


def recover(study: optuna.Study, storage: Any, optuna: ModuleType) -> list[str]:
    """Trials left running by a process that is gone (the lock is ours) marked failed,
    stopped; every stopped trial without a retry queued again with its values and seed.
    Returns what it did, in words."""
    state = optuna.trial.TrialState
    notes = []
    study_id = storage.get_study_id_from_name(STUDY_NAME)
    for trial in study.get_trials(deepcopy=False, states=(state.RUNNING,)):
        trial_id = storage.get_trial_id_from_study_id_trial_number(study_id, trial.number)
        storage.set_trial_user_attr(trial_id, "stopped", "its process ended")
        study.tell(trial.number, state=state.FAIL)
        notes.append(f"trial {trial.number} was running when its process ended: marked failed")
    trials = study.get_trials(deepcopy=False)
    retried = {t.user_attrs.get("retry_of") for t in trials}
    for trial in trials:
        stopped = trial.state == state.FAIL and "stopped" in trial.user_attrs
        # A trial stopped before it drew its values has nothing to repeat.
        if stopped and trial.params and trial.number not in retried:
            attrs = {"retry_of": trial.number, "seed": trial.user_attrs.get("seed")}
            study.enqueue_trial(trial.params, user_attrs=attrs)
            notes.append(f"trial {trial.number} queued again with its values and seed")
    return notes


@dataclass
class Objective:
    """One trial: sample, train on each of its seeds where the launcher runs it, report
    each evaluation, prune, return the worst seed's mean of its last evaluations."""

    settings: TuneSettings
    launch: Launcher
    announce: Callable[[str], None]
    stopping: threading.Event = dataclasses.field(default_factory=threading.Event)
    """Set by ``stop``: no trial starts after it."""

    def stop(self) -> None:
        """Start no new trial, and ask the running ones to stop (the launcher's ``stop``:
        each at its iteration's end, with a checkpoint)."""
        self.stopping.set()
        stop = getattr(self.launch, "stop", None)
        if stop is not None:
            stop()

    def __call__(self, trial: optuna.Trial) -> float:
        settings = self.settings
        values = settings.space.sample(trial)
        # A retry keeps the seeds of the trial it repeats.
        seeds = _seeds(settings, trial)
        trial.set_user_attr("seed", seeds[0])
        folder = settings.study_dir / "trials" / f"trial_{trial.number:04d}"
        shown = ", ".join(f"{name}={format_value(v)}" for name, v in values.items())
        self.announce(f"trial {trial.number} ({seeds_words(seeds)}): {shown}")
        scores = []
        for index, seed in enumerate(seeds):
            run_dir = folder if len(seeds) == 1 else folder / f"seed_{seed}"
            overrides = settings.trial_overrides(values, seed, run_dir)
            job = TrialJob(settings.env_id, settings.algo, overrides, str(run_dir), trial.number)
            last = self._train(trial, job, index * EVALUATIONS)[-LAST_EVALUATIONS:]
            scores.append(sum(last) / len(last))
        if len(seeds) > 1:
            trial.set_user_attr("seed_scores", scores)
        return min(scores)

    def _train(self, trial: optuna.Trial, job: TrialJob, offset: int) -> list[float]:
        """One seed of the trial, its evaluations reported at ``offset`` + their step and
        returned; raises TrialPruned, TrialInterrupted or TrialFailed."""
        optuna = import_optuna()
        reported: list[float] = []
        ended: Ended | None = None
        with contextlib.closing(self.launch(job)) as events:
            for event in events:
                if isinstance(event, Ended):
                    ended = event
                    break
                trial.report(event.value, offset + event.step)
                reported.append(event.value)
                if trial.should_prune():
                    where = self.settings.where(offset + event.step)
                    raise optuna.TrialPruned(f"at {where}, evaluation {event.value:.2f}")
        if ended is None or ended.outcome == "interrupted":
            trial.set_user_attr("stopped", "interrupted")
            raise TrialInterrupted(f"trial {trial.number} interrupted")
        if ended.interrupt:  # the trial finished under a Ctrl-C: the study stops with it
            self.stop()
        if ended.outcome == "failed" or not reported:
            message = ended.message or "no evaluation was reported"
            trial.set_user_attr("error", message)
            raise TrialFailed(message)
        return reported


def seeds_words(seeds: list[int], short: bool = False) -> str:
    """A trial's seeds in words: "seed 1003", "seeds 1006-1007" (short: "1003",
    "1006-1007")."""
    if len(seeds) == 1:
        return str(seeds[0]) if short else f"seed {seeds[0]}"
    return f"{seeds[0]}-{seeds[-1]}" if short else f"seeds {seeds[0]}-{seeds[-1]}"


def _seeds(settings: TuneSettings, trial: Any) -> list[int]:
    """The seeds a trial of the study trains on (those of the trial a retry repeats)."""
    return settings.trial_seeds(trial.number, trial.user_attrs.get("seed"))


def _objective(trial: Any) -> float:
    """A completed trial's objective (Optuna types it as optional)."""
    return float(trial.value)


def format_value(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)


@dataclass
class TuneOutcome:
    """How a session of a study ended, and the study as it stands."""

    study: Any
    """The ``optuna.Study``."""
    settings: TuneSettings
    interrupted: bool
    best_file: Path | None


def tune(
    settings: TuneSettings,
    launch: Launcher | None = None,
    announce: Callable[[str], None] = print,
) -> TuneOutcome:
    """Run the study until it holds ``settings.trials`` trials (it resumes where one
    exists), with ``settings.jobs`` trials at a time: in this process (one job) or in
    child processes, unless ``launch`` runs them elsewhere (Ray tasks:
    ``trustrl.remote.tune.RayTrials``). Ctrl-C stops the running trials at their next
    iteration's end and returns with ``interrupted``; the best trial's settings are
    written to ``best.toml`` whenever a trial beats the best so far."""
    optuna = import_optuna()
    settings.study_dir.mkdir(parents=True, exist_ok=True)
    with study_lock(settings.study_dir):
        study, storage = open_study(settings, optuna)
        for note in recover(study, storage, optuna):
            announce(note)
        remaining = settings.trials - counted(study.get_trials(deepcopy=False), optuna)
        announce(
            f"study {settings.study_dir}: {settings.algo} on {settings.env_id}, "
            f"{settings.trials - remaining} of {settings.trials} trials done, "
            f"{settings.budget:,} env steps each"
            + (f", {settings.jobs} at a time" if settings.jobs > 1 and remaining > 0 else "")
        )
        if launch is None:
            launch = InProcess() if settings.jobs == 1 else Subprocesses()
        interrupted = False
        if remaining > 0:
            callback = _TrialEnded(settings, announce)
            objective = Objective(settings, launch, announce)
            trials = _Trials(study, objective, callback, optuna)
            with _stop_on_interrupt(objective, announce):
                stopped = trials.run(remaining, settings.jobs)
            # A Ctrl-C that came as the last trial finished left nothing to resume.
            counted_now = counted(study.get_trials(deepcopy=False), optuna)
            interrupted = stopped and counted_now < settings.trials
        best_file = write_best(settings, study, optuna)
    return TuneOutcome(study, settings, interrupted, best_file)


@dataclass
class _Trials:
    """The study's ask-and-tell loop: ``count`` trials, ``jobs`` at a time, each told to
    the study as it ends (completed, pruned, failed) and passed to ``callback``.

    Not Optuna's ``optimize(n_jobs=...)``: on SQLite, whose rows cannot be locked for an
    update, two of its threads can take the same queued trial; here one lock orders every
    ask and tell. With one job the trials run in this (the main) thread, where a trial's
    trainer can take Ctrl-C."""

    study: Any
    objective: Objective
    callback: Callable[[Any, Any], None]
    optuna: ModuleType
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    started: int = 0
    error: BaseException | None = None

    def run(self, count: int, jobs: int) -> bool:
        """Run the trials; whether a Ctrl-C interrupted them. An unexpected error in a
        trial stops the others (they run again on resume) and is raised here."""
        if jobs == 1:
            self._work(count)
        else:
            threads = [
                threading.Thread(target=self._work, args=(count,), daemon=True)
                for _ in range(min(jobs, count))
            ]
            for thread in threads:
                thread.start()
            for thread in threads:
                while thread.is_alive():  # in short waits: Ctrl-C's handler runs between
                    thread.join(0.5)
        if self.error is not None:
            raise self.error
        # Stopped without an error: a Ctrl-C, whether or not a trial was still running.
        return self.objective.stopping.is_set()

    def _work(self, count: int) -> None:
        while True:
            with self.lock:
                if self.started >= count or self.objective.stopping.is_set():
                    return
                self.started += 1
                trial = self.study.ask()
            try:
                ended = self._run(trial)
            except BaseException as exc:
                with self.lock:
                    self.error = self.error or exc
                self.objective.stop()
                return
            self.callback(self.study, ended)

    def _run(self, trial: Any) -> Any:
        """One trial, told to the study; its frozen record."""
        state = self.optuna.trial.TrialState
        try:
            value = self.objective(trial)
        except self.optuna.TrialPruned:
            return self._tell(trial, state=state.PRUNED)
        except TrialFailed:
            return self._tell(trial, state=state.FAIL)
        except TrialInterrupted:
            # The study stops with its trial: with one job the trial trains in this
            # process, under the trainer's own Ctrl-C handler, so the study's never ran.
            self.objective.stop()
            return self._tell(trial, state=state.FAIL)
        except BaseException:
            trial.set_user_attr("stopped", "an error in the study's process")
            self._tell(trial, state=state.FAIL)
            raise
        return self._tell(trial, values=value)

    def _tell(self, trial: Any, **how: Any) -> Any:
        with self.lock:
            return self.study.tell(trial, **how)


@dataclass
class _TrialEnded:
    """Says how each trial ended, and writes best.toml when one beats the best so far."""

    settings: TuneSettings
    announce: Callable[[str], None]

    def __call__(self, study: optuna.Study, trial: Any) -> None:
        optuna = import_optuna()
        state = optuna.trial.TrialState
        if trial.state == state.COMPLETE:
            best = study.best_trial.number == trial.number
            scores = trial.user_attrs.get("seed_scores")
            each = f": {', '.join(f'{v:.2f}' for v in scores)}" if scores else ""
            self.announce(
                f"trial {trial.number}: {trial.value:.2f} ({self.settings.objective_words()}"
                f"{each}){'; the best so far' if best else ''}"
            )
            if best:
                write_best(self.settings, study, optuna)
        elif trial.state == state.PRUNED:
            steps = sorted(trial.intermediate_values)
            at = f" at {self.settings.where(steps[-1])}" if steps else ""
            last = f" (evaluation {trial.intermediate_values[steps[-1]]:.2f})" if steps else ""
            self.announce(f"trial {trial.number}: pruned{at}{last}")
        elif "stopped" in trial.user_attrs:
            self.announce(f"trial {trial.number}: interrupted; it runs again on resume")
        else:
            self.announce(f"trial {trial.number}: failed: {trial.user_attrs.get('error', '?')}")


@contextlib.contextmanager
def _stop_on_interrupt(objective: Objective, announce: Callable[[str], None]) -> Iterator[None]:
    """First Ctrl-C: start no new trial and ask the running ones to stop (each at its
    iteration's end, with a checkpoint). Second: stop at once (KeyboardInterrupt)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    requested = False

    def handle(signum: int, frame: Any) -> None:
        nonlocal requested
        if requested:
            raise KeyboardInterrupt
        requested = True
        announce("interrupt: stopping the running trials (Ctrl-C again to abort)")
        objective.stop()

    previous = signal.signal(signal.SIGINT, handle)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def write_best(settings: TuneSettings, study: optuna.Study, optuna: ModuleType) -> Path | None:
    """The best completed trial's settings as a preset file, ``best.toml``: the env's
    shipped preset, the study's ``config``, and the trial's values over them (its own
    seed, budget and folder are the study's business and left out). None where no trial
    completed yet."""
    completed = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
    if not completed:
        return None
    best = max(completed, key=_objective)
    values = settings.space.values(best.params)
    preset = merge(preset_table(settings.algo, settings.env_id) or {}, settings.config)
    table = merge(preset, overrides(values))
    path = settings.study_dir / "best.toml"
    over = "the env's shipped preset" + (", the study's --config" if settings.config else "")
    header = (
        f"# trustrl tune: the best trial of the study in {settings.study_dir}, "
        f"{settings.algo} on {settings.env_id}.\n"
        + _comment(
            f"Trial {best.number} of {len(study.trials)}: objective {best.value:.2f}, "
            f"{settings.objective_words()} ({settings.eval_episodes} episodes each), "
            f"{seeds_words(_seeds(settings, best))}, "
            f"{settings.budget:,} env steps."
        )
        + _comment(
            f"{over[0].upper()}{over[1:]} and the tuned values over it: {', '.join(values)}."
        )
        + "# Confirm it at the full budget on other seeds before relying on it:\n"
        f"#   trustrl train {settings.env_id} --algo {settings.algo} --config {path}\n"
    )
    # checkpoint.py loads torch, which a study whose trials run elsewhere does not need.
    from trustrl.run.checkpoint import write_atomic

    write_atomic(path, header + tomli_w.dumps(table))
    return path


def _comment(text: str) -> str:
    """``text`` as TOML comment lines of at most 88 characters."""
    return "".join(f"# {line}\n" for line in textwrap.wrap(text, 86))


def top_trials_table(outcome: TuneOutcome, count: int = 5) -> str:
    """The best completed trials side by side: objective, seed and each sampled value."""
    optuna = import_optuna()
    completed = outcome.study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
    top = sorted(completed, key=_objective, reverse=True)[:count]
    if not top:
        return "no trial completed yet"
    space = outcome.settings.space
    rows = [
        ["trial", *(f"#{t.number}" for t in top)],
        ["objective", *(f"{t.value:.2f}" for t in top)],
        ["seed", *(seeds_words(_seeds(outcome.settings, t), short=True) for t in top)],
    ]
    if outcome.settings.seeds_per_trial > 1:
        scores = [t.user_attrs.get("seed_scores") or [] for t in top]
        for index in range(outcome.settings.seeds_per_trial):
            rows.append([f"seed {index + 1}", *(f"{v[index]:.2f}" if v else "-" for v in scores)])
    for name in space.names:
        rows.append([name, *(format_value(space.values(t.params).get(name, "-")) for t in top)])
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [
        "  ".join(
            cell.ljust(w) if i == 0 else cell.rjust(w)
            for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        )
        for row in rows
    ]
    states = _state_counts(outcome.study, optuna)
    return f"top {len(top)} of {states}:\n" + "\n".join(lines)


def _state_counts(study: optuna.Study, optuna: ModuleType) -> str:
    state = optuna.trial.TrialState
    counts = {name: 0 for name in ("completed", "pruned", "failed", "interrupted")}
    for trial in study.get_trials(deepcopy=False):
        if trial.state == state.COMPLETE:
            counts["completed"] += 1
        elif trial.state == state.PRUNED:
            counts["pruned"] += 1
        elif trial.state == state.FAIL:
            counts["interrupted" if "stopped" in trial.user_attrs else "failed"] += 1
    shown = ", ".join(f"{n} {name}" for name, n in counts.items() if n or name == "completed")
    return f"{sum(counts.values())} trials ({shown})"


def importances(outcome: TuneOutcome) -> tuple[dict[str, float], str]:
    """Optuna's importance of each sampled parameter (PED-ANOVA, its default), or an
    empty dict and why not (too few completed trials, or values that never varied)."""
    optuna = import_optuna()
    completed = outcome.study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
    if len(completed) < IMPORTANCE_MIN_TRIALS:
        return {}, (
            f"parameter importances need {IMPORTANCE_MIN_TRIALS} completed trials; "
            f"the study has {len(completed)}"
        )
    try:
        found = optuna.importance.get_param_importances(outcome.study)
    except (RuntimeError, ValueError) as exc:
        return {}, f"parameter importances could not be computed: {exc}"
    return dict(found), f"parameter importances over {len(completed)} completed trials"


@dataclass(frozen=True)
class TrialPoint:
    """A trial as the study plot draws it."""

    number: int
    state: str
    """complete, pruned or failed (running and waiting trials are not drawn)."""
    value: float
    """The objective; for a pruned trial its last evaluation; nan for a failed one."""


def study_points(study_dir: str | Path) -> tuple[dict[str, Any], list[TrialPoint]]:
    """The study's settings and its finished trials, in trial order."""
    study_dir = Path(study_dir)
    spec = stored_spec(study_dir)
    if spec is None:
        raise TuneError(f"{study_dir}: no trustrl tune study there (study.db)")
    optuna = import_optuna()
    study = optuna.load_study(study_name=STUDY_NAME, storage=_storage(optuna, study_dir))
    state = optuna.trial.TrialState
    points = []
    for trial in study.get_trials(deepcopy=False):
        if trial.state == state.COMPLETE:
            points.append(TrialPoint(trial.number, "complete", float(trial.value)))
        elif trial.state == state.PRUNED:
            steps = sorted(trial.intermediate_values)
            value = trial.intermediate_values[steps[-1]] if steps else math.nan
            points.append(TrialPoint(trial.number, "pruned", float(value)))
        elif trial.state == state.FAIL:
            points.append(TrialPoint(trial.number, "failed", math.nan))
    return spec, points
