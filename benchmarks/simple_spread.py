"""Multi-agent benchmark on PettingZoo MPE simple_spread_v3 (mpe2): trustrl MAPPO and IPPO
against two reference policies.

    .venv/bin/python benchmarks/simple_spread.py                       # 2M steps x 3 seeds
    .venv/bin/python benchmarks/simple_spread.py --steps 50000 --seeds 1 --jobs 1
    .venv/bin/python benchmarks/simple_spread.py --algo-variants mappo,ippo,mappo-per-agent
    .venv/bin/python benchmarks/simple_spread.py --references-only
    .venv/bin/python benchmarks/simple_spread.py --report-only docs/multiagent.json

The score of a policy is the mean per-agent episode return: for each episode, each agent's
rewards summed over the episode's 25 steps, averaged over the 3 agents, then over episodes
(the same quantity as trustrl's ``episode_return_mean`` and ``evaluate``). Every policy
is scored on the same episodes (``--episodes`` resets seeded ``--eval-seed + i``).

* **random**: every agent picks one of the 5 actions uniformly.
* **scripted**: each step, the agents are assigned to landmarks by the permutation with
  the least total agent-landmark distance (brute force over 3! = 6; every agent can
  compute it from its own observation, which shows every position), and each agent takes
  the action that brings its position after next closest to its landmark (an action
  changes the velocity, which moves the agent from the following step on).
* **trustrl**: the seed kernel's preset (``--preset relayrl-kernel``,
  ``trustrl/presets/ppo/mpe2_simple_spread_v3/relayrl-kernel.toml``) overlaid with
  ``--config`` (default ``benchmarks/simple_spread.toml``: the MAPPO paper's MPE settings
  as tuned there, one actor shared by the agents; with ``mappo-centric`` they are the
  env's shipped default preset), with the critic reading the global state (``mappo``),
  the global state plus the agent's own observation (``mappo-as``), every agent's
  observation with the agent's own first (``mappo-centric``) or the agent's own
  observation alone (``ippo``); ``-per-agent`` and ``-shared`` variants set the actors
  whatever the config says. ``--config ''`` runs the kernel's settings alone.
  Each (variant, seed) trains in its own process; its learning curve (env steps vs the
  mean per-agent return of the training episodes, from ``progress.csv``), SPS and final
  scores (stochastic policy, as trained, and deterministic) are recorded.

Results go to ``docs/multiagent.json`` (everything) and to the section between the
benchmark markers in ``docs/multiagent.md`` (the rest of that file is left alone). The
gap closed is ``(R - R_random) / (R_scripted - R_random)``.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import itertools
import json
import math
import os
import platform
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

ENV_ID = "mpe2:simple_spread_v3"
ENV_KWARGS: dict[str, Any] = {"local_ratio": 0.5, "max_cycles": 25, "continuous_actions": False}
NUM_AGENTS = 3
BASE_PRESET = "relayrl-kernel"  # what the settings file is applied over
PRESET_STEPS = 2_000_000
VARIANTS: dict[str, dict[str, str]] = {
    "mappo": {"critic_input": "global"},  # actors as the config says
    "ippo": {"critic_input": "local"},
    "mappo-as": {"critic_input": "agent_state"},  # MAPPO's agent-specific global state
    "mappo-centric": {"critic_input": "agent_centric"},
    "mappo-per-agent": {"critic_input": "global", "actor": "per_agent"},
    "ippo-per-agent": {"critic_input": "local", "actor": "per_agent"},
    "mappo-shared": {"critic_input": "global", "actor": "shared"},
    "ippo-shared": {"critic_input": "local", "actor": "shared"},
}
MARK_START = "<!-- simple_spread benchmark: start (written by benchmarks/simple_spread.py) -->"
MARK_END = "<!-- simple_spread benchmark: end -->"
# Discrete actions of MPE: no-op, left, right, down, up (unit force directions).
MOVES = np.array([[0, 0], [-1, 0], [1, 0], [0, -1], [0, 1]], dtype=np.float64)
DT, DAMPING, ACCEL = 0.1, 0.25, 5.0  # MPE's world.dt, world.damping, action sensitivity


# Reference policies: (observations dict, rng) -> actions dict.


def random_policy(observations: dict[str, Any], rng: np.random.Generator) -> dict[str, int]:
    return {agent: int(rng.integers(len(MOVES))) for agent in observations}


def scripted_policy(observations: dict[str, Any], rng: np.random.Generator) -> dict[str, int]:
    """Landmarks by least total distance, then one-step greedy steering (see the module
    docstring). Observation layout of simple_spread: self_vel (2), self_pos (2),
    landmark_rel_positions (2N), other_agent_rel_positions (2(N-1)), communication."""
    n = NUM_AGENTS
    actions = {}
    for name, raw in observations.items():
        obs = np.asarray(raw, dtype=np.float64)
        me = int(name.rsplit("_", 1)[1])
        vel, pos = obs[0:2], obs[2:4]
        landmarks = pos + obs[4 : 4 + 2 * n].reshape(n, 2)
        others = pos + obs[4 + 2 * n : 4 + 2 * n + 2 * (n - 1)].reshape(n - 1, 2)
        agents = np.insert(others, me, pos, axis=0)  # others are listed in agent order
        cost = np.linalg.norm(agents[:, None] - landmarks[None], axis=-1)
        best = min(
            itertools.permutations(range(n)),
            key=lambda perm: sum(cost[a, perm[a]] for a in range(n)),
        )
        target = landmarks[best[me]]
        # Next step: p += v dt, then v = (1 - damping) v + accel dt u. The action shows in
        # the position after that.
        next_vel = (1 - DAMPING) * vel + ACCEL * DT * MOVES
        after_next = pos + vel * DT + next_vel * DT
        actions[name] = int(np.argmin(np.linalg.norm(after_next - target, axis=1)))
    return actions


def score(policy: Any, episodes: int, seed: int) -> list[float]:
    """Per-episode mean over agents of each agent's episode return."""
    from trustrl.envs.pettingzoo import parallel_env_factory

    env = parallel_env_factory(ENV_ID, ENV_KWARGS)()
    rng = np.random.default_rng(seed)
    returns = []
    try:
        for episode in range(episodes):
            observations, _ = env.reset(seed=seed + episode)
            totals = dict.fromkeys(env.possible_agents, 0.0)
            while env.agents:
                actions = policy({a: observations[a] for a in env.agents}, rng)
                observations, rewards, _, _, _ = env.step(actions)
                for agent, reward in rewards.items():
                    totals[agent] += float(reward)
            returns.append(float(np.mean(list(totals.values()))))
    finally:
        env.close()
    return returns


