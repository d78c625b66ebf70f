"""The numpy gradients (trustrl/learner/updates/grads.py) against autograd.

``NumpyGradients`` is a hand-written backward pass of the PPO losses, so every quantity
it produces is checked against ``TorchGradients`` (autograd on the losses of losses.py):
the named terms (losses.py's ``policy_terms`` and ``value_terms`` against their numpy
twins) and each optimizer's flat gradient, for every head, activation, mask and loss
option; then whole updates, step for step. Each backend is chosen as a user chooses it,
by ``ppo.grad_backend`` (``make_gradients``' ``backend``).
"""

from __future__ import annotations

import copy
import itertools
from dataclasses import replace

import gymnasium as gym
import numpy as np
import pytest
import torch

from trustrl.config import ConfigError, PolicyConfig, PPOConfig
from trustrl.envs.spaces import SpaceSpec
from trustrl.learner.optim import Adam
from trustrl.learner.policy import Policy
from trustrl.learner.rollout import Batch, Rollout
from trustrl.learner.updates.grads import (
    LossSettings,
    NumpyGradients,
    TorchGradients,
    make_gradients,
)
from trustrl.learner.updates.ppo import PPOUpdate

OBS_DIM, ROWS = 5, 40
SPACES = {
    "discrete": gym.spaces.Discrete(4),
    "multidiscrete": gym.spaces.MultiDiscrete([3, 2, 4]),
    "box": gym.spaces.Box(-1.0, 1.0, (3,), np.float32),
}


def make_policy(space: str, activation: str = "tanh", seed: int = 0, **kwargs) -> Policy:
    torch.manual_seed(seed)
    spec = SpaceSpec.from_spaces(
        gym.spaces.Box(-5.0, 5.0, (OBS_DIM,), np.float32), SPACES[space], False
    )
    policy = Policy(spec, PolicyConfig(hidden_sizes=(16, 8), activation=activation), **kwargs)
    with torch.no_grad():  # away from the near-uniform initial head
        for p in policy.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return policy


def make_batch(policy: Policy, masked: bool, seed: int = 1, rows: int = ROWS) -> Batch:
    """Samples of ``policy`` with perturbed old log-probs and values, so that ratios leave
    the clip range on both sides and the value clip binds for some rows."""
    g = torch.Generator().manual_seed(seed)
    obs = torch.randn(rows, OBS_DIM, generator=g)
    mask = None
    if masked:
        width = sum(policy.spec.nvec)
        mask = torch.rand(rows, width, generator=g) > 0.4
        for lo, _ in itertools.pairwise(np.cumsum([0, *policy.spec.nvec]).tolist()):
            mask[:, lo] = True  # at least one legal action per block
    actions, logprob, values = (t.clone() for t in policy.step(obs, mask, generator=g))
    return Batch(
        obs=obs,
        actions=actions,
        logprob=logprob + 0.3 * torch.randn(rows, generator=g),
        values=values + 0.3 * torch.randn(rows, generator=g),
        advantages=torch.randn(rows, generator=g) * 2 + 0.5,
        returns=values + torch.randn(rows, generator=g),
        action_mask=mask,
    )


def optimizers(policy: Policy, separate: bool) -> dict[str, Adam]:
    if separate:
        return {
            "pi": Adam(policy.actor_parameters(), lr=1e-3),
            "vf": Adam(policy.critic_parameters(), lr=1e-3),
        }
    return {"all": Adam(policy.parameters(), lr=1e-3)}


CASES = [
    # (space, masked, activation, ppo options)
    ("discrete", False, "tanh", {}),
    ("discrete", True, "relu", {"ent_coef": 0.05}),
    ("discrete", False, "relu", {"vf_clip_coef": 0.2, "norm_adv": False}),
    ("multidiscrete", False, "tanh", {"ent_coef": 0.01, "vf_clip_coef": 0.1}),
    ("multidiscrete", True, "tanh", {"ent_coef": 0.01}),
    ("box", False, "tanh", {"ent_coef": 0.01}),
    ("box", False, "relu", {"vf_clip_coef": 0.2, "norm_adv": False}),
]


