"""``trustrl tune``: small CartPole studies run, prune, resume after a SIGKILL, run their
trials in child processes and as Ray tasks, and write a preset ``trustrl train`` loads;
search spaces are checked entry by entry."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import math
import os
import random
import re
import shlex
import signal
import subprocess
import sys
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.test_cli import run_cli
from trustrl import cli
from trustrl.config import list_presets, resolve
from trustrl.run import tune as tuning
from trustrl.run.logging import read_progress
from trustrl.run.pruning import seed_median_pruner
from trustrl.run.space import check_space, default_space, read_space
from trustrl.run.trial import Ended, Evaluation, Event, TrialJob

optuna = pytest.importorskip("optuna")

ROOT = Path(__file__).resolve().parent.parent
BUDGET = "4096"  # 16 iterations of the CartPole preset's 8 x 32 steps: 8 evaluations
SPACE = """\
[ppo.learning_rate]
low = 1e-3
high = 3e-3
log = true

[ppo]
update_epochs = { low = 5, high = 10 }
"""


def load(study_dir: Path) -> optuna.Study:
    return optuna.load_study(study_name=tuning.STUDY_NAME, storage=tuning.storage_url(study_dir))


@pytest.fixture(scope="module")
def space_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("space") / "space.toml"
    path.write_text(SPACE)
    return path


@pytest.fixture(scope="module")
def study(tmp_path_factory: pytest.TempPathFactory, space_file: Path) -> tuple[Path, str]:
    """A study of 3 CartPole trials of 4,096 steps, through the command line."""
    study_dir = tmp_path_factory.mktemp("tune") / "study"
    argv = ["tune", "CartPole-v1", "--trials", "3", "--budget", BUDGET]
    argv += ["--space", str(space_file), "--study-dir", str(study_dir)]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(argv) == 0
    return study_dir, out.getvalue()


def test_a_small_study_runs_and_writes_a_loadable_preset(study: tuple[Path, str]) -> None:
    study_dir, out = study
    trials = load(study_dir).trials
    assert [t.state for t in trials] == [optuna.trial.TrialState.COMPLETE] * 3
    # Seeds outside the quality table's (101-103) and the tests' (0-10): 1000 + number.
    assert [t.user_attrs["seed"] for t in trials] == [1000, 1001, 1002]
    for trial in trials:
        run_dir = study_dir / "trials" / f"trial_{trial.number:04d}"
        config = tomllib.loads((run_dir / "config.toml").read_text())
        assert config["seed"] == 1000 + trial.number and config["total_steps"] == 4096
        assert config["ppo"]["learning_rate"] == trial.params["ppo.learning_rate"]
        evaluations = [
            r["eval_return_mean"]
            for r in read_progress(run_dir / "progress.csv")
            if math.isfinite(r["eval_return_mean"])
        ]
        assert len(evaluations) == 8  # every 2 of 16 iterations
        assert sorted(trial.intermediate_values) == [1, 2, 3, 5, 6, 7, 8, 10]
        assert list(trial.intermediate_values.values()) == evaluations
        assert trial.value == pytest.approx(sum(evaluations[-3:]) / 3)
    best = max(trials, key=lambda t: t.value)
    assert "top 3 of 3 trials" in out and f"#{best.number}" in out
    assert "parameter importances need 4 completed trials" in out
    # best.toml is the preset with the best values, and trustrl train takes it.
    best_file = study_dir / "best.toml"
    config = resolve("CartPole-v1", "ppo", config_file=best_file)
    assert config.ppo.learning_rate == best.params["ppo.learning_rate"]
    assert config.ppo.update_epochs == best.params["ppo.update_epochs"]
    assert config.total_steps == resolve("CartPole-v1").total_steps  # the preset's budget
    assert config.seed == 1 and config.run_dir is None  # a trial's own settings stay out
    assert f"--config {best_file}" in out
    _known, parsed = cli.parse_train(["CartPole-v1", "--config", str(best_file)])
    assert parsed == config


def test_the_study_plot_draws_every_trial(
    study: tuple[Path, str], capsys: pytest.CaptureFixture[str]
) -> None:
    study_dir, _ = study
    out = study_dir.parent / "study.svg"
    code, printed, err = run_cli(["plot", str(study_dir), "--out", str(out)], capsys)
    assert code == 0, err
    assert f"{out}: 3 trials" in printed and out.stat().st_size > 1000


def test_a_resumed_study_keeps_its_settings(
    study: tuple[Path, str], capsys: pytest.CaptureFixture[str]
) -> None:
    study_dir, _ = study
    argv = ["tune", "--study-dir", str(study_dir), "--budget", "8192"]
    code, _, err = run_cli(argv, capsys)
    assert code == 2
    assert err.strip() == (
        f"trustrl: error: the study in {study_dir} was made with budget = 4096, not 8192: "
        "leave it out to resume the study, or choose a new --study-dir"
    )
    # Done already: the same command reports the study and trains nothing.
    code, out, _ = run_cli(["tune", "--study-dir", str(study_dir)], capsys)
    assert code == 0 and "3 of 3 trials done" in out and "(seed" not in out


def test_one_session_at_a_time(study: tuple[Path, str]) -> None:
    study_dir, _ = study
    settings = tuning.plan(study_dir, None, trials=4)
    with tuning.study_lock(study_dir), pytest.raises(tuning.TuneError, match="in use by"):
        tuning.tune(settings, announce=lambda line: None)


def test_a_study_tunes_around_a_config_file(
    tmp_path: Path, space_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--config's settings sit over the preset and under the sampled values, in every
    trial and in best.toml; the study keeps them, and a resume with other ones is refused."""
    base = tmp_path / "base.toml"
    base.write_text("[env]\nnum_envs = 4\n[ppo]\nclip_coef = 0.3\nlearning_rate = 0.5\n")
    study_dir = tmp_path / "study"
    argv = ["tune", "CartPole-v1", "--trials", "1", "--budget", BUDGET, "--space"]
    argv += [str(space_file), "--config", str(base), "--study-dir", str(study_dir)]
    code, out, err = run_cli(argv, capsys)
    assert code == 0, err
    (trial,) = load(study_dir).trials
    config = tomllib.loads((study_dir / "trials" / "trial_0000" / "config.toml").read_text())
    assert config["env"]["num_envs"] == 4 and config["ppo"]["clip_coef"] == 0.3
    # The sampled value wins over the file's.
    assert config["ppo"]["learning_rate"] == trial.params["ppo.learning_rate"] != 0.5
    best = resolve("CartPole-v1", config_file=study_dir / "best.toml")
    assert best.env.num_envs == 4 and best.ppo.clip_coef == 0.3
    assert best.ppo.learning_rate == trial.params["ppo.learning_rate"]
    assert "the study's --config" in (study_dir / "best.toml").read_text()
    # Resumed without --config, the study keeps its own; with another file, refused.
    code, out, _ = run_cli(["tune", "--study-dir", str(study_dir)], capsys)
    assert code == 0 and "1 of 1 trials done" in out
    other = tmp_path / "other.toml"
    other.write_text("[ppo]\nclip_coef = 0.2\n")
    code, _, err = run_cli(["tune", "--study-dir", str(study_dir), "--config", str(other)], capsys)
    assert code == 2 and err.count("\n") == 1
    assert "was made with config = " in err and "not the config given" in err


