"""PPOUpdate on a tiny discrete policy and a hand-filled rollout; what the update
decides (the KL stop, the non-finite guard) is checked with each gradient backend
(``ppo.grad_backend``)."""

from __future__ import annotations

import copy
import itertools
import math
from dataclasses import replace

import gymnasium as gym
import numpy as np
import pytest
import torch

from trustrl.config import PolicyConfig, PPOConfig
from trustrl.envs.spaces import SpaceSpec
from trustrl.learner.losses import clipped_surrogate, value_loss
from trustrl.learner.policy import Policy
from trustrl.learner.rollout import Rollout
from trustrl.learner.updates.ppo import PPOUpdate

OBS_DIM, N_ACTIONS, STEPS, ROWS = 3, 3, 8, 4
BACKENDS = ("numpy", "torch")

METRIC_KEYS = {
    "loss_pi",
    "delta_loss_pi",
    "loss_v",
    "delta_loss_v",
    "approx_kl",
    "entropy",
    "clip_fraction",
    "explained_variance",
    "stop_iter",
    "learning_rate",
}


def make_policy(seed: int = 0) -> Policy:
    torch.manual_seed(seed)
    spec = SpaceSpec.from_spaces(
        gym.spaces.Box(-1.0, 1.0, (OBS_DIM,), np.float32), gym.spaces.Discrete(N_ACTIONS)
    )
    return Policy(spec, PolicyConfig(hidden_sizes=(16,)))


def make_rollout(policy: Policy, seed: int = 0) -> Rollout:
    """A rollout whose actions, log-probs and values come from ``policy`` itself, so the
    ratio is exactly 1 before the first step, with one episode boundary of each kind."""
    g = torch.Generator().manual_seed(seed)
    rollout = Rollout(STEPS, ROWS, OBS_DIM, (), np.int64)
    rollout.obs = torch.randn(STEPS, ROWS, OBS_DIM, generator=g)
    actions, logprob, values = policy.step(rollout.obs.reshape(-1, OBS_DIM), generator=g)
    rollout.actions = actions.reshape(STEPS, ROWS).clone()
    rollout.logprob = logprob.reshape(STEPS, ROWS).clone()
    rollout.values = values.reshape(STEPS, ROWS).clone()
    # Rewards that depend on the action, so the policy gradient has a direction.
    rollout.rewards = (rollout.actions == 1).float() + 0.1 * torch.randn(STEPS, ROWS, generator=g)
    rollout.valid = torch.ones(STEPS, ROWS, dtype=torch.bool)
    rollout.terminated[2, 0] = 1.0
    rollout.valid[3, 0] = False
    rollout.truncated[5, 1] = 1.0
    rollout.valid[6, 1] = False
    rollout.last_value = torch.randn(ROWS, generator=g)
    rollout.compute_advantages(0.99, 0.95)
    return rollout


def snapshot(params) -> list[torch.Tensor]:
    return [p.detach().clone() for p in params]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def record_events(
    monkeypatch: pytest.MonkeyPatch, update: PPOUpdate, after: dict | None = None
) -> list[tuple[str, float]]:
    """The sequence of KL measurements and optimizer steps, in the order they happen;
    ``after[key]()`` runs after each step of optimizer ``key``."""
    events: list[tuple[str, float]] = []
    measure = update.gradients.step

    def recording_step(*args, **kwargs):  # type: ignore[no-untyped-def]
        terms, grads = measure(*args, **kwargs)
        if kwargs["fit_policy"]:
            events.append(("kl", terms["approx_kl"]))
        return terms, grads

    monkeypatch.setattr(update.gradients, "step", recording_step)
    for key, opt in update.optimizers.items():

        def step(*args, original=opt.step, key=key) -> None:  # type: ignore[no-untyped-def]
            original(*args)
            events.append((f"step:{key}", 0.0))
            if after and key in after:
                after[key]()

        monkeypatch.setattr(opt, "step", step)
    return events


# (a) A plain update.