@pytest.mark.parametrize("separate", [False, True], ids=["shared", "separate"])
@pytest.mark.parametrize(("space", "masked", "activation", "options"), CASES)
def test_terms_and_gradients_match_autograd(
    space: str, masked: bool, activation: str, options: dict, separate: bool
) -> None:
    policy = make_policy(space, activation)
    assert_matches_autograd(policy, make_batch(policy, masked), options, separate)


@pytest.mark.parametrize("separate", [False, True], ids=["shared", "separate"])
def test_large_minibatches_match_autograd(separate: bool) -> None:
    """A rollout-sized minibatch (the ones above are small)."""
    policy = make_policy("discrete")
    batch = make_batch(policy, masked=False, rows=520)
    assert_matches_autograd(policy, batch, {"ent_coef": 0.01}, separate)


FITS = [(True, True), (True, False), (False, True)]  # (fit_policy, fit_value)


def assert_matches_autograd(policy: Policy, batch: Batch, options: dict, separate: bool) -> None:
    lrs = {"pi_lr": 1e-3, "vf_lr": 1e-3} if separate else {}
    config = LossSettings.of(PPOConfig(**options, **lrs))
    opts = optimizers(policy, separate)
    reference = make_gradients(policy, config, opts, backend="torch")
    mine = make_gradients(policy, config, opts, backend="numpy")
    assert isinstance(reference, TorchGradients) and isinstance(mine, NumpyGradients)
    for fit_pi, fit_vf in FITS:
        fit = {"fit_policy": fit_pi, "fit_value": fit_vf, "clip_coef": 0.2}
        want_terms, want = reference.step(batch, **fit)
        got_terms, have = mine.step(batch.numpy(), **fit)
        assert got_terms.keys() == want_terms.keys()
        for name, value in want_terms.items():
            tolerance = {"rtol": 1e-5} if name == "loss_v" else {"rtol": 1e-5, "atol": 1e-6}
            np.testing.assert_allclose(got_terms[name], value, **tolerance, err_msg=name)
        if fit_pi:
            assert 0.0 < got_terms["clip_fraction"] < 1.0, "the clip should bind for some"
        # Only the optimizers whose loss has a fitted term get a gradient.
        assert have.keys() == want.keys()
        assert set(want) == {
            key
            for key in opts
            if (fit_pi and key in ("pi", "all")) or (fit_vf and key in ("vf", "all"))
        }
        for key, grad in want.items():
            scale = float(grad.abs().max())
            assert scale > 0
            np.testing.assert_allclose(
                have[key].numpy(), grad.numpy(), rtol=1e-4, atol=1e-5 * scale, err_msg=key
            )


@pytest.mark.parametrize("separate", [False, True], ids=["shared", "separate"])
@pytest.mark.parametrize("backend", ["torch", "numpy"])
def test_the_kl_stop_reports_the_policy_terms_and_fits_only_the_value(
    backend: str, separate: bool
) -> None:
    """Past target_kl the policy terms are measured, not fitted: no loss_pi, and the
    gradients are the value term's alone, as if the policy had not been asked for."""
    policy = make_policy("discrete")
    batch = make_batch(policy, masked=False)
    lrs = {"pi_lr": 1e-3, "vf_lr": 1e-3} if separate else {}
    config = LossSettings.of(PPOConfig(**lrs))
    opts = optimizers(policy, separate)
    grads = make_gradients(policy, config, opts, backend=backend)
    mb = batch if backend == "torch" else batch.numpy()
    fit = {"fit_policy": True, "fit_value": True, "clip_coef": 0.2}
    terms, stopped = grads.step(mb, **fit, target_kl=0.0)
    assert terms["kl_stop"] == 1.0 and terms["approx_kl"] > 0.0
    assert "loss_pi" not in terms and "entropy" not in terms
    stopped = {k: g.clone() for k, g in stopped.items()}
    value_terms, value_only = grads.step(mb, fit_policy=False, fit_value=True)
    assert terms["loss_v"] == value_terms["loss_v"]
    assert stopped.keys() == value_only.keys() == {"vf" if separate else "all"}
    for key, grad in value_only.items():
        assert torch.equal(stopped[key], grad), key
    kept, _ = grads.step(mb, **fit, target_kl=1e9)
    assert kept["kl_stop"] == 0.0 and "loss_pi" in kept


