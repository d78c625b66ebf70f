"""Training with Ray runners: the same trainer, the envs in actors, lost runners replaced.

Each test starts its own loopback Ray instance (trustrl.remote.cluster) and stops it;
the module shares the "ray" xdist group with tests/test_ray_cluster.py, so no two Ray
instances run at once.
"""

from __future__ import annotations

import csv
import importlib.util
import os
import signal
from pathlib import Path
from typing import Any

import pytest

import trustrl
from trustrl.run.trainer import Trainer

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="needs trustrl[ray]"),
    pytest.mark.xdist_group("ray"),
    pytest.mark.time_limit(150),
]

STEPS = 32  # per env and iteration
CLOCKS = ("sps", "wall_time", "learner_busy", "runner_idle")  # measured time


def config(iterations: int, **runners: Any) -> trustrl.Config:
    """Two runners over 4 envs; ``runners`` sets the [runners] section's other fields."""
    table = {
        "quiet": True,
        "runners": {"count": 2, **runners},
        "total_steps": iterations * 4 * STEPS,
        "eval_episodes": 0,
        "checkpoint_every": 2,
        "env": {"num_envs": 4, "normalize_obs": True, "normalize_reward": True},
        "rollout": {"num_steps": STEPS},
    }
    return trustrl.resolve("CartPole-v1", overrides=table)


def progress(run_dir: Path) -> list[dict[str, str]]:
    with (run_dir / "progress.csv").open() as f:
        return list(csv.DictReader(f))


def without_clocks(rows: list[dict[str, str]]) -> list[dict[str, str]]:
    return [{k: v for k, v in row.items() if k not in CLOCKS} for row in rows]


def test_same_seed_same_runners_same_progress_and_exact_statistics(tmp_path: Path) -> None:
    """Two runs, 2 runners each: identical progress files (clocks aside); the learner's
    observation statistics took in every observation of every runner exactly once."""
    runs = []
    for name in ("a", "b"):
        trainer = Trainer(config(3), tmp_path / name)
        policy = trainer.train()
        runs.append(progress(tmp_path / name))
        assert isinstance(policy, trustrl.Policy) and policy.obs_normalizer is not None
        assert policy.obs_normalizer.count.item() == 3 * 4 * STEPS
    assert without_clocks(runs[0]) == without_clocks(runs[1])
    assert [float(r["env_steps"]) for r in runs[0]] == [128.0, 256.0, 384.0]
    assert {float(r["runner_restarts"]) for r in runs[0]} == {0.0}


