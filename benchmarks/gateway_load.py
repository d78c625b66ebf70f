"""Load on the gateway: many agents over gRPC against one ``trustrl serve`` learner.

    .venv/bin/python benchmarks/gateway_load.py                       # 64 agents, 60 s
    .venv/bin/python benchmarks/gateway_load.py --kill-at 30          # SIGKILL the learner
                                                                      # at 30 s, resume it
    .venv/bin/python benchmarks/gateway_load.py --agents 8 --seconds 10   # a smoke run

The learner serves an application's spaces (observations of 4 numbers, two actions; no
env), on a loopback Ray cluster this script starts (so that a killed learner's inbox
actor goes with it and a resumed one takes its name) with its gateway on a fixed
loopback port. The agents are ``trustrl.Agent.connect("grpc://...")`` threads, spread
over processes (``--processes``), each with a token of its own; each acts on random
observations at ``--pace`` seconds a step, in episodes of 1 to 64 steps. Printed as one
JSON line, and written to ``--out`` if given:

* accepted chunks per second (all agents), and the agents' fates of every chunk they
  finished: accepted, stale, refused, dropped, or still queued at the end. Counted by
  sequence numbers: each agent numbers its chunks 0, 1, ...; ``produced`` is the next
  number, so ``accepted + stale + refused + dropped + queued == produced`` says that
  nothing was lost unaccounted, and every accepted chunk was spooled before the answer;
* acknowledgement latency: each Submit call's round trip (median, 99th percentile);
* ``act`` latency (median, 99th percentile);
* the learner's updates per second (its progress file).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

APP = """
total_steps = 100000000
checkpoint_every = 10
[env]
num_envs = 1
[rollout]
num_steps = 256
[agent]
observation_shape = [4]
action_kind = "discrete"
action_choices = [2]
queue_size = 100000
"""

AGENTS = textwrap.dedent(
    """
    import json, sys, threading, time
    import numpy as np
    import trustrl
    from trustrl.remote import grpc_link

    url, seconds, pace, seed = sys.argv[1], float(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
    tokens = json.loads(sys.argv[5])
    acks = []
    submit = grpc_link.GrpcLink._submit

    def timed(self, batch):
        began = time.perf_counter()
        try:
            return submit(self, batch)
        finally:
            acks.append(time.perf_counter() - began)

    grpc_link.GrpcLink._submit = timed
    results = [None] * len(tokens)

    def run(index, token):
        agent = trustrl.Agent.connect(url, token=token, seed=seed + index, timeout=120)
        rng = np.random.default_rng(seed + index)
        acts = []
        end = time.monotonic() + seconds
        while time.monotonic() < end and not agent.status()["finished"]:
            began = time.perf_counter()
            action = agent.act(rng.normal(size=4))
            acts.append(time.perf_counter() - began)
            for _ in range(int(rng.integers(0, 64))):
                time.sleep(pace)
                began = time.perf_counter()
                action = agent.act(rng.normal(size=4), reward=float(action))
                acts.append(time.perf_counter() - began)
            time.sleep(pace)
            agent.end_episode(float(action))
        produced = agent.seq
        agent.flush(30)
        status = agent.status()
        agent.close(flush_timeout=0)
        results[index] = {"produced": produced, **status, "acts": acts}

    threads = [threading.Thread(target=run, args=(i, t)) for i, t in enumerate(tokens)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    acts = [a for r in results for a in r.pop("acts")]
    print(json.dumps({"agents": results, "acts": acts, "acks": acks}))
    """
)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def percentiles(values: list[float]) -> dict[str, float]:
    import numpy as np

    if not values:
        return {"median_ms": float("nan"), "p99_ms": float("nan")}
    array = np.asarray(values) * 1e3
    return {
        "median_ms": round(float(np.median(array)), 3),
        "p99_ms": round(float(np.percentile(array, 99)), 3),
    }


def serve(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "trustrl.cli", "serve", *args]
    return subprocess.Popen(
        command, env=env, cwd=ROOT, stdout=log.open("ab"), stderr=subprocess.STDOUT
    )


def wait_for_gateway(log: Path, process: subprocess.Popen[bytes], since: int) -> None:
    deadline = time.monotonic() + 180
    while "gateway on grpc://" not in log.read_text(errors="replace")[since:]:
        if process.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"the learner did not start:\n{log.read_text()[-3000:]}")
        time.sleep(0.2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--agents", type=int, default=64)
    parser.add_argument("--processes", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--pace", type=float, default=0.002, help="seconds per step")
    parser.add_argument("--kill-at", type=float, default=None, help="SIGKILL and resume at")
    parser.add_argument("--out", default=None, help="also write the JSON here")
    args = parser.parse_args()

    from trustrl.remote import credentials, import_ray

    work = Path(tempfile.mkdtemp(prefix="trustrl-load-"))
    os.environ.update(
        RAY_TMPDIR=tempfile.mkdtemp(prefix="trl", dir="/tmp"),
        RAY_AUTH_MODE="token",
        RAY_USAGE_STATS_ENABLED="0",
    )
    import_ray(loopback=True)  # Ray reads the auth mode at import: after it is set
    from ray.cluster_utils import Cluster

    ray_cli = Path(sys.executable).with_name("ray")
    subprocess.run([str(ray_cli), "get-auth-token", "--generate"], check=True, capture_output=True)
    head = Cluster(initialize_head=True, head_node_args={"num_cpus": 4, "include_dashboard": False})
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run_dir = work / "run"
    tokens = [credentials.add(run_dir, f"agent-{i}") for i in range(args.agents)]
    config = work / "app.toml"
    config.write_text(APP)
    listen = f"127.0.0.1:{free_port()}"
    joined = [
        "--name",
        "load",
        "--runners.ray-address",
        head.address,
        "--listen",
        listen,
        "--quiet",
    ]
    log = work / "serve.log"
    learner = serve(["--config", str(config), "--run-dir", str(run_dir), *joined], env, log)
    agents: list[subprocess.Popen[bytes]] = []
    try:
        wait_for_gateway(log, learner, 0)
        script = work / "agents.py"
        script.write_text(AGENTS)
        per = -(-args.agents // args.processes)
        started = time.monotonic()
        for index in range(0, args.agents, per):
            agents.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        str(script),
                        f"grpc://{listen}",
                        str(args.seconds),
                        str(args.pace),
                        str(index),
                        json.dumps(tokens[index : index + per]),
                    ],
                    env=env,
                    cwd=ROOT,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.DEVNULL,
                )
            )
        killed = None
        if args.kill_at is not None:
            time.sleep(max(0.0, args.kill_at - (time.monotonic() - started)))
            learner.send_signal(signal.SIGKILL)
            learner.wait(30)
            killed = {"at_s": round(time.monotonic() - started, 1)}
            size = log.stat().st_size
            learner = serve(["--resume", str(run_dir), *joined], env, log)
            wait_for_gateway(log, learner, size)
            killed["back_after_s"] = round(time.monotonic() - started - killed["at_s"], 1)
        outputs = [json.loads(agent.communicate(timeout=args.seconds + 300)[0]) for agent in agents]
        elapsed = time.monotonic() - started
    finally:
        learner.send_signal(signal.SIGINT)
        try:
            learner.wait(120)
        except subprocess.TimeoutExpired:
            learner.kill()
        for agent in agents:
            if agent.poll() is None:
                agent.kill()
        head.shutdown()
    results = [r for output in outputs for r in output["agents"]]
    fates = {
        k: sum(r[k] for r in results) for k in ("shipped", "stale", "rejected", "dropped", "queued")
    }
    produced = sum(r["produced"] for r in results)
    accepted = fates.pop("shipped")
    rows = [line.split(",") for line in (run_dir / "progress.csv").read_text().splitlines()[1:]]
    header = (run_dir / "progress.csv").read_text().splitlines()[0].split(",")
    wall = [float(row[header.index("wall_time")]) for row in rows]
    report = {
        "agents": args.agents,
        "processes": len(agents),
        "seconds": round(elapsed, 1),
        "pace_s": args.pace,
        "killed": killed,
        "accepted_chunks_per_s": round(accepted / elapsed, 1),
        "produced": produced,
        "fates": {"accepted": accepted, **fates},
        "unaccounted": produced - accepted - sum(fates.values()),
        "ack_latency": percentiles([a for o in outputs for a in o["acks"]]),
        "act_latency": percentiles([a for o in outputs for a in o["acts"]]),
        "updates": len(rows),
        "updates_per_s": round(len(rows) / max(wall[-1], 1e-9), 2) if wall else 0.0,
        "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                                 capture_output=True, text=True).stdout.strip(),
    }  # fmt: skip
    print(json.dumps(report))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
