"""Adam, as torch.optim.Adam computes it, without torch.optim, on one flat buffer.

Why not ``torch.optim.Adam``: constructing any ``torch.optim.Optimizer`` imports
``torch._dynamo``, which takes longer than a whole CartPole training run (see
docs/performance.md); and on CPU its per-parameter (or per-tensor ``foreach``)
ops dominate a small network's step (see docs/performance.md). This class keeps the
weights and moments in flat tensors and steps them with a handful of in-place numpy ops
on views of those (the arithmetic of ``torch.optim.Adam``'s single-tensor CPU path);
``tests/test_optim.py`` checks it step for step against ``torch.optim.Adam``. It keeps
torch's attribute names (``param_groups``, ``state``) and ``state_dict`` layout, so
checkpoints written with either load in both.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from trustrl.learner.updates import critic_worker


class Adam:
    """Adam over parameters that live in one flat buffer.

    At construction (and after ``grow``) the parameters' storage is moved into one
    contiguous tensor, each parameter becoming a view of its slice, and the moments are
    flat tensors too. A step is then a dozen numpy ops on three flat arrays, whatever the
    number of parameters: on CPU, torch's ``foreach`` path still pays dispatch per tensor.
    ``state[p]`` holds views of the flat moments, in torch's layout.

    One difference from torch.optim.Adam: within a step where some but not all
    parameters have a gradient, the others are stepped with a zero gradient (their
    moments decay) instead of being skipped. trustrl's updates always give every
    parameter of an optimizer a gradient.
    """

    def __init__(
        self,
        params: Iterable[nn.Parameter],
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        shared: bool = False,
    ) -> None:
        self.param_groups: list[dict[str, Any]] = [
            {"params": list(params), "lr": lr, "betas": betas, "eps": eps}
        ]
        # The flat weights in shared memory, for the critic's worker process to read (see
        # learner/updates/critic_worker.py): allocated so from the start, as moving a tensor there
        # later would leave any numpy view of it pointing at freed memory.
        self.shared = shared
        self.steps = 0  # steps taken (torch keeps one count per parameter; they agree)
        self._flatten(torch.zeros(0), torch.zeros(0))

    @property
    def params(self) -> list[nn.Parameter]:
        return self.param_groups[0]["params"]  # type: ignore[no-any-return]

    @torch.no_grad()
    def _flatten(self, exp_avg: Tensor, exp_avg_sq: Tensor) -> None:
        """Move the parameters into one buffer; moments given flat (empty: zeros)."""
        params = self.params
        self.flat = torch.cat([p.detach().reshape(-1) for p in params])
        if self.shared:
            flat = shared_zeros(self.flat)
            self.shared = flat is not None
            if flat is not None:
                self.flat = flat.copy_(self.flat)
        # Both moments in one (2, n) buffer, so that a step updates them together: a
        # step's cost is mostly numpy's per-call overhead, not the arithmetic.
        self.moments = self.flat.new_zeros((2, self.flat.numel()))
        if exp_avg.numel():
            self.moments[0] = exp_avg
            self.moments[1] = exp_avg_sq
        self.exp_avg, self.exp_avg_sq = self.moments[0], self.moments[1]
        self.sizes = [p.numel() for p in params]
        for p, view in zip(params, self.views(self.flat), strict=True):
            p.data = view
        self._scratch = torch.empty_like(self.moments)  # the step's temporaries, reused
        self._arrays: tuple[Tensor, np.ndarray, np.ndarray] | None = None
        self._grad_seen: tuple[Tensor, np.ndarray] | None = None

    def views(self, flat: Tensor) -> list[Tensor]:
        """A flat tensor cut into one view per parameter, shaped like it."""
        return [t.view_as(p) for t, p in zip(flat.split(self.sizes), self.params, strict=True)]

    @property
    def state(self) -> dict[nn.Parameter, dict[str, Tensor]]:
        """torch's per-parameter view: step, and views of the flat moments (empty before
        the first step, as in torch)."""
        if self.steps == 0:
            return {}
        step = torch.tensor(float(self.steps))
        return {
            p: {"step": step, "exp_avg": m, "exp_avg_sq": v}
            for p, m, v in zip(
                self.params, self.views(self.exp_avg), self.views(self.exp_avg_sq), strict=True
            )
        }

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    def flat_grad(self) -> Tensor | None:
        """The gradients as one flat tensor (None when no parameter has one)."""
        grads = [p.grad for p in self.params]
        if all(g is None for g in grads):
            return None
        return torch.cat(
            [
                (g if g is not None else p.new_zeros(p.shape)).reshape(-1)
                for g, p in zip(grads, self.params, strict=True)
            ]
        )

    def step(self, grad: Tensor | None = None) -> None:
        """One step on ``grad`` (flat, as ``flat_grad`` gives it; default: the .grads).

        The arithmetic of ``torch.optim.Adam``'s single-tensor path on the flat tensors
        (``tests/test_optim.py`` holds them together step for step).
        """
        if grad is None:
            grad = self.flat_grad()
            if grad is None:
                return
        group = self.param_groups[0]
        (beta1, beta2), eps, lr = group["betas"], group["eps"], group["lr"]
        self.steps += 1
        if self.flat.device.type != "cpu":  # a twin on an accelerator (updates/device.py)
            torch_step(self.flat, self.moments, grad, beta1, beta2, eps, lr, self.steps)
            return
        # In numpy on views of the flat tensors: between the numpy gradients' calls the
        # same ops in torch cost about half again as much (dispatch), and ATen's fused
        # kernel is reachable only through a private function. Ten numpy calls: the
        # moments step together, and the bias corrections fold into two scalars,
        # lr sqrt(bc2) / bc1 * m / (sqrt(v) + eps sqrt(bc2)), which is torch's
        # lr / bc1 * m / (sqrt(v) / sqrt(bc2) + eps) rearranged.
        param, moments, scratch = self._numpy()
        seen = self._grad_seen
        if seen is None or seen[0] is not grad:  # the numpy gradients hand the same tensor
            seen = self._grad_seen = (grad, grad.numpy())
        g = seen[1]
        decay, gain = _beta_columns(beta1, beta2, moments.dtype)
        moments *= decay
        np.copyto(scratch[0], g)
        np.multiply(g, g, out=scratch[1])
        scratch *= gain
        moments += scratch
        bias_correction1 = 1.0 - beta1**self.steps
        bias_correction2_sqrt = math.sqrt(1.0 - beta2**self.steps)
        denom = scratch[0]
        np.sqrt(moments[1], out=denom)
        denom += eps * bias_correction2_sqrt
        np.divide(moments[0], denom, out=denom)
        denom *= -lr * bias_correction2_sqrt / bias_correction1
        param += denom

    def _numpy(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Numpy views of the flat weights, the moments and the scratch buffer (made again
        when the flat buffer was, by ``grow`` or a new optimizer state layout)."""
        if self._arrays is None or self._arrays[0] is not self.flat:
            self._arrays = (self.flat, self.flat.numpy(), self.moments.numpy())
            self._scratch_array = self._scratch.numpy()
        return self._arrays[1], self._arrays[2], self._scratch_array

    def grow(self, grown: list[tuple[nn.Parameter, nn.Parameter, int]]) -> None:
        """After ``Policy.register_agent`` replaced parameters with grown ones (old, new,
        dimension grown), optimize the new ones, their moments extended with zeros.
        Entries for parameters of other optimizers are ignored."""
        moments = dict(
            zip(
                self.params,
                zip(self.views(self.exp_avg), self.views(self.exp_avg_sq), strict=True),
                strict=True,
            )
        )
        grown = [(old, new, dim) for old, new, dim in grown if old in moments]
        if not grown:
            return  # none of this optimizer's parameters grew
        for old, new, dim in grown:
            self.param_groups[0]["params"] = [new if p is old else p for p in self.params]
            m, v = moments.pop(old)
            shape = list(m.shape)
            shape[dim] = new.shape[dim] - m.shape[dim]
            moments[new] = (
                torch.cat([m, m.new_zeros(shape)], dim),
                torch.cat([v, v.new_zeros(shape)], dim),
            )
        self._flatten(
            torch.cat([moments[p][0].reshape(-1) for p in self.params]),
            torch.cat([moments[p][1].reshape(-1) for p in self.params]),
        )

    def state_dict(self) -> dict[str, Any]:
        """torch.optim's layout: state by parameter index, groups with indices for params."""
        index = {p: i for i, p in enumerate(self.params)}
        group = {k: v for k, v in self.param_groups[0].items() if k != "params"}
        group["params"] = list(range(len(self.params)))
        return {
            "state": {
                index[p]: {k: t.clone() for k, t in s.items()} for p, s in self.state.items()
            },
            "param_groups": [group],
        }

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        (group,) = state["param_groups"]
        self.param_groups[0]["lr"] = group["lr"]
        self.param_groups[0]["betas"] = tuple(group["betas"])
        self.param_groups[0]["eps"] = group["eps"]
        entries = {int(i): s for i, s in state["state"].items()}
        if not entries:
            self.steps = 0
            self.exp_avg.zero_()
            self.exp_avg_sq.zero_()
            return
        if len(entries) != len(self.params):
            raise ValueError(
                f"optimizer state has {len(entries)} parameters, this optimizer {len(self.params)}"
            )
        self.steps = int(float(entries[0]["step"]))
        self.exp_avg.copy_(
            torch.cat([entries[i]["exp_avg"].reshape(-1) for i in range(len(entries))])
        )
        self.exp_avg_sq.copy_(
            torch.cat([entries[i]["exp_avg_sq"].reshape(-1) for i in range(len(entries))])
        )