@pytest.mark.parametrize("space", list(SPACES))
def test_a_step_depends_on_its_minibatch_alone(space: str) -> None:
    """The same minibatch gives the same terms and gradients whatever came before it."""
    policy = make_policy(space)
    opts = optimizers(policy, separate=False)
    grads = make_gradients(policy, LossSettings(ent_coef=0.01), opts, backend="numpy")
    first, other = make_batch(policy, False).numpy(), make_batch(policy, False, seed=7).numpy()
    fit = {"fit_policy": True, "fit_value": True, "clip_coef": 0.2}
    terms, out = grads.step(first, **fit)
    want = {k: g.clone() for k, g in out.items()}
    grads.step(other, **fit)
    grads.step(other, fit_policy=False, fit_value=True)
    again, out = grads.step(first, **fit)
    assert again == terms
    for key, grad in want.items():
        assert torch.equal(out[key], grad), key


def test_ties_of_the_clipped_branches_carry_the_full_gradient() -> None:
    """Fresh samples (ratio exactly 1) and old values equal to the new ones put every row
    on a tie of min/max: autograd splits the gradient over both branches, which sum to it."""
    policy = make_policy("discrete")
    batch = make_batch(policy, masked=False)
    with torch.no_grad():
        batch.logprob = policy.head.log_prob(policy.dist_params(batch.obs), batch.actions)
        batch.values = policy.value_raw(batch.obs)
    config = LossSettings(vf_clip_coef=0.2)
    opts = optimizers(policy, separate=False)
    reference = make_gradients(policy, config, opts, backend="torch")
    mine = make_gradients(policy, config, opts, backend="numpy")
    fit = {"fit_policy": True, "fit_value": True, "clip_coef": 0.2}
    got_terms, have = mine.step(batch.numpy(), **fit)
    assert got_terms["clip_fraction"] == 0.0
    _, want = reference.step(batch, **fit)
    np.testing.assert_allclose(have["all"].numpy(), want["all"].numpy(), rtol=1e-4, atol=1e-6)


NUMPY_LESS = [  # policies the numpy gradients do not cover, and why
    ({"num_agents": 3, "per_agent": True}, "one actor per agent"),
    ({"num_agents": 3, "agent_id": True}, "agent id"),
    ({"critic_dim": 7}, "global state"),
]


def test_auto_follows_the_policy_and_torch_serves_every_policy() -> None:
    config = LossSettings()
    for space in SPACES:
        policy = make_policy(space)
        opts = optimizers(policy, False)
        assert isinstance(make_gradients(policy, config, opts), NumpyGradients)
        assert isinstance(make_gradients(policy, config, opts, backend="torch"), TorchGradients)
    for kwargs, _ in NUMPY_LESS:
        policy = make_policy("discrete", **kwargs)
        gradients = make_gradients(policy, config, optimizers(policy, False), backend="auto")
        assert isinstance(gradients, TorchGradients), kwargs


@pytest.mark.parametrize(("kwargs", "why"), NUMPY_LESS)
def test_numpy_where_it_cannot_serve_is_a_config_error(kwargs: dict, why: str) -> None:
    """The error names the field, the value and what in the policy it cannot train."""
    policy = make_policy("discrete", **kwargs)
    with pytest.raises(ConfigError, match=rf'ppo.grad_backend = "numpy" .*{why}'):
        PPOUpdate(policy, PPOConfig(grad_backend="numpy"))
    assert isinstance(PPOUpdate(policy, PPOConfig()).gradients, TorchGradients)


def test_the_torch_backend_runs_no_critic_process() -> None:
    policy = make_policy("discrete")
    update = PPOUpdate(policy, PPOConfig(grad_backend="torch", critic_process=True))
    assert isinstance(update.gradients, TorchGradients) and not update.critic_process


