"""Closed-form checks of the pure loss and diagnostic functions."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from trustrl.acting.kernels import normalize_advantages_numpy, policy_terms_numpy, value_terms_numpy
from trustrl.learner.losses import (
    approx_kl,
    clip_fraction,
    clipped_surrogate,
    explained_variance,
    normalize_advantages,
    policy_terms,
    surrogate,
    value_loss,
    value_terms,
)

EPS = 0.2


def clipped_coefficient(ratio: float, advantage: float, epsilon: float) -> float:
    """The seed text's scalar that multiplies the score for min(r A, clip(r) A)."""
    if advantage >= 0.0 and ratio > 1.0 + epsilon:
        return 0.0
    if advantage < 0.0 and ratio < 1.0 - epsilon:
        return 0.0
    return advantage * ratio


def linear_softmax_sample(seed: int, n_actions: int = 4, n_features: int = 3):
    """theta (A, F) with grad, a state (F,), and the log-softmax of theta @ state."""
    g = torch.Generator().manual_seed(seed)
    theta = torch.randn(n_actions, n_features, generator=g, dtype=torch.float64)
    theta.requires_grad_(True)
    state = torch.randn(n_features, generator=g, dtype=torch.float64)
    return theta, state


def closed_form_gradient(theta, state, action, ratio, advantage, epsilon):
    """coefficient * (onehot(a) - p) outer state: the gradient of the surrogate (ascent)."""
    with torch.no_grad():
        probs = torch.softmax(theta @ state, -1)
        onehot = torch.zeros_like(probs)
        onehot[action] = 1.0
        coefficient = clipped_coefficient(ratio, advantage, epsilon)
        return coefficient * torch.outer(onehot - probs, state)


RATIOS = [0.5, 0.75, 0.9, 1.0, 1.1, 1.25, 1.5, 3.0]
ADVANTAGES = [1.3, 0.4, -0.7, -2.0]


@pytest.mark.parametrize("advantage", ADVANTAGES)
@pytest.mark.parametrize("ratio", RATIOS)
def test_surrogate_gradient_matches_clipped_coefficient(ratio: float, advantage: float) -> None:
    theta, state = linear_softmax_sample(seed=int(ratio * 100) + int(advantage * 10) + 50)
    action = 2
    logprob = torch.log_softmax(theta @ state, -1)[action]
    # Put the ratio where we want it: old = new - log r.
    old_logprob = logprob.detach() - math.log(ratio)

    loss, log_ratio = clipped_surrogate(
        logprob[None], old_logprob[None], torch.tensor([advantage], dtype=torch.float64), EPS
    )
    assert log_ratio.item() == pytest.approx(math.log(ratio), abs=1e-12)
    clipped_r = min(max(ratio, 1 - EPS), 1 + EPS)
    assert loss.item() == pytest.approx(-min(ratio * advantage, clipped_r * advantage), abs=1e-12)

    (grad,) = torch.autograd.grad(loss, theta)
    expected = closed_form_gradient(theta, state, action, ratio, advantage, EPS)
    # The loss is the negated (mean of the) surrogate: its gradient is minus the ascent one.
    torch.testing.assert_close(-grad, expected, rtol=1e-10, atol=1e-12)

    flat = (advantage >= 0 and ratio > 1 + EPS) or (advantage < 0 and ratio < 1 - EPS)
    if flat:
        assert torch.count_nonzero(grad) == 0
    else:
        assert grad.abs().max() > 1e-3


def test_surrogate_gradient_batched_is_mean_of_per_sample() -> None:
    """A batch mixing every case: the gradient is -(1/N) sum of the per-sample closed forms."""
    g = torch.Generator().manual_seed(3)
    n_actions, n_features = 5, 4
    theta = torch.randn(n_actions, n_features, generator=g, dtype=torch.float64)
    theta.requires_grad_(True)
    cases = [(r, a) for r in RATIOS for a in ADVANTAGES]
    states = torch.randn(len(cases), n_features, generator=g, dtype=torch.float64)
    actions = torch.randint(0, n_actions, (len(cases),), generator=g)
    ratios = torch.tensor([r for r, _ in cases], dtype=torch.float64)
    advantages = torch.tensor([a for _, a in cases], dtype=torch.float64)

    logprob = torch.log_softmax(states @ theta.T, -1).gather(1, actions[:, None]).squeeze(1)
    old_logprob = logprob.detach() - ratios.log()
    loss, _ = clipped_surrogate(logprob, old_logprob, advantages, EPS)
    (grad,) = torch.autograd.grad(loss, theta)

    expected = sum(
        closed_form_gradient(theta, states[i], int(actions[i]), r, a, EPS)
        for i, (r, a) in enumerate(cases)
    )
    torch.testing.assert_close(-grad * len(cases), expected, rtol=1e-10, atol=1e-12)


