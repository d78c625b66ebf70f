"""Runner scaling on Ray: env steps per second with 1, 2, 4, 8 runners, and what the
distributed path costs on cheap envs.

    .venv/bin/python benchmarks/scaling.py                       # everything, then docs/scaling.md
    .venv/bin/python benchmarks/scaling.py --cases sleep --runners 1 2
    .venv/bin/python benchmarks/scaling.py --rllib /tmp/rllib-venv  # and RLlib's table beside

Cases, each configuration in a fresh process (start-up is timed from process start):

* ``sleep``: the sleep env (benchmarks/sleep_env.py: about 1 ms of wall time a step, no
  CPU), synchronous runners 1, 2, 4, 8 and asynchronous runners 4, 8 (the default, a
  rollout per runner joined for each update, lag bound 1; and ``async-each``, one
  rollout per update, lag bound k; env steps per second count the rows trained on); 4
  envs a runner x 64 steps, PPO 4 epochs x 4 minibatches, 64x64 tanh: the settings of
  ``benchmarks/rllib_sleep.py``. Scaling efficiency SPS(k) / (k x SPS(1)).
* ``cartpole``: CartPole-v1 with runners 0 (everything in this process) and 2, the same
  8 envs x 32 steps: the distributed path's overhead on an env that costs nothing.
* ``hopper``: Hopper-v5 with runners 0 and 2 (synchronous, and asynchronous: collection
  overlapping the update), 2 envs x 1024 steps.
* ``learn``: CartPole-v1's preset to a deterministic evaluation of 475, synchronous and
  asynchronous with 2 runners: env steps and wall time.

SPS is measured over the iterations after the first (which pays for warm-up), from the
progress file's env_steps and wall_time: collection and update both count. The start-up
figure is the time from the worker's process start to its first collected rollout.
"""

from __future__ import annotations

import time

PROCESS_START = time.perf_counter()  # before the heavy imports

import argparse  # noqa: E402
import csv  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SLEEP_ENV = "benchmarks.sleep_env:make"

SLEEP = {
    "runners": {"envs_per_runner": 4},
    "env": {"num_envs": 4, "backend": "sync"},
    "rollout": {"num_steps": 64},
    "ppo": {"update_epochs": 4, "num_minibatches": 4, "learning_rate": 3e-4},
    "policy": {"hidden_sizes": [64, 64], "activation": "tanh"},
}


def worker(spec: dict[str, Any]) -> dict[str, Any]:
    """One configuration, in this (fresh) process: train, time, report."""
    sys.path.insert(0, str(ROOT))
    import trustrl
    from trustrl.run.trainer import Trainer

    run_dir = Path(spec["run_dir"])
    overrides = {"quiet": True, "run_dir": str(run_dir), **spec["overrides"]}
    config = trustrl.resolve(spec["env_id"], overrides=overrides)
    trainer = Trainer(config)
    collect = trainer.collector.collect
    first: list[float] = []

    def timed(snapshot: Any, train: bool = True) -> Any:
        batch = collect(snapshot, train)
        if not first:
            first.append(time.perf_counter() - PROCESS_START)
        return batch

    trainer.collector.collect = timed  # type: ignore[method-assign]
    trainer.train()
    with (run_dir / "progress.csv").open() as f:
        rows = list(csv.DictReader(f))
    steps = [float(r["env_steps"]) for r in rows]
    wall = [float(r["wall_time"]) for r in rows]
    sps = (steps[-1] - steps[0]) / (wall[-1] - wall[0]) if len(rows) > 1 else float("nan")
    evals = [(s, float(r["eval_return_mean"])) for s, r in zip(steps, rows, strict=True)]
    solved = next((s for s, e in evals if e == e and e >= 475.0), None)
    last = rows[-1]
    return {
        "sps": sps,
        "startup_s": first[0],
        "iterations": len(rows),
        "env_steps": steps[-1],
        "wall_time": wall[-1],
        "solved_at": solved,
        "dropped_rollouts": float(last.get("dropped_rollouts") or 0.0),
        "version_lag_max": max(float(r.get("version_lag_max") or 0.0) for r in rows),
        "learner_busy": _mean(rows, "learner_busy"),
        "runner_idle": _mean(rows, "runner_idle"),
    }


