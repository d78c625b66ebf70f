"""Multi-agent PPO learns a cooperative game with a known optimum (slow: real training).

``CoopCueEnv`` (tests/coop_env.py): three agents see the same cue each step, agent i must
answer ``(cue + i) % 3``, and every agent gets 1 only when all three are right. The
optimal per-agent return is the episode length (5); a random joint policy gets 5 / 27.
Agents must act differently on the same observation, so the shared actor needs the
agent id (and without it cannot beat 0: the negative control). The continuous version
answers with a point in [-1, 1] per agent and a dense team reward, same optimum.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.coop_env import CoopCueEnv
from trustrl.config import config_from_dict
from trustrl.learner.policy import MultiAgentPolicy
from trustrl.run.trainer import Trainer

pytestmark = pytest.mark.slow

ENV_KWARGS = {"num_agents": 3, "num_cues": 3, "episode_length": 5, "agent_shift": 1}
OPTIMAL = CoopCueEnv(**ENV_KWARGS).optimal_return


def coop_trainer(
    run_dir: Path, total_steps: int, seed: int = 1, continuous: bool = False, **multiagent: Any
) -> Trainer:
    return Trainer(
        config_from_dict(
            {
                "env_id": "tests.coop_env:CoopCueEnv",
                "seed": seed,
                "total_steps": total_steps,
                "quiet": True,
                "run_dir": str(run_dir),
                "checkpoint_every": 1000,
                "eval_episodes": 20,
                "target_return": 0.95 * OPTIMAL,
                "env": {"num_envs": 8, "kwargs": {**ENV_KWARGS, "continuous": continuous}},
                "rollout": {"num_steps": 24, "gamma": 0.9, "gae_lambda": 0.9},
                "policy": {"hidden_sizes": [64, 64], "activation": "relu", "log_std_init": -0.5},
                "ppo": {
                    "learning_rate": 1e-3,
                    "update_epochs": 10,
                    "num_minibatches": 2,
                    "anneal_lr": False,
                },
                "multiagent": multiagent,
            }
        )
    )


SHARED = {"actor": "shared", "agent_id": True}
PER_AGENT = {"actor": "per_agent"}


@pytest.mark.parametrize(
    ("multiagent", "continuous", "seed"),
    [
        (PER_AGENT, False, 1),
        (PER_AGENT, False, 2),
        (SHARED, True, 1),
        (PER_AGENT, True, 1),
    ],
    ids=[
        "per_agent-discrete-1",
        "per_agent-discrete-2",
        "shared-continuous-1",
        "per_agent-continuous-1",
    ],
)
def test_learns_the_cooperative_game(
    tmp_path: Path, multiagent: dict[str, Any], continuous: bool, seed: int
) -> None:
    trainer = coop_trainer(tmp_path, 30_000, seed, continuous, **multiagent)
    policy = trainer.train()
    assert isinstance(policy, MultiAgentPolicy)
    assert trainer.groups[0].spec.action_kind == ("box" if continuous else "discrete")
    result = trainer.eval_result
    assert result is not None
    # Deterministic evaluation on held-out seeds: within 5% of the optimum.
    assert result.mean_return >= 0.95 * OPTIMAL, result.returns
    assert trainer.env_steps < 30_000  # stopped early on reaching it


def test_shared_actor_learns_the_cooperative_game_on_2_of_3_seeds(tmp_path: Path) -> None:
    """The shared discrete actor sometimes settles in a local optimum (a training return
    near 3.3 of 5, where it stays for the whole budget): seeds 1-8 solved 6 times with
    numpy sampling, seeds 1-9 solved 8 times with the earlier torch sampling. So this
    asks for 2 solves out of 3 seeds, each as strict as the per-seed tests above."""
    solved = []
    for seed in (1, 2, 3):
        trainer = coop_trainer(tmp_path / str(seed), 30_000, seed, False, **SHARED)
        trainer.train()
        result = trainer.eval_result
        assert result is not None
        solved.append(result.mean_return >= 0.95 * OPTIMAL and trainer.env_steps < 30_000)
    assert sum(solved) >= 2, solved


def test_shared_actor_without_agent_id_cannot_solve_it(tmp_path: Path) -> None:
    trainer = coop_trainer(tmp_path, 4_000, actor="shared", agent_id=False)
    trainer.train()
    assert trainer.eval_result is not None
    assert trainer.eval_result.mean_return < 0.5