def make_rollout(policy: Policy, space: str) -> Rollout:
    g = torch.Generator().manual_seed(3)
    steps, rows = 16, 4
    action_shape = policy.spec.action_shape if space != "discrete" else ()
    dtype = np.float32 if space == "box" else np.int64
    rollout = Rollout(steps, rows, OBS_DIM, action_shape, dtype)
    rollout.obs = torch.randn(steps, rows, OBS_DIM, generator=g)
    actions, logprob, values = policy.step(rollout.obs.reshape(-1, OBS_DIM), generator=g)
    rollout.actions = actions.reshape(steps, rows, *action_shape).clone()
    rollout.logprob = logprob.reshape(steps, rows).clone()
    rollout.values = values.reshape(steps, rows).clone()
    rollout.rewards = torch.randn(steps, rows, generator=g)
    rollout.valid = torch.ones(steps, rows, dtype=torch.bool)
    rollout.terminated[5, 1] = 1.0
    rollout.last_value = torch.randn(rows, generator=g)
    rollout.compute_advantages(0.99, 0.95)
    return rollout


@pytest.mark.parametrize(
    ("space", "options"),
    [
        ("discrete", {"ent_coef": 0.01, "max_grad_norm": 0.5}),
        ("box", {"pi_lr": 3e-3, "vf_lr": 1e-2, "vf_epochs": 6, "target_kl": 0.02}),
        ("multidiscrete", {"vf_clip_coef": 0.2, "learning_rate": 3e-3}),
    ],
)
def test_whole_updates_match_autograd(space: str, options: dict) -> None:
    """Several updates (epochs, minibatches, clipping, Adam, the KL stop) with each
    backend from the same start end at the same weights and metrics."""
    policy = make_policy(space)
    twin = copy.deepcopy(policy)
    config = PPOConfig(update_epochs=4, num_minibatches=4, **options)
    numpy_update = PPOUpdate(policy, replace(config, grad_backend="numpy"), seed=5)
    torch_update = PPOUpdate(twin, replace(config, grad_backend="torch"), seed=5)
    assert isinstance(numpy_update.gradients, NumpyGradients)
    assert isinstance(torch_update.gradients, TorchGradients)
    for i in range(3):
        rollout = make_rollout(policy, space)
        got = numpy_update(policy, rollout, i / 3)
        want = torch_update(twin, copy.deepcopy(rollout), i / 3)
        assert got.keys() == want.keys()
        for name in got:
            np.testing.assert_allclose(got[name], want[name], rtol=2e-3, atol=1e-5, err_msg=name)
        for (name, p), q in zip(policy.named_parameters(), twin.parameters(), strict=True):
            np.testing.assert_allclose(
                p.detach().numpy(), q.detach().numpy(), rtol=1e-3, atol=1e-5, err_msg=name
            )


def test_trpo_critic_fit_matches_autograd() -> None:
    """TRPO fits its critic with the same backends; its actor has no optimizer."""
    from trustrl.config import TRPOConfig
    from trustrl.learner.updates.trpo import TRPOUpdate

    policy = make_policy("box")
    twin = copy.deepcopy(policy)
    config = TRPOConfig(train_vf_iters=5, minibatches=4)
    numpy_update = TRPOUpdate(policy, config, seed=2)
    torch_update = TRPOUpdate(twin, config, seed=2)
    assert isinstance(numpy_update.gradients, NumpyGradients)
    # TRPO has no grad_backend of its own (its critic fit takes the numpy one where it can).
    optimizer = {"vf": torch_update.vf_optimizer}
    torch_update.gradients = make_gradients(twin, LossSettings(), optimizer, backend="torch")
    rollout = make_rollout(policy, "box")
    batch = rollout.flat()
    got = numpy_update.fit_critic(policy, batch, {})
    want = torch_update.fit_critic(twin, rollout.flat(), {})
    np.testing.assert_allclose(
        [got["loss_v"], got["delta_loss_v"]], [want["loss_v"], want["delta_loss_v"]], rtol=1e-4
    )
    for p, q in zip(policy.parameters(), twin.parameters(), strict=True):
        np.testing.assert_allclose(p.detach().numpy(), q.detach().numpy(), rtol=1e-4, atol=1e-6)
