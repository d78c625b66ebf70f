"""Pure loss and diagnostic functions: tensors in, tensors out, no config objects.

``policy_terms`` and ``value_terms`` are PPO's losses as named terms (TorchRL's style):

* ``loss_pi``: the clipped surrogate, ``clipped_surrogate``;
* ``entropy``: the mean entropy of the policy on the minibatch;
* ``loss_v``: the (optionally clipped) squared error, ``value_loss``;
* ``approx_kl``, ``clip_fraction``: diagnostics, no gradient.

The progress file and TensorBoard report these terms, averaged over minibatches, under the
same names. Each loss term is unweighted: the objective is ``loss_pi - ent_coef * entropy``
for an actor's optimizer, ``loss_v`` for a critic's, and ``loss_pi - ent_coef * entropy +
vf_coef * loss_v`` where one optimizer holds both (``learner/updates/grads.py``). Each torch form
has a numpy twin in kernels.py (``*_numpy``: there so that PPO's critic process imports no
torch), which also returns the derivative the hand-written backward pass starts from;
``tests/test_losses.py`` holds them equal.
"""

from __future__ import annotations

import torch
from torch import Tensor


def clipped_surrogate(
    logprob: Tensor, old_logprob: Tensor, advantages: Tensor, clip_coef: float
) -> tuple[Tensor, Tensor]:
    """PPO's clipped policy loss -mean(min(r A, clip(r, 1-eps, 1+eps) A)) and the log-ratio.

    The min takes the pessimistic branch: an overlarge step is not rewarded, a wrong one
    is still penalized, so the per-sample gradient is A r grad log pi except in the flat
    region (A >= 0 and r > 1 + eps, or A < 0 and r < 1 - eps), where it is exactly zero.
    """
    log_ratio = logprob - old_logprob
    ratio = log_ratio.exp()
    unclipped = ratio * advantages
    clipped = ratio.clamp(1.0 - clip_coef, 1.0 + clip_coef) * advantages
    return -torch.min(unclipped, clipped).mean(), log_ratio


def surrogate(logprob: Tensor, old_logprob: Tensor, advantages: Tensor) -> Tensor:
    """TRPO's objective, to be maximized: mean(r A), r = pi_new / pi_old on old samples
    (its gradient at r = 1 is the policy gradient; the KL bound keeps r near 1)."""
    return ((logprob - old_logprob).exp() * advantages).mean()


def policy_terms(
    logprob: Tensor,
    old_logprob: Tensor,
    advantages: Tensor,
    entropy: Tensor,
    clip_coef: float,
    norm_adv: bool = True,
) -> dict[str, Tensor]:
    """PPO's policy terms on a minibatch; ``entropy`` (rows,) is the policy's per row."""
    if norm_adv:
        advantages = normalize_advantages(advantages)
    loss, log_ratio = clipped_surrogate(logprob, old_logprob, advantages, clip_coef)
    with torch.no_grad():
        kl, fraction = approx_kl(log_ratio), clip_fraction(log_ratio, clip_coef)
    return {
        "loss_pi": loss,
        "entropy": entropy.mean(),
        "approx_kl": kl,
        "clip_fraction": fraction,
    }


def value_terms(
    values: Tensor, old_values: Tensor, returns: Tensor, clip_coef: float | None = None
) -> dict[str, Tensor]:
    """PPO's value term on a minibatch (the critic's raw outputs and targets)."""
    return {"loss_v": value_loss(values, old_values, returns, clip_coef)}


def approx_kl(log_ratio: Tensor) -> Tensor:
    """KL(old || new) estimated as mean((r - 1) - log r), r = pi_new / pi_old on old samples.

    Unbiased and always >= 0, with far lower variance than mean(-log r), which is noisy
    enough to trip early stopping at random (Schulman 2020, "Approximating KL divergence").
    """
    return (log_ratio.exp() - 1.0 - log_ratio).mean()


def clip_fraction(log_ratio: Tensor, clip_coef: float) -> Tensor:
    """Share of samples whose ratio left [1 - eps, 1 + eps]."""
    return ((log_ratio.exp() - 1.0).abs() > clip_coef).float().mean()


def value_loss(
    values: Tensor, old_values: Tensor, returns: Tensor, clip_coef: float | None = None
) -> Tensor:
    """Mean squared error to the returns; with ``clip_coef``, the pessimistic clipped form
    max((v - R)^2, (v_old + clip(v - v_old, -c, c) - R)^2) of Schulman et al.'s PPO code."""
    unclipped = (values - returns).square()
    if clip_coef is None:
        return unclipped.mean()
    clipped = old_values + (values - old_values).clamp(-clip_coef, clip_coef)
    return torch.max(unclipped, (clipped - returns).square()).mean()


def normalize_advantages(advantages: Tensor) -> Tensor:
    """Zero mean and unit (unbiased) standard deviation; a single row is only centered."""
    if advantages.numel() < 2:
        return advantages - advantages.mean()
    return (advantages - advantages.mean()) / (advantages.std() + 1e-8)


def explained_variance(predictions: Tensor, targets: Tensor) -> float:
    """1 - Var(targets - predictions) / Var(targets); nan when the targets do not vary."""
    variance = targets.var(unbiased=False)
    if variance == 0:
        return float("nan")
    return float(1.0 - (targets - predictions).var(unbiased=False) / variance)