def test_sigkilled_runner_is_replaced_and_the_lost_batch_never_reaches_the_learner(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trainer = Trainer(config(5), tmp_path)
    runners: Any = trainer.collector
    collect = runners.collect
    killed: list[int] = []
    later: list[list[int]] = []

    def collect_with_a_kill(snapshot: Any, train: bool = True) -> Any:
        if trainer.iteration == 2 and not killed:
            pid = runners.pids()[1]
            os.kill(pid, signal.SIGKILL)  # mid-run: before runner-1 collects iteration 3
            killed.append(pid)
        if trainer.iteration == 4:
            later.append(runners.pids())
        return collect(snapshot, train)

    runners.collect = collect_with_a_kill
    policy = trainer.train()
    rows = progress(tmp_path)
    with capsys.disabled():
        print(
            f"\nSIGKILL runner-1 (pid {killed[0]}) before iteration 3: runner_restarts per "
            f"iteration {[r['runner_restarts'] for r in rows]}, env_steps "
            f"{[r['env_steps'] for r in rows]}"
        )
    assert killed[0] not in later[0]  # runner-1 is a new process
    assert [float(r["env_steps"]) for r in rows] == [128.0 * i for i in range(1, 6)]
    assert [float(r["runner_restarts"]) for r in rows] == [0, 0, 1, 1, 1]
    # The learner merged exactly five complete iterations of observations: nothing of
    # the lost batch, nothing twice.
    assert isinstance(policy, trustrl.Policy) and policy.obs_normalizer is not None
    assert policy.obs_normalizer.count.item() == 5 * 4 * STEPS


def test_runners_that_keep_failing_stop_the_run(tmp_path: Path) -> None:
    from trustrl.remote.runners import RunnerFailedError

    trainer = Trainer(config(4, failures=1), tmp_path)
    runners: Any = trainer.collector
    collect = runners.collect

    def collect_with_a_kill(snapshot: Any, train: bool = True) -> Any:
        if trainer.iteration == 1:
            os.kill(runners.pids()[0], signal.SIGKILL)
        return collect(snapshot, train)

    runners.collect = collect_with_a_kill
    with pytest.raises(RunnerFailedError, match="runner-0 failed"):
        trainer.train()
    assert len(progress(tmp_path)) == 1


def test_resume_with_runners_continues_the_run(tmp_path: Path) -> None:
    Trainer(config(2), tmp_path).train()
    resumed = Trainer(config(4), tmp_path, resume=True)
    assert resumed.iteration == 2 and not resumed.envs_restored
    resumed.train()
    assert [float(r["env_steps"]) for r in progress(tmp_path)] == [128.0 * i for i in range(1, 5)]


def test_asynchronous_collection_trains_on_fresh_batches_and_drops_stale_ones(
    tmp_path: Path,
) -> None:
    """With runners.async_batches = 1 each update takes one runner's batch as it arrives;
    with runners.max_version_lag = 0 a batch of an older policy is dropped (the other
    runner's first batch at least), and every trained row came from the current policy."""
    cfg = config(3, async_collection=True, max_version_lag=0, async_batches=1)
    assert cfg.batch_size == 2 * STEPS  # one runner's envs
    policy = Trainer(cfg, tmp_path / "lag0").train()
    rows = progress(tmp_path / "lag0")
    assert [float(r["env_steps"]) for r in rows] == [64.0 * i for i in range(1, 7)]
    assert {float(r["version_lag_max"]) for r in rows} == {0.0}
    assert float(rows[-1]["dropped_rollouts"]) >= 1
    for r in rows:
        assert 0.0 <= float(r["learner_busy"]) <= 1.0
        assert 0.0 <= float(r["runner_idle"]) <= 1.0
    # The statistics took in exactly the trained batches' observations.
    assert isinstance(policy, trustrl.Policy) and policy.obs_normalizer is not None
    assert policy.obs_normalizer.count.item() == 6 * 2 * STEPS

    Trainer(
        config(3, async_collection=True, max_version_lag=1, async_batches=1), tmp_path / "lag1"
    ).train()
    rows = progress(tmp_path / "lag1")
    assert len(rows) == 6 and max(float(r["version_lag_max"]) for r in rows) <= 1.0

    # The default: a batch per runner, so an update trains on as many rows as a synchronous
    # one, of versions at most one behind.
    cfg = config(4, async_collection=True)
    assert cfg.runners.rollouts_per_update == 2 and cfg.batch_size == 4 * STEPS
    policy = Trainer(cfg, tmp_path / "joined").train()
    rows = progress(tmp_path / "joined")
    assert [float(r["env_steps"]) for r in rows] == [128.0 * i for i in range(1, 5)]
    assert max(float(r["version_lag_max"]) for r in rows) <= 1.0
    assert policy.obs_normalizer is not None
    assert policy.obs_normalizer.count.item() == 4 * 4 * STEPS


def test_runners_are_spread_over_the_nodes_of_a_two_node_cluster(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``ray.cluster_utils.Cluster`` with a head and a second node on this machine: a run
    joining it (``runners.ray_address``) places its two runners on both nodes and trains."""
    import shutil
    import subprocess
    import sys
    import tempfile

    from trustrl.remote.cluster import import_ray

    ray_tmp = Path(tempfile.mkdtemp(prefix="trl", dir="/tmp"))  # short: socket paths
    monkeypatch.setenv("RAY_TMPDIR", str(ray_tmp))
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    ray = import_ray(loopback=True)
    from ray.cluster_utils import Cluster

    ray_cli = Path(sys.executable).with_name("ray")
    subprocess.run([str(ray_cli), "get-auth-token", "--generate"], check=True, capture_output=True)
    cluster = Cluster(
        initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False}
    )
    try:
        cluster.add_node(num_cpus=1)
        trainer = Trainer(config(2, ray_address=cluster.address), tmp_path)
        runners: Any = trainer.collector
        placed = runners.node_ids()
        nodes = {node["NodeID"] for node in ray.nodes() if node["Alive"]}
        trainer.train()
        assert len(set(placed)) == 2 and set(placed) == nodes, (placed, nodes)
        assert [float(r["env_steps"]) for r in progress(tmp_path)] == [128.0, 256.0]
    finally:
        cluster.shutdown()
        shutil.rmtree(ray_tmp, ignore_errors=True)


@pytest.mark.parametrize(
    ("env_id", "algo", "table"),
    [
        ("CartPole-v1", "trpo", {"env": {"num_envs": 4}}),
        ("mpe2:simple_spread_v3", "ppo", {"env": {"num_envs": 2}}),
    ],
    ids=["trpo", "multiagent"],
)
def test_trpo_and_multiagent_ppo_go_through_the_same_runners(
    env_id: str, algo: str, table: dict[str, Any], tmp_path: Path
) -> None:
    envs = table["env"]["num_envs"]
    overrides = {
        "quiet": True,
        "runners": {"count": 2},
        "eval_episodes": 0,
        "total_steps": 2 * envs * 16,
        "rollout": {"num_steps": 16},
        **table,
    }
    trainer = Trainer(trustrl.resolve(env_id, algo, overrides=overrides), tmp_path)
    trainer.train()
    rows = progress(tmp_path)
    assert [float(r["env_steps"]) for r in rows] == [envs * 16.0, 2 * envs * 16.0]
    assert all(r["loss_v"] not in ("", "nan") for r in rows)


@pytest.mark.parametrize("async_collection", [False, True])
def test_recurrent_policies_train_on_runners_with_their_chunk_states(
    tmp_path: Path, async_collection: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each runner carries its rows' recurrent states; the joined batch's chunk-start
    states line up with the chunks of the joined rows (acting/memory.py's order)."""
    import dataclasses

    import trustrl.run.trainer as trainer_module
    from trustrl.acting.memory import chunk_layout

    base = config(3, async_collection=async_collection)
    recurrent = dataclasses.replace(
        base,
        policy=dataclasses.replace(base.policy, memory="gru", memory_size=8),
        rollout=dataclasses.replace(base.rollout, sequence_length=8),
    )
    seen = []
    absorb = trainer_module.absorb

    def recording(*args: Any) -> Any:
        rollouts = absorb(*args)
        seen.extend(rollouts)
        return rollouts

    monkeypatch.setattr(trainer_module, "absorb", recording)
    trainer = Trainer(recurrent, tmp_path)
    trainer.train()
    assert len(seen) == 3
    for rollout in seen:
        assert rollout.starts is not None and rollout.states is not None
        chunks = len(chunk_layout(rollout.starts.numpy(), 8)[0])
        assert rollout.states.shape == (chunks, trainer.policy.state_size)  # type: ignore[union-attr]
        assert rollout.num_rows == 4
    rows = progress(tmp_path)
    assert len(rows) == 3 and all(float(r["loss_v"]) == float(r["loss_v"]) for r in rows)