def test_surrogate_is_pessimistic_min() -> None:
    ratios = torch.tensor([0.5, 0.5, 1.5, 1.5, 1.1], dtype=torch.float64)
    advantages = torch.tensor([2.0, -2.0, 2.0, -2.0, 1.0], dtype=torch.float64)
    loss, _ = clipped_surrogate(ratios.log(), torch.zeros(5, dtype=torch.float64), advantages, EPS)
    # min(rA, clip(r)A) per sample: 1.0, -1.6, 2.4, -3.0, 1.1
    assert loss.item() == pytest.approx(-(1.0 - 1.6 + 2.4 - 3.0 + 1.1) / 5, abs=1e-12)


def categorical_pair():
    old_logits = torch.tensor([0.2, -0.4, 1.0, 0.0, -1.2], dtype=torch.float64)
    new_logits = torch.tensor([0.5, -0.1, 0.6, 0.3, -0.5], dtype=torch.float64)
    return torch.log_softmax(old_logits, -1), torch.log_softmax(new_logits, -1)


def test_approx_kl_estimates_exact_kl_of_categoricals() -> None:
    old_logp, new_logp = categorical_pair()
    exact = float((old_logp.exp() * (old_logp - new_logp)).sum())
    reference = torch.distributions.kl_divergence(
        torch.distributions.Categorical(logits=old_logp),
        torch.distributions.Categorical(logits=new_logp),
    )
    assert exact == pytest.approx(float(reference), rel=1e-12)
    assert exact > 0.02  # far from zero, so the tolerance below is meaningful

    g = torch.Generator().manual_seed(0)
    n = 200_000
    samples = torch.multinomial(old_logp.exp(), n, replacement=True, generator=g)
    log_ratio = new_logp[samples] - old_logp[samples]
    estimate = float(approx_kl(log_ratio))

    per_sample = log_ratio.exp() - 1 - log_ratio
    standard_error = float(per_sample.std()) / math.sqrt(n)
    assert abs(estimate - exact) < 4 * standard_error
    assert estimate == pytest.approx(exact, rel=0.03)
    # The naive estimator mean(-log r) is also unbiased, but noisier: same target.
    assert float(-log_ratio.mean()) == pytest.approx(exact, rel=0.1)


def test_approx_kl_nonnegative_per_sample() -> None:
    for log_ratio in torch.linspace(-6.0, 6.0, 241, dtype=torch.float64):
        value = float(approx_kl(log_ratio[None]))
        assert value >= 0.0
        if abs(float(log_ratio)) > 1e-6:
            assert value > 0.0
    # A closed value: r = e, (e - 1) - 1 = e - 2.
    assert float(approx_kl(torch.tensor([1.0], dtype=torch.float64))) == pytest.approx(
        math.e - 2, abs=1e-12
    )


def test_approx_kl_zero_when_distributions_equal() -> None:
    old_logp, _ = categorical_pair()
    same_logp = torch.log_softmax(
        torch.tensor([0.2, -0.4, 1.0, 0.0, -1.2], dtype=torch.float64), -1
    )
    samples = torch.multinomial(
        old_logp.exp(), 1000, replacement=True, generator=torch.Generator().manual_seed(1)
    )
    log_ratio = same_logp[samples] - old_logp[samples]
    assert float(approx_kl(log_ratio)) == 0.0


def test_value_loss_unclipped_hand_computed() -> None:
    values = torch.tensor([1.0, 2.0, 3.0, 0.0])
    returns = torch.tensor([2.0, 1.0, 3.5, 3.0])
    # (1 + 1 + 0.25 + 9) / 4
    assert float(value_loss(values, values * 0, returns)) == pytest.approx(11.25 / 4, abs=1e-6)


def test_value_loss_clipped_hand_computed() -> None:
    values = torch.tensor([1.0, 2.0, 3.0, 0.0, 1.1])
    old_values = torch.tensor([0.5, 2.5, 3.0, 1.0, 1.0])
    returns = torch.tensor([2.0, 1.0, 3.5, 3.0, 5.0])
    # Clipped predictions, c = 0.2: 0.7, 2.3, 3.0, 0.8, 1.1
    #   unclipped squares: 1, 1, 0.25, 9, 15.21
    #   clipped squares:   1.69, 1.69, 0.25, 4.84, 15.21
    #   max:               1.69, 1.69, 0.25, 9, 15.21 -> mean 27.84 / 5
    loss = float(value_loss(values, old_values, returns, clip_coef=0.2))
    assert loss == pytest.approx(27.84 / 5, abs=1e-5)
    unclipped = float(value_loss(values, old_values, returns))
    assert unclipped == pytest.approx((1 + 1 + 0.25 + 9 + 15.21) / 5, abs=1e-5)


def test_value_loss_clipped_gradient_is_zero_where_the_clipped_term_wins() -> None:
    # v moved 1.0 above old, target far above: the clipped square is larger and flat in v.
    values = torch.tensor([2.0], requires_grad=True)
    loss = value_loss(values, torch.tensor([1.0]), torch.tensor([10.0]), clip_coef=0.2)
    # max((2 - 10)^2, (1.2 - 10)^2) = 77.44
    assert loss.item() == pytest.approx(77.44, abs=1e-4)
    (grad,) = torch.autograd.grad(loss, values)
    assert float(grad) == 0.0