def summary(returns: list[float]) -> dict[str, float]:
    values = np.asarray(returns)
    return {
        "mean": float(values.mean()),
        "stderr": float(values.std(ddof=1) / math.sqrt(len(values))) if len(values) > 1 else 0.0,
        "episodes": len(values),
    }


# One trustrl run (in its own process).


def train_one(job: dict[str, Any]) -> dict[str, Any]:
    import torch

    import trustrl
    from trustrl.config import config_to_dict

    variant, seed, steps = job["variant"], job["seed"], job["steps"]
    run_dir = Path(job["run_root"]) / f"{variant}__seed{seed}"
    config = trustrl.resolve(
        ENV_ID,
        preset=BASE_PRESET,
        config_file=job["config"] or None,
        overrides={
            "total_steps": steps,
            "seed": seed,
            "run_dir": str(run_dir),
            "quiet": True,
            "eval_episodes": 0,
            "env": {"kwargs": ENV_KWARGS},
            "multiagent": VARIANTS[variant],
        },
    )
    trainer = trustrl.Trainer(config)
    start = time.perf_counter()
    policy = trainer.train()
    wall = time.perf_counter() - start
    with (run_dir / "progress.csv").open(newline="") as handle:
        rows = list(csv.DictReader(handle))
    curve = [
        [int(float(r["env_steps"])), float(r["episode_return_mean"])]
        for r in rows
        if math.isfinite(float(r["episode_return_mean"]))
    ]
    torch.manual_seed(seed)
    stochastic = score(
        lambda o, _: policy.act(o, deterministic=False), job["episodes"], job["eval_seed"]
    )
    deterministic = score(
        lambda o, _: policy.act(o, deterministic=True), job["episodes"], job["eval_seed"]
    )
    return {
        "variant": variant,
        "seed": seed,
        "env_steps": trainer.env_steps,
        "wall_time_s": wall,
        "sps": trainer.env_steps / wall,
        "stochastic": summary(stochastic),
        "deterministic": summary(deterministic),
        "curve": curve,
        "run_dir": str(run_dir),
        "config": config_to_dict(config),
    }


# Reporting.


def gap_closed(value: float, random: float, scripted: float) -> float:
    return (value - random) / (scripted - random)


def binned_curve(curves: list[list[list[float]]], steps: int, bins: int) -> list[dict[str, Any]]:
    """Mean training return per bin of env steps: within a run, then over runs."""
    edges = np.linspace(0, steps, bins + 1)
    out = []
    for lo, hi in itertools.pairwise(edges):
        per_run = []
        for curve in curves:
            inside = [r for s, r in curve if lo < s <= hi]
            if inside:
                per_run.append(float(np.mean(inside)))
        out.append(
            {
                "steps": int(hi),
                "mean": float(np.mean(per_run)) if per_run else None,
                "runs": len(per_run),
            }
        )
    return out


