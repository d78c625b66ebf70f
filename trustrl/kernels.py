"""Compiled loops (numba) for the running statistics the collector updates every step.

A normalizer's step on one env's observation is a few dozen floating-point operations.
As numpy calls it was about fifteen calls of most of a microsecond each, a quarter of
the collector's own time per Hopper step (docs/performance.md, round 5); one compiled
call does the fold and the standardization in about a microsecond. numpy cannot fuse
the calls and torch dispatches slower still, so these few loops are compiled with numba.

Every update of a ``RunningMeanStd`` goes through ``fold`` (Welford's update, one sample
at a time), whatever the number of rows: one implementation of the statistics. The
statistics are float64 arrays, flattened to (D,), with the count as a (1,) array; all
are updated in place. This module is imported on the first update or standardization
(``normalize.py``), so that ``import trustrl`` stays light; ``cache=True`` keeps the
compiled code next to this file (or in numba's user cache), so only the first process
on a machine pays the compilation (a second or two).
"""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True)
def _take(sample, mean, var, count):  # type: ignore[no-untyped-def]
    """Fold one sample (D,) into (mean, population variance, count)."""
    old = count[0]
    total = old + 1.0
    for j in range(mean.shape[0]):
        delta = sample[j] - mean[j]
        mean[j] += delta / total
        var[j] = var[j] * (old / total) + delta * delta * (old / (total * total))
    count[0] = total


@njit(cache=True)
def fold(x, mean, var, count):  # type: ignore[no-untyped-def]
    """Fold the rows of x (B, D) into the statistics, in row order."""
    for row in range(x.shape[0]):
        _take(x[row], mean, var, count)


@njit(cache=True)
def standardize(x, mean, var, epsilon, clip, out):  # type: ignore[no-untyped-def]
    """out = clip((x - mean) / sqrt(var + epsilon), -clip, clip), x and out (B, D): the
    arithmetic in float64, rounded once when written into ``out``."""
    for j in range(mean.shape[0]):
        scale = 1.0 / np.sqrt(var[j] + epsilon)
        for row in range(x.shape[0]):
            out[row, j] = min(max((x[row, j] - mean[j]) * scale, -clip), clip)


@njit(cache=True)
def fold_standardize(x, mean, var, count, epsilon, clip, out):  # type: ignore[no-untyped-def]
    """``fold`` then ``standardize``, in one call: the collector's step."""
    fold(x, mean, var, count)
    standardize(x, mean, var, epsilon, clip, out)


@njit(cache=True)
def scale_rewards(  # type: ignore[no-untyped-def]
    reward, valid, done, discounted, gamma, train, mean, var, count, epsilon, clip, out
):
    """Reward scaling over a rollout's (T, rows) rewards, step by step as it would run
    live: each row's discounted return (``discounted``, (rows,), carried across calls) is
    folded into the scalar statistics where the step is ``valid`` (with ``train``), then
    every reward of the step is divided by the spread so far and clipped into ``out``;
    a row's discounted return restarts after ``done``."""
    for t in range(reward.shape[0]):
        for row in range(reward.shape[1]):
            discounted[row] = discounted[row] * gamma + reward[t, row]
            if train and valid[t, row]:
                _take(discounted[row : row + 1], mean, var, count)
        scale = 1.0 / np.sqrt(var[0] + epsilon)
        for row in range(reward.shape[1]):
            if done[t, row]:
                discounted[row] = 0.0
            out[t, row] = min(max(reward[t, row] * scale, -clip), clip)
