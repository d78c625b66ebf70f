"""Adam, as torch.optim.Adam computes it, without torch.optim.

Why not ``torch.optim.Adam``: constructing any ``torch.optim.Optimizer`` imports
``torch._dynamo``, which costs 2-3 s on this project's 2-core machines, longer than a
whole CartPole training run (see docs/performance.md). This class is the same
arithmetic (bias-corrected moments, ``eps`` added after the square root, the order of
torch's single-tensor implementation) run as ``torch._foreach_*`` ops, one call per
stage for all parameters; ``tests/test_optim.py`` checks it step for step against
``torch.optim.Adam``. It keeps torch's attribute names (``param_groups``, ``state``)
and ``state_dict`` layout, so checkpoints written with either load in both.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor, nn


class Adam:
    def __init__(
        self,
        params: Iterable[nn.Parameter],
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
    ) -> None:
        self.param_groups: list[dict[str, Any]] = [
            {"params": list(params), "lr": lr, "betas": betas, "eps": eps}
        ]
        # Per parameter: step (a float tensor, as torch keeps it), exp_avg, exp_avg_sq.
        self.state: dict[nn.Parameter, dict[str, Tensor]] = {}
        self._counts: dict[nn.Parameter, int] = {}  # state[p]["step"] as an int

    @property
    def params(self) -> list[nn.Parameter]:
        return self.param_groups[0]["params"]  # type: ignore[no-any-return]

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    @torch.no_grad()
    def step(self) -> None:
        group = self.param_groups[0]
        lr, (beta1, beta2), eps = group["lr"], group["betas"], group["eps"]
        params = [p for p in self.params if p.grad is not None]
        if not params:
            return
        for p in params:
            if p not in self.state:
                self.state[p] = {
                    "step": torch.zeros((), dtype=torch.float32),
                    "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                    "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
                }
        states = [self.state[p] for p in params]
        grads = [p.grad for p in params if p.grad is not None]
        exp_avgs = [s["exp_avg"] for s in states]
        exp_avg_sqs = [s["exp_avg_sq"] for s in states]
        steps = [s["step"] for s in states]
        torch._foreach_add_(steps, 1.0)
        torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1 - beta2)
        # Step counts mirrored as Python ints (reading the tensors would cost a sync each).
        counts = self._counts
        for p in params:
            counts[p] = counts.get(p, 0) + 1
        # Parameters added later (register_agent) may be on another step count.
        for count in sorted({counts[p] for p in params}):
            idx = [i for i, p in enumerate(params) if counts[p] == count]
            bias_correction1 = 1 - beta1**count
            bias_correction2_sqrt = (1 - beta2**count) ** 0.5
            denom = torch._foreach_sqrt([exp_avg_sqs[i] for i in idx])
            torch._foreach_div_(denom, bias_correction2_sqrt)
            torch._foreach_add_(denom, eps)
            torch._foreach_addcdiv_(
                [params[i] for i in idx],
                [exp_avgs[i] for i in idx],
                denom,
                -lr / bias_correction1,
            )

    def grow(self, grown: list[tuple[nn.Parameter, nn.Parameter, int]]) -> None:
        """After ``Policy.register_agent`` replaced parameters with grown ones (old, new,
        dimension grown), optimize the new ones, their moments extended with zeros."""
        for old, new, dim in grown:
            self.param_groups[0]["params"] = [new if p is old else p for p in self.params]
            state = self.state.pop(old, None)
            count = self._counts.pop(old, None)
            if state is None or count is None:
                continue
            for key in ("exp_avg", "exp_avg_sq"):
                value = state[key]
                shape = list(value.shape)
                shape[dim] = new.shape[dim] - value.shape[dim]
                state[key] = torch.cat([value, value.new_zeros(shape)], dim)
            self.state[new] = state
            self._counts[new] = count

    def state_dict(self) -> dict[str, Any]:
        """torch.optim's layout: state by parameter index, groups with indices for params."""
        index = {p: i for i, p in enumerate(self.params)}
        group = {k: v for k, v in self.param_groups[0].items() if k != "params"}
        group["params"] = list(range(len(self.params)))
        return {
            "state": {index[p]: dict(s) for p, s in self.state.items()},
            "param_groups": [group],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        (group,) = state["param_groups"]
        self.param_groups[0]["lr"] = group["lr"]
        self.param_groups[0]["betas"] = tuple(group["betas"])
        self.param_groups[0]["eps"] = group["eps"]
        self.state = {
            self.params[int(i)]: {
                "step": torch.as_tensor(s["step"], dtype=torch.float32).clone(),
                "exp_avg": s["exp_avg"].clone(),
                "exp_avg_sq": s["exp_avg_sq"].clone(),
            }
            for i, s in state["state"].items()
        }
        self._counts = {p: int(s["step"]) for p, s in self.state.items()}


@torch.no_grad()
def clip_grad_norm(params: list[nn.Parameter], max_norm: float) -> float:
    """Scale the gradients to a global L2 norm of at most ``max_norm``; the norm before.

    ``nn.utils.clip_grad_norm_`` with the same ``1e-6`` in the divisor, minus its grouping
    of tensors by device and dtype, which measured half of its 200 us per call on a
    two-layer MLP. A non-finite norm leaves the gradients as they are.
    """
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return 0.0
    norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
    value = float(norm)
    if math.isfinite(value) and value > max_norm:
        torch._foreach_mul_(grads, max_norm / (value + 1e-6))
    return value
