"""RLlib PPO on the sleep env (benchmarks/sleep_env.py) with 1, 2, 4, 8 env runners: the peer
of trustrl's runner-scaling benchmark.

Runs in its own environment, never trustrl's (RLlib is not a trustrl dependency)::

    bash benchmarks/rllib_setup.sh /tmp/rllib-venv
    /tmp/rllib-venv/bin/python benchmarks/rllib_sleep.py --runners 1 2 4 8 --iterations 10

Each runner count runs in a fresh process (this script with ``--one K``), so its start-up
is measured from process start: ``startup_s`` is the time from the child's start to a
built ``Algorithm`` (Ray started, env runners up); ``imported_s`` and ``ray_started_s``
are the times to the end of the imports and of ``ray.init`` within it. Env steps per
second are taken over the iterations after the first (which pays for warm-up), from
RLlib's own sampled-steps counter and the wall clock: sampling and the update both
count, as they do for trustrl.

The Ray instance is started as trustrl starts its own (loopback only, token
authentication, no dashboard), so both sides pay for the same Ray. The env sleeps
instead of computing, so Ray is told there are more logical CPUs than cores (one per env
runner plus one for the learner): the runners wait, they do not compete for cores.

Prints one JSON line per runner count, then a table with scaling efficiency
SPS(k) / (k x SPS(1)).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
ENV = "benchmarks.sleep_env:Sleep-v0"  # gymnasium imports the module, then makes the env


def run_one(args: argparse.Namespace, runners: int, started: float) -> dict[str, Any]:
    # Single-machine mode before Ray's import: the node IP stays 127.0.0.1 and every
    # listener on loopback (trustrl/remote/cluster.py says why).
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    os.environ.setdefault("RAY_AUTH_MODE", "token")
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    # The env runners import benchmarks.sleep_env themselves: the repo on their path,
    # inherited from this process through the raylet (a runtime_env would cost start-up).
    os.environ["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(REPO), os.environ.get("PYTHONPATH")])
    )
    import ray
    from ray.rllib.algorithms.ppo import PPOConfig
    from ray.rllib.core.rl_module.default_model_config import DefaultModelConfig

    imported_s = time.time() - started
    ray.init(
        address="local",
        num_cpus=runners + 1,
        include_dashboard=False,
        log_to_driver=False,
    )
    ray_started_s = time.time() - started
    fragment = args.num_steps
    config = (
        PPOConfig()
        .environment(ENV, env_config={})
        .framework("torch")
        .env_runners(
            num_env_runners=runners,
            num_envs_per_env_runner=args.envs_per_runner,
            num_cpus_per_env_runner=1,
            rollout_fragment_length=fragment,
        )
        .learners(num_learners=0)
        .training(
            train_batch_size_per_learner=runners * args.envs_per_runner * fragment,
            minibatch_size=max(1, runners * args.envs_per_runner * fragment // 4),
            num_epochs=args.epochs,
            lr=3e-4,
            gamma=0.99,
            lambda_=0.95,
        )
        .rl_module(model_config=DefaultModelConfig(fcnet_hiddens=[64, 64], fcnet_activation="tanh"))
        .debugging(seed=args.seed)
    )
    algo = config.build_algo()
    startup_s = time.time() - started
    marks: list[tuple[float, int]] = []
    for _ in range(args.iterations):
        result = algo.train()
        marks.append((time.perf_counter(), sampled_steps(result)))
    algo.stop()
    ray.shutdown()
    (t0, s0), (t1, s1) = marks[0], marks[-1]
    return {
        "library": "rllib",
        "runners": runners,
        "envs_per_runner": args.envs_per_runner,
        "iterations": args.iterations,
        "startup_s": round(startup_s, 2),
        "imported_s": round(imported_s, 2),  # of startup_s: Python, RLlib and torch imported
        "ray_started_s": round(ray_started_s, 2),  # ... and the Ray instance started
        "env_steps": s1,
        "sps": round((s1 - s0) / (t1 - t0), 1) if t1 > t0 else None,
    }


def sampled_steps(result: dict[str, Any]) -> int:
    """RLlib's lifetime count of sampled env steps (its key moved between releases)."""
    for path in (
        ("env_runners", "num_env_steps_sampled_lifetime"),
        ("num_env_steps_sampled_lifetime",),
        ("env_runners", "num_env_steps_sampled"),
    ):
        value: Any = result
        for key in path:
            value = value.get(key) if isinstance(value, dict) else None
        if value is not None:
            return int(value)
    raise KeyError(f"no sampled-steps counter in RLlib's result: {sorted(result)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runners", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--envs-per-runner", type=int, default=4)
    parser.add_argument("--num-steps", type=int, default=64, help="steps per env per iteration")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--iterations", type=int, default=10, help="at least 2")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--started", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.iterations < 2:
        parser.error("--iterations must be at least 2 (SPS is taken after the first)")
    if args.one is not None:
        print("RESULT " + json.dumps(run_one(args, args.one, args.started)), flush=True)
        return
    rows = []
    for runners in args.runners:
        command = [sys.executable, __file__, "--one", str(runners), "--started", str(time.time())]
        for flag in ("envs_per_runner", "num_steps", "epochs", "iterations", "seed"):
            command += ["--" + flag.replace("_", "-"), str(getattr(args, flag))]
        done = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
        lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
        if done.returncode != 0 or not lines:
            sys.stderr.write(done.stderr[-4000:])
            raise SystemExit(f"runners={runners} failed (exit {done.returncode})")
        row = json.loads(lines[-1].removeprefix("RESULT "))
        print(json.dumps(row), flush=True)
        rows.append(row)
    base = next((row["sps"] for row in rows if row["runners"] == 1), None)
    print(f"\n{'runners':>7} {'env steps/s':>12} {'efficiency':>10} {'startup s':>9}")
    for row in rows:
        efficiency = row["sps"] / (row["runners"] * base) if base else float("nan")
        sps, startup = row["sps"], row["startup_s"]
        print(f"{row['runners']:>7} {sps:>12.0f} {efficiency:>10.2f} {startup:>9.1f}")


if __name__ == "__main__":
    main()
