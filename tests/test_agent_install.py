"""The agent-only install (clients/python: the ``trustrl-agent`` distribution) in a fresh
virtual environment: no torch, no Ray, and an agent from it trains a ``trustrl serve``
learner through the gateway."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest

from tests.test_gateway import ROOT, ServeProcess, _private_ray, _wait, ray_needed
from trustrl.remote import credentials
from trustrl.run.logging import read_progress


def _site_packages_mib(venv: Path) -> float:
    (site,) = venv.glob("lib/python*/site-packages")
    return sum(p.stat().st_size for p in site.rglob("*") if p.is_file()) / 2**20


@ray_needed
@pytest.mark.slow
@pytest.mark.xdist_group("ray")
@pytest.mark.time_limit(600)  # a venv's install, Ray's start and stop included
def test_an_agent_only_install_has_no_torch_and_trains_a_learner(tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(wheels), str(ROOT / "clients" / "python")],
        check=True,
    )  # fmt: skip
    (wheel,) = wheels.glob("trustrl_agent-*.whl")
    venv = tmp_path / "agent-venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", str(wheel)],
        check=True,
    )
    probe = (
        "import importlib.util as u, json, trustrl.client.agent, trustrl.remote.grpc_link;"
        "print(json.dumps({m: u.find_spec(m) is not None for m in ('torch', 'ray')}))"
    )
    found = subprocess.run(
        [str(python), "-c", probe], check=True, capture_output=True, text=True, cwd=tmp_path
    )
    assert json.loads(found.stdout) == {"torch": False, "ray": False}
    size = _site_packages_mib(venv)
    print(f"\nagent-only install: {size:.0f} MiB of site-packages, no torch, no Ray")

    run_dir = tmp_path / "run"
    token = credentials.add(run_dir, "field-1")
    learner = ServeProcess(
        ["CartPole-v1", "--seed", "3", "--total-steps", "8192", "--run-dir", str(run_dir),
         "--quiet"],
        _private_ray(tmp_path),
        tmp_path / "serve.log",
    )  # fmt: skip
    try:
        # The agent runs from a folder of its own, with the fresh venv's interpreter: it
        # can import trustrl only from its install.
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        env["TRUSTRL_TOKEN"] = token
        started = time.monotonic()
        agent = subprocess.run(
            [str(python), str(ROOT / "examples" / "external_cartpole.py"), "--name", learner.url,
             "--seed", "1", "--seconds", "300", "--pace", "0"],
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400,
        )  # fmt: skip
        assert agent.returncode == 0, agent.stderr[-3000:]
        report = json.loads(agent.stdout.strip().splitlines()[-1])
        _wait(lambda: learner.process.poll() is not None, "the learner to finish")
        output = learner.stop()
        assert learner.process.returncode == 0, output[-3000:]
        rows = read_progress(run_dir / "progress.csv")
        print(f"agent: {json.dumps(report)}; {time.monotonic() - started:.1f} s")
        assert rows  # iterations trained on the agent's chunks
        trained = int(rows[-1]["env_steps"])
        # The learner's steps are the agent's (it has no env of its own); it ends at its
        # budget, or earlier where an evaluation reaches the preset's target return.
        assert report["steps"] >= trained and report["rejected"] == 0
        target = tomllib.loads((run_dir / "config.toml").read_text())["target_return"]
        solved = json.loads((run_dir / "eval.json").read_text())["mean_return"] >= target
        assert trained >= 8192 or solved, (trained, output[-3000:])
    finally:
        learner.stop()
