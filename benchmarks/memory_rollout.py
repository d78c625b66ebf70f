"""The memory a recurrent rollout costs beside a feed-forward one: the bytes of one
rollout's batch (what a runner sends) and of the update's training rows (a recurrent
policy's padded sequence chunks), and the peak RSS of a short training run in a fresh
process, A B A B.

    .venv/bin/python benchmarks/memory_rollout.py                      # CartPole-v1's preset
    .venv/bin/python benchmarks/memory_rollout.py --env MinAtar/Breakout-v1

The env's preset on both sides but ``policy.memory`` (none against gru, 64 units, chunks
of ``--sequence-length`` steps).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
from typing import Any

import numpy as np


def measure(env_id: str, memory: str, sequence_length: int, steps: int) -> dict:
    """In this process: one rollout's batch and training-row bytes, then a short run's peak
    RSS (MiB)."""
    import trustrl
    from trustrl.contract import PolicySnapshot
    from trustrl.run.trainer import absorb

    overrides: dict[str, Any] = {
        "quiet": True,
        "eval_episodes": 0,
        "total_steps": steps,
        "policy": {"memory": memory, "memory_size": 64},
        "rollout": {"sequence_length": sequence_length},
    }
    with tempfile.TemporaryDirectory() as folder:
        overrides["run_dir"] = folder
        config = trustrl.resolve(env_id, overrides=overrides)
        trainer = trustrl.Trainer(config)
        collector = trainer.collector
        batch = collector.collect(PolicySnapshot.of(trainer.policies, 0))
        group = batch.groups[0]
        sent = sum(v.nbytes for v in vars(group).values() if isinstance(v, np.ndarray))
        [rollout] = absorb(trainer.policies, batch, 0, 0, config.rollout.sequence_length)
        rollout.compute_advantages(0.99, 0.95)
        rows = rollout.training_batch()
        trained = sum(
            getattr(rows, name).numpy().nbytes
            for name in ("obs", "actions", "logprob", "values", "advantages", "returns", "agent")
        )
        if hasattr(rows, "state"):
            trained += rows.state.numpy().nbytes + rows.loss_rows.numpy().nbytes
        trainer.train()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"batch_bytes": sent, "training_bytes": trained, "peak_rss_mib": peak}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--env", default="CartPole-v1")
    parser.add_argument("--sequence-length", type=int, default=16)
    parser.add_argument("--steps", type=int, default=20_480)
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # a child's side
    args = parser.parse_args()
    if args.one is not None:
        out = measure(args.env, args.one, args.sequence_length, args.steps)
        print(json.dumps(out))
        return
    results: dict[str, list[dict]] = {"none": [], "gru": []}
    for _ in range(args.pairs):
        for memory in ("none", "gru"):
            command = [sys.executable, __file__, "--one", memory, "--env", args.env]
            command += ["--sequence-length", str(args.sequence_length)]
            command += ["--steps", str(args.steps)]
            done = subprocess.run(command, capture_output=True, text=True, check=True)
            results[memory].append(json.loads(done.stdout.strip().splitlines()[-1]))
    print(f"{args.env}, sequence_length {args.sequence_length}, {args.pairs} pairs (medians)")
    print("| policy | rollout batch, KiB | training rows, KiB | peak RSS, MiB |")
    print("| --- | --- | --- | --- |")
    for memory, runs in results.items():
        batch = statistics.median(r["batch_bytes"] for r in runs) / 1024
        trained = statistics.median(r["training_bytes"] for r in runs) / 1024
        rss = statistics.median(r["peak_rss_mib"] for r in runs)
        print(f"| {memory} | {batch:,.1f} | {trained:,.1f} | {rss:,.0f} |")


if __name__ == "__main__":
    main()
