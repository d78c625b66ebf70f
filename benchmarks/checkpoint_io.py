"""Checkpoint write time and size for the CartPole preset and a Hopper run.

Usage: .venv/bin/python benchmarks/checkpoint_io.py
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import trustrl


def main() -> None:
    cases = {
        "CartPole-v1 PPO preset": ("CartPole-v1", {}),
        "Hopper-v5 PPO, 1 env, obs+reward normalization": (
            "Hopper-v5",
            {
                "env": {"num_envs": 1, "normalize_obs": True, "normalize_reward": True},
                "rollout": {"num_steps": 2048},
            },
        ),
    }
    with tempfile.TemporaryDirectory() as root:
        for name, (env_id, extra) in cases.items():
            overrides = {"quiet": True, "total_steps": 4096, "eval_episodes": 0, **extra}
            overrides["run_dir"] = str(Path(root) / env_id)
            trainer = trustrl.Trainer(trustrl.resolve(env_id, overrides=overrides))
            trainer.train(iterations=1)
            times = []
            for i in range(10):
                start = time.perf_counter()
                folder = trainer.save(f"iter_{9000 + i:08d}")
                times.append(time.perf_counter() - start)
            sizes = {f.name: f.stat().st_size for f in folder.iterdir()}
            print(
                f"{name}: write median {statistics.median(times) * 1e3:.1f} ms, "
                f"size {sum(sizes.values()) / 1024:.0f} KiB {sizes}"
            )


if __name__ == "__main__":
    main()