@torch.no_grad()
def torch_step(
    flat: Tensor,
    moments: Tensor,
    grad: Tensor,
    beta1: float,
    beta2: float,
    eps: float,
    lr: float,
    steps: int,
) -> None:
    """``Adam.step``'s arithmetic in torch ops, for weights on an accelerator (where numpy
    cannot reach them): ``flat`` and ``moments`` (2, n) stepped in place on ``grad``."""
    exp_avg, exp_avg_sq = moments[0], moments[1]
    exp_avg.lerp_(grad, 1.0 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
    bias_correction1 = 1.0 - beta1**steps
    bias_correction2_sqrt = math.sqrt(1.0 - beta2**steps)
    denom = exp_avg_sq.sqrt().add_(eps * bias_correction2_sqrt)
    flat.addcdiv_(exp_avg, denom, value=-lr * bias_correction2_sqrt / bias_correction1)


@functools.cache  # a handful of (betas, dtype) per process
def _beta_columns(beta1: float, beta2: float, dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """(beta1, beta2) and (1 - beta1, 1 - beta2) as columns, one per moment (read-only)."""
    decay = np.array([[beta1], [beta2]], dtype=dtype)
    gain = np.array([[1.0 - beta1], [1.0 - beta2]], dtype=dtype)
    decay.flags.writeable = gain.flags.writeable = False
    return decay, gain


def shared_zeros(like: Tensor) -> Tensor | None:
    """Zeros shaped like ``like`` in memory PPO's critic process maps
    (``critic_worker.shared_array``); None, with a warning, where the system refuses."""
    try:
        array = critic_worker.shared_array(tuple(like.shape), like.numpy().dtype)
    except OSError as exc:
        warnings.warn(
            f"shared memory unavailable ({exc}); PPO's critic runs in the trainer's process",
            RuntimeWarning,
            stacklevel=2,
        )
        return None
    return torch.from_numpy(array)


def clip_grad_norm(grad: Tensor, max_norm: float) -> float:
    """Scale a flat gradient in place to an L2 norm of at most ``max_norm``; the norm before.

    ``nn.utils.clip_grad_norm_``'s formula (the same ``1e-6`` in the divisor) on the one
    flat tensor ``Adam.flat_grad`` gives, in numpy on its memory (see ``Adam.step``). A
    non-finite norm leaves the gradient as it is.
    """
    if grad.device.type != "cpu":  # on an accelerator: one read of the norm
        value = float(torch.linalg.vector_norm(grad))
        if math.isfinite(value) and value > max_norm:
            grad.mul_(max_norm / (value + 1e-6))
        return value
    g = grad.numpy()
    value = math.sqrt(float(g @ g))
    if math.isfinite(value) and value > max_norm:
        g *= max_norm / (value + 1e-6)
    return value
