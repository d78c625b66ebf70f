"""Update SPS per device: one preset's PPO update, timed on the CPU and on CUDA.

    .venv/bin/python benchmarks/update_device.py                       # the four cases below
    .venv/bin/python benchmarks/update_device.py --cases minatar --blocks 5

For each case the preset's trainer collects one real rollout (its envs x steps), then the
update (every epoch and minibatch, and on CUDA the rows' move there and the weights' copy
back) runs on that rollout in blocks that alternate between the devices (A B A B); the
table gives each device's median update SPS (rollout rows / seconds per update) and their
ratio. Where torch sees no GPU, only the CPU column is measured. The CPU runs on
``--threads`` torch threads (1, the presets' own count, unless given).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

import trustrl
from trustrl.run.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # examples.masked

# Each a (env id, config file or None for the env's preset).
CASES: dict[str, tuple[str, Path | None]] = {
    "cartpole": ("CartPole-v1", None),
    "masked-gru": ("examples.masked:cartpole", ROOT / "examples" / "masked_cartpole.toml"),
    "minatar": ("MinAtar/Breakout-v1", None),
    "atari": ("ALE/Breakout-v5", None),
}


def trainer(case: str, device: str) -> Trainer:
    env_id, config_file = CASES[case]
    overrides = {
        "quiet": True,
        "eval_episodes": 0,
        "device": device,
        "run_dir": f"/tmp/update_device/{case}-{device}",
    }
    return Trainer(trustrl.resolve(env_id, config_file=config_file, overrides=overrides),
                   overwrite=True)  # fmt: skip


def time_update(run: Trainer, rollout: Any, repeats: int) -> float:
    """Seconds per update (the policy's weights back on the CPU at the end of each)."""
    update, policy = run.updates[0], run.policies[0]
    start = time.perf_counter()
    for _ in range(repeats):
        update(policy, rollout, 0.0)
    if run.device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--blocks", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    devices = ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]
    if "cuda" in devices:
        print(f"GPU: {torch.cuda.get_device_name()}; torch {torch.__version__}")
    print(
        "| case | rows per update | epochs x minibatches | "
        + " | ".join(f"{d} update SPS" for d in devices)
        + (" | cuda / cpu |" if len(devices) == 2 else " |")
    )
    print("| --- " * (3 + len(devices) + (len(devices) == 2)) + "|")
    for case in args.cases.split(","):
        runs = {d: trainer(case, d) for d in devices}
        first = runs[devices[0]]
        (rollout,) = first.collect().rollouts
        cfg = first.config
        rollout.compute_advantages(cfg.rollout.gamma, cfg.rollout.gae_lambda)
        rows = rollout.valid.numel()  # the env steps the update trains on
        with torch.inference_mode(False):
            for run in runs.values():  # warm-up: kernels chosen, buffers made
                time_update(run, rollout, 1)
            seconds: dict[str, list[float]] = {d: [] for d in devices}
            for _ in range(args.blocks):
                for d, run in runs.items():
                    seconds[d].append(time_update(run, rollout, args.repeats))
        sps = {d: rows / statistics.median(s) for d, s in seconds.items()}
        algo = getattr(cfg, cfg.algo)
        shape = f"{algo.update_epochs} x {algo.num_minibatches}"
        cells = " | ".join(f"{sps[d]:,.0f}" for d in devices)
        ratio = f" | {sps['cuda'] / sps['cpu']:.2f}x |" if len(devices) == 2 else " |"
        print(f"| {case} | {rows:,} | {shape} | {cells}{ratio}", flush=True)
        for run in runs.values():
            run.collector.close()
            for update in run.updates:
                update.close()


if __name__ == "__main__":
    main()
