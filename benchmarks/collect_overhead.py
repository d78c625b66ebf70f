"""The collector against the env-only ceiling, alternated in one process.

    .venv/bin/python benchmarks/collect_overhead.py --case 4 --rounds 15
    PYTHONPATH=/path/to/other/checkout .venv/bin/python benchmarks/collect_overhead.py --case 1

Each round times one ``Collector.collect`` of the case's rollout (the policy untrained,
from one snapshot), then the same number of vector steps of a
second vector env built the same way, with random actions: the env-only ceiling of
``benchmarks/run.py``. Alternating them in one process keeps the machine's drift out of
their ratio. Also timed: the vector env's ``step`` inside ``collect``, so the rest is the
collector's own work per vector step (inference, bookkeeping, rollout writes). Printed:
one row per round, then the medians. Used for docs/performance.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cases


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--case", type=int, default=4, choices=sorted(cases.CASES))
    parser.add_argument("--rounds", type=int, default=15, help="collect/ceiling alternations")
    args = parser.parse_args()

    import trustrl
    from trustrl.config import config_from_dict
    from trustrl.envs.gym import make_vec_env

    settings = cases.settings(args.case)
    with tempfile.TemporaryDirectory(prefix="trustrl-collect-") as run_dir:
        trainer = trustrl.Trainer(config_from_dict(cases.trustrl_table(settings, 1, run_dir)))
    collector = trainer.collector
    num_envs, num_steps = collector.num_envs, collector.num_steps

    envs = collector.envs
    inner_step = envs.step
    env_time = [0.0]

    def timed_step(actions: Any) -> Any:
        start = time.perf_counter()
        out = inner_step(actions)
        env_time[0] += time.perf_counter() - start
        return out

    envs.step = timed_step  # instance attribute: this script's wrapping only

    ceiling = make_vec_env(settings["env_id"], num_envs, settings["backend"])
    ceiling.reset(seed=1)
    ceiling.action_space.seed(1)
    actions = [ceiling.action_space.sample() for _ in range(1000)]

    collector.collect(trainer.snapshot())  # warm-up of both
    for i in range(50):
        ceiling.step(actions[i % len(actions)])

    print(f"trustrl {Path(trustrl.__file__).parent}")
    print(f"case {args.case}: {settings['env_id']}, {num_envs} env(s) x {num_steps} steps")
    print("round | collect SPS | ceiling SPS | collect / ceiling | own work per vector step")
    rows = []
    for r in range(args.rounds):
        env_time[0] = 0.0
        snapshot = trainer.snapshot()  # once per rollout, as the trainer takes it
        start = time.perf_counter()
        collector.collect(snapshot)
        collect_s = time.perf_counter() - start
        own_us = (collect_s - env_time[0]) / num_steps * 1e6

        start = time.perf_counter()
        for i in range(num_steps):
            ceiling.step(actions[i % len(actions)])
        ceiling_s = time.perf_counter() - start

        steps = num_steps * num_envs
        rows.append((steps / collect_s, steps / ceiling_s, ceiling_s / collect_s, own_us))
        c, e, ratio, own = rows[-1]
        print(f"{r:>5} | {c:>11,.0f} | {e:>11,.0f} | {ratio:>17.1%} | {own:>10.1f} µs")
    medians = [statistics.median(column) for column in zip(*rows, strict=True)]
    c, e, ratio, own = medians
    print(f"median | {c:>10,.0f} | {e:>11,.0f} | {ratio:>17.1%} | {own:>10.1f} µs")
    ceiling.close()
    collector.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
