"""One short training run per action space, backend and optimizer setting.

Each run is two iterations of a few dozen steps: enough to go through collection,
advantages, the update, logging, checkpoints and the final evaluation. The run
folder must hold everything the README promises.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import threading
import tomllib
import warnings
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import pytest
import torch
from threadpoolctl import threadpool_info

import trustrl
from tests import envs as E
from trustrl.config import (
    Config,
    EnvConfig,
    PolicyConfig,
    PPOConfig,
    RolloutConfig,
    config_from_dict,
)
from trustrl.envs.gym import env_factory
from trustrl.learner.warn import warn
from trustrl.run.logging import read_progress
from trustrl.run.trainer import Trainer

METRICS = (
    "episode_return_mean",
    "episode_return_std",
    "episode_return_min",
    "episode_return_max",
    "episode_length_mean",
    "loss_pi",
    "delta_loss_pi",
    "loss_v",
    "delta_loss_v",
    "approx_kl",
    "entropy",
    "clip_fraction",
    "explained_variance",
    "stop_iter",
    "learning_rate",
    "env_steps",
    "sps",
    "wall_time",
)
# Finite in every iteration of every smoke run (episodes are short everywhere, so each
# iteration finishes some; the others may legitimately be nan, e.g. clip_fraction of an
# epoch the KL stop skipped).
ALWAYS_FINITE = (
    "episode_return_mean",
    "episode_length_mean",
    "loss_pi",
    "loss_v",
    "approx_kl",
    "entropy",
    "explained_variance",
    "stop_iter",
    "learning_rate",
    "env_steps",
    "sps",
    "wall_time",
)

NUM_ENVS, NUM_STEPS, ITERATIONS = 2, 16, 2

ENVS = {
    "CartPole-v1": ("sync", "async", "vector"),
    "tests.envs:MaskedInfoEnv": ("sync", "async"),
    "tests.envs:MaskedDictEnv": ("sync", "async"),
    "tests.envs:MultiDiscreteEnv": ("sync", "async"),
    "Pendulum-v1": ("sync", "async"),
    "tests.envs:ImageBoxEnv": ("sync", "async"),
}
CASES = [
    pytest.param(env_id, backend, separate, id=f"{env_id}-{backend}-{opt}")
    for env_id, backends in ENVS.items()
    for backend in backends
    for separate, opt in ((False, "shared"), (True, "separate"))
    # The async backend only changes where envs run: one optimizer setting is enough.
    if backend != "async" or separate
]


# Gymnasium envs get a short time limit, so that every iteration finishes episodes.
ENV_KWARGS = {"CartPole-v1": {"max_episode_steps": 12}, "Pendulum-v1": {"max_episode_steps": 12}}


def smoke_config(env_id: str, backend: str, separate: bool, **extra) -> Config:
    ppo = PPOConfig(
        learning_rate=1e-3,
        pi_lr=1e-3 if separate else None,
        vf_lr=2e-3 if separate else None,
        vf_epochs=3 if separate else None,
        update_epochs=2,
        num_minibatches=2,
        target_kl=0.5,
    )
    return Config(
        env_id=env_id,
        seed=4,
        total_steps=ITERATIONS * NUM_ENVS * NUM_STEPS,
        quiet=True,
        eval_episodes=1,
        checkpoint_every=1,
        env=EnvConfig(num_envs=NUM_ENVS, backend=backend, kwargs=ENV_KWARGS.get(env_id, {})),
        rollout=RolloutConfig(num_steps=NUM_STEPS),
        policy=PolicyConfig(hidden_sizes=(16,)),
        ppo=ppo,
        **extra,
    )


def tensorboard_scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder))
    events.Reload()
    return {
        tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]
    }


def run_episode(policy: trustrl.Policy, env: gym.Env, seed: int, deterministic: bool) -> int:
    """Act with single raw observations until the episode ends; returns its length."""
    obs, info = env.reset(seed=seed)
    for step in range(1, 1000):
        action = policy.act(obs, deterministic=deterministic, mask=info.get("action_mask"))
        assert env.action_space.contains(action), f"{action!r} not in {env.action_space}"
        obs, _, terminated, truncated, info = env.step(action)
        if terminated or truncated:
            return step
    raise AssertionError("episode did not end")


@pytest.mark.parametrize(("env_id", "backend", "separate"), CASES)
def test_smoke(tmp_path: Path, env_id: str, backend: str, separate: bool) -> None:
    config = smoke_config(env_id, backend, separate)
    trainer = Trainer(config, tmp_path)
    policy = trainer.train()
    assert trainer.iteration == ITERATIONS

    rows = read_progress(tmp_path / "progress.csv")
    assert len(rows) == ITERATIONS
    assert set(METRICS) <= set(rows[0]), set(METRICS) - set(rows[0])
    assert ("vf_learning_rate" in rows[0]) == separate
    for n, row in enumerate(rows, start=1):
        assert row["iteration"] == n
        assert row["env_steps"] == n * NUM_ENVS * NUM_STEPS
        for name in ALWAYS_FINITE:
            assert math.isfinite(row[name]), (n, name, row[name])
        assert row["episodes"] >= 1
        assert row["episode_return_min"] <= row["episode_return_mean"]
        assert row["episode_return_mean"] <= row["episode_return_max"]
        assert 1 <= row["stop_iter"] <= 2
        assert 0 <= row["clip_fraction"] <= 1 or math.isnan(row["clip_fraction"])
        assert row["entropy"] > 0
    # anneal_lr: the step size of iteration n is base * (1 - (n - 1) / iterations).
    assert rows[0]["learning_rate"] == pytest.approx(1e-3)
    assert rows[1]["learning_rate"] == pytest.approx(1e-3 * (1 - 1 / ITERATIONS))
    if separate:
        assert rows[0]["vf_learning_rate"] == pytest.approx(2e-3)
    assert rows[1]["wall_time"] >= rows[0]["wall_time"] > 0

    written = tomllib.loads((tmp_path / "config.toml").read_text())
    assert config_from_dict(written) == config
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    scalars = tensorboard_scalars(tmp_path / "tensorboard")
    assert set(ALWAYS_FINITE) <= set(scalars), set(ALWAYS_FINITE) - set(scalars)
    for name in ("loss_pi", "loss_v", "entropy", "episode_return_mean"):
        steps = [step for step, _ in scalars[name]]
        assert steps == [row["env_steps"] for row in rows], name
        values = [value for _, value in scalars[name]]
        assert values == pytest.approx([row[name] for row in rows], rel=1e-6), name
    checkpoints = tmp_path / "checkpoints"
    assert (checkpoints / "latest").read_text().strip() == "final"
    for name in ("final", "iter_00000001", "iter_00000002"):
        assert (checkpoints / name / "policy.safetensors").is_file(), name
        assert (checkpoints / name / "meta.json").is_file(), name
    assert trainer.eval_result is not None and len(trainer.eval_result.returns) == 1
    assert (tmp_path / "eval.json").is_file()

    # The trained policy acts on single raw observations with valid env actions
    # (the test envs raise on an action outside the space or against the mask).
    env = env_factory(env_id, config.env.kwargs)()
    try:
        run_episode(policy, env, seed=0, deterministic=True)
        run_episode(policy, env, seed=1, deterministic=False)
    finally:
        env.close()


# --- policy.act on single raw observations, with forced preferences. ---


def fresh_policy(env: gym.Env, info_mask: bool = False) -> trustrl.Policy:
    from trustrl.envs.spaces import SpaceSpec

    spec = SpaceSpec.from_spaces(env.observation_space, env.action_space, info_mask)
    torch.manual_seed(0)
    return trustrl.Policy(spec, PolicyConfig(hidden_sizes=(8,)))


def test_act_discrete_info_mask() -> None:
    env = E.MaskedInfoEnv(n=5)
    policy = fresh_policy(env, info_mask=True)
    with torch.no_grad():
        policy.head.linear.bias.copy_(torch.tensor([0.0, 0.0, 0.0, 0.0, 50.0]))
    obs, info = env.reset(seed=0)
    assert not info["action_mask"][4]
    # Without the mask the policy wants the forbidden action 4 ...
    assert policy.act(obs) == 4
    # ... with it, it never takes it, deterministic or sampled.
    allowed = set(np.flatnonzero(info["action_mask"]))
    action = policy.act(obs, mask=info["action_mask"])
    assert isinstance(action, np.integer) and np.ndim(action) == 0
    assert int(action) in allowed
    for _ in range(20):
        assert int(policy.act(obs, deterministic=False, mask=info["action_mask"])) in allowed
    # A batch of observations gives a batch of actions.
    batch = np.stack([obs, obs])
    masks = np.stack([info["action_mask"], np.eye(5, dtype=np.int8)[4]])
    assert policy.act(batch, mask=masks).tolist() == [int(action), 4]


def test_act_discrete_dict_mask() -> None:
    env = E.MaskedDictEnv(n=4)
    policy = fresh_policy(env)
    with torch.no_grad():
        policy.head.linear.bias.copy_(torch.tensor([0.0, 50.0, 0.0, 0.0]))
    obs, _ = env.reset(seed=0)
    assert not obs["action_mask"][1]
    action = policy.act(obs)
    assert env.action_space.contains(action)
    assert obs["action_mask"][int(action)]
    for _ in range(20):
        assert obs["action_mask"][int(policy.act(obs, deterministic=False))]
    # Where the preferred action is allowed, it is taken.
    obs, *_ = env.step(action)
    assert obs["action_mask"][1]
    assert policy.act(obs) == 1


def test_act_multidiscrete() -> None:
    env = E.MultiDiscreteEnv()
    policy = fresh_policy(env)
    with torch.no_grad():
        policy.head.linear.bias.copy_(torch.tensor([0.0, 0.0, 50.0, 0.0, 50.0, 0.0, 0.0]))
    obs, _ = env.reset(seed=0)
    action = policy.act(obs)
    assert env.action_space.contains(action)
    assert action.shape == (2,) and action.tolist() == [2, 1]
    for _ in range(10):
        assert env.action_space.contains(policy.act(obs, deterministic=False))


@pytest.mark.parametrize("env_id", ["tests.envs:ImageBoxEnv", "Pendulum-v1"])
def test_act_box_is_clipped(env_id: str) -> None:
    env = env_factory(env_id)()
    policy = fresh_policy(env)
    with torch.no_grad():
        policy.head.linear.bias.fill_(5.0)  # a mean far above the upper bound
    obs, _ = env.reset(seed=0)
    action = policy.act(obs)
    assert env.action_space.contains(action)
    assert action.shape == env.action_space.shape
    assert np.array_equal(action, env.action_space.high)
    for _ in range(10):
        assert env.action_space.contains(policy.act(obs, deterministic=False))
    env.close()


def test_act_cartpole() -> None:
    env = gym.make("CartPole-v1")
    policy = fresh_policy(env)
    assert run_episode(policy, env, seed=0, deterministic=True) >= 1
    obs, _ = env.reset(seed=0)
    with torch.no_grad():
        policy.head.linear.bias.copy_(torch.tensor([0.0, 50.0]))
    assert policy.act(obs) == 1
    env.close()


def test_tensorboard_rows_keep_their_wall_times_and_a_resume_purges(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows wait for the writer's first flush (FLUSH_SECONDS or close) with the wall time
    they were written at; a writer opened with purge_step hides the events from that step
    on (a resume from the checkpoint at step 2 passes 3: the row of step 2 stays)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from trustrl.run import logging as log

    clock = [1000.0]
    monkeypatch.setattr(log.time, "time", lambda: clock[0])
    writer = log.TensorBoardWriter(tmp_path)
    for step in (1, 2, 3):
        clock[0] += 10.0
        writer.write({"loss": float(step), "skipped": math.nan}, step)
    assert writer.writer is None  # nothing started before a flush is due
    writer.close()
    resumed = log.TensorBoardWriter(tmp_path, purge_step=3)
    clock[0] += 10.0
    resumed.write({"loss": 20.0}, 3)
    resumed.close()

    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert events.Tags()["scalars"] == ["loss"]
    scalars = events.Scalars("loss")
    assert [(e.step, e.value) for e in scalars] == [(1, 1.0), (2, 2.0), (3, 20.0)]
    assert [e.wall_time for e in scalars] == [1010.0, 1020.0, 1040.0]


def test_a_resumed_run_keeps_every_iteration_in_tensorboard(tmp_path: Path) -> None:
    config = dataclasses.replace(
        smoke_config("CartPole-v1", "sync", False), total_steps=4 * NUM_ENVS * NUM_STEPS
    )
    Trainer(config, tmp_path).train(iterations=2)  # pauses with a checkpoint at 2
    Trainer(config, tmp_path, resume=True).train()
    rows = read_progress(tmp_path / "progress.csv")
    scalars = tensorboard_scalars(tmp_path / "tensorboard")
    assert len(rows) == 4
    assert [step for step, _ in scalars["loss_pi"]] == [row["env_steps"] for row in rows]


def _process_settings() -> tuple[int, int, list[tuple[str, int]]]:
    """What a run may change process-wide: gc's frozen objects, torch's and BLAS's threads."""
    blas = [(i["filepath"], i["num_threads"]) for i in threadpool_info() if i["user_api"] == "blas"]
    return gc.get_freeze_count(), torch.get_num_threads(), blas


