"""The TRPO update step (Schulman et al. 2015): natural gradient under a hard KL bound.

Policy: g = grad of the surrogate mean(r A); solve (F + damping I) x = g by conjugate
gradient, where F v is the gradient of (grad KL . v) and F is never formed; scale x to
the KL radius, then backtrack until the measured mean KL is within ``max_kl`` and the
surrogate improved. If no try is accepted, the actor is restored bit for bit.
Critic: fitted separately by Adam on minibatches, on the same returns as PPO.

A step whose loss or gradient is non-finite is skipped and counted in ``nonfinite_skips``
(with a warning), as PPO skips its minibatch steps. A rollout on which no critic step was
finite trains no policy either, as a PPO minibatch with a non-finite term trains nothing:
both losses are then reported NaN, and the trainer stops after a few such iterations in a
row (``run/trainer.py``'s ``FAILED_UPDATES_LIMIT``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.nn.utils import parameters_to_vector

from trustrl.config import ConfigError, TRPOConfig
from trustrl.learner.losses import explained_variance, normalize_advantages, surrogate
from trustrl.learner.optim import Adam
from trustrl.learner.policy import Policy
from trustrl.learner.rollout import Batch, Rollout
from trustrl.learner.updates.grads import LossSettings, make_gradients, warn_skipped


def conjugate_gradient(
    matvec: Callable[[Tensor], Tensor], b: Tensor, iters: int, residual_tol: float = 1e-10
) -> tuple[Tensor, float]:
    """Solve A x = b for symmetric positive-definite A given only x -> A x.

    Returns x and the final squared residual norm |b - A x|^2 (stops once below the tol).
    """
    x = torch.zeros_like(b)
    r = b.clone()
    p = b.clone()
    rr = torch.dot(r, r)
    for _ in range(iters):
        if rr <= residual_tol:
            break
        ap = matvec(p)
        alpha = rr / torch.dot(p, ap)
        x += alpha * p
        r -= alpha * ap
        rr_new = torch.dot(r, r)
        p = r + (rr_new / rr) * p
        rr = rr_new
    return x, float(rr)


def backtracking_line_search(
    evaluate: Callable[[Tensor], tuple[float, float]],
    theta: Tensor,
    full_step: Tensor,
    base_objective: float,
    max_kl: float,
    shrink: float,
    tries: int,
) -> tuple[int, Tensor | None]:
    """Try theta + shrink^i * full_step for i = 0, 1, ...; accept the first whose
    ``evaluate`` (objective, kl) has kl <= max_kl and objective > base_objective.

    Returns (tries used, accepted parameters) or (tries, None) if none was accepted.
    """
    for i in range(tries):
        candidate = theta + (shrink**i) * full_step
        objective, kl = evaluate(candidate)
        if math.isfinite(objective) and kl <= max_kl and objective > base_objective:
            return i + 1, candidate
    return tries, None


def fisher_vector_product(
    policy: Policy,
    obs: Tensor,
    mask: Tensor | None,
    old_params: Tensor,
    damping: float,
    agent: Tensor | None = None,
    batch: Batch | None = None,
) -> Callable[[Tensor], Tensor]:
    """v -> (F + damping I) v at the current actor, F the Hessian of mean KL(old || new).

    The Fisher is the Hessian of the KL at zero divergence; Hessian times v is the
    gradient of (grad KL . v). The forward pass and the first backward (with its graph)
    are built once here, for every product of the conjugate gradient (the weights do not
    move within it): each product is then one backward pass through that graph.
    """
    params = policy.actor_parameters()
    # A recurrent policy's rows are ``batch``'s sequence chunks, averaged over its real steps.
    sequences = batch.sequences if batch is not None else None
    kl = policy.head.kl(old_params, policy.dist_params(obs, mask, agent, sequences=sequences))
    kl = (batch.loss(kl) if batch is not None else kl).mean()
    grads = torch.autograd.grad(kl, params, create_graph=True)
    flat = torch.cat([g.reshape(-1) for g in grads])

    def product(v: Tensor) -> Tensor:
        hv = torch.autograd.grad(flat, params, grad_outputs=v, retain_graph=True)
        return torch.cat([h.reshape(-1) for h in hv]) + damping * v

    return product


@torch.no_grad()
def assign(params: list[torch.nn.Parameter], flat: Tensor) -> None:
    """Copy a flat vector into the parameters (in place: they stay independent tensors,
    unlike torch's vector_to_parameters, which makes them views of the vector)."""
    offset = 0
    for param in params:
        count = param.numel()
        param.copy_(flat[offset : offset + count].view_as(param))
        offset += count


class TRPOUpdate:
    """The TRPO update (Schulman et al. 2015): one natural-gradient policy step, the
    direction by conjugate gradient on Fisher-vector products, scaled to the KL radius and
    accepted by a backtracking line search only if the measured KL stays within it and the
    surrogate improves; then the critic fitted by Adam in minibatch passes. Called by the
    trainer exactly as ``PPOUpdate`` is."""

    def __init__(self, policy: Policy, config: TRPOConfig, seed: int = 0) -> None:
        if policy.share_encoder:
            raise ConfigError(
                "policy.share_encoder: TRPO steps the actor within a KL radius and fits the "
                "critic apart, so they cannot share an encoder (set it to false)"
            )
        self.config = config
        self.generator = torch.Generator().manual_seed(seed)
        self.vf_optimizer = Adam(policy.critic_parameters(), lr=config.vf_lr, eps=1e-5)
        # The critic's plain squared error, by the PPO update's gradient backends.
        self.gradients = make_gradients(policy, LossSettings(), {"vf": self.vf_optimizer})

    def close(self) -> None:
        """Nothing to release: TRPO's update runs in this process only."""

    def register_agent(
        self, grown: list[tuple[torch.nn.Parameter, torch.nn.Parameter, int]]
    ) -> None:
        """Extend the critic optimizer's state for parameters ``Policy.register_agent`` grew."""
        self.vf_optimizer.grow(grown)

    def state_dict(self) -> dict[str, Any]:
        return {
            "optimizers": {"vf": self.vf_optimizer.state_dict()},
            "generator": self.generator.get_state(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.vf_optimizer.load_state_dict(state["optimizers"]["vf"])
        self.generator.set_state(state["generator"])

    def __call__(self, policy: Policy, rollout: Rollout, progress: float) -> dict[str, float]:
        batch = rollout.training_batch().to(policy.device)
        batch.returns, batch.values = policy.value_targets(batch.returns, batch.values, batch.loss)
        skipped: dict[str, int] = {}
        # The critic first (the two touch disjoint weights, so the order changes no number):
        # where none of its steps was finite, the policy is not stepped on the rollout.
        critic = self.fit_critic(policy, batch, skipped)
        if math.isfinite(critic["loss_v"]):
            radius = self.config.max_kl * ((1.0 - progress) if self.config.anneal_kl else 1.0)
            metrics = self.policy_step(policy, batch, radius)
            if not math.isfinite(metrics["loss_pi"]):
                skipped["loss_pi"] = 1
        else:
            metrics = dict(NO_POLICY_STEP)
        metrics.update(critic)
        metrics["explained_variance"] = explained_variance(
            batch.loss(batch.values), batch.loss(batch.returns)
        )
        metrics["learning_rate"] = self.config.vf_lr
        metrics["nonfinite_skips"] = float(sum(skipped.values()))
        warn_skipped(skipped)
        return metrics

    def policy_step(
        self, policy: Policy, batch: Batch, max_kl: float | None = None
    ) -> dict[str, float]:
        """The natural-gradient step within the KL radius ``max_kl`` (default: the
        config's); a non-finite objective, gradient or curvature skips it (``loss_pi`` is
        then NaN)."""
        cfg = self.config
        max_kl = cfg.max_kl if max_kl is None else max_kl
        params = policy.actor_parameters()
        # A recurrent policy's rows are sequence chunks: every mean is over their real
        # steps (batch.loss; all rows otherwise).
        rows, sequences = batch.loss, batch.sequences
        advantages = rows(batch.advantages)
        advantages = normalize_advantages(advantages) if cfg.norm_adv else advantages
        old_logprob = rows(batch.logprob)
        with torch.no_grad():
            old_params = policy.dist_params(
                batch.obs, batch.action_mask, batch.agent, sequences=sequences
            )
            entropy = float(rows(policy.head.entropy(old_params)).mean())

        def actor_params() -> Tensor:
            return policy.dist_params(
                batch.obs, batch.action_mask, batch.agent, sequences=sequences
            )

        new_params = actor_params()
        logprob = rows(policy.head.log_prob(new_params, batch.actions))
        objective = surrogate(logprob, old_logprob, advantages)
        grads = torch.autograd.grad(objective, params)
        g = torch.cat([grad.reshape(-1) for grad in grads])
        base = objective.item()

        fvp = fisher_vector_product(
            policy, batch.obs, batch.action_mask, old_params, cfg.cg_damping, batch.agent, batch
        )
        direction, residual = conjugate_gradient(fvp, g, cfg.cg_iters, cfg.cg_residual_tol)
        curvature = float(torch.dot(direction, fvp(direction)))
        # Largest step along the direction whose quadratic KL model equals max_kl:
        # 0.5 * s^T F s = max_kl.
        scale = math.sqrt(2 * max_kl / curvature) if curvature > 0 else 0.0
        full_step = scale * direction
        expected_full = float(torch.dot(g, full_step))

        theta = parameters_to_vector(params).detach().clone()

        @torch.no_grad()
        def evaluate(candidate: Tensor) -> tuple[float, float]:
            assign(params, candidate)
            new_params = actor_params()
            logprob = rows(policy.head.log_prob(new_params, batch.actions))
            kl = rows(policy.head.kl(old_params, new_params)).mean()
            return float(surrogate(logprob, old_logprob, advantages)), float(kl)

        finite = all(math.isfinite(v) for v in (base, expected_full, curvature))
        tries, accepted = (0, None)
        if scale > 0 and finite:
            tries, accepted = backtracking_line_search(
                evaluate,
                theta,
                full_step,
                base,
                max_kl,
                cfg.line_search_shrink,
                cfg.line_search_steps,
            )
        if accepted is None:
            # Restore the exact old weights (a copy, no arithmetic): bit-identical.
            assign(params, theta)
            new_objective, kl, step_norm, fraction = base, 0.0, 0.0, 0.0
        else:
            new_objective, kl = evaluate(accepted)
            step_norm = float((accepted - theta).norm())
            fraction = cfg.line_search_shrink ** (tries - 1)
        return {
            "loss_pi": -base if finite else math.nan,
            "delta_loss_pi": -(new_objective - base),
            "actual_improvement": new_objective - base,
            "expected_improvement": expected_full * fraction,
            "approx_kl": kl,
            "line_search_steps": float(tries),
            "line_search_accepted": float(accepted is not None),
            "cg_residual": residual,
            "step_norm": step_norm,
            "entropy": entropy,
        }

    def fit_critic(self, policy: Policy, batch: Batch, skipped: dict[str, int]) -> dict[str, float]:
        """Adam on the value loss over minibatch epochs; a step whose loss or gradient is
        non-finite is skipped (counted in ``skipped``)."""
        cfg = self.config
        grads = self.gradients
        epoch_losses: list[float] = []
        for _ in range(cfg.train_vf_iters):
            losses = []
            for mb in grads.minibatches(batch, cfg.minibatches, self.generator):
                terms, mb_grads = grads.step(mb, fit_policy=False, fit_value=True)
                value, grad = terms["loss_v"], mb_grads["vf"]
                if not math.isfinite(value):
                    skipped["loss_v"] = skipped.get("loss_v", 0) + 1
                    continue
                if not bool(torch.isfinite(grad).all()):
                    skipped["gradient"] = skipped.get("gradient", 0) + 1
                    continue
                self.vf_optimizer.step(grad)
                losses.append(value)
            if losses:
                epoch_losses.append(sum(losses) / len(losses))
        if not epoch_losses:
            return {"loss_v": math.nan, "delta_loss_v": math.nan}
        return {"loss_v": epoch_losses[-1], "delta_loss_v": epoch_losses[-1] - epoch_losses[0]}


# The policy metrics of an update that took no policy step because no critic step was
# finite: the losses NaN (as for a PPO update none of whose steps was taken), no step.
NO_POLICY_STEP = {
    "loss_pi": math.nan,
    "delta_loss_pi": math.nan,
    "actual_improvement": math.nan,
    "expected_improvement": math.nan,
    "approx_kl": math.nan,
    "line_search_steps": 0.0,
    "line_search_accepted": 0.0,
    "cg_residual": math.nan,
    "step_norm": 0.0,
    "entropy": math.nan,
}
