"""Running mean and variance, as a torch module so that it is part of the model.

Gymnasium's NormalizeObservation wrapper keeps its statistics in the environment
wrapper; trustrl keeps them in the policy instead, so they are saved, loaded,
exported and evaluated with the weights, always (the statistics are a large part of
PPO's edge, and a policy restored without them silently acts on differently scaled
inputs). The same class scales rewards by the spread of the discounted return.
"""

from __future__ import annotations

import functools
from types import ModuleType

import numpy as np
import torch
from torch import Tensor, nn

_Arrays = tuple[np.ndarray, np.ndarray, np.ndarray]  # (mean, var, count)


class RunningMeanStd(nn.Module):
    """Mean and (population) variance over every sample seen.

    ``update`` folds a batch in with Welford's update, one sample at a time (a compiled
    loop, ``kernels.fold``: the collector calls it every step on a handful of rows, where
    numpy's per-call cost would dominate); ``forward`` standardizes and clips. Statistics
    are float64 buffers, so they ride along in ``state_dict`` and survive long runs without
    drift.
    """

    mean: Tensor
    var: Tensor
    count: Tensor

    def __init__(
        self, shape: tuple[int, ...] | int = (), clip: float = 10.0, epsilon: float = 1e-8
    ):
        super().__init__()
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        self.clip = float(clip)
        self.epsilon = float(epsilon)
        self.register_buffer("mean", torch.zeros(shape, dtype=torch.float64))
        self.register_buffer("var", torch.ones(shape, dtype=torch.float64))
        self.register_buffer("count", torch.zeros((), dtype=torch.float64))
        self._arrays: tuple[Tensor, _Arrays, _Arrays] | None = None

    def arrays(self) -> _Arrays:
        """(mean, var, count) as numpy views of the buffers."""
        return self._views()[0]

    def flat_arrays(self) -> _Arrays:
        """(mean, var, count) as the kernels take them: views of shape (D,), (D,), (1,)."""
        return self._views()[1]

    def _views(self) -> tuple[_Arrays, _Arrays]:
        # Cached while the buffers are the same tensors (``load_state_dict`` copies in
        # place, so the views stay valid); _buffers directly, as nn.Module's attribute
        # lookup is slow for a per-step call.
        cached = self._arrays
        if cached is None or cached[0] is not self._buffers["mean"]:
            shaped = (self.mean.numpy(), self.var.numpy(), self.count.numpy())
            flat = (shaped[0].reshape(-1), shaped[1].reshape(-1), shaped[2].reshape(1))
            cached = self._arrays = (self.mean, shaped, flat)
        return cached[1], cached[2]

    def update(self, batch: Tensor | np.ndarray) -> None:
        """Fold in a batch of shape (B, *shape), one sample at a time (Welford)."""
        mean, var, count = self.flat_arrays()
        _kernels().fold(np.asarray(batch).reshape(-1, len(mean)), mean, var, count)

    def forward(self, x: Tensor) -> Tensor:
        scale = torch.rsqrt(self.var.to(x.dtype) + self.epsilon)
        return ((x - self.mean.to(x.dtype)) * scale).clamp(-self.clip, self.clip)

    # The collector's versions, on numpy arrays (compiled loops: see kernels.py).

    def normalize_array(self, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """``forward`` on an array (B, *shape), into ``out`` (float32; a new array by
        default). The arithmetic runs on the float64 statistics and is rounded once, when
        written."""
        mean, var, _ = self.flat_arrays()
        if out is None:
            out = np.empty(x.shape, dtype=np.float32)
        dims = len(mean)
        _kernels().standardize(
            x.reshape(-1, dims), mean, var, self.epsilon, self.clip, out.reshape(-1, dims)
        )
        return out

    def update_normalize(
        self, x: np.ndarray, out: np.ndarray | None = None, rows: np.ndarray | None = None
    ) -> np.ndarray:
        """``update`` with the rows ``rows`` of x (all by default), then
        ``normalize_array(x, out)``: the collector's step, one compiled call."""
        if rows is not None:
            self.update(x[rows])
            return self.normalize_array(x, out)
        mean, var, count = self.flat_arrays()
        if out is None:
            out = np.empty(x.shape, dtype=np.float32)
        dims = len(mean)
        _kernels().fold_standardize(
            x.reshape(-1, dims), mean, var, count, self.epsilon, self.clip, out.reshape(-1, dims)
        )
        return out

    def scale_rewards(
        self,
        reward: np.ndarray,
        valid: np.ndarray,
        done: np.ndarray,
        discounted: np.ndarray,
        gamma: float,
        train: bool,
    ) -> np.ndarray:
        """A rollout's (T, rows) rewards divided by the spread of the discounted return
        (Engstrom et al. 2020's reward scaling; scalar statistics), step by step as it
        would have run live: with ``train``, step t's valid rows fold their discounted
        returns (``discounted``, (rows,), carried across rollouts and updated in place) in
        before step t is scaled; a row's return restarts after ``done``. The scale keeps
        the sign and offset of a reward and clips it to the bound."""
        mean, var, count = self.flat_arrays()
        out = np.empty_like(reward)
        _kernels().scale_rewards(
            reward, valid, done, discounted, gamma, train, mean, var, count,
            self.epsilon, self.clip, out,
        )  # fmt: skip
        return out


@functools.cache
def _kernels() -> ModuleType:
    """The compiled loops, imported (and numba with them) on first use."""
    from trustrl import kernels

    return kernels