def test_update_changes_weights_and_reports_every_metric() -> None:
    policy = make_policy()
    rollout = make_rollout(policy)
    before = snapshot(policy.parameters())
    update = PPOUpdate(policy, PPOConfig(learning_rate=1e-2, update_epochs=3, num_minibatches=2))
    metrics = update(policy, rollout, progress=0.0)

    assert set(metrics) >= METRIC_KEYS
    assert all(isinstance(v, float) for v in metrics.values())
    for key in METRIC_KEYS:
        assert math.isfinite(metrics[key]), key
    after = list(policy.parameters())
    assert all(not torch.equal(b, a) for b, a in zip(before, after, strict=True))
    assert metrics["stop_iter"] == 3.0
    assert metrics["learning_rate"] == 1e-2
    assert metrics["approx_kl"] > 0
    assert 0.0 <= metrics["clip_fraction"] <= 1.0
    assert 0.0 < metrics["entropy"] <= math.log(N_ACTIONS) + 1e-6
    # The critic fits: the value loss falls from the first epoch to the last.
    assert metrics["delta_loss_v"] < 0
    batch = rollout.flat()
    residual = (batch.returns - batch.values).var(unbiased=False)
    expected_ev = float(1 - residual / batch.returns.var(unbiased=False))
    assert metrics["explained_variance"] == pytest.approx(expected_ev, rel=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_update_is_deterministic_for_a_seed(backend: str) -> None:
    results = []
    for _ in range(2):
        policy = make_policy(seed=3)
        rollout = make_rollout(policy, seed=3)
        config = PPOConfig(num_minibatches=3, grad_backend=backend)
        metrics = PPOUpdate(policy, config, seed=7)(policy, rollout, 0.0)
        results.append((metrics, snapshot(policy.parameters())))
    assert results[0][0] == results[1][0]
    assert same(results[0][1], results[1][1])


# (b) The KL early stop comes before the step that would overshoot.


def kl_stop_config(**kwargs) -> PPOConfig:
    defaults = dict(
        learning_rate=0.5, update_epochs=5, num_minibatches=1, target_kl=1e-6, anneal_lr=False
    )
    return PPOConfig(**{**defaults, **kwargs})


@pytest.mark.parametrize("backend", BACKENDS)
def test_kl_stop_is_checked_before_the_step(monkeypatch: pytest.MonkeyPatch, backend: str) -> None:
    policy = make_policy()
    rollout = make_rollout(policy)
    update = PPOUpdate(policy, kl_stop_config(num_minibatches=2, grad_backend=backend))
    events = record_events(monkeypatch, update)
    metrics = update(policy, rollout, progress=0.0)

    # Epoch 1, minibatch 1: ratio 1, KL 0 -> step. Minibatch 2: the huge step moved the
    # policy, KL > target -> stop, and that minibatch's step is not taken.
    kinds = [kind for kind, _ in events]
    assert kinds == ["kl", "step:all", "kl"]
    assert events[0][1] <= 1e-6 < events[2][1]
    assert metrics["stop_iter"] == 1.0
    # The metric is the mean of the last epoch's measurements, the stopping one included.
    assert metrics["approx_kl"] == pytest.approx((events[0][1] + events[2][1]) / 2)


def test_kl_stop_weights_equal_those_after_the_steps_taken() -> None:
    policy = make_policy()
    rollout = make_rollout(policy)
    reference = copy.deepcopy(policy)

    metrics = PPOUpdate(policy, kl_stop_config(), seed=4)(policy, rollout, progress=0.0)
    # Epoch 1 took its one step at KL 0; epoch 2 measured KL > target and stopped.
    assert metrics["stop_iter"] == 2.0

    # Exactly one step of the same update (same seed, so the same shuffle).
    PPOUpdate(reference, kl_stop_config(update_epochs=1), seed=4)(reference, rollout, 0.0)
    assert same(snapshot(policy.parameters()), snapshot(reference.parameters()))

    # And two steps would have been different: the second step is the one not taken.
    two = copy.deepcopy(make_policy())
    PPOUpdate(two, kl_stop_config(update_epochs=2, target_kl=None), seed=4)(two, rollout, 0.0)
    assert not same(snapshot(policy.parameters()), snapshot(two.parameters()))


def test_no_kl_stop_runs_every_epoch(monkeypatch: pytest.MonkeyPatch) -> None:
    policy = make_policy()
    rollout = make_rollout(policy)
    update = PPOUpdate(policy, kl_stop_config(target_kl=None, update_epochs=3, num_minibatches=2))
    events = record_events(monkeypatch, update)
    metrics = update(policy, rollout, 0.0)
    assert [kind for kind, _ in events] == ["kl", "step:all"] * 6
    assert metrics["stop_iter"] == 3.0


# (c) Separate optimizers.


def separate_config(**kwargs) -> PPOConfig:
    defaults = dict(
        pi_lr=0.5,
        vf_lr=1e-2,
        update_epochs=4,
        num_minibatches=1,
        target_kl=1e-6,
        anneal_lr=False,
    )
    return PPOConfig(**{**defaults, **kwargs})


@pytest.mark.parametrize("backend", BACKENDS)
def test_critic_keeps_fitting_after_the_policy_stops(
    monkeypatch: pytest.MonkeyPatch, backend: str
) -> None:
    policy = make_policy()
    rollout = make_rollout(policy)
    update = PPOUpdate(policy, separate_config(grad_backend=backend))
    actor_after_vf_step: list[list[torch.Tensor]] = []
    critic_after_vf_step: list[list[torch.Tensor]] = []

    def after_vf_step() -> None:
        actor_after_vf_step.append(snapshot(policy.actor_parameters()))
        critic_after_vf_step.append(snapshot(policy.critic_parameters()))

    events = record_events(monkeypatch, update, after={"vf": after_vf_step})
    critic_before = snapshot(policy.critic_parameters())
    metrics = update(policy, rollout, progress=0.0)

    kinds = [kind for kind, _ in events]
    assert kinds == ["kl", "step:pi", "step:vf", "kl", "step:vf", "step:vf", "step:vf"]
    assert events[3][1] > 1e-6
    assert metrics["stop_iter"] == 2.0

    # After the one actor step, the actor is frozen while the critic moves every epoch.
    assert len(critic_after_vf_step) == 4
    for earlier, later in itertools.pairwise(actor_after_vf_step):
        assert same(earlier, later)
    for earlier, later in itertools.pairwise([critic_before, *critic_after_vf_step]):
        assert not same(earlier, later)
    assert metrics["learning_rate"] == 0.5
    assert metrics["vf_learning_rate"] == 1e-2


def test_separate_actor_equals_one_step_and_critic_differs() -> None:
    policy = make_policy()
    rollout = make_rollout(policy)
    reference = copy.deepcopy(policy)
    PPOUpdate(policy, separate_config(), seed=2)(policy, rollout, 0.0)
    PPOUpdate(reference, separate_config(update_epochs=1), seed=2)(reference, rollout, 0.0)
    assert same(snapshot(policy.actor_parameters()), snapshot(reference.actor_parameters()))
    assert not same(snapshot(policy.critic_parameters()), snapshot(reference.critic_parameters()))


def test_separate_vf_epochs_beyond_policy_epochs(monkeypatch: pytest.MonkeyPatch) -> None:
    policy = make_policy()
    rollout = make_rollout(policy)
    config = separate_config(update_epochs=2, vf_epochs=5, target_kl=None, num_minibatches=2)
    update = PPOUpdate(policy, config)
    events = record_events(monkeypatch, update)
    update(policy, rollout, 0.0)
    kinds = [kind for kind, _ in events]
    assert kinds.count("step:pi") == 4
    assert kinds.count("step:vf") == 10


def test_losses_reach_only_their_own_network() -> None:
    policy = make_policy()
    rollout = make_rollout(policy)
    batch = rollout.flat()
    actor, critic = policy.actor_parameters(), policy.critic_parameters()
    assert {id(p) for p in actor}.isdisjoint(id(p) for p in critic)
    assert {id(p) for p in policy.parameters()} == {id(p) for p in [*actor, *critic]}

    new_values = policy.critic_value(batch.obs)
    loss_v = value_loss(new_values + 0.5, batch.values, batch.returns)
    grads = torch.autograd.grad(loss_v, [*actor, *critic], allow_unused=True)
    assert all(g is None or torch.count_nonzero(g) == 0 for g in grads[: len(actor)])
    assert any(g is not None and torch.count_nonzero(g) > 0 for g in grads[len(actor) :])

    params = policy.dist_params(batch.obs)
    logprob = policy.head.log_prob(params, batch.actions)
    loss_pi, _ = clipped_surrogate(logprob, batch.logprob, batch.advantages, 0.2)
    loss_pi = loss_pi - 0.01 * policy.head.entropy(params).mean()
    grads = torch.autograd.grad(loss_pi, [*actor, *critic], allow_unused=True)
    assert all(g is None or torch.count_nonzero(g) == 0 for g in grads[len(actor) :])
    assert any(g is not None and torch.count_nonzero(g) > 0 for g in grads[: len(actor)])


# (d) The non-finite guard.


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("separate", [False, True], ids=["shared", "separate"])
@pytest.mark.parametrize(("field", "term"), [("advantages", "loss_pi"), ("returns", "loss_v")])
def test_nan_everywhere_leaves_weights_bit_identical(
    field: str, term: str, separate: bool, backend: str
) -> None:
    policy = make_policy()
    rollout = make_rollout(policy)
    getattr(rollout, field).fill_(float("nan"))
    before = snapshot(policy.parameters())
    config = separate_config(target_kl=None) if separate else PPOConfig(num_minibatches=2)
    update = PPOUpdate(policy, replace(config, grad_backend=backend))

    with pytest.warns(RuntimeWarning, match=rf"non-finite loss term: .*{term} \(\d+x\)"):
        metrics = update(policy, rollout, progress=0.0)

    after = snapshot(policy.parameters())
    assert same(before, after)
    assert all(torch.isfinite(p).all() for p in after)
    assert metrics["nonfinite_skips"] > 0
    # No Adam state was created from a poisoned gradient: a clean update afterwards works.
    clean = make_rollout(policy, seed=1)
    with_clean = update(policy, clean, progress=0.0)
    assert all(torch.isfinite(p).all() for p in policy.parameters())
    assert not same(before, snapshot(policy.parameters()))
    assert math.isfinite(with_clean["loss_pi"]) and math.isfinite(with_clean["loss_v"])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("field", "term"), [("advantages", "loss_pi"), ("returns", "loss_v")])
