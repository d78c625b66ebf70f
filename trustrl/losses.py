"""Pure loss and diagnostic functions: tensors in, tensors out, no config objects.

``policy_terms`` and ``value_terms`` are PPO's losses as named terms (TorchRL's style):

* ``loss/policy``: the clipped surrogate, ``clipped_surrogate``;
* ``loss/entropy``: the mean entropy of the policy on the minibatch;
* ``loss/value``: the (optionally clipped) squared error, ``value_loss``;
* ``diag/approx_kl``, ``diag/clip_fraction``: diagnostics, no gradient.

Each loss term is unweighted: the objective is ``policy - ent_coef * entropy`` for an
actor's optimizer, ``value`` for a critic's, and ``policy - ent_coef * entropy + vf_coef *
value`` where one optimizer holds both (``updates/grads.py``). Beside each torch form sits
its numpy twin (``*_numpy``), which also returns the derivative the hand-written backward
pass starts from; ``tests/test_grads.py`` holds them equal.
"""

from __future__ import annotations

import math

import numpy as np
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
        "loss/policy": loss,
        "loss/entropy": entropy.mean(),
        "diag/approx_kl": kl,
        "diag/clip_fraction": fraction,
    }


def policy_terms_numpy(
    logprob: np.ndarray,
    old_logprob: np.ndarray,
    advantages: np.ndarray,
    entropy: float,
    clip_coef: float,
    norm_adv: bool = True,
) -> tuple[dict[str, float], np.ndarray]:
    """``policy_terms`` in numpy, and d loss/policy / d logprob (rows,); ``entropy`` is the
    minibatch's mean (the numpy heads' ``terms`` give it so).

    Means as sums / n throughout: ndarray.mean's Python wrapper costs more than the
    arithmetic on a minibatch."""
    n = len(logprob)
    if norm_adv:
        advantages = normalize_advantages_numpy(advantages)
    log_ratio = logprob - old_logprob
    ratio = np.exp(log_ratio)
    unclipped = ratio * advantages
    clipped = np.minimum(np.maximum(ratio, 1.0 - clip_coef), 1.0 + clip_coef) * advantages
    terms = {
        "loss/policy": -float(np.minimum(unclipped, clipped).sum()) / n,
        "loss/entropy": entropy,
        "diag/approx_kl": (float(ratio.sum()) - n - float(log_ratio.sum())) / n,
        "diag/clip_fraction": np.count_nonzero(np.abs(ratio - 1.0) > clip_coef) / n,
    }
    # The unclipped branch's gradient where min picks it (ties too: both branches then
    # carry the same gradient), zero where the clipped one is flat.
    d_logprob = np.where(unclipped <= clipped, -(advantages * ratio) / n, np.float32(0.0))
    return terms, d_logprob.astype(np.float32, copy=False)


def value_terms(
    values: Tensor, old_values: Tensor, returns: Tensor, clip_coef: float | None = None
) -> dict[str, Tensor]:
    """PPO's value term on a minibatch (the critic's raw outputs and targets)."""
    return {"loss/value": value_loss(values, old_values, returns, clip_coef)}


def value_terms_numpy(
    values: np.ndarray, old_values: np.ndarray, returns: np.ndarray, clip_coef: float | None
) -> tuple[dict[str, float], np.ndarray]:
    """``value_terms`` in numpy, and d loss/value / d values (rows,)."""
    n = len(values)
    error = values - returns
    unclipped = error * error
    d_values = (2.0 / n) * error
    if clip_coef is None:
        loss = float(unclipped.sum()) / n
    else:
        clipped_values = old_values + np.clip(values - old_values, -clip_coef, clip_coef)
        clipped_error = clipped_values - returns
        clipped = clipped_error * clipped_error
        loss = float(np.maximum(unclipped, clipped).sum()) / n
        inside = np.abs(values - old_values) <= clip_coef
        d_clipped = (2.0 / n) * clipped_error * inside
        # torch.max's gradient: the larger branch's, split evenly on a tie.
        d_values = np.where(
            unclipped > clipped,
            d_values,
            np.where(unclipped < clipped, d_clipped, 0.5 * (d_values + d_clipped)),
        )
    return {"loss/value": loss}, d_values.astype(np.float32, copy=False)


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


def normalize_advantages_numpy(advantages: np.ndarray) -> np.ndarray:
    """``normalize_advantages`` in numpy (float sums: see ``policy_terms_numpy``)."""
    n = len(advantages)
    centered = advantages - float(advantages.sum()) / n
    if n < 2:
        return centered
    return centered / (math.sqrt(float(centered @ centered) / (n - 1)) + 1e-8)


def explained_variance(predictions: Tensor, targets: Tensor) -> float:
    """1 - Var(targets - predictions) / Var(targets); nan when the targets do not vary."""
    variance = targets.var(unbiased=False)
    if variance == 0:
        return float("nan")
    return float(1.0 - (targets - predictions).var(unbiased=False) / variance)
