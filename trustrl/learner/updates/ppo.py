"""The PPO update step: shuffled minibatch epochs over one rollout -> metrics.

The loop is ``PPOUpdate.__call__``; the formulas are losses.py's (``policy_terms``,
``value_terms``), which the gradient backend (grads.py: autograd, or their numpy twins
with a hand-written backward pass) evaluates, one call per minibatch.

Two optimizer settings share the loop. Shared (the CleanRL/SB3 habit): one Adam over
all weights, loss = policy - ent_coef * entropy + vf_coef * value, and a KL stop ends
the whole update. Separate (Spinning Up and the multi-agent kernel): an actor Adam
at ``pi_lr`` and a critic Adam at ``vf_lr``; the critic keeps fitting for its own
``vf_epochs`` after the policy stopped on KL.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from trustrl.config import ConfigError, PPOConfig
from trustrl.learner.losses import explained_variance
from trustrl.learner.optim import Adam, clip_grad_norm
from trustrl.learner.policy import Policy
from trustrl.learner.rollout import Rollout
from trustrl.learner.updates.grads import (
    LOSS_TERMS,
    Gradients,
    Grads,
    LossSettings,
    Terms,
    critic_process_possible,
    make_gradients,
    warn_skipped,
)


class PPOUpdate:
    """The PPO update (Schulman et al. 2017): minibatch epochs of the clipped surrogate,
    the value loss and the entropy bonus on one rollout, with KL early stopping and
    learning-rate and clip annealing. Owns the optimizers and the gradient backend
    (``grads.py``: autograd, or the numpy gradients for MLP policies); the trainer calls it
    once per iteration with the rollout and the run's progress, and logs the flat dict of
    metrics it returns."""

    def __init__(self, policy: Policy, config: PPOConfig, seed: int = 0) -> None:
        self.config = config
        self.generator = torch.Generator().manual_seed(seed)
        self.optimizers: dict[str, Adam]
        self.base_lr: dict[str, float]
        # The critic's share of each minibatch in a second process (critic_worker.py):
        # weights and gradients then live in shared memory.
        shared = config.critic_process and critic_process_possible(policy, config.grad_backend)
        # eps=1e-5 rather than Adam's 1e-8: the value of OpenAI baselines' PPO2, kept by
        # CleanRL; it damps steps on weights whose gradients are consistently tiny.
        if config.separate_optimizers and policy.share_encoder:
            raise ConfigError(
                "policy.share_encoder trains one encoder with both losses: it needs PPO's "
                "shared loss (unset ppo.pi_lr and ppo.vf_lr) or share_encoder = false"
            )
        if config.separate_optimizers:
            assert config.pi_lr is not None and config.vf_lr is not None
            self.base_lr = {"pi": config.pi_lr, "vf": config.vf_lr}
            self.optimizers = {
                "pi": Adam(policy.actor_parameters(), config.pi_lr, eps=1e-5, shared=shared),
                "vf": Adam(policy.critic_parameters(), config.vf_lr, eps=1e-5, shared=shared),
            }
        else:
            self.base_lr = {"all": config.learning_rate}
            self.optimizers = {
                "all": Adam(policy.parameters(), config.learning_rate, eps=1e-5, shared=shared)
            }
        # Where the system refused shared memory, the optimizers fell back (with a warning).
        self.critic_process = shared and all(o.shared for o in self.optimizers.values())
        self.gradients: Gradients = make_gradients(
            policy,
            LossSettings.of(config),
            self.optimizers,
            self.critic_process,
            config.grad_backend,
        )

    def close(self) -> None:
        """Stop the critic's worker process, if one runs (the next call starts another)."""
        self.gradients.close()

    def register_agent(self, grown: list[tuple[nn.Parameter, nn.Parameter, int]]) -> None:
        """Extend optimizer state for parameters that ``Policy.register_agent`` grew."""
        for optimizer in self.optimizers.values():
            optimizer.grow(grown)

    def state_dict(self) -> dict[str, Any]:
        return {
            "optimizers": {k: opt.state_dict() for k, opt in self.optimizers.items()},
            "generator": self.generator.get_state(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key, opt in self.optimizers.items():
            opt.load_state_dict(state["optimizers"][key])
        self.generator.set_state(state["generator"])

    def __call__(self, policy: Policy, rollout: Rollout, progress: float) -> dict[str, float]:
        """One update on a rollout whose advantages are computed; ``progress`` in [0, 1)."""
        cfg = self.config
        remaining = 1.0 - progress
        for key, opt in self.optimizers.items():
            lr = self.base_lr[key] * (remaining if cfg.anneal_lr else 1.0)
            for group in opt.param_groups:
                group["lr"] = lr
        clip_coef = cfg.clip_coef * (remaining if cfg.anneal_clip else 1.0)

        batch = rollout.training_batch().to(policy.device)
        batch.returns, batch.values = policy.value_targets(batch.returns, batch.values, batch.loss)
        separate = cfg.separate_optimizers
        pi_epochs = cfg.update_epochs
        vf_epochs = (cfg.vf_epochs or cfg.update_epochs) if separate else pi_epochs

        pi_stopped, stop_iter = False, pi_epochs
        epoch_stats: list[dict[str, list[float]]] = []
        skipped: dict[str, int] = {}
        clip_fractions: list[float] = []
        grads = self.gradients
        for epoch in range(max(pi_epochs, vf_epochs)):
            if not ((epoch < pi_epochs and not pi_stopped) or (epoch < vf_epochs and separate)):
                break
            stats: dict[str, list[float]] = {name: [] for name in EPOCH_MEANS}
            epoch_stats.append(stats)
            for mb in grads.minibatches(batch, cfg.num_minibatches, self.generator):
                fit_pi = epoch < pi_epochs and not pi_stopped
                fit_vf = epoch < vf_epochs and (separate or not pi_stopped)
                if not (fit_pi or fit_vf):
                    break
                terms, mb_grads = grads.step(
                    mb,
                    fit_policy=fit_pi,
                    fit_value=fit_vf,
                    clip_coef=clip_coef,
                    target_kl=cfg.target_kl,
                )
                if fit_pi:
                    stats["approx_kl"].append(terms["approx_kl"])
                    if terms["kl_stop"]:  # this step's policy term is not taken
                        pi_stopped, stop_iter = True, epoch + 1
                        if not separate:
                            break
                    else:
                        clip_fractions.append(terms["clip_fraction"])
                self._step(terms, mb_grads, stats, skipped)
        grads.rest()

        warn_skipped(skipped)

        metrics = _summarize(epoch_stats)
        metrics.update(
            clip_fraction=_mean(clip_fractions),
            explained_variance=explained_variance(
                batch.loss(batch.values), batch.loss(batch.returns)
            ),
            stop_iter=float(stop_iter),
            learning_rate=self.optimizers["pi" if separate else "all"].param_groups[0]["lr"],
            clip_coef=clip_coef,
            nonfinite_skips=float(sum(skipped.values())),
        )
        if separate:
            metrics["vf_learning_rate"] = self.optimizers["vf"].param_groups[0]["lr"]
        return metrics

    def _step(
        self, terms: Terms, grads: Grads, stats: dict[str, list[float]], skipped: dict[str, int]
    ) -> None:
        """A step of each optimizer with a gradient, unless a loss term or that gradient is
        non-finite (counted in ``skipped`` and left out)."""
        bad = False
        for term in LOSS_TERMS:
            value = terms.get(term)
            if value is not None and not math.isfinite(value):
                skipped[term] = skipped.get(term, 0) + 1
                bad = True
        if bad:
            return
        for term in LOSS_TERMS:
            if term in terms:
                stats[term].append(terms[term])
        for key, opt in self.optimizers.items():
            if key not in grads:
                continue
            norm = clip_grad_norm(grads[key], self.config.max_grad_norm)
            if not math.isfinite(norm):
                skipped["gradient"] = skipped.get("gradient", 0) + 1
                continue
            opt.step(grads[key])


# What each epoch collects per minibatch step: the loss terms and the KL measured.
EPOCH_MEANS = (*LOSS_TERMS, "approx_kl")


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def _summarize(epoch_stats: list[dict[str, list[float]]]) -> dict[str, float]:
    """Last-epoch means, and their change since the first epoch (the seed kernel's deltas)."""

    def first_last(key: str) -> tuple[float, float]:
        epochs = [s[key] for s in epoch_stats if s[key]]
        if not epochs:
            return float("nan"), float("nan")
        return _mean(epochs[0]), _mean(epochs[-1])

    metrics: dict[str, float] = {}
    for name in ("loss_pi", "loss_v"):
        first, last = first_last(name)
        metrics[name], metrics[f"delta_{name}"] = last, last - first
    for name in ("approx_kl", "entropy"):
        metrics[name] = first_last(name)[1]
    return metrics
