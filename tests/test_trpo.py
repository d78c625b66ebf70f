"""The TRPO update against closed forms and brute force.

* conjugate gradient against numpy.linalg.solve;
* Fisher-vector products against the explicit Fisher matrix, built from per-parameter
  Jacobians and an exact expectation over actions (never from the KL the library uses);
* the trust region: every accepted step is within max_kl (measured again here), every
  rejected one leaves the actor bit for bit as it was;
* actor and critic are stepped apart; every metric is reported;
* a step whose loss is non-finite is skipped and counted.
"""

from __future__ import annotations

import copy
import itertools
import math

import gymnasium as gym
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

import trustrl.learner.updates.trpo as trpo_module
from trustrl.config import PolicyConfig, TRPOConfig
from trustrl.envs.spaces import SpaceSpec
from trustrl.learner.losses import value_loss
from trustrl.learner.policy import Policy
from trustrl.learner.rollout import Batch, Rollout
from trustrl.learner.updates.grads import LossSettings, make_gradients
from trustrl.learner.updates.trpo import (
    TRPOUpdate,
    backtracking_line_search,
    conjugate_gradient,
    fisher_vector_product,
)

OBS_DIM = 2
KINDS = ("categorical", "masked", "multidiscrete", "gaussian")
METRICS = (
    "loss_pi",
    "delta_loss_pi",
    "expected_improvement",
    "approx_kl",
    "line_search_steps",
    "line_search_accepted",
    "cg_residual",
    "step_norm",
    "loss_v",
    "delta_loss_v",
    "entropy",
    "explained_variance",
)


# Conjugate gradient.