def test_explained_variance_closed_cases() -> None:
    targets = torch.tensor([1.0, 2.0, 3.0, 4.0])
    assert explained_variance(targets.clone(), targets) == 1.0
    assert explained_variance(torch.full((4,), 2.5), targets) == pytest.approx(0.0, abs=1e-7)
    assert math.isnan(explained_variance(targets, torch.full((4,), 3.0)))
    # Residual [0, 0, 0, -1]: Var = 0.1875, Var(targets) = 1.25 -> 1 - 0.15.
    predictions = torch.tensor([1.0, 2.0, 3.0, 5.0])
    assert explained_variance(predictions, targets) == pytest.approx(0.85, abs=1e-6)
    # Worse than the mean is negative.
    assert explained_variance(-targets, targets) < 0


def test_clip_fraction() -> None:
    ratios = torch.tensor([0.5, 0.85, 1.0, 1.15, 1.3, 2.0], dtype=torch.float64)
    assert float(clip_fraction(ratios.log(), 0.2)) == pytest.approx(3 / 6)
    assert float(clip_fraction(ratios.log(), 0.1)) == pytest.approx(5 / 6)
    assert float(clip_fraction(ratios.log(), 1.5)) == 0.0
    assert float(clip_fraction(torch.zeros(7), 0.2)) == 0.0


def test_normalize_advantages() -> None:
    advantages = torch.tensor([1.0, 2.0, 3.0, 10.0])
    out = normalize_advantages(advantages)
    assert float(out.mean()) == pytest.approx(0.0, abs=1e-6)
    assert float(out.std()) == pytest.approx(1.0, abs=1e-6)
    torch.testing.assert_close(out, (advantages - 4.0) / advantages.std(), rtol=1e-6, atol=1e-6)
    assert torch.equal(normalize_advantages(torch.tensor([5.0])), torch.tensor([0.0]))


def test_surrogate_closed_form() -> None:
    """mean(r A) with r = exp(logprob - old): ratios 0.5, 1, 2 against advantages 2, -1, 3."""
    old = torch.zeros(3, dtype=torch.float64)
    logprob = torch.tensor([0.5, 1.0, 2.0], dtype=torch.float64).log()
    advantages = torch.tensor([2.0, -1.0, 3.0], dtype=torch.float64)
    assert float(surrogate(logprob, old, advantages)) == pytest.approx((1.0 - 1.0 + 6.0) / 3)
    # Its gradient at r = 1 is mean(A grad log pi): d/d logprob_i = A_i / n.
    logprob = torch.zeros(3, dtype=torch.float64, requires_grad=True)
    (grad,) = torch.autograd.grad(surrogate(logprob, old, advantages), logprob)
    torch.testing.assert_close(grad, advantages / 3)


# The numpy twins (losses.py's *_numpy) against the torch forms and autograd.


@pytest.mark.parametrize("norm_adv", [True, False])
def test_policy_terms_numpy_is_policy_terms(norm_adv: bool) -> None:
    g = torch.Generator().manual_seed(11)
    n = 64
    old = torch.randn(n, generator=g) - 1.0
    logprob = (old + 0.4 * torch.randn(n, generator=g)).requires_grad_(True)
    advantages = torch.randn(n, generator=g) * 2 + 0.3
    entropy = torch.rand(n, generator=g)
    want = policy_terms(logprob, old, advantages, entropy, EPS, norm_adv)
    (d_logprob,) = torch.autograd.grad(want["loss_pi"], logprob)
    got, d_numpy = policy_terms_numpy(
        logprob.detach().numpy(),
        old.numpy(),
        advantages.numpy(),
        float(entropy.mean()),
        EPS,
        norm_adv,
    )
    assert got.keys() == want.keys()
    for name, value in want.items():
        assert got[name] == pytest.approx(float(value.detach()), rel=1e-5, abs=1e-6), name
    assert 0.0 < got["clip_fraction"] < 1.0
    np.testing.assert_allclose(d_numpy, d_logprob.numpy(), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("clip", [None, 0.2])
def test_value_terms_numpy_is_value_terms(clip: float | None) -> None:
    g = torch.Generator().manual_seed(12)
    n = 64
    old = torch.randn(n, generator=g)
    values = (old + 0.4 * torch.randn(n, generator=g)).requires_grad_(True)
    with torch.no_grad():
        values[:4] = old[:4]  # ties of the two branches: autograd splits the gradient
    returns = old + torch.randn(n, generator=g)
    want = value_terms(values, old, returns, clip)
    (d_values,) = torch.autograd.grad(want["loss_v"], values)
    got, d_numpy = value_terms_numpy(values.detach().numpy(), old.numpy(), returns.numpy(), clip)
    assert got["loss_v"] == pytest.approx(float(want["loss_v"].detach()), rel=1e-5)
    np.testing.assert_allclose(d_numpy, d_values.numpy(), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("n", [1, 2, 9])
def test_normalize_advantages_numpy_is_normalize_advantages(n: int) -> None:
    advantages = torch.linspace(-1.0, 3.0, n) ** 2
    np.testing.assert_allclose(
        normalize_advantages_numpy(advantages.numpy()),
        normalize_advantages(advantages).numpy(),
        rtol=1e-6,
        atol=1e-6,
    )
