"""Running mean and variance in numpy: what acts on a runner, and what the policy's
torch normalizers (``policy.RunningMeanStd``) compute with.

Gymnasium's NormalizeObservation wrapper keeps its statistics in the environment
wrapper; trustrl keeps them in the policy instead, so they are saved, loaded,
exported and evaluated with the weights, always (the statistics are a large part of
PPO's edge, and a policy restored without them silently acts on differently scaled
inputs). The same class scales rewards by the spread of the discounted return.

This module imports no torch: a Ray runner or an external agent normalizes with
``MeanStd`` alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class RunningStats:
    """Count, mean and M2 (the sum of squared deviations from the mean) of some rows, in
    float64: what a runner sends the learner about the observations it saw.

    Statistics of separate chunks merge exactly into those of the concatenation (Chan,
    Golub and LeVeque 1979): M2 adds, plus a term for the distance between the means.
    Merging variances instead loses that term (RLlib's connector statistics needed the
    same fix in 2025).
    """

    count: float
    mean: np.ndarray  # (*shape,) float64
    m2: np.ndarray  # (*shape,) float64

    @classmethod
    def empty(cls, shape: tuple[int, ...] | int = ()) -> RunningStats:
        return cls(0.0, np.zeros(shape), np.zeros(shape))

    @classmethod
    def of(cls, rows: np.ndarray) -> RunningStats:
        """The statistics of ``rows`` (n, *shape)."""
        rows = np.asarray(rows, dtype=np.float64)
        if len(rows) == 0:
            return cls.empty(rows.shape[1:])
        mean = rows.mean(0)
        centered = rows - mean
        return cls(float(len(rows)), mean, (centered * centered).sum(0))

    @property
    def var(self) -> np.ndarray:
        """The population variance (ones before any row: normalizing is then the identity)."""
        return self.m2 / self.count if self.count > 0 else np.ones_like(self.m2)

    def merge(self, other: RunningStats) -> RunningStats:
        """The statistics of both sets of rows together."""
        if other.count == 0:
            return self
        if self.count == 0:
            return other
        total = self.count + other.count
        delta = other.mean - self.mean
        mean = self.mean + delta * (other.count / total)
        m2 = self.m2 + other.m2 + delta * delta * (self.count * other.count / total)
        return RunningStats(total, mean, m2)

    def is_finite(self) -> bool:
        return bool(np.isfinite(self.mean).all() and np.isfinite(self.m2).all())


class MeanStd:
    """Mean and (population) variance over every batch seen, merged in parallel form.

    ``update`` folds a batch in with Chan et al.'s pairwise update of Welford's
    statistics; ``normalize_array`` standardizes and clips. The statistics are float64
    arrays, possibly views of a torch module's buffers (``policy.RunningMeanStd``), so
    they survive long runs without drift.
    """

    def __init__(
        self,
        shape: tuple[int, ...] | int = (),
        clip: float = 10.0,
        epsilon: float = 1e-8,
        arrays: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None,
    ):
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        self.clip = clip
        self.epsilon = epsilon
        if arrays is None:
            arrays = (np.zeros(shape), np.ones(shape), np.zeros(()))
        self.mean: np.ndarray = arrays[0]
        self.var: np.ndarray = arrays[1]
        self.count: np.ndarray = arrays[2]

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(mean, var, count), written in place by every update."""
        return self.mean, self.var, self.count

    def state_dict(self) -> dict[str, Any]:
        return {"mean": self.mean.copy(), "var": self.var.copy(), "count": self.count.copy()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """From ``state_dict``'s arrays (or the tensors of a checkpoint written when this
        state was a torch module's)."""
        for name in ("mean", "var", "count"):
            getattr(self, name)[...] = np.asarray(state[name], dtype=np.float64)

    def update(self, batch: np.ndarray) -> None:
        """Fold in a batch of shape (B, *shape).

        In numpy on views of the buffers: the collector calls this every env step, on a
        handful of rows, where a dozen torch ops would cost more than the rest of the step.
        The count is a Python float here, so the scalar arithmetic costs no numpy calls.
        """
        mean, var, count = self.arrays()
        rows = np.asarray(batch).reshape(-1, *mean.shape)
        if not np.isfinite(rows.sum()):
            # Statistics never take a NaN or an infinity: one would stay in them for good.
            rows = rows[np.isfinite(rows.reshape(len(rows), -1)).all(1)]
        n = rows.shape[0]
        if n == 0:
            return
        if n == 1 and mean.ndim == 0:  # one scalar (a reward)
            self.update_scalar(float(rows[0]))
            return
        old = float(count)
        total = old + n
        if n == 1:  # one env: the batch variance is 0, skip numpy's mean and var
            delta = rows[0] - mean
            var *= old / total
            var += delta * delta * (old / (total * total))
        else:
            rows = rows.astype(np.float64, copy=False)
            batch_mean = rows.mean(0)
            centered = rows - batch_mean
            batch_var = (centered * centered).mean(0)
            delta = batch_mean - mean
            var *= old / total
            var += batch_var * (n / total) + delta * delta * (old * n / (total * total))
        mean += delta * (n / total)
        count[...] = total

    def stats(self) -> RunningStats:
        """A copy of the statistics, for a policy snapshot."""
        mean, var, count = self.arrays()
        n = float(count)
        return RunningStats(n, mean.copy(), var * n)

    def merge(self, delta: RunningStats) -> None:
        """Fold in the statistics of rows seen elsewhere (a runner's delta): the learner's
        one way of taking in observations. A non-finite delta is refused whole, so the
        statistics never turn NaN."""
        if not delta.is_finite():
            raise ValueError("non-finite observation statistics: refusing to merge them")
        mean, var, count = self.arrays()
        merged = self.stats().merge(delta)
        mean[...], var[...], count[...] = merged.mean, merged.var, merged.count

    @classmethod
    def of_stats(cls, stats: RunningStats, clip: float, epsilon: float = 1e-8) -> MeanStd:
        """A normalizer holding ``stats`` (a runner's acting copy of the learner's)."""
        norm = cls(stats.mean.shape, clip=clip, epsilon=epsilon)
        norm.mean[...], norm.var[...], norm.count[...] = stats.mean, stats.var, stats.count
        return norm

    def update_scalar(self, x: float) -> None:
        """``update`` with one number, for scalar statistics: Python floats throughout, so
        the arithmetic costs no numpy calls."""
        if not math.isfinite(x):
            return  # never taken into the statistics (see update)
        mean, var, count = self.arrays()
        mean[...], var[...], count[...] = _welford(float(mean), float(var), float(count), x)

    def update_and_scale(self, fold: list[float | None], values: list[float]) -> list[float]:
        """Scalar statistics, step by step: fold ``fold[i]`` in (None: nothing this step),
        then scale ``values[i]`` by the spread so far, as ``scale_array`` does. Python
        floats throughout and the buffers written once: no numpy call per element."""
        mean_buf, var_buf, count_buf = self.arrays()
        mean, var, count = float(mean_buf), float(var_buf), float(count_buf)
        epsilon, clip = self.epsilon, self.clip
        scaled = []
        for x, value in zip(fold, values, strict=True):
            if x is not None and math.isfinite(x):
                mean, var, count = _welford(mean, var, count, x)
            scaled.append(min(max(value * (1.0 / math.sqrt(var + epsilon)), -clip), clip))
        mean_buf[...], var_buf[...], count_buf[...] = mean, var, count
        return scaled

    def normalize_array(self, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """Standardize and clip ``x`` into ``out`` (float32; a new array by default), as
        ``policy.RunningMeanStd.forward`` does a tensor. The arithmetic runs on the float64
        statistics and is rounded once, when written.

        A row wider than the statistics (a structured observation's row, whose leading
        columns are its float vectors: envs/layout.py) has those columns standardized and
        the rest copied as they are."""
        mean, var, _ = self.arrays()
        if mean.ndim == 1 and x.shape[-1] > len(mean):
            if out is None:
                out = np.empty(x.shape, dtype=np.float32)
            out[..., len(mean) :] = x[..., len(mean) :]
            self.normalize_array(x[..., : len(mean)], out[..., : len(mean)])
            return out
        y = x - mean
        y *= 1.0 / np.sqrt(var + self.epsilon)
        if out is None:
            out = np.empty(y.shape, dtype=np.float32)
        return _clip_(y, self.clip, out)

    def update_normalize(
        self, x: np.ndarray, out: np.ndarray | None = None, rows: np.ndarray | None = None
    ) -> np.ndarray:
        """``update`` with the rows ``rows`` of x (all by default), then
        ``normalize_array(x, out)``: the collector's step.

        One row (one env) takes a shortcut in thirteen numpy calls: with d = x - the old
        mean, x - the new mean is d (n - 1) / n, which gives the new mean, the variance's
        increment and the standardized row without repeating the subtraction.
        """
        mean, var, count = self.arrays()
        if mean.ndim == 1 and x.shape[-1] > len(mean):  # a structured row: its vectors
            self.update((x if rows is None else x[rows])[:, : len(mean)])
            return self.normalize_array(x, out)
        if rows is not None or x.shape[0] != 1 or mean.ndim != 1 or not np.isfinite(x.sum()):
            self.update(x if rows is None else x[rows])
            return self.normalize_array(x, out)
        old = float(count)
        total = old + 1.0
        row = x[0]
        delta = row - mean  # x - the old mean
        shifted = delta * (old / total)  # x - the new mean
        np.subtract(row, shifted, out=mean)
        delta *= shifted
        delta *= 1.0 / total  # d^2 (n - 1) / n^2
        var *= old / total
        var += delta
        count[...] = total
        np.add(var, self.epsilon, out=delta)
        np.sqrt(delta, out=delta)
        shifted /= delta
        if out is None:
            out = np.empty(x.shape, dtype=np.float32)
        _clip_(shifted, self.clip, out[0])
        return out

    def scale_array(self, x: np.ndarray) -> np.ndarray:
        """Divide by the standard deviation only (reward scaling keeps the sign and offset),
        for scalar statistics (the reward scale)."""
        _, var, _ = self.arrays()
        return _clip_(x * (1.0 / math.sqrt(float(var) + self.epsilon)), self.clip)


def _welford(mean: float, var: float, count: float, x: float) -> tuple[float, float, float]:
    """(mean, population variance, count) with one more number ``x`` folded in."""
    total = count + 1.0
    delta = x - mean
    var = var * (count / total) + delta * delta * (count / (total * total))
    return mean + delta / total, var, total


def _clip_(x: np.ndarray, bound: float, out: np.ndarray | None = None) -> np.ndarray:
    """``np.clip(x, -bound, bound)`` in place (into ``out`` when given), as two ufuncs:
    np.clip's Python wrapper costs more than the clipping on a few rows."""
    return np.minimum(np.maximum(x, -bound, out=x), bound, out=x if out is None else out)
