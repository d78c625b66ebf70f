"""``trustrl serve`` with external agents in other processes, on a loopback Ray cluster
that the test starts (and stops): a learner trained by two hand-written CartPole loops,
and a learner killed and resumed while its agents keep acting."""

from __future__ import annotations

import csv
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="needs trustrl[ray]"),
    pytest.mark.xdist_group("ray"),
    pytest.mark.time_limit(400),  # the cluster's start and stop included
]

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def show(request: pytest.FixtureRequest) -> Callable[[str], None]:
    capture = request.config.pluginmanager.getplugin("capturemanager")

    def write(text: str) -> None:
        with capture.global_and_fixture_disabled():
            print(text, flush=True)

    return write


@pytest.fixture
def cluster(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, dict[str, str]]]:
    """A one-node loopback Ray cluster with token authentication, in a private temp root;
    (its address, the environment for processes that join it)."""
    from trustrl.remote import import_ray

    tmp = Path(tempfile.mkdtemp(prefix="trl", dir="/tmp"))
    monkeypatch.setenv("RAY_TMPDIR", str(tmp))
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    import_ray(loopback=True)
    from ray.cluster_utils import Cluster

    ray_cli = Path(sys.executable).with_name("ray")
    subprocess.run([str(ray_cli), "get-auth-token", "--generate"], check=True, capture_output=True)
    head = Cluster(initialize_head=True, head_node_args={"num_cpus": 4, "include_dashboard": False})
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    try:
        yield head.address, env
    finally:
        head.shutdown()


def start(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        args, env=env, cwd=ROOT, stdout=log.open("wb"), stderr=subprocess.STDOUT
    )


def serve(run_dir: Path, name: str, address: str, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "trustrl.cli", "serve", *extra,
        "--name", name, "--runners.ray-address", address, "--quiet",
        *(["--run-dir", str(run_dir)] if "--resume" not in extra else []),
    ]  # fmt: skip