def test_nan_in_one_row_skips_only_its_minibatches(field: str, term: str, backend: str) -> None:
    policy = make_policy()
    rollout = make_rollout(policy)
    getattr(rollout, field)[4, 2] = float("nan")
    before = snapshot(policy.parameters())
    config = PPOConfig(learning_rate=1e-2, update_epochs=3, num_minibatches=3)
    update = PPOUpdate(policy, replace(config, grad_backend=backend))

    with pytest.warns(RuntimeWarning, match=rf"{term} \(3x\)"):
        metrics = update(policy, rollout, progress=0.0)

    # One poisoned minibatch per epoch was skipped; the others trained, and nothing is NaN.
    assert metrics["nonfinite_skips"] == 3.0
    after = snapshot(policy.parameters())
    assert all(torch.isfinite(p).all() for p in after)
    assert not same(before, after)
    assert math.isfinite(metrics["loss_pi"]) and math.isfinite(metrics["loss_v"])


# (e) Learning-rate annealing.


@pytest.mark.parametrize("progress", [0.0, 0.25, 0.9])
def test_learning_rate_anneals_linearly(progress: float) -> None:
    policy = make_policy()
    rollout = make_rollout(policy)
    update = PPOUpdate(policy, PPOConfig(learning_rate=1e-3, anneal_lr=True, update_epochs=1))
    metrics = update(policy, rollout, progress=progress)
    assert metrics["learning_rate"] == pytest.approx(1e-3 * (1 - progress), rel=1e-12)
    assert update.optimizers["all"].param_groups[0]["lr"] == metrics["learning_rate"]