def aggregate(runs: list[dict[str, Any]], refs: dict[str, Any], steps: int) -> dict[str, Any]:
    random, scripted = refs["random"]["mean"], refs["scripted"]["mean"]
    out: dict[str, Any] = {}
    for variant in dict.fromkeys(r["variant"] for r in runs):
        mine = [r for r in runs if r["variant"] == variant]
        entry: dict[str, Any] = {"seeds": [r["seed"] for r in mine]}
        for kind in ("stochastic", "deterministic"):
            means = [r[kind]["mean"] for r in mine]
            entry[kind] = {
                "mean": float(np.mean(means)),
                "per_seed": means,
                "gap_closed": gap_closed(float(np.mean(means)), random, scripted),
            }
        last = [np.mean([ret for _, ret in r["curve"][-10:]]) for r in mine if r["curve"]]
        entry["final_training_return"] = float(np.mean(last)) if last else None
        entry["sps"] = float(np.mean([r["sps"] for r in mine]))
        entry["wall_time_s"] = [r["wall_time_s"] for r in mine]
        entry["curve"] = binned_curve([r["curve"] for r in mine], steps, 10)
        out[variant] = entry
    return out


def fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None or not math.isfinite(value) else f"{value:.{digits}f}"


def markdown(result: dict[str, Any]) -> str:
    refs, agg, settings = result["references"], result["aggregate"], result["settings"]
    dirty = " (trustrl/ with local changes)" if result["dirty"] else ""
    rand, scripted = refs["random"], refs["scripted"]
    lines = [
        MARK_START,
        "",
        f"Run {result['date']} on {result['machine']['cpus']} CPUs "
        f"({result['machine']['processor'] or result['machine']['platform']}), commit "
        f"`{result['commit'][:10] or 'unknown'}`{dirty}. "
        f"Budget: {settings['steps']:,} env steps per run, seeds "
        f"{', '.join(map(str, settings['seeds']))}; scores over {settings['episodes']} "
        f"episodes (seeds {settings['eval_seed']}+); {settings.get('jobs', 1)} run(s) trained "
        f"at a time. Settings: the {BASE_PRESET} preset"
        + (
            f" overlaid with `benchmarks/{Path(settings['config']).name}`."
            if settings.get("config")
            else " alone (the seed kernel's)."
        ),
        "",
        "| policy | mean per-agent return | deterministic | gap closed | SPS | wall time / run |",
        "| --- | --- | --- | --- | --- | --- |",
        f"| random | {fmt(rand['mean'])} ± {fmt(rand['stderr'])} | - | 0 | - | - |",
        f"| scripted | {fmt(scripted['mean'])} ± {fmt(scripted['stderr'])} | - | 1 | - | - |",
    ]
    if settings["steps"] < PRESET_STEPS:
        lines[2:2] = [
            f"A short run ({settings['steps']:,} of the preset's {PRESET_STEPS:,} env steps): "
            "it shows that training improves on random, not where it ends.",
            "",
        ]
    for variant, entry in agg.items():
        stoch, det = entry["stochastic"], entry["deterministic"]
        per_seed = ", ".join(fmt(v) for v in stoch["per_seed"])
        wall = np.mean(entry["wall_time_s"]) / 60
        lines.append(
            f"| trustrl {variant} | {fmt(stoch['mean'])} ({per_seed}) | {fmt(det['mean'])} | "
            f"{fmt(stoch['gap_closed'])} (det. {fmt(det['gap_closed'])}) | "
            f"{entry['sps']:.0f} | {wall:.1f} min |"
        )
    lines += [
        "",
        "Return: the stochastic policy as trained (each seed's mean in parentheses); gap closed "
        "= (R - random) / (scripted - random).",
        "",
        "Learning curve: mean per-agent return of the training episodes, averaged within "
        "each tenth of the budget, then over seeds.",
        "",
        "| env steps | " + " | ".join(agg) + " |",
        "| --- |" + " --- |" * len(agg),
    ]
    for i in range(10):
        cells = [fmt(entry["curve"][i]["mean"]) for entry in agg.values()]
        steps = next(iter(agg.values()))["curve"][i]["steps"] if agg else 0
        lines.append(f"| {steps:,} | " + " | ".join(cells) + " |")
    lines += ["", MARK_END]
    return "\n".join(lines)


