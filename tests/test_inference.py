"""The collector's numpy inference (trustrl/acting/inference.py) against the torch policy.

The update recomputes log-probabilities and values in torch from what the collector
stored, so the two paths must agree: same log-probabilities of the sampled actions,
same values, same normalization, and samples drawn from the policy's distribution.
"""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
import torch

from trustrl.acting.inference import Inference
from trustrl.config import PolicyConfig
from trustrl.envs.spaces import SpaceSpec
from trustrl.learner.policy import Policy

OBS_DIM = 6
ROWS = 12
AGENTS = 3

SPACES = {
    "discrete": gym.spaces.Discrete(5),
    "multidiscrete": gym.spaces.MultiDiscrete([3, 2, 4]),
    "box": gym.spaces.Box(-1.0, 1.0, (3,), np.float32),
}
# name -> Policy keyword arguments
LAYOUTS = {
    "single": {},
    "normalized": {"normalize_obs": True},
    "shared_with_ids": {"num_agents": AGENTS, "agent_id": True},
    "per_agent": {"num_agents": AGENTS, "per_agent": True},
    "per_agent_global_critic": {
        "num_agents": AGENTS,
        "per_agent": True,
        "agent_id": True,
        "critic_dim": 10,
        "value_norm": True,
    },
}


def make(space: str, layout: str, activation: str = "tanh") -> Policy:
    torch.manual_seed(0)
    spec = SpaceSpec.from_spaces(
        gym.spaces.Box(-5.0, 5.0, (OBS_DIM,), np.float32), SPACES[space], False
    )
    policy = Policy(
        spec, PolicyConfig(hidden_sizes=(16, 8), activation=activation), **LAYOUTS[layout]
    )
    with torch.no_grad():  # weights and statistics away from their initial values
        for p in policy.parameters():
            p.add_(0.3 * torch.randn_like(p))
        for norm in (policy.obs_normalizer, policy.critic_normalizer, policy.value_normalizer):
            if norm is not None:
                norm.update(torch.randn(50, *norm.mean.shape, dtype=torch.float64) * 3 + 1)
    return policy


def inputs(policy: Policy, seed: int = 1, rows: int = ROWS):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, OBS_DIM)).astype(np.float32)
    critic = (
        rng.normal(size=(rows, policy.critic_dim)).astype(np.float32) if policy.critic_dim else None
    )
    agent = np.arange(rows) % policy.num_agents
    return x, critic, agent


# A rollout's worth of rows, as the collector's once-per-rollout log-probs and values see.
LARGE = 520


@pytest.mark.parametrize("rows", [ROWS, LARGE], ids=["rows", "large"])
@pytest.mark.parametrize("activation", ["tanh", "relu"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("space", SPACES)
def test_log_probs_and_values_match_torch(
    space: str, layout: str, activation: str, rows: int
) -> None:
    policy = make(space, layout, activation)
    x, critic, agent = inputs(policy, rows=rows)
    actions, logprob, value = Inference.of(policy).step(
        x, None, np.random.default_rng(0), critic, agent
    )
    assert logprob.dtype == np.float32 and value.dtype == np.float32
    t_agent = torch.from_numpy(agent)
    t_critic = torch.from_numpy(critic) if critic is not None else None
    with torch.no_grad():
        params = policy.dist_params(torch.from_numpy(x), None, t_agent)
        expected_lp = policy.head.log_prob(params, torch.from_numpy(actions))
        expected_v = policy.critic_value(torch.from_numpy(x), t_critic, t_agent)
    np.testing.assert_allclose(logprob, expected_lp.numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(value, expected_v.numpy(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("space", SPACES)
def test_mode_is_the_torch_heads_mode(space: str, layout: str) -> None:
    """``mode`` (evaluation's deterministic action) is ``head.mode``, masks included."""
    policy = make(space, layout)
    x, _, agent = inputs(policy)
    width = Inference.of(policy).width
    mask = None
    if space != "box":  # one forbidden action per row (per block), never a block's only one
        mask = np.ones((ROWS, width), dtype=bool)
        mask[np.arange(ROWS), np.arange(ROWS) % 2] = False
    with torch.no_grad():
        t_mask = torch.from_numpy(mask) if mask is not None else None
        params = policy.dist_params(torch.from_numpy(x), t_mask, torch.from_numpy(agent))
        expected = policy.head.mode(params).numpy()
    actions = Inference.of(policy).mode(x, mask, agent)
    if mask is None:
        np.testing.assert_allclose(actions, expected, rtol=1e-5, atol=1e-6)
        return
    np.testing.assert_array_equal(actions, expected)
    space_nvec = getattr(SPACES[space], "nvec", np.array([width]))
    offsets = np.concatenate([[0], np.cumsum(space_nvec)[:-1]])
    assert mask[np.arange(ROWS)[:, None], actions.reshape(ROWS, -1) + offsets].all()


def test_weights_are_a_snapshot() -> None:
    """Weights are copied at construction: an update mid-collection cannot mix versions."""
    policy = make("discrete", "single")
    x, _, _ = inputs(policy)
    inference = Inference.of(policy)
    before = inference.value(x)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(1.0)
    np.testing.assert_array_equal(inference.value(x), before)
    assert not np.allclose(Inference.of(policy).value(x), before)


def test_categorical_samples_follow_the_policy_and_respect_masks() -> None:
    policy = make("discrete", "single")
    x = np.repeat(inputs(policy)[0][:1], 40_000, axis=0)
    mask = np.ones((len(x), 5), dtype=bool)
    mask[:, 1] = False
    actions, _, _ = Inference.of(policy).step(x, mask, np.random.default_rng(3))
    with torch.no_grad():
        masked = torch.from_numpy(mask[:1])
        probs = policy.dist_params(torch.from_numpy(x[:1]), masked)[0].exp().double().numpy()
    freq = np.bincount(actions, minlength=5) / len(actions)
    assert freq[1] == 0.0
    tolerance = 4 * np.sqrt(probs * (1 - probs) / len(actions)) + 1e-12
    assert np.all(np.abs(freq - probs) <= tolerance), (freq, probs)


def test_gaussian_samples_have_the_policy_mean_and_std() -> None:
    policy = make("box", "single")
    x = np.repeat(inputs(policy)[0][:1], 40_000, axis=0)
    actions, _, _ = Inference.of(policy).step(x, None, np.random.default_rng(4))
    with torch.no_grad():
        params = policy.dist_params(torch.from_numpy(x[:1]))[0].numpy()
    mean, std = params[:3], np.exp(params[3:])
    np.testing.assert_allclose(actions.mean(0), mean, atol=4 * std.max() / np.sqrt(len(x)))
    np.testing.assert_allclose(actions.std(0), std, rtol=0.02)