def test_learning_rate_constant_without_annealing_and_separate_rates() -> None:
    policy = make_policy()
    rollout = make_rollout(policy)
    flat = PPOUpdate(policy, PPOConfig(learning_rate=1e-3, anneal_lr=False, update_epochs=1))
    assert flat(policy, rollout, progress=0.5)["learning_rate"] == 1e-3

    config = separate_config(pi_lr=3e-4, vf_lr=1e-3, anneal_lr=True, target_kl=None)
    metrics = PPOUpdate(policy, config)(policy, rollout, progress=0.75)
    assert metrics["learning_rate"] == pytest.approx(3e-4 * 0.25, rel=1e-12)
    assert metrics["vf_learning_rate"] == pytest.approx(1e-3 * 0.25, rel=1e-12)


def test_clip_coef_anneals_when_asked() -> None:
    policy = make_policy()
    rollout = make_rollout(policy)
    config = PPOConfig(clip_coef=0.2, anneal_clip=True, update_epochs=1)
    assert PPOUpdate(policy, config)(policy, rollout, 0.5)["clip_coef"] == pytest.approx(0.1)
    config = PPOConfig(clip_coef=0.2, anneal_clip=False, update_epochs=1)
    assert PPOUpdate(policy, config)(policy, rollout, 0.5)["clip_coef"] == 0.2
