"""Time one PPO minibatch step (forward, losses, backward, clip, Adam) on case 1's shapes.

    .venv/bin/python benchmarks/update_step.py                    # numpy gradients
    .venv/bin/python benchmarks/update_step.py --backend torch    # autograd
    .venv/bin/python benchmarks/update_step.py --rows 1024        # case 6's minibatch
    .venv/bin/python benchmarks/update_step.py --critic-process off   # all in one process
    PYTHONPATH=/path/to/other/checkout .venv/bin/python benchmarks/update_step.py

CartPole-sized policy (64x64 tanh actor and critic), a 4 x 128 rollout, 4 epochs of 4
minibatches of 128 (``--rows``: the minibatch size, the rollout grows to match), one
torch and one BLAS thread. ``--backend`` picks the gradients of trustrl/learner/updates/grads.py
(default: the one PPOUpdate picks). Prints microseconds per minibatch step, the median
of 5 repeats of 50 updates. Used for docs/performance.md.
"""

from __future__ import annotations

import argparse
import statistics
import time

import gymnasium as gym
import numpy as np
import torch
from threadpoolctl import threadpool_limits

import trustrl
from trustrl.config import PolicyConfig, PPOConfig
from trustrl.envs.spaces import SpaceSpec
from trustrl.learner.policy import Policy
from trustrl.learner.rollout import Rollout
from trustrl.learner.updates.grads import LossSettings, NumpyGradients, TorchGradients
from trustrl.learner.updates.ppo import PPOUpdate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=["auto", "numpy", "torch"], default="auto")
    parser.add_argument("--rows", type=int, default=128, help="rows per minibatch")
    parser.add_argument(
        "--critic-process",
        choices=["on", "off"],
        default="on",
        help="ppo.critic_process: the critic's share in a second process (default here: on)",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    threadpool_limits(1, user_api="blas")
    torch.manual_seed(0)
    spec = SpaceSpec.from_spaces(
        gym.spaces.Box(-1, 1, (4,), np.float32), gym.spaces.Discrete(2), False
    )
    policy = Policy(spec, PolicyConfig())
    rollout = Rollout(args.rows, 4, 4, (), np.int64)
    rollout.obs.normal_()
    rollout.valid[:] = True
    rollout.logprob.fill_(-0.69)
    rollout.rewards.normal_()
    rollout.compute_advantages(0.99, 0.95)
    config = PPOConfig(
        update_epochs=4,
        num_minibatches=4,
        ent_coef=0.01,
        critic_process=args.critic_process == "on",
    )
    update = PPOUpdate(policy, config)
    if args.backend == "torch":
        update.gradients = TorchGradients(policy, LossSettings.of(config), update.optimizers)
    elif args.backend == "numpy":
        update.gradients = NumpyGradients(
            policy, LossSettings.of(config), update.optimizers, shared=update.critic_process
        )
    for _ in range(5):
        update(policy, rollout, 0.0)
    times = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(50):
            update(policy, rollout, 0.0)
        times.append((time.perf_counter() - start) / (50 * 16))
    print(
        f"{trustrl.__file__} ({type(update.gradients).__name__}, {args.rows} rows, "
        f"critic process {'on' if update.critic_process else 'off'}): "
        f"{statistics.median(times) * 1e6:.0f} us per minibatch step"
    )


if __name__ == "__main__":
    main()
