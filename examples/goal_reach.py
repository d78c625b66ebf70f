"""A goal-conditioned task with Dict observations, trained with trustrl's PPO.

A point in the unit square moves by its action (Box(-1, 1, (2,)), a step of at most 0.05
per axis) towards a goal drawn anew each episode. The observation is a Dict, as
Gymnasium-Robotics' goal envs hand them out, plus a Discrete entry:

    observation    float32 (4,)  position and last step
    achieved_goal  float32 (2,)  position
    desired_goal   float32 (2,)  the goal
    goal_quadrant  Discrete(4)   the goal's quadrant (one-hot encoded by the policy)

The reward is dense, minus the distance to the goal; an episode lasts 50 steps and is a
success (``info["is_success"]``) when it ends within 0.05 of the goal. The float entries
are normalized by the policy's running statistics; the Discrete one is not.

    PYTHONPATH=. .venv/bin/python examples/goal_reach.py              # 3 seeds, 100 episodes each
    PYTHONPATH=. .venv/bin/trustrl train examples.goal_reach:GoalReach --env.normalize-obs

Running this file trains seeds 1-3 (``--seeds``) for ``--steps`` env steps each and
prints each seed's success rate over 100 deterministic episodes, as one JSON line each.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces

SUCCESS_DISTANCE = 0.05
LENGTH = 50


class GoalReach(gym.Env):
    metadata = {"render_modes": []}  # noqa: RUF012 (Gymnasium's own convention)

    def __init__(self) -> None:
        self.observation_space = spaces.Dict(
            {
                "observation": spaces.Box(-1.0, 1.0, (4,), np.float32),
                "achieved_goal": spaces.Box(-1.0, 1.0, (2,), np.float32),
                "desired_goal": spaces.Box(-1.0, 1.0, (2,), np.float32),
                "goal_quadrant": spaces.Discrete(4),
            }
        )
        self.action_space = spaces.Box(-1.0, 1.0, (2,), np.float32)
        self.position = np.zeros(2, np.float32)
        self.goal = np.zeros(2, np.float32)
        self.last_step = np.zeros(2, np.float32)
        self.steps = 0

    def _obs(self) -> dict[str, Any]:
        quadrant = int(self.goal[0] > 0) + 2 * int(self.goal[1] > 0)
        return {
            "observation": np.concatenate([self.position, self.last_step / 0.05]),
            "achieved_goal": self.position.copy(),
            "desired_goal": self.goal.copy(),
            "goal_quadrant": quadrant,
        }

    def _distance(self) -> float:
        return float(np.linalg.norm(self.position - self.goal))

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        super().reset(seed=seed)
        self.position = self.np_random.uniform(-0.8, 0.8, 2).astype(np.float32)
        self.goal = self.np_random.uniform(-0.8, 0.8, 2).astype(np.float32)
        self.last_step = np.zeros(2, np.float32)
        self.steps = 0
        return self._obs(), {}

    def step(self, action: Any) -> tuple[dict[str, Any], float, bool, bool, dict[str, Any]]:
        step = 0.05 * np.clip(np.asarray(action, np.float32), -1.0, 1.0)
        self.position = np.clip(self.position + step, -1.0, 1.0).astype(np.float32)
        self.last_step = step
        self.steps += 1
        distance = self._distance()
        truncated = self.steps >= LENGTH
        info = {"is_success": distance < SUCCESS_DISTANCE} if truncated else {}
        return self._obs(), -distance, False, truncated, info


def success_rate(policy: Any, episodes: int, seed: int) -> float:
    """The share of ``episodes`` deterministic episodes that end within reach."""
    env = GoalReach()
    successes = 0
    for episode in range(episodes):
        obs, _ = env.reset(seed=seed + episode)
        info: dict[str, Any] = {}
        done = False
        while not done:
            obs, _, terminated, truncated, info = env.step(policy.act(obs))
            done = terminated or truncated
        successes += bool(info["is_success"])
    return successes / episodes


def main() -> None:
    import trustrl

    parser = argparse.ArgumentParser(description="PPO on GoalReach, success rate per seed")
    parser.add_argument("--seeds", default="1,2,3")
    parser.add_argument("--steps", type=int, default=409_600)
    parser.add_argument("--episodes", type=int, default=100)
    parser.add_argument("--run-root", default="runs/goal_reach")
    args = parser.parse_args()
    for seed in (int(s) for s in args.seeds.split(",")):
        config = trustrl.resolve(
            "examples.goal_reach:GoalReach",
            overrides={
                "total_steps": args.steps,
                "seed": seed,
                "run_dir": f"{args.run_root}/{seed}",
                "quiet": True,
                "env": {"num_envs": 8, "normalize_obs": True},
                "rollout": {"num_steps": 256},
                "ppo": {"learning_rate": 1e-3},
            },
        )
        start = time.perf_counter()
        trainer = trustrl.Trainer(config, overwrite=True)
        policy = trainer.train()
        rate = success_rate(policy, args.episodes, seed=10_000)
        wall = time.perf_counter() - start
        print(
            json.dumps(
                {
                    "seed": seed,
                    "steps": trainer.env_steps,
                    "success": rate,
                    "wall_s": round(wall, 1),
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