def test_a_trainer_gives_back_gc_and_thread_counts_as_it_found_them(tmp_path: Path) -> None:
    """Building a Trainer changes no process-wide setting. train() sets the heap it starts
    with aside from the cyclic collector's scans and runs at ``torch_threads``, and gives
    both back when it returns: when it pauses early, finishes, or fails."""
    gc.unfreeze()
    before = _process_settings()
    threads = before[1] + 1
    config = dataclasses.replace(
        smoke_config("CartPole-v1", "sync", False),
        total_steps=2 * NUM_ENVS * NUM_STEPS,
        torch_threads=threads,
    )
    trainer = Trainer(config, tmp_path / "run")
    assert _process_settings() == before  # built, never trained
    during: list[tuple[int, int]] = []
    collect = trainer.collector.collect

    def watched(*args, **kwargs):
        during.append((gc.get_freeze_count(), torch.get_num_threads()))
        return collect(*args, **kwargs)

    trainer.collector.collect = watched  # type: ignore[method-assign]
    trainer.train(iterations=1)
    assert _process_settings() == before
    trainer.train()
    assert _process_settings() == before
    assert len(during) == 2 and all(frozen > 0 and n == threads for frozen, n in during)

    failing = Trainer(config, tmp_path / "failing")

    def fail(*args, **kwargs):
        raise RuntimeError("the runner broke")

    failing.collector.collect = fail  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="the runner broke"):
        failing.train()
    assert _process_settings() == before


