"""Running mean and variance, as a torch module so that it is part of the model.

Gymnasium's NormalizeObservation wrapper keeps its statistics in the environment
wrapper; trustrl keeps them in the policy instead, so they are saved, loaded,
exported and evaluated with the weights, always (the statistics are a large part of
PPO's edge, and a policy restored without them silently acts on differently scaled
inputs). The same class scales rewards by the spread of the discounted return.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor, nn


class RunningMeanStd(nn.Module):
    """Mean and (population) variance over every batch seen, merged in parallel form.

    ``update`` folds a batch in with Chan et al.'s pairwise update of Welford's
    statistics; ``forward`` standardizes and clips. Statistics are float64 buffers,
    so they ride along in ``state_dict`` and survive long runs without drift.
    """

    mean: Tensor
    var: Tensor
    count: Tensor

    def __init__(
        self, shape: tuple[int, ...] | int = (), clip: float = 10.0, epsilon: float = 1e-8
    ):
        super().__init__()
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        self.clip = clip
        self.epsilon = epsilon
        self.register_buffer("mean", torch.zeros(shape, dtype=torch.float64))
        self.register_buffer("var", torch.ones(shape, dtype=torch.float64))
        self.register_buffer("count", torch.zeros((), dtype=torch.float64))
        self._arrays: tuple[Tensor, np.ndarray, np.ndarray, np.ndarray] | None = None

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(mean, var, count) as numpy views of the buffers (cached while they are the same
        tensors; ``load_state_dict`` copies in place, so the views stay valid)."""
        cached = self._arrays
        # _buffers directly: nn.Module's attribute lookup is slow for a per-step call.
        if cached is None or cached[0] is not self._buffers["mean"]:
            views = (self.mean.numpy(), self.var.numpy(), self.count.numpy())
            cached = self._arrays = (self.mean, *views)
        return cached[1], cached[2], cached[3]

    def update(self, batch: Tensor | np.ndarray) -> None:
        """Fold in a batch of shape (B, *shape).

        In numpy on views of the buffers: the collector calls this every env step, on a
        handful of rows, where a dozen torch ops would cost more than the rest of the step.
        The count is a Python float here, so the scalar arithmetic costs no numpy calls.
        """
        mean, var, count = self.arrays()
        batch = np.asarray(batch).reshape(-1, *mean.shape)
        n = batch.shape[0]
        if n == 0:
            return
        if n == 1 and mean.ndim == 0:  # one scalar (a reward)
            self.update_scalar(float(batch[0]))
            return
        old = float(count)
        total = old + n
        if n == 1:  # one env: the batch variance is 0, skip numpy's mean and var
            delta = batch[0] - mean
            var *= old / total
            var += delta * delta * (old / (total * total))
        else:
            batch = batch.astype(np.float64, copy=False)
            batch_mean = batch.mean(0)
            centered = batch - batch_mean
            batch_var = (centered * centered).mean(0)
            delta = batch_mean - mean
            var *= old / total
            var += batch_var * (n / total) + delta * delta * (old * n / (total * total))
        mean += delta * (n / total)
        count[...] = total

    def update_scalar(self, x: float) -> None:
        """``update`` with one number, for scalar statistics: Python floats throughout, so
        the arithmetic costs no numpy calls."""
        mean, var, count = self.arrays()
        old = float(count)
        total = old + 1.0
        delta = x - float(mean)
        var[...] = float(var) * (old / total) + delta * delta * (old / (total * total))
        mean[...] = float(mean) + delta / total
        count[...] = total

    def forward(self, x: Tensor) -> Tensor:
        scale = torch.rsqrt(self.var.to(x.dtype) + self.epsilon)
        return ((x - self.mean.to(x.dtype)) * scale).clamp(-self.clip, self.clip)

    # The collector's numpy versions (per env step, numpy ops cost a fraction of torch's).

    def normalize_array(self, x: np.ndarray) -> np.ndarray:
        """``forward`` on a float32 array: the same operations in the same order."""
        mean, var, _ = self.arrays()
        scale = 1.0 / np.sqrt(var.astype(np.float32) + np.float32(self.epsilon))
        return _clip_((x - mean.astype(np.float32)) * scale, self.clip)

    def scale_array(self, x: np.ndarray) -> np.ndarray:
        """Divide by the standard deviation only (reward scaling keeps the sign and offset)."""
        _, var, _ = self.arrays()
        if var.ndim == 0:  # the reward scale: one number
            return _clip_(x * (1.0 / math.sqrt(float(var) + self.epsilon)), self.clip)
        return _clip_(x * (1.0 / np.sqrt(var + self.epsilon)), self.clip)

    def scale_scalar(self, x: float) -> float:
        """``scale_array`` of one number by scalar statistics, in Python floats."""
        _, var, _ = self.arrays()
        return min(max(x * (1.0 / math.sqrt(float(var) + self.epsilon)), -self.clip), self.clip)


def _clip_(x: np.ndarray, bound: float) -> np.ndarray:
    """``np.clip(x, -bound, bound)`` in place, as two ufuncs: np.clip's Python wrapper
    costs more than the clipping on a few rows."""
    return np.minimum(np.maximum(x, -bound, out=x), bound, out=x)