def test_a_trial_on_several_seeds_scores_its_worst_seed(
    tmp_path: Path, space_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--seeds-per-trial 2: each trial trains its values on two seeds of its own, reports
    the second seed's evaluations after the first's, and scores the worse of the two
    seeds' means of their last 3; the study keeps the count."""
    study_dir = tmp_path / "study"
    argv = ["tune", "CartPole-v1", "--trials", "2", "--budget", BUDGET, "--space"]
    argv += [str(space_file), "--seeds-per-trial", "2", "--study-dir", str(study_dir)]
    code, out, err = run_cli(argv, capsys)
    assert code == 0, err
    trials = load(study_dir).trials
    assert [t.state for t in trials] == [optuna.trial.TrialState.COMPLETE] * 2
    for trial in trials:
        seeds = [1000 + 2 * trial.number, 1001 + 2 * trial.number]
        assert trial.user_attrs["seed"] == seeds[0]
        means, steps = [], []
        for index, seed in enumerate(seeds):
            run_dir = study_dir / "trials" / f"trial_{trial.number:04d}" / f"seed_{seed}"
            config = tomllib.loads((run_dir / "config.toml").read_text())
            assert config["seed"] == seed
            assert config["ppo"]["learning_rate"] == trial.params["ppo.learning_rate"]
            evaluations = [
                r["eval_return_mean"]
                for r in read_progress(run_dir / "progress.csv")
                if math.isfinite(r["eval_return_mean"])
            ]
            offset = 10 * index
            steps += [offset + s for s in (1, 2, 3, 5, 6, 7, 8, 10)]
            assert [trial.intermediate_values[s] for s in steps[-8:]] == evaluations
            means.append(sum(evaluations[-3:]) / 3)
        assert sorted(trial.intermediate_values) == steps
        assert trial.user_attrs["seed_scores"] == pytest.approx(means)
        assert trial.value == pytest.approx(min(means))
        assert f"trial {trial.number} (seeds {seeds[0]}-{seeds[1]})" in out
    scores = ", ".join(f"{v:.2f}" for v in trials[0].user_attrs["seed_scores"])
    assert f"seeds, each the mean of its last 3 deterministic evaluations: {scores})" in out
    header = (study_dir / "best.toml").read_text()
    assert "the worst of its 2 seeds, each" in header and "seeds 100" in header
    # The top table shows each seed's score; a resume with another count is refused.
    assert re.search(r"^seed 2 +\d", out, re.MULTILINE), out
    argv = ["tune", "--study-dir", str(study_dir), "--seeds-per-trial", "1"]
    code, _, err = run_cli(argv, capsys)
    assert code == 2 and "was made with seeds_per_trial = 2, not 1" in err


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("[ppo]\nclip_coeff = 0.3\n", "unknown key ppo.clip_coeff; allowed: anneal_clip"),
        ("[ppo]\nclip_coef = 3\n", "ppo.clip_coef must be in (0, 1), got 3"),
        ('env_id = "Pendulum-v1"\n', "it sets env_id/algo to Pendulum-v1/ppo"),
        ("[ppo\n", "is not valid TOML"),
    ],
)
def test_a_bad_config_file_is_one_line(
    text: str, expected: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "base.toml"
    path.write_text(text)
    argv = ["tune", "CartPole-v1", "--config", str(path), "--study-dir", str(tmp_path / "s")]
    code, _out, err = run_cli(argv, capsys)
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith(f"trustrl: error: config file {path}") and expected in err, err
    assert not (tmp_path / "s").exists()  # refused before anything was made


@pytest.mark.filterwarnings("ignore:Fixed parameter")  # 1e-9 is outside the space
def test_a_trial_that_cannot_learn_is_pruned(tmp_path: Path, space_file: Path) -> None:
    lines: list[str] = []
    settings = tuning.plan(
        tmp_path / "study",
        "CartPole-v1",
        budget=int(BUDGET),
        space=space_file,
        trials=1,
        startup_trials=1,
        warmup=1,
    )
    tuning.tune(settings, announce=lines.append)
    load(settings.study_dir).enqueue_trial({"ppo.learning_rate": 1e-9, "ppo.update_epochs": 5})
    outcome = tuning.tune(tuning.plan(settings.study_dir, None, trials=2), announce=lines.append)
    assert outcome.settings.startup_trials == 1 and outcome.settings.warmup == 1  # kept
    first, second = outcome.study.trials
    assert first.state == optuna.trial.TrialState.COMPLETE
    assert second.state == optuna.trial.TrialState.PRUNED
    assert second.params["ppo.learning_rate"] == 1e-9
    # It stopped early: fewer evaluations than the 8 of a whole trial.
    assert len(second.intermediate_values) < 8
    assert any(line.startswith("trial 1: pruned at") for line in lines)


def start_study(study_dir: Path, space_file: Path, budget: str) -> subprocess.Popen[str]:
    """`trustrl tune` of 3 CartPole trials in a child process, its output on a pipe."""
    argv = ["tune", "CartPole-v1", "--trials", "3", "--budget", budget]
    argv += ["--space", str(space_file), "--study-dir", str(study_dir)]
    return subprocess.Popen(
        [sys.executable, "-m", "trustrl.cli", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )


def test_the_study_resumes_after_sigkill(
    tmp_path: Path, space_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    study_dir = tmp_path / "study"
    child = start_study(study_dir, space_file, BUDGET)
    assert child.stdout is not None
    seen = []
    for line in child.stdout:  # killed once trial 0 finished and trial 1 is training
        seen.append(line)
        if line.startswith("trial 1 (seed 1001)"):
            break
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    child.stdout.close()
    assert child.returncode == -signal.SIGKILL, "".join(seen)
    first_value = float(re.search(r"trial 0: (\S+)", "".join(seen))[1])  # type: ignore[index]

    code, out, err = run_cli(["tune", "--study-dir", str(study_dir)], capsys)
    assert code == 0, err
    assert "trial 1 was running when its process ended: marked failed" in out
    assert "trial 1 queued again with its values and seed" in out
    trials = load(study_dir).trials
    state = optuna.trial.TrialState
    assert [t.state for t in trials] == [state.COMPLETE, state.FAIL, state.COMPLETE, state.COMPLETE]
    assert round(trials[0].value, 2) == first_value  # the finished trial was kept
    killed, retry = trials[1], next(t for t in trials if t.user_attrs.get("retry_of") == 1)
    assert retry.params == killed.params and retry.user_attrs["seed"] == 1001
    assert tuning.counted(trials, optuna) == 3


def test_ctrl_c_stops_the_running_trials_and_the_study_resumes(
    tmp_path: Path, space_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    study_dir = tmp_path / "study"
    argv = ["tune", "CartPole-v1", "--trials", "2", "--budget", "16384", "--jobs", "2"]
    argv += ["--space", str(space_file), "--study-dir", str(study_dir)]
    child = subprocess.Popen(
        [sys.executable, "-m", "trustrl.cli", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    progress = [study_dir / "trials" / f"trial_{n:04d}" / "progress.csv" for n in (0, 1)]
    deadline = time.monotonic() + 120
    while not all(p.is_file() for p in progress):  # both trials training
        assert child.poll() is None and time.monotonic() < deadline
        time.sleep(0.2)
    child.send_signal(signal.SIGINT)
    out, _ = child.communicate(timeout=120)
    assert child.returncode == 130, out
    # Each stopped at an iteration's end, with a checkpoint (or, where the Ctrl-C landed
    # in its last iteration, finished and counts).
    stopped = [n for n in (0, 1) if f"trial {n}: interrupted" in out]
    assert stopped, out
    for number in (0, 1):
        assert re.search(rf"^trial {number}: (interrupted|\S+ \(mean of its last)", out, re.M), out
    assert f"resume the study with:\n  trustrl tune --study-dir {study_dir}" in out
    for number in stopped:
        assert (study_dir / "trials" / f"trial_{number:04d}" / "checkpoints" / "latest").is_file()

    code, out, err = run_cli(["tune", "--study-dir", str(study_dir), "--jobs", "1"], capsys)
    assert code == 0, err
    trials = load(study_dir).trials
    state = optuna.trial.TrialState
    first = [state.FAIL if n in stopped else state.COMPLETE for n in (0, 1)]
    assert [t.state for t in trials] == first + [state.COMPLETE] * len(stopped)
    assert [t.user_attrs.get("retry_of") for t in trials[2:]] == stopped
    assert [t.params for t in trials[2:]] == [trials[n].params for n in stopped]


def test_ctrl_c_stops_a_study_of_one_job_after_its_trial(tmp_path: Path, space_file: Path) -> None:
    # One job trains its trial in the study's process, where the trainer's own Ctrl-C
    # handler takes the signal: the study stopped its trial and then started the next.
    # (A Ctrl-C in the trial's last iteration lets it finish: it counts, and the study
    # stops all the same.)
    study_dir = tmp_path / "study"
    child = start_study(study_dir, space_file, "16384")
    progress = study_dir / "trials" / "trial_0000" / "progress.csv"
    deadline = time.monotonic() + 120
    while not progress.is_file():  # trial 0 training
        assert child.poll() is None and time.monotonic() < deadline
        time.sleep(0.2)
    child.send_signal(signal.SIGINT)
    out, _ = child.communicate(timeout=120)
    assert child.returncode == 130, out
    assert re.search(r"^trial 0: (interrupted|\S+ \(mean of its last)", out, re.M), out
    assert "trial 1 (seed" not in out, out
    assert not (study_dir / "trials" / "trial_0001").exists()
    assert f"resume the study with:\n  trustrl tune --study-dir {study_dir}" in out


def test_a_trial_that_finished_under_a_ctrl_c_counts_and_stops_the_study(
    tmp_path: Path, space_file: Path
) -> None:
    # One job: the Ctrl-C landed in the trainer's last iteration, so the trial finished
    # (its value is kept) and told of it; the study starts no other trial.
    def launch(job: TrialJob) -> Iterator[Event]:
        yield from (Evaluation(step, 100.0 + step, 256 * step) for step in range(1, 11))
        yield Ended("finished", interrupt=True)

    settings = tuning.plan(
        tmp_path / "study", "CartPole-v1", budget=2560, space=space_file, trials=3
    )
    lines: list[str] = []
    outcome = tuning.tune(settings, launch, announce=lines.append)
    assert outcome.interrupted
    [trial] = outcome.study.trials
    assert trial.state == optuna.trial.TrialState.COMPLETE and trial.value == 109.0
    assert outcome.best_file is not None and outcome.best_file.is_file()
    # The last trial of a study: nothing is left to resume.
    again = tuning.tune(tuning.plan(settings.study_dir, None, trials=2), launch, lines.append)
    assert not again.interrupted and len(again.study.trials) == 2


def test_each_seed_of_a_trial_is_pruned_on_its_own(tmp_path: Path, space_file: Path) -> None:
    """The median rule with two seeds a trial: each seed is judged by its own best
    evaluation so far against the completed trials' evaluations at the same step, after
    its own warm-up, so a good first seed does not carry a poor second one (Optuna's
    MedianPruner, which takes the best over all the trial's steps, would let it run)."""
    curves = {
        (0, 0): [100.0] * 10, (0, 1): [100.0] * 10,
        (1, 0): [100.0] * 10, (1, 1): [1.0] * 10,
        (2, 0): [1.0] * 10, (2, 1): [100.0] * 10,
    }  # fmt: skip

    def launch(job: TrialJob) -> Iterator[Event]:
        curve = curves[(job.number, job.overrides["seed"] % 2)]
        yield from (Evaluation(step, curve[step - 1], 256 * step) for step in range(1, 11))
        yield Ended("finished")

    settings = tuning.plan(
        tmp_path / "study", "CartPole-v1", budget=2560, space=space_file, trials=3,
        seeds_per_trial=2, startup_trials=1, warmup=3,
    )  # fmt: skip
    lines: list[str] = []
    outcome = tuning.tune(settings, launch, announce=lines.append)
    first, second, third = outcome.study.trials
    assert first.state == optuna.trial.TrialState.COMPLETE
    assert second.state == third.state == optuna.trial.TrialState.PRUNED
    # The second seed ran to its own warm-up (steps 11-13), not to its end.
    assert sorted(second.intermediate_values) == [*range(1, 11), 11, 12, 13]
    assert "trial 1: pruned at 3/10 of its budget on its seed 2 of 2 (evaluation 1.00)" in lines
    assert sorted(third.intermediate_values) == [1, 2, 3]
    assert "trial 2: pruned at 3/10 of its budget on its seed 1 of 2 (evaluation 1.00)" in lines


@pytest.mark.parametrize("draw", range(20))
def test_with_one_seed_a_trial_the_pruner_decides_as_optunas_median_pruner(draw: int) -> None:
    rng = random.Random(draw)
    startup, warmup = rng.randint(0, 4), rng.randint(0, 5)

    def values(steps: int) -> dict[int, float]:
        choices = [rng.uniform(0, 100), rng.choice([0.0, 50.0, 100.0]), math.nan]
        return {s: rng.choice(choices) for s in range(1, steps + 1) if rng.random() > 0.1}

    study = optuna.create_study(direction="maximize")
    for _ in range(rng.randint(0, 7)):
        study.add_trial(
            optuna.trial.create_trial(value=rng.uniform(0, 100), intermediate_values=values(10))
        )
    ours = seed_median_pruner(optuna, startup, warmup)
    theirs = optuna.pruners.MedianPruner(n_startup_trials=startup, n_warmup_steps=warmup)
    for steps in range(1, 11):
        running = optuna.trial.create_trial(
            state=optuna.trial.TrialState.RUNNING, intermediate_values=values(steps)
        )
        if running.last_step is None:
            continue
        assert ours.prune(study, running) == theirs.prune(study, running), (steps, running)


def test_trials_run_side_by_side_in_child_processes(tmp_path: Path, space_file: Path) -> None:
    settings = tuning.plan(
        tmp_path / "study", "CartPole-v1", budget=2048, space=space_file, trials=2, jobs=2
    )
    outcome = tuning.tune(settings, announce=lambda line: None)
    trials = outcome.study.trials
    assert [t.state for t in trials] == [optuna.trial.TrialState.COMPLETE] * 2
    for trial in trials:
        assert len(trial.intermediate_values) == 8
        assert (settings.study_dir / "trials" / f"trial_{trial.number:04d}" / "eval.json").is_file()
    assert outcome.best_file is not None and outcome.best_file.is_file()


@pytest.mark.xdist_group("ray")
@pytest.mark.time_limit(300)
@pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="needs trustrl[ray]")
def test_trials_run_as_ray_tasks(tmp_path: Path, space_file: Path) -> None:
    from trustrl.remote.tune import RayTrials

    settings = tuning.plan(
        tmp_path / "study", "CartPole-v1", budget=2048, space=space_file, trials=2, jobs=2
    )
    with RayTrials(None, num_cpus=2) as launch:  # a private loopback instance
        outcome = tuning.tune(settings, launch, announce=lambda line: None)
    trials = outcome.study.trials
    assert [t.state for t in trials] == [optuna.trial.TrialState.COMPLETE] * 2
    assert all(len(t.intermediate_values) == 8 for t in trials)
    assert outcome.best_file is not None and outcome.best_file.is_file()


BAD_SPACES = {
    "unknown field": (
        "[ppo.learning_rat]\nlow = 1e-5\nhigh = 1e-3\n",
        "ppo.learning_rat: unknown field",
    ),
    "unknown section": ("[optim.lr]\nlow = 1\nhigh = 2\n", "optim.lr: no tunable section"),
    "the other algorithm": ("[trpo.max_kl]\nlow = 0.001\nhigh = 0.1\n", "trpo.max_kl: a ppo study"),
    "range of strings": (
        '[ppo.learning_rate]\nlow = "a"\nhigh = 1e-3\n',
        'ppo.learning_rate: low must be a number, got the string "a"',
    ),
    "float bounds of an integer": (
        "[ppo.update_epochs]\nlow = 1.5\nhigh = 10\n",
        "ppo.update_epochs: low must be an integer, got the number 1.5",
    ),
    "low above high": (
        "[ppo.clip_coef]\nlow = 0.3\nhigh = 0.1\n",
        "ppo.clip_coef: low 0.3 is above high 0.1",
    ),
    "range of a true/false field": (
        "[ppo.norm_adv]\nlow = 0\nhigh = 1\n",
        "ppo.norm_adv: a range needs a numeric field; give choices",
    ),
    "a bound the config refuses": (
        "[ppo.clip_coef]\nlow = 0.1\nhigh = 1.5\n",
        "ppo.clip_coef: high 1.5 is refused: ppo.clip_coef must be in (0, 1), got 1.5",
    ),
    "a choice of the wrong type": (
        '[policy.activation]\nchoices = ["tanh", "gelu"]\n',
        "policy.activation: choice 'gelu' is refused: policy.activation must be one of tanh, relu",
    ),
    "log scale through zero": (
        "[ppo.ent_coef]\nlow = 0.0\nhigh = 0.1\nlog = true\n",
        "ppo.ent_coef: a log scale needs low > 0",
    ),
    "a misspelt key": (
        "[ppo.clip_coef]\nlow = 0.1\nhihg = 0.3\n",
        "ppo.clip_coef: unknown key hihg",
    ),
    "a bare value": ("[ppo]\nclip_coef = 0.1\n", "ppo.clip_coef: an entry is a table"),
}


@pytest.mark.parametrize("case", list(BAD_SPACES))
def test_a_bad_space_file_is_one_line_naming_the_entry(
    case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text, expected = BAD_SPACES[case]
    path = tmp_path / "space.toml"
    path.write_text(text)
    argv = ["tune", "CartPole-v1", "--space", str(path), "--study-dir", str(tmp_path / "s")]
    code, _out, err = run_cli(argv, capsys)
    assert code == 2
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith(f"trustrl: error: space file {path}: {expected}"), err
    assert not (tmp_path / "s").exists()  # refused before anything was made


def test_a_space_file_samples_config_values(tmp_path: Path) -> None:
    path = tmp_path / "space.toml"
    path.write_text(
        '"ppo.learning_rate" = { low = 1e-5, high = 1e-2, log = true }\n'
        "[ppo.update_epochs]\nlow = 2\nhigh = 20\nstep = 2\n"
        "[policy]\nhidden_sizes = { choices = [[64, 64], [256, 256]] }\n"
        'activation = { choices = ["tanh", "relu"] }\n'
    )
    space = read_space(str(path), "ppo")
    assert space.names == [
        "ppo.learning_rate",
        "ppo.update_epochs",
        "policy.hidden_sizes",
        "policy.activation",
    ]
    fixed = optuna.trial.FixedTrial(
        {
            "ppo.learning_rate": 3e-4,
            "ppo.update_epochs": 6,
            "policy.hidden_sizes": "[256, 256]",  # Optuna's choices are JSON text
            "policy.activation": "relu",
        }
    )
    values = space.sample(fixed)
    settings = tuning.plan(tmp_path / "s", "CartPole-v1", budget=512, space=space)
    config = resolve("CartPole-v1", overrides=settings.trial_overrides(values, 7, tmp_path))
    assert config.policy.hidden_sizes == (256, 256) and config.policy.activation == "relu"
    assert config.ppo.update_epochs == 6 and config.seed == 7 and config.target_return is None


@pytest.mark.parametrize("algo", ["ppo", "trpo"])
def test_the_default_space_fits_every_preset(algo: str) -> None:
    for info in list_presets(algo):
        if ":" in info.env_id:  # PettingZoo: the same sections, checked by CartPole's
            continue
        base = resolve(info.env_id, algo)
        space = default_space(base, box_actions=True)
        check_space(space, base)
        smallest_batch = base.num_envs * min(
            space.params[space.names.index("rollout.num_steps")].choices
        )
        minibatches = "ppo.num_minibatches" if algo == "ppo" else "trpo.minibatches"
        assert max(space.params[space.names.index(minibatches)].choices) <= smallest_batch
    names = default_space(resolve("CartPole-v1", algo), box_actions=False).names
    assert "policy.log_std_init" not in names
    assert ("ppo.learning_rate" if algo == "ppo" else "trpo.max_kl") in names


def test_box_actions_add_the_initial_log_std() -> None:
    assert "policy.log_std_init" in tuning.plan(None, "Pendulum-v1").space.names
    assert "policy.log_std_init" not in tuning.plan(None, "CartPole-v1").space.names


def test_importances_and_the_top_table(tmp_path: Path) -> None:
    space = read_space(_write(tmp_path / "s.toml", SPACE), "ppo")
    settings = tuning.plan(tmp_path / "study", "CartPole-v1", budget=512, space=space)
    study = optuna.create_study(direction="maximize")
    for number in range(6):
        params = {"ppo.learning_rate": 1e-3 * (1 + number / 3), "ppo.update_epochs": 5 + number % 2}
        study.add_trial(
            optuna.trial.create_trial(
                params=params,
                distributions={
                    "ppo.learning_rate": optuna.distributions.FloatDistribution(
                        1e-3, 3e-3, log=True
                    ),
                    "ppo.update_epochs": optuna.distributions.IntDistribution(5, 10),
                },
                value=100.0 * number,
                user_attrs={"seed": 1000 + number},
            )
        )
    outcome = tuning.TuneOutcome(study, settings, interrupted=False, best_file=None)
    found, note = tuning.importances(outcome)
    assert set(found) == {"ppo.learning_rate", "ppo.update_epochs"}
    assert note == "parameter importances over 6 completed trials"
    table = tuning.top_trials_table(outcome, count=3).splitlines()
    assert table[0] == "top 3 of 6 trials (6 completed):"
    assert table[1].split() == ["trial", "#5", "#4", "#3"]
    assert table[2].split() == ["objective", "500.00", "400.00", "300.00"]


def _write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


def readme_tune_lines() -> list[list[str]]:
    """The README's ``trustrl tune`` command lines (placeholders included: they must
    parse too)."""
    text = (ROOT / "README.md").read_text()
    lines = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.DOTALL):
        for line in block.splitlines():
            words = shlex.split(line, comments=True)
            if words[:2] == ["trustrl", "tune"] and not any(w.startswith("[") for w in words):
                lines.append(words[2:])
    return lines


def test_the_readme_tune_lines_parse() -> None:
    lines = readme_tune_lines()
    assert len(lines) >= 3
    for argv in lines:
        cli.tune_parser().parse_args(argv)


def test_importing_trustrl_loads_no_optuna() -> None:
    code = (
        "import importlib, pkgutil, sys, trustrl\n"
        "for m in pkgutil.walk_packages(trustrl.__path__, 'trustrl.'):\n"
        "    if not m.name.endswith('__main__'):\n"
        "        importlib.import_module(m.name)\n"
        "print('optuna' in sys.modules)\n"
    )
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert child.returncode == 0, child.stderr[-2000:]
    assert child.stdout.split() == ["False"]