def wait_for(predicate: Callable[[], bool], what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


def finish(
    process: subprocess.Popen[bytes],
    log: Path,
    timeout: float = 240,
    others: dict[Path, subprocess.Popen[bytes]] | None = None,
) -> str:
    """Wait for ``process`` to exit 0; its output. ``others`` (log: process) must not fail
    meanwhile: a crashed agent fails the test at once, with its output."""
    deadline = time.monotonic() + timeout
    try:
        while process.poll() is None:
            for other_log, other in (others or {}).items():
                code = other.poll()
                assert code in (None, 0), other_log.read_text(errors="replace")[-3000:]
            if time.monotonic() > deadline:
                raise AssertionError(f"{log.name}: still running after {timeout:.0f} s")
            time.sleep(0.2)
    finally:
        if process.poll() is None:
            process.kill()
    text = log.read_text(errors="replace")
    assert process.returncode == 0, text[-3000:]
    return text


def progress(run_dir: Path) -> list[dict[str, str]]:
    path = run_dir / "progress.csv"
    if not path.is_file():
        return []
    with path.open() as f:
        return list(csv.DictReader(f))


@pytest.mark.slow
def test_two_processes_train_one_cartpole_policy_to_475(tmp_path: Path, cluster, show) -> None:
    address, env = cluster
    run_dir = tmp_path / "run"
    learner_log = tmp_path / "serve.log"
    # Twice the preset's budget (it still stops at the first evaluation at 475): agents
    # that act on their own clocks make this run's data depend on timing, and one CI run
    # in about fifteen, on a loaded machine, spent the preset's 49,920 steps at 384.
    # Measured here under a 2-core load: solved after 4,479-25,219 env steps (9 of 9).
    learner = start(
        serve(run_dir, "cartpole", address, "CartPole-v1", "--seed", "5", "--total-steps", "99840"),
        env,
        learner_log,
    )
    agents = [
        start(
            [
                sys.executable,
                "examples/external_cartpole.py",
                "--name",
                "cartpole",
                "--address",
                address,
                "--seed",
                str(seed),
                "--seconds",
                "240",
            ],
            env,
            tmp_path / f"agent{seed}.log",
        )
        for seed in (1, 2)
    ]
    started = time.monotonic()
    logs = {
        tmp_path / f"agent{seed}.log": agent for seed, agent in zip((1, 2), agents, strict=True)
    }
    output = finish(learner, learner_log, others=logs)
    wall = time.monotonic() - started
    results = [
        json.loads(finish(agent, tmp_path / f"agent{i}.log").strip().splitlines()[-1])
        for i, agent in zip((1, 2), agents, strict=True)
    ]
    evaluation = json.loads((run_dir / "eval.json").read_text())
    rows = progress(run_dir)
    show(
        f"\ntwo agent processes, CartPole to 475: {output.strip().splitlines()[0]}\n"
        f"  solved after {rows[-1]['env_steps']} env steps, {float(rows[-1]['wall_time']):.1f} s "
        f"of training ({wall:.1f} s from launch); evaluation {evaluation['mean_return']}\n"
        + "\n".join(f"  agent {i}: {json.dumps(r)}" for i, r in enumerate(results, 1))
    )
    assert "solved" in output or evaluation["mean_return"] >= 475
    assert evaluation["mean_return"] >= 475
    for result in results:
        assert result["steps"] > 0 and result["rejected"] == 0
        assert result["finished"]


# An application's agent loop for the outage tests (here over Ray, in test_gateway.py over
# gRPC): it acts until the learner finishes, then prints its counts. CONNECT builds the agent.
AGENT_SCRIPT = textwrap.dedent(
    """
    import json, sys, time
    import numpy as np
    import trustrl

    agent = CONNECT
    rng = np.random.default_rng(int(sys.argv[2]))
    while not agent.status()["finished"]:
        action = agent.act(rng.normal(size=3))
        for _ in range(int(rng.integers(1, 8))):
            time.sleep(0.002)  # an application's own pace
            action = agent.act(rng.normal(size=3), reward=float(action == 1))
        agent.end_episode(float(action == 1))
    produced = agent.seq
    agent.flush(30)
    status = agent.status()
    agent.close(flush_timeout=0)
    print(json.dumps({"produced": produced, **status}))
    """
)
AGENT = AGENT_SCRIPT.replace(
    "CONNECT", 'trustrl.Agent.connect("outage", address=sys.argv[1], seed=int(sys.argv[2]))'
)


def test_learner_killed_and_resumed_while_agents_act_loses_nothing(
    tmp_path: Path, cluster, show
) -> None:
    address, env = cluster
    config = tmp_path / "app.toml"
    config.write_text(
        textwrap.dedent(
            """
            total_steps = 6000
            checkpoint_every = 4
            [env]
            num_envs = 1
            [rollout]
            num_steps = 128
            [agent]
            observation_shape = [3]
            action_kind = "discrete"
            action_choices = [2]
            queue_size = 100000
            """
        )
    )
    run_dir = tmp_path / "run"
    script = tmp_path / "agent.py"
    script.write_text(AGENT)
    first_log = tmp_path / "serve1.log"
    learner = start(serve(run_dir, "outage", address, "--config", str(config)), env, first_log)
    agents = [
        start([sys.executable, str(script), address, str(seed)], env, tmp_path / f"a{seed}.log")
        for seed in (1, 2)
    ]
    # Kill it hard past its first checkpoint, between two others.
    wait_for(lambda: len(progress(run_dir)) >= 6, "six iterations")
    learner.send_signal(signal.SIGKILL)
    learner.wait(30)
    killed_at = len(progress(run_dir))
    spooled = sorted(p.name for p in (run_dir / "inbox").glob("*.chunk"))
    time.sleep(3)  # the agents act on, their chunks queue
    second_log = tmp_path / "serve2.log"
    resumed = start(serve(run_dir, "outage", address, "--resume", str(run_dir)), env, second_log)
    logs = {tmp_path / f"a{seed}.log": agent for seed, agent in zip((1, 2), agents, strict=True)}
    finish(resumed, second_log, others=logs)
    results = [
        json.loads(finish(agent, tmp_path / f"a{seed}.log").strip().splitlines()[-1])
        for seed, agent in zip((1, 2), agents, strict=True)
    ]
    rows = progress(run_dir)
    show(
        f"\nlearner SIGKILLed after {killed_at} iterations ({len(spooled)} chunks spooled, not "
        f"yet checkpointed), resumed, finished at {rows[-1]['env_steps']} env steps\n"
        + "\n".join(f"  agent {i}: {json.dumps(r)}" for i, r in enumerate(results, 1))
    )
    assert spooled, "the killed learner's unreleased chunks are on disk"
    for result in results:
        # Every chunk the agent finished was acknowledged by a learner: none dropped, none
        # refused, none left behind.
        assert result["dropped"] == 0 and result["rejected"] == 0 and result["queued"] == 0
        assert result["shipped"] == result["produced"]
        assert result["retries"] > 0  # it did see the learner gone
    iterations = [int(float(row["iteration"])) for row in rows]
    assert iterations == list(range(1, len(rows) + 1))
    assert int(float(rows[-1]["env_steps"])) >= 6000
    # The chunks spooled when the learner was killed were trained on by the resumed one
    # and released with its checkpoints.
    assert not set(spooled) & {p.name for p in (run_dir / "inbox").glob("*.chunk")}