def write_markdown(path: Path, section: str) -> None:
    text = path.read_text() if path.exists() else "# Multi-agent PPO\n"
    if MARK_START in text and MARK_END in text:
        head, rest = text.split(MARK_START, 1)
        _, tail = rest.split(MARK_END, 1)
        text = head + section + tail
    else:
        text = text.rstrip("\n") + "\n\n## Benchmark: simple_spread_v3\n\n" + section + "\n"
    path.write_text(text)


def git(*args: str) -> str:
    try:
        return subprocess.run(
            ["git", *args], capture_output=True, text=True, cwd=ROOT, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=PRESET_STEPS, help="env steps per run")
    parser.add_argument("--seeds", default="1,2,3", help="comma-separated training seeds")
    parser.add_argument(
        "--algo-variants",
        default="mappo,ippo,mappo-centric",
        help=f"comma-separated, of {', '.join(VARIANTS)}",
    )
    parser.add_argument(
        "--config",
        default=str(ROOT / "benchmarks" / "simple_spread.toml"),
        help=f"settings applied over the {BASE_PRESET} preset (TOML; '' for the preset alone)",
    )
    parser.add_argument("--episodes", type=int, default=200, help="scoring episodes per policy")
    parser.add_argument("--eval-seed", type=int, default=10_000, help="seed of the first one")
    parser.add_argument("--jobs", type=int, default=1, help="runs trained at once (processes)")
    parser.add_argument("--run-root", default=str(ROOT / "runs" / "simple_spread_bench"))
    parser.add_argument("--out-json", default=str(ROOT / "docs" / "multiagent.json"))
    parser.add_argument("--out-md", default=str(ROOT / "docs" / "multiagent.md"))
    parser.add_argument(
        "--references-only", action="store_true", help="score random and scripted, train nothing"
    )
    parser.add_argument(
        "--report-only",
        metavar="JSON",
        help="rewrite the markdown section from a results JSON of an earlier run, run nothing",
    )
    args = parser.parse_args(argv)
    if args.report_only:
        result = json.loads(Path(args.report_only).read_text())
        write_markdown(Path(args.out_md), markdown(result))
        return 0
    seeds = [int(s) for s in args.seeds.split(",") if s]
    variants = [v for v in args.algo_variants.split(",") if v]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        parser.error(f"unknown variant(s) {', '.join(unknown)}; choose from {', '.join(VARIANTS)}")

    refs = {}
    for name, policy in (("random", random_policy), ("scripted", scripted_policy)):
        refs[name] = summary(score(policy, args.episodes, args.eval_seed))
        print(f"{name:>9}: {refs[name]['mean']:.2f} ± {refs[name]['stderr']:.2f}", flush=True)

    runs: list[dict[str, Any]] = []
    if not args.references_only:
        jobs = [
            {
                "variant": v,
                "seed": s,
                "steps": args.steps,
                "episodes": args.episodes,
                "eval_seed": args.eval_seed,
                "run_root": args.run_root,
                "config": args.config,
            }
            for s in seeds
            for v in variants
        ]
        with ProcessPoolExecutor(args.jobs, mp_context=get_context("spawn")) as pool:
            for run in pool.map(train_one, jobs):
                runs.append(run)
                print(
                    f"{run['variant']:>12} seed {run['seed']}: "
                    f"{run['stochastic']['mean']:.2f} (det. {run['deterministic']['mean']:.2f}), "
                    f"{run['sps']:.0f} SPS, {run['wall_time_s'] / 60:.1f} min",
                    flush=True,
                )

    import torch

    result = {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": git("rev-parse", "HEAD"),
        "dirty": bool(git("status", "--porcelain", "--", "trustrl")),
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "processor": platform.processor(),
            "python": platform.python_version(),
            "torch": torch.__version__,
        },
        "settings": {
            "env_id": ENV_ID,
            "env_kwargs": ENV_KWARGS,
            "steps": args.steps,
            "seeds": seeds,
            "variants": {v: VARIANTS[v] for v in variants},
            "episodes": args.episodes,
            "eval_seed": args.eval_seed,
            "jobs": args.jobs,
            "config": args.config,
        },
        "references": refs,
        "aggregate": aggregate(runs, refs, args.steps) if runs else {},
        "runs": runs,
    }
    Path(args.out_json).write_text(json.dumps(result, indent=1) + "\n")
    if runs:
        write_markdown(Path(args.out_md), markdown(result))
    for variant, entry in result["aggregate"].items():
        print(
            f"{variant:>12}: {entry['stochastic']['mean']:.2f}, gap closed "
            f"{entry['stochastic']['gap_closed']:.2f} (det. {entry['deterministic']['mean']:.2f},"
            f" {entry['deterministic']['gap_closed']:.2f}), {entry['sps']:.0f} SPS"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