@pytest.mark.parametrize("quiet", [False, True])
def test_an_updates_warning_names_its_iteration_and_no_warning_filter_is_touched(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], quiet: bool
) -> None:
    """A warning from inside an update is shown as "[iteration N] warning: ..." on the bar,
    or through ``warnings.warn`` where the run is quiet; the process-wide warning filters
    stay as they are meanwhile (``Agent.local`` trains on a thread)."""
    filters, before = warnings.filters, list(warnings.filters)
    untouched: list[bool] = []
    update = Trainer._update

    def warning_update(self: Trainer, progress: float, rollouts: Any) -> dict[str, float]:
        untouched.append(warnings.filters is filters and warnings.filters == before)
        warn("the update saw something odd", RuntimeWarning)
        return update(self, progress, rollouts)

    monkeypatch.setattr(Trainer, "_update", warning_update)
    config = dataclasses.replace(
        smoke_config("CartPole-v1", "sync", False),
        total_steps=2 * NUM_ENVS * NUM_STEPS,
        eval_episodes=0,
        quiet=quiet,
    )
    failures: list[BaseException] = []

    def train() -> None:
        try:
            Trainer(config, tmp_path).train()
        except BaseException as exc:  # re-raised on the test's thread
            failures.append(exc)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        filters, before = warnings.filters, list(warnings.filters)
        thread = threading.Thread(target=train)
        thread.start()
        thread.join()
    if failures:
        raise failures[0]
    assert untouched == [True, True]
    expected = [f"[iteration {n}] warning: the update saw something odd" for n in (1, 2)]
    if quiet:
        assert [str(w.message) for w in caught] == expected
    else:
        printed = capsys.readouterr().out
        assert all(line in printed for line in expected), printed
        assert not caught
