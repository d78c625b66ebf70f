"""An application that owns its loop: a hand-written CartPole, trained through trustrl.Agent.

Start the learner, then any number of these, each in its own process:

    trustrl serve CartPole-v1 --name cartpole          # prints the address to connect to
    python examples/external_cartpole.py --name cartpole --address 127.0.0.1:PORT --seed 1
    python examples/external_cartpole.py --name cartpole --address 127.0.0.1:PORT --seed 2

or through the learner's gateway (`trustrl serve ... --listen 127.0.0.1:50051`, a token
from `trustrl agents add RUN_DIR NAME`; docs/gateway.md), without Ray:

    TRUSTRL_TOKEN=... python examples/external_cartpole.py --name grpc://127.0.0.1:50051

The simulator below is CartPole's physics written out (Barto, Sutton and Anderson 1983,
as Gymnasium's CartPole-v1 has them, with its 500-step time limit): no Gymnasium here.
The learner takes the spaces from the env id and evaluates on Gymnasium's CartPole-v1.
Each process runs until the learner's run has finished (or --seconds pass), then prints
one line of JSON: steps acted, episodes, wall time, and the agent's act() latency. It
steps at ten times CartPole's real time by default (--pace): an application has a clock
of its own, and agents that act as fast as the CPU allows leave a small machine's
learner no time to train (their chunks then lag and are drained).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time

import numpy as np

GRAVITY, CART_MASS, POLE_MASS, HALF_LENGTH, FORCE, TAU = 9.8, 1.0, 0.1, 0.5, 10.0, 0.02
TOTAL_MASS, POLE_MOMENT = CART_MASS + POLE_MASS, POLE_MASS * HALF_LENGTH
X_LIMIT, ANGLE_LIMIT, TIME_LIMIT = 2.4, 12 * 2 * math.pi / 360, 500


class CartPole:
    def __init__(self, seed: int) -> None:
        self.random = random.Random(seed)
        self.state = [0.0] * 4
        self.steps = 0

    def reset(self) -> np.ndarray:
        self.state = [self.random.uniform(-0.05, 0.05) for _ in range(4)]
        self.steps = 0
        return np.array(self.state, dtype=np.float32)

    def step(self, action: int) -> tuple[np.ndarray, float, bool, bool]:
        x, x_dot, theta, theta_dot = self.state
        force = FORCE if action == 1 else -FORCE
        cos, sin = math.cos(theta), math.sin(theta)
        temp = (force + POLE_MOMENT * theta_dot**2 * sin) / TOTAL_MASS
        theta_acc = (GRAVITY * sin - cos * temp) / (
            HALF_LENGTH * (4.0 / 3.0 - POLE_MASS * cos**2 / TOTAL_MASS)
        )
        x_acc = temp - POLE_MOMENT * theta_acc * cos / TOTAL_MASS
        x, x_dot = x + TAU * x_dot, x_dot + TAU * x_acc
        theta, theta_dot = theta + TAU * theta_dot, theta_dot + TAU * theta_acc
        self.state = [x, x_dot, theta, theta_dot]
        self.steps += 1
        terminated = abs(x) > X_LIMIT or abs(theta) > ANGLE_LIMIT
        truncated = self.steps >= TIME_LIMIT and not terminated
        return np.array(self.state, dtype=np.float32), 1.0, terminated, truncated


def run(agent, seed: int, seconds: float, pace: float) -> dict[str, float]:
    env = CartPole(seed)
    latencies: list[float] = []
    steps = episodes = 0
    start = time.perf_counter()

    def act(obs: np.ndarray, reward: float | None) -> int:
        began = time.perf_counter()
        action = agent.act(obs, reward=reward)
        latencies.append(time.perf_counter() - began)
        return int(action)

    action = act(env.reset(), None)
    while not agent.status()["finished"] and time.perf_counter() - start < seconds:
        time.sleep(pace)  # the application's own clock
        obs, reward, terminated, truncated = env.step(action)
        steps += 1
        if terminated or truncated:
            agent.end_episode(reward, truncated=truncated)
            episodes += 1
            action = act(env.reset(), None)
        else:
            action = act(obs, reward)
    return {
        "steps": steps,
        "episodes": episodes,
        "seconds": time.perf_counter() - start,
        "act_median_us": float(np.median(latencies) * 1e6),
        "act_p99_us": float(np.percentile(latencies, 99) * 1e6),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--name",
        default="cartpole",
        help="the learner's --name, or its gateway's grpc://HOST:PORT (token: TRUSTRL_TOKEN)",
    )
    parser.add_argument("--address", default=None, help="the Ray address trustrl serve printed")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--seconds", type=float, default=600.0, help="stop after this long")
    parser.add_argument(
        "--pace",
        type=float,
        default=0.002,
        help="seconds per step (0.002: ten times CartPole's real time, tau = 0.02 s; 0: as "
        "fast as the CPU allows, which on a small machine starves the learner)",
    )
    args = parser.parse_args()
    import trustrl

    agent = trustrl.Agent.connect(args.name, address=args.address, seed=args.seed)
    try:
        result = run(agent, args.seed, args.seconds, args.pace)
        agent.flush(timeout=10)
        result.update(agent.status())
    finally:
        agent.close(flush_timeout=0)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