def _mean(rows: list[dict[str, str]], key: str) -> float:
    values = [float(r[key]) for r in rows[1:] if r.get(key)]
    return sum(values) / len(values) if values else float("nan")


def jobs(cases: list[str], runner_counts: list[int]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if "sleep" in cases:
        for k in runner_counts:
            out.append(_job("sleep", f"sync x{k}", SLEEP_ENV, 10 * 4 * 64 * k, k, SLEEP))
        for k in [k for k in runner_counts if k >= 4]:
            # The default: an update joins one rollout per runner (the synchronous batch
            # size) while the runners collect the next; lag bound 1.
            tail = {**SLEEP, "runners": {**SLEEP["runners"], "async_collection": True}}
            out.append(_job("sleep", f"async x{k}", SLEEP_ENV, 10 * 4 * 64 * k, k, tail))
            # One runner's rollout per update, lag bound k (every batch that was in flight
            # while the learner updated on the others): k times the updates.
            runners = {**tail["runners"], "async_batches": 1, "max_version_lag": k}
            tail = {**tail, "runners": runners}
            out.append(_job("sleep", f"async-each x{k}", SLEEP_ENV, 10 * 4 * 64 * k, k, tail))
    if "cartpole" in cases:
        table = {"env": {"num_envs": 8}, "rollout": {"num_steps": 32}, "target_return": None}
        for k in (0, 2):
            out.append(_job("cartpole", f"runners {k}", "CartPole-v1", 40_960, k, table))
    if "hopper" in cases:
        table = {"env": {"num_envs": 2}, "rollout": {"num_steps": 1024}}
        for k in (0, 2):
            out.append(_job("hopper", f"runners {k}", "Hopper-v5", 20_480, k, table))
        # Collection overlapping the update: the same batch, of a version at most 1 behind.
        asynchronous = {**table, "runners": {"async_collection": True}}
        out.append(_job("hopper", "runners 2, async", "Hopper-v5", 20_480, 2, asynchronous))
    if "learn" in cases:
        for mode in ("sync", "async"):
            table = {"runners": {"async_collection": mode == "async"}, "eval_every": 1}
            out.append(_job("learn", f"{mode} x2", "CartPole-v1", 100_000, 2, table))
    return out


def _job(
    case: str, label: str, env_id: str, steps: int, runners: int, table: dict[str, Any]
) -> dict[str, Any]:
    section = {**table.get("runners", {}), "count": runners}
    overrides = {**table, "runners": section, "total_steps": steps, "eval_episodes": 10}
    if case != "learn":
        overrides["eval_episodes"] = 0
    return {"case": case, "label": label, "env_id": env_id, "overrides": overrides}


def run(job: dict[str, Any], folder: Path) -> dict[str, Any]:
    spec = {**job, "run_dir": str(folder / f"{job['case']}_{job['label']}".replace(" ", "_"))}
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    done = subprocess.run(
        [sys.executable, __file__, "--worker", json.dumps(spec)],
        capture_output=True,
        text=True,
        env=env,
        timeout=1800,
    )
    if done.returncode != 0:
        raise RuntimeError(f"{job['label']} failed:\n{done.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return {**job, **result}


def rllib(venv: Path, runner_counts: list[int]) -> list[dict[str, Any]]:
    done = subprocess.run(
        [str(venv / "bin" / "python"), str(ROOT / "benchmarks" / "rllib_sleep.py"),
         "--runners", *map(str, runner_counts), "--iterations", "10"],
        capture_output=True, text=True, timeout=3600,
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"RLlib failed:\n{done.stderr[-3000:]}")
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def report(results: list[dict[str, Any]], peers: list[dict[str, Any]], commit: str) -> str:
    lines = [
        "# Runner scaling on Ray",
        "",
        f"`benchmarks/scaling.py` at commit `{commit}`, {platform.machine()}, "
        f"{os.cpu_count()} CPUs, one process per configuration (start-up from process start).",
        "",
    ]
    sleep = [r for r in results if r["case"] == "sleep"]
    if sleep:
        base = next((r["sps"] for r in sleep if r["label"] == "sync x1"), None)
        lines += [
            "## The sleep env (1 ms a step, no CPU): 4 envs a runner x 64 steps, PPO 4 x 4",
            "",
            "| runners | mode | env steps/s | efficiency SPS(k)/(k SPS(1)) | start-up to first"
            " rollout (s) | learner busy | runner idle | dropped |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for r in sleep:
            mode, k = r["label"].split(" x")
            eff = r["sps"] / (int(k) * base) if base else float("nan")
            lines.append(
                f"| {k} | {mode} | {r['sps']:,.0f} | {eff:.0%} | {r['startup_s']:.1f} |"
                f" {r['learner_busy']:.2f} | {r['runner_idle']:.2f} | {r['dropped_rollouts']:.0f} |"
            )
        lines.append("")
    if peers:
        base = next((p["sps"] for p in peers if p["runners"] == 1), None)
        lines += [
            "RLlib 2.60 PPO, the same env and settings (`benchmarks/rllib_sleep.py`), same "
            "sitting:",
            "",
            "| env runners | env steps/s | efficiency | start-up to built algorithm (s) |",
            "| --- | --- | --- | --- |",
        ]
        for p in peers:
            eff = p["sps"] / (p["runners"] * base) if base else float("nan")
            lines.append(f"| {p['runners']} | {p['sps']:,.0f} | {eff:.0%} | {p['startup_s']:.1f} |")
        lines.append("")
    for case, title in (
        ("cartpole", "CartPole-v1, 8 envs x 32 steps: the distributed path's overhead"),
        ("hopper", "Hopper-v5, 2 envs x 1024 steps"),
    ):
        rows = [r for r in results if r["case"] == case]
        if rows:
            base = rows[0]["sps"]
            lines += [f"## {title}", "", "| runners | env steps/s | vs runners 0 | start-up (s) |"]
            lines += ["| --- | --- | --- | --- |"]
            for r in rows:
                lines.append(
                    f"| {r['label'].removeprefix('runners ')} | {r['sps']:,.0f} |"
                    f" {r['sps'] / base:.2f}x | {r['startup_s']:.1f} |"
                )
            lines.append("")
    learn = [r for r in results if r["case"] == "learn"]
    if learn:
        lines += [
            "## CartPole-v1 preset to a deterministic evaluation of 475, 2 runners",
            "",
            "| mode | env steps to 475 | wall time (s) | max version lag | dropped |",
            "| --- | --- | --- | --- | --- |",
        ]
        for r in learn:
            solved = f"{r['solved_at']:,.0f}" if r["solved_at"] else "not solved"
            lines.append(
                f"| {r['label'].split()[0]} | {solved} | {r['wall_time']:.1f} |"
                f" {r['version_lag_max']:.0f} | {r['dropped_rollouts']:.0f} |"
            )
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", nargs="+", default=["sleep", "cartpole", "hopper", "learn"])
    parser.add_argument("--runners", nargs="+", type=int, default=[1, 2, 4, 8])
    parser.add_argument("--rllib", type=Path, default=None, help="RLlib's venv, to run beside")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "scaling.md")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT
    ).stdout.strip()
    results = []
    with tempfile.TemporaryDirectory(prefix="trustrl-scaling-") as folder:
        for job in jobs(args.cases, args.runners):
            result = run(job, Path(folder))
            print(json.dumps({k: v for k, v in result.items() if k != "overrides"}), flush=True)
            results.append(result)
    peers = rllib(args.rllib, args.runners) if args.rllib else []
    text = report(results, peers, commit)
    args.out.write_text(text + "\n")
    args.out.with_suffix(".json").write_text(
        json.dumps({"trustrl": results, "rllib": peers}, indent=1)
    )
    print(text)


if __name__ == "__main__":
    main()