def random_spd(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((n, n))
    return q @ q.T + n * np.eye(n)


@pytest.mark.parametrize("n", [1, 2, 5, 12, 30])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_conjugate_gradient_solves_spd_systems(n: int, seed: int) -> None:
    a = random_spd(n, seed)
    b = np.random.default_rng(100 + seed).standard_normal(n)
    a_t, b_t = torch.from_numpy(a), torch.from_numpy(b)
    x, residual = conjugate_gradient(lambda v: a_t @ v, b_t, iters=2 * n, residual_tol=1e-24)
    expected = np.linalg.solve(a, b)
    np.testing.assert_allclose(x.numpy(), expected, rtol=1e-9, atol=1e-11)
    assert residual <= 1e-20
    # The reported residual is |b - A x|^2 (up to the recursion's rounding).
    assert residual == pytest.approx(float(np.sum((b - a @ x.numpy()) ** 2)), abs=1e-20)
    # b itself is not modified.
    assert torch.equal(b_t, torch.from_numpy(b))


def test_conjugate_gradient_first_iterate_is_steepest_descent_step() -> None:
    a = random_spd(6, 7)
    b = np.random.default_rng(7).standard_normal(6)
    x, residual = conjugate_gradient(
        lambda v: torch.from_numpy(a) @ v, torch.from_numpy(b), iters=1, residual_tol=0.0
    )
    alpha = (b @ b) / (b @ a @ b)
    np.testing.assert_allclose(x.numpy(), alpha * b, rtol=1e-12)
    assert residual == pytest.approx(float(np.sum((b - alpha * a @ b) ** 2)), rel=1e-9)


def test_conjugate_gradient_stops_at_the_residual_tolerance() -> None:
    n = 40
    # A spread spectrum: CG needs many iterations to get the residual very small.
    rng = np.random.default_rng(3)
    q, _ = np.linalg.qr(rng.standard_normal((n, n)))
    a = torch.from_numpy(q @ np.diag(np.logspace(0, 2, n)) @ q.T)
    b = torch.from_numpy(rng.standard_normal(n))
    calls = 0

    def matvec(v: Tensor) -> Tensor:
        nonlocal calls
        calls += 1
        return a @ v

    # Residual after each number of iterations, without any early stop.
    residuals = [conjugate_gradient(matvec, b, k, residual_tol=0.0)[1] for k in range(n)]
    assert residuals[0] == pytest.approx(float(b @ b))
    tol = residuals[0] * 1e-4
    first_below = next(k for k, r in enumerate(residuals) if r <= tol)
    assert 5 < first_below < n - 5
    calls = 0
    x, residual = conjugate_gradient(matvec, b, iters=n, residual_tol=tol)
    # It stopped at the first iterate below the tolerance, not a matvec later.
    assert calls == first_below
    assert residual <= tol
    assert residual == residuals[first_below]
    # An already-small right-hand side: zero iterations, x = 0, residual = |b|^2.
    calls = 0
    x, residual = conjugate_gradient(matvec, b, iters=n, residual_tol=float(b @ b))
    assert calls == 0
    assert torch.equal(x, torch.zeros_like(b))
    assert residual == pytest.approx(float(b @ b))


# Policies and batches.


def make_spec(kind: str) -> SpaceSpec:
    obs_space = gym.spaces.Box(-1.0, 1.0, (OBS_DIM,))
    if kind == "categorical":
        return SpaceSpec.from_spaces(obs_space, gym.spaces.Discrete(4))
    if kind == "masked":
        return SpaceSpec.from_spaces(obs_space, gym.spaces.Discrete(4), info_mask=True)
    if kind == "multidiscrete":
        return SpaceSpec.from_spaces(obs_space, gym.spaces.MultiDiscrete([3, 2]))
    return SpaceSpec.from_spaces(obs_space, gym.spaces.Box(-1.0, 1.0, (2,)))


def make_policy(kind: str, seed: int, hidden: tuple[int, ...] = (3,)) -> Policy:
    torch.manual_seed(seed)
    # Plain (non-orthogonal) init, so the distributions are far from uniform.
    policy = Policy(make_spec(kind), PolicyConfig(hidden_sizes=hidden, ortho_init=False))
    if kind == "gaussian":
        with torch.no_grad():
            policy.head.log_std.copy_(torch.tensor([-0.4, 0.3]))  # type: ignore[attr-defined]
    return policy


def random_mask(kind: str, batch: int, generator: torch.Generator) -> Tensor | None:
    if kind != "masked":
        return None
    mask = torch.rand(batch, 4, generator=generator) > 0.4
    mask[torch.arange(batch), torch.randint(0, 4, (batch,), generator=generator)] = True
    mask[0] = torch.tensor([True, False, True, False])  # always some masked actions
    return mask


def random_batch(policy: Policy, kind: str, seed: int, size: int = 32) -> Batch:
    """Observations, masks, actions sampled from the policy and their log-probs, random
    advantages, values and returns."""
    g = torch.Generator().manual_seed(seed)
    dtype = next(policy.parameters()).dtype
    obs = torch.randn(size, OBS_DIM, generator=g, dtype=dtype)
    mask = random_mask(kind, size, g)
    with torch.no_grad():
        params = policy.dist_params(obs, mask)
        actions = policy.head.sample(params, g)
        logprob = policy.head.log_prob(params, actions)
    values = torch.randn(size, generator=g, dtype=dtype)
    returns = values + torch.randn(size, generator=g, dtype=dtype)
    advantages = torch.randn(size, generator=g, dtype=dtype)
    return Batch(obs, actions, logprob, values, advantages, returns, mask)


# The Fisher matrix by brute force.


def jacobian(policy: Policy, obs: Tensor, mask: Tensor | None) -> Tensor:
    """(B, P, n_params): d dist_params[s, j] / d theta, one backward pass per entry."""
    params = policy.actor_parameters()
    out = policy.dist_params(obs, mask)
    rows = []
    for s, j in itertools.product(range(out.shape[0]), range(out.shape[1])):
        grads = torch.autograd.grad(out[s, j], params, retain_graph=True, allow_unused=True)
        rows.append(
            torch.cat(
                [
                    (g if g is not None else torch.zeros_like(p)).reshape(-1)
                    for g, p in zip(grads, params, strict=True)
                ]
            )
        )
    return torch.stack(rows).reshape(out.shape[0], out.shape[1], -1)


def brute_force_fisher(policy: Policy, kind: str, obs: Tensor, mask: Tensor | None) -> Tensor:
    """mean_s E_{a ~ pi(.|s)}[grad log pi(a|s) grad log pi(a|s)^T], the expectation exact
    (a sum over every action); for the Gaussian, J^T diag(1/sigma^2, 2) J."""
    jac = jacobian(policy, obs, mask)  # (B, P, n)
    with torch.no_grad():
        out = policy.dist_params(obs, mask)
    n = jac.shape[-1]
    fisher = torch.zeros(n, n, dtype=jac.dtype)
    for s in range(obs.shape[0]):
        if kind in ("categorical", "masked"):
            for a in range(out.shape[1]):
                p = out[s, a].exp()  # the params are log-probabilities
                if p == 0:
                    continue  # a masked action is never taken
                g = jac[s, a]
                fisher += p * torch.outer(g, g)
        elif kind == "multidiscrete":
            # Every joint action, its probability the product, its score the sum.
            for a0, a1 in itertools.product(range(3), range(2)):
                p = (out[s, a0] + out[s, 3 + a1]).exp()
                g = jac[s, a0] + jac[s, 3 + a1]
                fisher += p * torch.outer(g, g)
        else:
            dim = out.shape[1] // 2
            sigma2 = (2 * out[s, dim:]).exp()
            weights = torch.cat([1 / sigma2, torch.full((dim,), 2.0, dtype=out.dtype)])
            fisher += jac[s].T @ torch.diag(weights) @ jac[s]
    return fisher / obs.shape[0]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("seed", [0, 1])
def test_fisher_vector_product_matches_brute_force(kind: str, seed: int) -> None:
    policy = make_policy(kind, seed).double()
    g = torch.Generator().manual_seed(seed)
    obs = torch.randn(6, OBS_DIM, generator=g, dtype=torch.float64)
    mask = random_mask(kind, 6, g)
    fisher = brute_force_fisher(policy, kind, obs, mask)
    n = fisher.shape[0]
    assert n == sum(p.numel() for p in policy.actor_parameters())
    # The reference is a proper Fisher: symmetric positive semi-definite, and not zero.
    torch.testing.assert_close(fisher, fisher.T)
    assert torch.linalg.eigvalsh(fisher).min() > -1e-10
    assert fisher.abs().max() > 1e-3
    with torch.no_grad():
        old = policy.dist_params(obs, mask)
    for damping in (0.0, 0.1, 2.5):
        fvp = fisher_vector_product(policy, obs, mask, old, damping)
        for _ in range(3):
            v = torch.randn(n, generator=g, dtype=torch.float64)
            torch.testing.assert_close(
                fvp(v),
                (fisher + damping * torch.eye(n, dtype=torch.float64)) @ v,
                rtol=1e-8,
                atol=1e-10,
            )
        # Conjugate gradient on the product solves the explicit damped system.
        if damping > 0:
            b = torch.randn(n, generator=g, dtype=torch.float64)
            x, _ = conjugate_gradient(fvp, b, iters=4 * n, residual_tol=1e-26)
            expected = np.linalg.solve((fisher + damping * torch.eye(n)).numpy(), b.numpy())
            np.testing.assert_allclose(x.detach().numpy(), expected, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("kind", KINDS)
def test_full_step_is_the_natural_gradient_scaled_to_the_kl_radius(kind: str) -> None:
    """s = sqrt(2 max_kl / x^T (F + damping I) x) x with x = (F + damping I)^-1 g, the
    explicit Fisher and the surrogate's gradient g: in float64, with a radius small enough
    for the first try to be taken."""
    policy = make_policy(kind, 2).double()
    batch = random_batch(policy, kind, 2, size=8)
    actor = policy.actor_parameters()
    n = sum(p.numel() for p in actor)
    max_kl, damping = 1e-5, 0.05
    config = TRPOConfig(
        max_kl=max_kl,
        cg_damping=damping,
        cg_iters=3 * n,
        cg_residual_tol=1e-28,
        line_search_steps=1,
    )
    fisher = brute_force_fisher(policy, kind, batch.obs, batch.action_mask)
    damped = fisher + damping * torch.eye(n, dtype=torch.float64)
    advantages = normalized(batch.advantages)
    params = policy.dist_params(batch.obs, batch.action_mask)
    ratio = torch.exp(policy.head.log_prob(params, batch.actions) - batch.logprob)
    g = torch.cat([x.reshape(-1) for x in torch.autograd.grad((ratio * advantages).mean(), actor)])
    x = torch.linalg.solve(damped, g)
    expected = math.sqrt(2 * max_kl / float(x @ damped @ x)) * x
    theta = parameters_vector(actor).detach().clone()
    with torch.no_grad():
        old = policy.dist_params(batch.obs, batch.action_mask)

    metrics = TRPOUpdate(policy, config).policy_step(policy, batch)
    assert metrics["line_search_accepted"] == 1.0
    assert metrics["line_search_steps"] == 1.0
    step = parameters_vector(actor).detach() - theta
    torch.testing.assert_close(step, expected, rtol=1e-6, atol=1e-12)
    assert 0.5 * float(step @ damped @ step) == pytest.approx(max_kl, rel=1e-6)
    assert metrics["expected_improvement"] == pytest.approx(float(g @ step), rel=1e-6)
    assert metrics["cg_residual"] <= 1e-20
    # A small step: the measured KL is the quadratic model's 0.5 s^T F s.
    with torch.no_grad():
        kl = float(policy.head.kl(old, policy.dist_params(batch.obs, batch.action_mask)).mean())
    assert kl == pytest.approx(0.5 * float(step @ fisher @ step), rel=0.02)
    assert metrics["approx_kl"] == pytest.approx(kl, rel=1e-9)


def test_masked_actions_carry_no_fisher_curvature() -> None:
    """Logits of actions masked in every state get no curvature: their weight rows of the
    head span the null space of F."""
    policy = make_policy("masked", 3).double()
    obs = torch.randn(5, OBS_DIM, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    mask = torch.tensor([[True, False, True, True]] * 5)
    with torch.no_grad():
        old = policy.dist_params(obs, mask)
    fvp = fisher_vector_product(policy, obs, mask, old, 0.0)
    v = torch.zeros(sum(p.numel() for p in policy.actor_parameters()), dtype=torch.float64)
    head = policy.head.linear  # type: ignore[attr-defined]
    offset = sum(p.numel() for p in policy.actor.parameters())
    # The head's weight row 1 and bias entry 1: the logit of the masked action.
    v_weight = torch.zeros_like(head.weight)
    v_weight[1] = 1.0
    v_bias = torch.zeros_like(head.bias)
    v_bias[1] = 1.0
    v[offset:] = torch.cat([v_weight.reshape(-1), v_bias])
    torch.testing.assert_close(fvp(v), torch.zeros_like(v), rtol=0, atol=1e-12)


# The trust region.


def snapshot(params: list[torch.nn.Parameter]) -> list[Tensor]:
    return [p.detach().clone() for p in params]


def surrogate(policy: Policy, batch: Batch, advantages: Tensor) -> float:
    with torch.no_grad():
        params = policy.dist_params(batch.obs, batch.action_mask)
        ratio = torch.exp(policy.head.log_prob(params, batch.actions) - batch.logprob)
        return float((ratio * advantages).mean())


def normalized(advantages: Tensor) -> Tensor:
    return (advantages - advantages.mean()) / (advantages.std() + 1e-8)


# (max_kl, line_search_steps) per seed: small radii, and huge radii with one or two tries,
# whose first try often overshoots (KL over the bound, or the surrogate worse).
LINE_SEARCH_CASES = [
    (1e-3, 10),
    (1e-2, 10),
    (0.05, 3),
    (0.3, 2),
    *[(max_kl, 1) for max_kl in (0.3, 1.0, 3.0) for _ in range(4)],
    (10.0, 1),
    (30.0, 2),
]


def checked_policy_step(kind: str, seed: int, config: TRPOConfig, size: int = 32) -> bool:
    """One policy step on a random batch, checked against a fresh measurement; returns
    whether the line search accepted a step."""
    policy = make_policy(kind, 10 + seed, hidden=(8,))
    batch = random_batch(policy, kind, seed, size)
    update = TRPOUpdate(policy, config)
    actor = policy.actor_parameters()
    before, critic_before = snapshot(actor), snapshot(policy.critic_parameters())
    advantages = normalized(batch.advantages) if config.norm_adv else batch.advantages
    with torch.no_grad():
        old = policy.dist_params(batch.obs, batch.action_mask)
    base = surrogate(policy, batch, advantages)

    # Every try the line search makes is measured here too, independently of the library.
    measured: list[tuple[float, float]] = []

    def spy(evaluate, theta, full_step, base_objective, max_kl, shrink, tries):  # type: ignore[no-untyped-def]
        def evaluate_and_measure(candidate: Tensor) -> tuple[float, float]:
            result = evaluate(candidate)  # writes the candidate into the actor
            with torch.no_grad():
                kl = float(
                    policy.head.kl(old, policy.dist_params(batch.obs, batch.action_mask)).mean()
                )
            measured.append((surrogate(policy, batch, advantages), kl))
            return result

        return backtracking_line_search(
            evaluate_and_measure, theta, full_step, base_objective, max_kl, shrink, tries
        )

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(trpo_module, "backtracking_line_search", spy)
        metrics = update.policy_step(policy, batch)
    good = [obj > base and kl <= config.max_kl for obj, kl in measured]
    with torch.no_grad():
        new = policy.dist_params(batch.obs, batch.action_mask)
        kl = float(policy.head.kl(old, new).mean())
    after = surrogate(policy, batch, advantages)
    label = f"{kind} seed={seed} {config}: {metrics}"
    assert metrics["loss_pi"] == pytest.approx(-base, rel=1e-5, abs=1e-7), label
    assert 1 <= metrics["line_search_steps"] <= config.line_search_steps, label
    critic = policy.critic_parameters()
    assert all(torch.equal(a, b) for a, b in zip(critic, critic_before, strict=True)), label
    # The first try that improved the surrogate within the KL radius is the one taken.
    first_good = good.index(True) + 1 if any(good) else None
    assert len(measured) == (first_good or config.line_search_steps), (measured, label)
    assert metrics["line_search_accepted"] == float(first_good is not None), (measured, label)
    if metrics["line_search_accepted"] == 1.0:
        assert metrics["line_search_steps"] == first_good, label
        # Measured here, on the weights the actor now holds.
        assert kl <= config.max_kl * (1 + 1e-5), label
        assert after > base, label
        assert metrics["approx_kl"] == pytest.approx(kl, rel=1e-4), label
        assert metrics["delta_loss_pi"] == pytest.approx(-(after - base), rel=1e-3), label
        assert metrics["delta_loss_pi"] < 0, label
        assert metrics["expected_improvement"] > 0, label
        changed = torch.cat(
            [(a.detach() - b).reshape(-1) for a, b in zip(actor, before, strict=True)]
        )
        assert float(changed.norm()) == pytest.approx(metrics["step_norm"], rel=1e-4), label
        assert metrics["step_norm"] > 0, label
        return True
    assert metrics["line_search_accepted"] == 0.0, label
    assert metrics["line_search_steps"] == config.line_search_steps, label
    assert all(torch.equal(a, b) for a, b in zip(actor, before, strict=True)), label
    assert metrics["approx_kl"] == 0.0 and metrics["step_norm"] == 0.0, label
    assert metrics["delta_loss_pi"] == 0.0, label
    return False


@pytest.mark.parametrize("kind", KINDS)
def test_every_accepted_step_is_inside_the_trust_region(kind: str) -> None:
    accepted = [
        checked_policy_step(
            kind, seed, TRPOConfig(max_kl=max_kl, line_search_steps=steps, cg_damping=0.01)
        )
        for seed, (max_kl, steps) in enumerate(LINE_SEARCH_CASES)
    ]
    # Both branches were exercised: small radii are accepted, huge single tries not always.
    assert all(accepted[:3])
    assert not all(accepted)


@pytest.mark.parametrize("kind", KINDS)
def test_a_step_too_small_to_change_the_weights_is_not_accepted(kind: str) -> None:
    """At max_kl = 1e-30 every try rounds back to the same float32 weights: the surrogate
    does not improve (it is equal), so all tries are refused and nothing moves."""
    assert not checked_policy_step(kind, 0, TRPOConfig(max_kl=1e-30, line_search_steps=3))


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    kind=st.sampled_from(KINDS),
    seed=st.integers(0, 10_000),
    max_kl=st.floats(1e-4, 20.0),
    steps=st.integers(1, 12),
    shrink=st.floats(0.1, 0.95),
    damping=st.sampled_from([0.0, 1e-3, 0.1, 1.0]),
    norm_adv=st.booleans(),
    size=st.integers(4, 64),
)
def test_trust_region_property(
    kind: str,
    seed: int,
    max_kl: float,
    steps: int,
    shrink: float,
    damping: float,
    norm_adv: bool,
    size: int,
) -> None:
    config = TRPOConfig(
        max_kl=max_kl,
        line_search_steps=steps,
        line_search_shrink=shrink,
        cg_damping=damping,
        norm_adv=norm_adv,
    )
    checked_policy_step(kind, seed, config, size)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("norm_adv", [True, False])
def test_zero_advantages_leave_the_actor_bit_identical(kind: str, norm_adv: bool) -> None:
    """No advantage, no possible improvement: nothing is accepted and nothing moves."""
    policy = make_policy(kind, 4, hidden=(8,))
    batch = random_batch(policy, kind, 4)
    batch.advantages = torch.zeros_like(batch.advantages)
    update = TRPOUpdate(policy, TRPOConfig(norm_adv=norm_adv))
    actor = policy.actor_parameters()
    before = snapshot(actor)
    metrics = update.policy_step(policy, batch)
    assert metrics["line_search_accepted"] == 0.0
    assert metrics["approx_kl"] == 0.0 and metrics["step_norm"] == 0.0
    assert all(torch.equal(a, b) for a, b in zip(actor, before, strict=True))


@pytest.mark.parametrize("kind", KINDS)
def test_rejected_line_search_restores_moved_weights_bit_for_bit(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every try is written into the actor and then refused (its KL reported over the
    bound): the actor must come back exactly, not as theta + step - step."""
    tried: list[Tensor] = []

    def refusing(evaluate, theta, full_step, base, max_kl, shrink, tries):  # type: ignore[no-untyped-def]
        def over_the_bound(candidate: Tensor) -> tuple[float, float]:
            objective, _ = evaluate(candidate)
            tried.append(
                parameters_vector(policy.actor_parameters()).detach().clone()  # written?
            )
            return objective, math.inf

        return backtracking_line_search(
            over_the_bound, theta, full_step, base, max_kl, shrink, tries
        )

    monkeypatch.setattr(trpo_module, "backtracking_line_search", refusing)
    policy = make_policy(kind, 5, hidden=(8,))
    batch = random_batch(policy, kind, 5)
    update = TRPOUpdate(policy, TRPOConfig(line_search_steps=4))
    actor = policy.actor_parameters()
    before = snapshot(actor)
    theta = parameters_vector(actor).detach().clone()
    metrics = update.policy_step(policy, batch)
    assert len(tried) == 4
    # The tries really moved the actor, by shrinking amounts.
    moves = [float((t - theta).norm()) for t in tried]
    assert all(m > 0 for m in moves)
    assert moves == pytest.approx([moves[0] * 0.8**i for i in range(4)], rel=1e-4)
    assert metrics["line_search_accepted"] == 0.0
    assert metrics["line_search_steps"] == 4.0
    assert all(torch.equal(a, b) for a, b in zip(actor, before, strict=True))
    # And the policy computes exactly what it computed before.
    fresh = make_policy(kind, 5, hidden=(8,))
    with torch.no_grad():
        assert torch.equal(
            policy.dist_params(batch.obs, batch.action_mask),
            fresh.dist_params(batch.obs, batch.action_mask),
        )


def parameters_vector(params: list[torch.nn.Parameter]) -> Tensor:
    return torch.cat([p.reshape(-1) for p in params])


def test_line_search_tries_shrinking_steps_and_accepts_the_first_good_one() -> None:
    theta = torch.tensor([1.0, -2.0])
    step = torch.tensor([0.5, 0.25])
    seen: list[Tensor] = []

    def evaluate(candidate: Tensor) -> tuple[float, float]:
        seen.append(candidate.clone())
        i = len(seen) - 1
        # Try 0: KL too big; try 1: no improvement; try 2: non-finite; try 3: good.
        return [(1.0, 0.5), (0.0, 0.01), (math.nan, 0.0), (0.5, 0.01), (2.0, 0.0)][i]

    tries, accepted = backtracking_line_search(evaluate, theta, step, 0.0, 0.1, 0.5, 10)
    assert tries == 4
    assert accepted is not None
    torch.testing.assert_close(accepted, theta + 0.125 * step)
    for i, candidate in enumerate(seen):
        torch.testing.assert_close(candidate, theta + 0.5**i * step)
    seen.clear()
    tries, accepted = backtracking_line_search(evaluate, theta, step, 0.0, 0.1, 0.5, 3)
    assert (tries, accepted) == (3, None)


# Actor and critic apart.


@pytest.mark.parametrize("kind", KINDS)
def test_policy_step_and_critic_fit_touch_only_their_own_parameters(kind: str) -> None:
    policy = make_policy(kind, 6, hidden=(8,))
    batch = random_batch(policy, kind, 6, size=64)
    update = TRPOUpdate(policy, TRPOConfig(cg_damping=0.01))
    actor, critic = policy.actor_parameters(), policy.critic_parameters()
    assert {id(p) for p in actor}.isdisjoint(id(p) for p in critic)
    assert len(actor) + len(critic) == len(list(policy.parameters()))

    # The value loss does not reach the actor at all.
    loss = value_loss(policy.critic_value(batch.obs), batch.values, batch.returns)
    grads = torch.autograd.grad(loss, [*actor, *critic], allow_unused=True)
    assert all(g is None for g in grads[: len(actor)])
    assert all(g is not None for g in grads[len(actor) :])

    actor_0, critic_0 = snapshot(actor), snapshot(critic)
    metrics = update.policy_step(policy, batch)
    assert metrics["line_search_accepted"] == 1.0
    assert all(torch.equal(a, b) for a, b in zip(critic, critic_0, strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(actor, actor_0, strict=True))
    assert all(p.grad is None for p in policy.parameters())

    actor_1 = snapshot(actor)
    update.fit_critic(policy, batch, {})
    assert all(torch.equal(a, b) for a, b in zip(actor, actor_1, strict=True))
    assert all(not torch.equal(a, b) for a, b in zip(critic, critic_0, strict=True))
    assert all(p.grad is None for p in actor)


def filled_rollout(policy: Policy, kind: str, seed: int, t: int = 16, n: int = 2) -> Rollout:
    spec = policy.spec
    rollout = Rollout(t, n, spec.obs_dim, spec.action_shape, spec.action_dtype, spec.mask_dim)
    batch = random_batch(policy, kind, seed, size=t * n)
    g = torch.Generator().manual_seed(seed)
    rollout.obs.copy_(batch.obs.reshape(t, n, -1))
    rollout.actions.copy_(batch.actions.reshape(t, n, *spec.action_shape))
    rollout.logprob.copy_(batch.logprob.reshape(t, n))
    with torch.no_grad():
        rollout.values.copy_(policy.critic_value(batch.obs).reshape(t, n))
    rollout.rewards.copy_(torch.randn(t, n, generator=g))
    rollout.terminated[t // 2, 0] = 1.0
    rollout.valid.fill_(True)
    rollout.valid[t // 2 + 1, 0] = False  # the reset row after the episode end
    if rollout.action_mask is not None and batch.action_mask is not None:
        rollout.action_mask.copy_(batch.action_mask.reshape(t, n, -1))
    rollout.compute_advantages(0.99, 0.95)
    return rollout


@pytest.mark.parametrize("kind", KINDS)
def test_update_reports_every_metric(kind: str) -> None:
    policy = make_policy(kind, 8, hidden=(8,))
    rollout = filled_rollout(policy, kind, 8)
    update = TRPOUpdate(policy, TRPOConfig(train_vf_iters=3, minibatches=2))
    batch = rollout.flat()
    assert len(batch) == 31
    with torch.no_grad():
        params = policy.dist_params(batch.obs, batch.action_mask)
        entropy = float(policy.head.entropy(params).mean())
    metrics = update(policy, rollout, progress=0.0)
    missing = [name for name in METRICS if name not in metrics]
    assert not missing
    for name in METRICS:
        assert isinstance(metrics[name], float), name
        assert math.isfinite(metrics[name]), name
    assert metrics["line_search_accepted"] == 1.0
    assert metrics["approx_kl"] <= 0.01
    assert metrics["entropy"] == pytest.approx(entropy)  # of the policy before the step
    assert metrics["cg_residual"] >= 0
    assert metrics["loss_v"] > 0
    # train_vf_iters passes: the critic's loss fell from the first pass to the last.
    assert metrics["delta_loss_v"] < 0
    assert metrics["nonfinite_skips"] == 0.0


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("progress", [0.0, 0.75])
def test_anneal_kl_steps_within_the_shrunk_radius(kind: str, progress: float) -> None:
    """trpo.anneal_kl at ``progress`` takes the very step (bit for bit) of a radius
    max_kl * (1 - progress) without it: the KL radius shrinks linearly over the run."""
    policy = make_policy(kind, 9, hidden=(8,))
    rollout = filled_rollout(policy, kind, 9)
    twin, full = copy.deepcopy(policy), copy.deepcopy(policy)
    annealed = TRPOUpdate(policy, TRPOConfig(max_kl=0.01, anneal_kl=True))(
        policy, rollout, progress=progress
    )
    shrunk = TRPOUpdate(twin, TRPOConfig(max_kl=0.01 * (1.0 - progress)))(
        twin, rollout, progress=progress
    )
    plain = TRPOUpdate(full, TRPOConfig(max_kl=0.01))(full, rollout, progress=progress)
    assert annealed["line_search_accepted"] == shrunk["line_search_accepted"] == 1.0
    assert annealed["approx_kl"] <= 0.01 * (1.0 - progress) and annealed["step_norm"] > 0
    for a, b in zip(policy.actor_parameters(), twin.actor_parameters(), strict=True):
        assert torch.equal(a, b)
    if progress > 0:  # without anneal_kl the whole radius is used: a longer step
        assert plain["step_norm"] > 1.5 * annealed["step_norm"]
    else:
        assert plain["step_norm"] == annealed["step_norm"]


# Non-finite losses: skipped, counted and said, as PPO's update does.


def nonfinite_update(policy: Policy, backend: str) -> TRPOUpdate:
    update = TRPOUpdate(policy, TRPOConfig(train_vf_iters=3, minibatches=2))
    if backend == "torch":  # TRPO's critic fit takes the numpy gradients where it can
        optimizer = {"vf": update.vf_optimizer}
        update.gradients = make_gradients(policy, LossSettings(), optimizer, backend="torch")
    return update


@pytest.mark.parametrize("backend", ["numpy", "torch"])
@pytest.mark.parametrize("kind", ["categorical", "gaussian"])
def test_a_non_finite_return_skips_only_the_critic_steps_it_is_in(kind: str, backend: str) -> None:
    policy = make_policy(kind, 8, hidden=(8,))
    rollout = filled_rollout(policy, kind, 8)
    rollout.returns[3, 1] = math.nan
    update = nonfinite_update(policy, backend)
    critic_0 = snapshot(policy.critic_parameters())
    with pytest.warns(RuntimeWarning, match=r"non-finite loss term: loss_v \(3x\)"):
        metrics = update(policy, rollout, progress=0.0)
    # One of the two minibatches of each of the three passes; the others trained.
    assert metrics["nonfinite_skips"] == 3.0
    assert math.isfinite(metrics["loss_v"]) and metrics["line_search_accepted"] == 1.0
    assert all(torch.isfinite(p).all() for p in policy.parameters())
    critic = policy.critic_parameters()
    assert not all(torch.equal(a, b) for a, b in zip(critic, critic_0, strict=True))


@pytest.mark.parametrize("backend", ["numpy", "torch"])
@pytest.mark.parametrize("kind", ["categorical", "gaussian"])
def test_a_critic_loss_non_finite_everywhere_trains_nothing(kind: str, backend: str) -> None:
    """Finite returns whose squared error overflows float32: every critic step is skipped
    and counted, the policy takes no step on that rollout, and both losses are NaN (what
    the trainer stops on after a few such iterations). Nothing is poisoned: a finite
    rollout afterwards trains as before."""
    policy = make_policy(kind, 8, hidden=(8,))
    rollout = filled_rollout(policy, kind, 8)
    rollout.returns.fill_(1e30)
    update = nonfinite_update(policy, backend)
    before = snapshot(list(policy.parameters()))
    with pytest.warns(RuntimeWarning, match=r"non-finite loss term: loss_v \(6x\)"):
        metrics = update(policy, rollout, progress=0.0)
    assert metrics["nonfinite_skips"] == 6.0
    assert math.isnan(metrics["loss_pi"]) and math.isnan(metrics["loss_v"])
    assert metrics["line_search_accepted"] == 0.0
    assert all(torch.equal(a, b) for a, b in zip(before, policy.parameters(), strict=True))
    metrics = update(policy, filled_rollout(policy, kind, 9), progress=0.0)
    assert metrics["nonfinite_skips"] == 0.0 and metrics["line_search_accepted"] == 1.0
    assert all(math.isfinite(metrics[name]) for name in ("loss_pi", "loss_v"))


def test_a_non_finite_policy_objective_skips_the_policy_step_only() -> None:
    policy = make_policy("categorical", 8, hidden=(8,))
    rollout = filled_rollout(policy, "categorical", 8)
    rollout.advantages[2, 0] = math.nan
    update = nonfinite_update(policy, "numpy")
    actor_0 = snapshot(policy.actor_parameters())
    with pytest.warns(RuntimeWarning, match=r"non-finite loss term: loss_pi \(1x\)"):
        metrics = update(policy, rollout, progress=0.0)
    assert metrics["nonfinite_skips"] == 1.0
    assert math.isnan(metrics["loss_pi"]) and math.isfinite(metrics["loss_v"])
    actor = policy.actor_parameters()
    assert all(torch.equal(a, b) for a, b in zip(actor, actor_0, strict=True))


def test_update_state_round_trips() -> None:
    policy = make_policy("categorical", 9, hidden=(8,))
    rollout = filled_rollout(policy, "categorical", 9)
    update = TRPOUpdate(policy, TRPOConfig(), seed=3)
    update(policy, rollout, 0.0)
    # A deep copy, as a checkpoint on disk would be: state_dict() hands out the live Adam
    # moments, which the next update changes in place.
    state = copy.deepcopy(update.state_dict())
    twin_policy = make_policy("categorical", 9, hidden=(8,))
    twin_policy.load_state_dict(policy.state_dict())
    twin = TRPOUpdate(twin_policy, TRPOConfig(), seed=99)
    twin.load_state_dict(state)
    a = update(policy, rollout, 0.5)
    b = twin(twin_policy, rollout, 0.5)
    assert a == b
    for p, q in zip(policy.parameters(), twin_policy.parameters(), strict=True):
        assert torch.equal(p, q)
