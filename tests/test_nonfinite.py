"""Non-finite observations and rewards: stopped where they enter, never taken into the
normalizer's statistics; a run whose update steps all fail stops and says why."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.test_cli import run_cli
from trustrl.config import resolve
from trustrl.envs.rows import AgentGroup, GroupObs, GroupStep, NonFiniteError, check_finite
from trustrl.envs.spaces import SpaceSpec
from trustrl.normalize import MeanStd
from trustrl.run.logging import read_progress
from trustrl.run.trainer import FAILED_UPDATES_LIMIT, Trainer, TrainingError

ENV = "tests.envs:NonFiniteEnv"


def config(run_dir: Path, **kwargs: Any) -> Any:
    return resolve(
        ENV,
        overrides={
            "quiet": True,
            "total_steps": 8 * 16,
            "eval_episodes": 0,
            "checkpoint_every": 1,
            "run_dir": str(run_dir),
            "env": {"num_envs": 2, "normalize_obs": True, "kwargs": kwargs},
            "rollout": {"num_steps": 16},
            "ppo": {"num_minibatches": 2, "update_epochs": 1},
        },
    )


@pytest.mark.parametrize(
    ("kwargs", "fragments"),
    [
        # The env's own step 40 is its vector env's step 43 (a reset step per episode).
        ({"at": 40}, ["non-finite observation at env step 43, row 0", "entries [2] = nan"]),
        ({"at": 40, "value": math.inf, "entry": 0}, ["observation", "entries [0] = inf"]),
        ({"at": 0}, ["non-finite observation at reset, row 0", "[2] = nan"]),
        ({"where": "reward", "at": 21}, ["non-finite reward at env step 23, row 0", "= nan"]),
        ({"where": "reward", "at": 21, "value": -math.inf}, ["reward", "= -inf"]),
    ],
    ids=["obs-nan", "obs-inf", "reset", "reward-nan", "reward-inf"],
)
def test_a_non_finite_value_stops_the_run_naming_env_row_step_and_entries(
    tmp_path: Path, kwargs: dict[str, Any], fragments: list[str]
) -> None:
    cfg = config(tmp_path / "run", **kwargs)
    with pytest.raises((TrainingError, NonFiniteError)) as info:
        Trainer(cfg).train()
    message = str(info.value)
    assert message.startswith(f"{ENV} returned a non-finite"), message
    for fragment in fragments:
        assert fragment in message, message
    assert "(and 1 more rows)" in message  # both envs hit it at once
    if kwargs["at"] >= 32:  # after two iterations, each checkpointed
        assert "the last good checkpoint is" in message and "iter_00000002" in message


def test_the_cli_reports_it_as_an_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = tmp_path / "run"
    argv = ["train", ENV, "--quiet", "--run-dir", str(run_dir), "--env.num-envs", "2"]
    argv += ["--rollout.num-steps", "16", "--checkpoint-every", "1", "--total-steps", "2048"]
    code, _, err = run_cli([*argv, "--env.kwargs", "at", "40"], capsys)
    assert code == 1
    assert err.startswith(f"trustrl: error: {ENV} returned a non-finite observation")
    assert "Traceback" not in err
    assert (run_dir / "checkpoints" / "latest").is_file()  # the last good one is kept


def test_the_normalizer_never_took_the_value(tmp_path: Path) -> None:
    trainer = Trainer(config(tmp_path / "run", at=40))
    with pytest.raises(TrainingError):
        trainer.train()
    normalizer = trainer.policy.obs_normalizer
    assert normalizer is not None
    assert all(torch.isfinite(t).all() for t in (normalizer.mean, normalizer.var))


def test_check_finite_names_the_agent_and_skips_finished_rows() -> None:
    spec = SpaceSpec((2,), "discrete", (), (2,))
    groups = [AgentGroup("adversary", ("adversary_0", "adversary_1"), spec)]
    obs = np.zeros((4, 2), np.float32)
    obs[3, 1] = np.nan
    alive = np.array([True, True, True, False])  # row 3's agent finished: stale data
    check_finite("mpe2:simple_tag_v3", [GroupObs(obs, alive=alive)], None, 7, groups)
    alive[3] = True
    with pytest.raises(NonFiniteError, match=r"row 3, agent adversary_1: entries \[1\] = nan"):
        check_finite("mpe2:simple_tag_v3", [GroupObs(obs, alive=alive)], None, 7, groups)
    step = GroupStep(np.array([0.0, np.nan, 0.0, 0.0]), np.zeros(4, bool), np.zeros(4, bool))
    with pytest.raises(NonFiniteError, match=r"reward at env step 7, row 1, agent adversary_1"):
        check_finite("x", [GroupObs(np.zeros((4, 2), np.float32))], [step], 7, groups)


BAD = (math.nan, math.inf, -math.inf)


@pytest.mark.parametrize("bad", BAD)
def test_every_normalizer_update_path_leaves_non_finite_values_out(bad: float) -> None:
    # (B, d) batches, one row (the collector's shortcut), selected rows, scalars.
    vector = MeanStd(3)
    vector.update(np.array([[1.0, 2.0, 3.0], [1.0, bad, 3.0], [3.0, 4.0, 5.0]]))
    vector.update_normalize(np.array([[bad, 0.0, 0.0]], np.float32))
    vector.update_normalize(np.array([[1.0, 1.0, bad], [1.0, 1.0, 1.0]]), rows=np.array([0]))
    np.testing.assert_allclose(vector.mean, [2.0, 3.0, 4.0])
    assert float(vector.count) == 2
    scalar = MeanStd(())
    scalar.update(np.array([bad]))
    scalar.update_scalar(bad)
    scaled = scalar.update_and_scale([2.0, bad, 4.0], [1.0, 1.0, 1.0])
    assert float(scalar.count) == 2 and float(scalar.mean) == 3.0
    assert all(math.isfinite(v) for v in scaled)


def test_a_run_without_a_successful_update_step_stops(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    failed = {"loss_pi": math.nan, "loss_v": math.nan, "nonfinite_skips": 4.0}
    monkeypatch.setattr(Trainer, "_update", lambda self, progress, *rollouts: dict(failed))
    trainer = Trainer(config(tmp_path / "run", at=10**9))
    with pytest.raises(
        TrainingError,
        match=f"no update step succeeded in the last {FAILED_UPDATES_LIMIT} iterations",
    ):
        trainer.train()
    assert trainer.iteration == FAILED_UPDATES_LIMIT


def test_a_trpo_run_whose_critic_loss_overflows_stops(tmp_path: Path) -> None:
    """Rewards of 1e30, finite but with a squared error past float32: TRPO skips and
    counts every critic step, takes no policy step on such a rollout, and the run stops as
    a PPO run does."""
    cfg = resolve(
        ENV,
        "trpo",
        overrides={
            "quiet": True,
            "total_steps": 10 * 32,
            "eval_episodes": 0,
            "run_dir": str(tmp_path / "run"),
            "env": {
                "num_envs": 2,
                "kwargs": {"where": "reward", "at": 1, "value": 1e30, "every": True},
            },
            "rollout": {"num_steps": 16},
            "trpo": {"minibatches": 2, "train_vf_iters": 2},
        },
    )
    trainer = Trainer(cfg)
    initial = {k: v.clone() for k, v in trainer.policy.state_dict().items()}
    with (
        pytest.warns(RuntimeWarning, match=r"loss_v \(4x\)"),
        pytest.raises(TrainingError, match="no update step succeeded"),
    ):
        trainer.train()
    assert trainer.iteration == FAILED_UPDATES_LIMIT
    rows = read_progress(tmp_path / "run" / "progress.csv")
    assert [row["nonfinite_skips"] for row in rows] == [4.0] * FAILED_UPDATES_LIMIT
    assert all(math.isnan(row["loss_pi"]) and math.isnan(row["loss_v"]) for row in rows)
    for name, value in trainer.policy.state_dict().items():
        if "normalizer" not in name:
            assert torch.equal(value, initial[name]), name


def test_one_good_update_resets_the_count(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = iter(range(100))

    def update(self: Trainer, progress: float, *rollouts: Any) -> dict[str, float]:
        good = next(calls) % FAILED_UPDATES_LIMIT == 0
        return {"loss_pi": 0.1 if good else math.nan, "loss_v": math.nan}

    monkeypatch.setattr(Trainer, "_update", update)
    trainer = Trainer(config(tmp_path / "run", at=10**9))
    trainer.train()
    assert trainer.outcome == "finished"


# env.nonfinite = "drop": the episode ends where the value appeared, untrained from there.


def test_a_dropped_episode_ends_before_the_bad_step_and_is_not_reported() -> None:
    from tests.collecting import collect
    from trustrl.acting.collector import Collector
    from trustrl.envs.gym import make_row_env
    from trustrl.learner.policy import Policy

    cfg = resolve(ENV, overrides={"env": {"num_envs": 1, "nonfinite": "drop", "kwargs": {"at": 5}}})
    collector = Collector(make_row_env(cfg), seed=0, gamma=0.99)
    policy = Policy(collector.spec)
    rollout, stats = collect(collector, policy, 16)
    valid, truncated = rollout.valid[:, 0].numpy(), rollout.truncated[:, 0].numpy()
    # The env's step 5 (t = 4) handed out NaN: the episode ends, truncated, at t = 3, and
    # t = 4 is its reset step; the new episode starts at t = 5 and ends at t = 14.
    assert valid.tolist() == [True] * 4 + [False] + [True] * 10 + [False]
    assert truncated.nonzero()[0].tolist() == [3]
    assert rollout.terminated[:, 0].nonzero()[0].tolist() == [14]
    assert torch.isfinite(rollout.obs).all() and torch.isfinite(rollout.rewards).all()
    np.testing.assert_array_equal(rollout.obs[5, 0].numpy(), np.zeros(4))  # the reset obs
    assert stats.dropped == 1
    assert stats.lengths == [10]  # only the new episode is reported
    assert stats.returns == [float(rollout.actions[5:15, 0].sum())]


@pytest.mark.parametrize(
    ("where", "backend"), [("observation", "sync"), ("reward", "sync"), ("observation", "async")]
)
def test_a_run_dropping_episodes_goes_on_and_counts_them(
    tmp_path: Path, where: str, backend: str
) -> None:
    from trustrl.run.logging import read_progress

    base = config(tmp_path / "run", where=where, at=40)
    table = {"env": {"nonfinite": "drop", "backend": backend}}
    cfg = resolve(ENV, overrides=_merge(base, table))
    trainer = Trainer(cfg)
    trainer.train()
    rows = read_progress(tmp_path / "run" / "progress.csv")
    assert sum(r["dropped_episodes"] for r in rows) == 2  # both envs, once each
    assert all(math.isfinite(r["loss_pi"]) and math.isfinite(r["loss_v"]) for r in rows)
    assert all(torch.isfinite(t).all() for t in trainer.policy.state_dict().values())


def _merge(config_: Any, table: dict[str, Any]) -> dict[str, Any]:
    from trustrl.config import config_to_dict, merge

    return merge(config_to_dict(config_), table)


@pytest.mark.parametrize(
    ("env_id", "backend", "message"),
    [
        ("CartPole-v1", "vector", "use env.backend sync or async"),
        ("CartPole-v1", "auto", "use env.backend sync or async"),
        ("mpe2:simple_spread_v3", "auto", "is for Gymnasium envs"),
    ],
)
def test_drop_is_refused_where_it_cannot_work(env_id: str, backend: str, message: str) -> None:
    from trustrl.config import ConfigError
    from trustrl.envs.gym import make_row_env

    cfg = resolve(env_id, overrides={"env": {"nonfinite": "drop", "backend": backend}})
    with pytest.raises(ConfigError, match=message):
        make_row_env(cfg)
