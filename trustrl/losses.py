"""Pure loss and diagnostic functions: tensors in, tensors out, no config objects."""

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
    if advantages.numel() < 2:
        return advantages - advantages.mean()
    return (advantages - advantages.mean()) / (advantages.std() + 1e-8)


def explained_variance(predictions: Tensor, targets: Tensor) -> float:
    """1 - Var(targets - predictions) / Var(targets); nan when the targets do not vary."""
    variance = targets.var(unbiased=False)
    if variance == 0:
        return float("nan")
    return float(1.0 - (targets - predictions).var(unbiased=False) / variance)
