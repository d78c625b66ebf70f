"""Partially observed classics: CartPole-v1 and Pendulum-v1 with their velocities masked
(positions only), the tasks rl-baselines3-zoo's RecurrentPPO figures use
(CartPoleNoVel-v1, PendulumNoVel-v1). A memoryless policy cannot infer a velocity from
one observation; a recurrent one (``policy.memory``) can, from the observations before.

    PYTHONPATH=. .venv/bin/trustrl train examples.masked:cartpole \\
        --config examples/masked_cartpole.toml

The mask is Gymnasium's ``TransformObservation`` with the reduced Box (Gymnasium has no
wrapper that drops vector entries; ``FilterObservation`` takes Dict spaces only).
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np

# The entries kept: CartPole's cart position and pole angle (not their velocities);
# Pendulum's cos and sin of the angle (not the angular velocity).
KEPT = {"CartPole-v1": [0, 2], "Pendulum-v1": [0, 1]}


def masked(env_id: str, **kwargs: Any) -> gym.Env:
    """``env_id`` with only the ``KEPT`` entries of its observation."""
    env = gym.make(env_id, **kwargs)
    keep = KEPT[env_id]
    box = env.observation_space
    assert isinstance(box, gym.spaces.Box)
    space = gym.spaces.Box(box.low[keep], box.high[keep], dtype=np.float32)
    return gym.wrappers.TransformObservation(env, lambda obs: obs[keep], space)


def cartpole(**kwargs: Any) -> gym.Env:
    """CartPole-v1, positions only (the zoo's CartPoleNoVel-v1)."""
    return masked("CartPole-v1", **kwargs)


def pendulum(**kwargs: Any) -> gym.Env:
    """Pendulum-v1, the angle's cos and sin only (the zoo's PendulumNoVel-v1)."""
    return masked("Pendulum-v1", **kwargs)
