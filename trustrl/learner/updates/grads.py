"""One minibatch's loss terms and gradients, by autograd or by hand in numpy.

A backend's one call, ``step(mb, fit_policy=..., fit_value=..., clip_coef=...,
target_kl=...)``, returns the minibatch's named terms (losses.py) and the flat gradient
(in each optimizer's layout) of every optimizer whose loss has a fitted term. Nothing is
kept from one call to the next that could make a later call's answer depend on the
order of earlier ones; the gradient tensors are the backend's buffers, valid until its
next ``step``.

* ``TorchGradients`` runs autograd on the losses of losses.py. It serves every policy
  (per-agent actors, agent ids, global-state critics) and is the reference.
* ``NumpyGradients`` does the same arithmetic with the numpy twins (kernels.py for the
  MLPs, distributions.py for the heads, losses.py for the losses) and a hand-written
  backward pass, for the policies single-agent training uses: MLP actor and critic on
  the observation, categorical, multi-categorical or diagonal Gaussian head. Why by hand:
  a CartPole-sized minibatch step is some 550 small torch ops (autograd's included) at a
  few microseconds of dispatch each, several times the arithmetic; numpy's per-op cost is
  about a microsecond and the backward of an MLP is a handful of matmuls. Its weights and
  gradients are numpy views of the optimizers' flat torch buffers (optim.py): no copies.
  ``tests/test_grads.py`` holds its terms and gradients equal to ``TorchGradients``.

The KL stop is inside the call because it decides what the call fits: where the policy's
``approx_kl`` exceeds ``target_kl``, the policy terms are reported but not fitted
(``kl_stop`` is 1), so that step is never taken (it is checked before the step it
would overshoot, not after: the multi-agent seed kernel's mistake).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import numpy as np
import torch
from torch import Tensor, nn

import trustrl.learner.updates.critic_worker as critic_worker
from trustrl.acting import kernels
from trustrl.config import ConfigError, PPOConfig
from trustrl.learner.heads import (
    CategoricalHead,
    DiagGaussianHead,
    MultiCategoricalHead,
)
from trustrl.learner.losses import policy_terms, value_terms
from trustrl.learner.optim import Adam, shared_zeros
from trustrl.learner.policy import Policy
from trustrl.learner.rollout import Batch, NumpyBatch
from trustrl.learner.updates.critic_worker import CriticShare, CriticWorker
from trustrl.learner.warn import warn

Terms = dict[str, float]
Grads = dict[str, Tensor]
GradBackend = Literal["auto", "numpy", "torch"]

# The loss terms a step's terms may hold (the rest are diagnostics), named as in the
# progress file.
LOSS_TERMS = ("loss_pi", "entropy", "loss_v")


class Gradients(Protocol):
    """One minibatch step's losses and gradients, written into the optimizers' buffers:
    the backend the PPO update steps with. ``TorchGradients`` (autograd, every policy) is
    the reference; ``NumpyGradients`` computes the same by hand for MLP policies, where
    torch's per-op overhead outweighs the arithmetic (``ppo.grad_backend`` picks)."""

    def minibatches(self, batch: Batch, count: int, generator: torch.Generator) -> Iterator[Any]:
        """One epoch of ``batch``'s minibatches (``Batch.minibatches``), in the form this
        backend's ``step`` takes."""

    def step(
        self,
        mb: Any,
        *,
        fit_policy: bool,
        fit_value: bool,
        clip_coef: float | None = None,
        target_kl: float | None = None,
    ) -> tuple[Terms, Grads]:
        """A minibatch's terms (the loss terms of what was fitted, ``LOSS_TERMS``, and the
        diagnostics ``approx_kl``, ``clip_fraction``, ``kl_stop``) and the flat gradient
        of each optimizer whose loss has a fitted term: ``loss_pi - ent_coef * entropy``
        for the actor's, ``loss_v`` for the critic's (times ``vf_coef`` where one
        optimizer holds both)."""

    def rest(self) -> None:
        """The update is over (a hint: a critic worker stops waiting for work)."""

    def close(self) -> None:
        """Release what the backend holds (a critic worker process)."""


@dataclass(frozen=True)
class LossSettings:
    """What the losses need of the algorithm's config (defaults: a plain value fit)."""

    ent_coef: float = 0.0
    vf_coef: float = 0.5
    vf_clip_coef: float | None = None
    norm_adv: bool = True

    @classmethod
    def of(cls, config: PPOConfig) -> LossSettings:
        return cls(config.ent_coef, config.vf_coef, config.vf_clip_coef, config.norm_adv)


def warn_skipped(skipped: dict[str, int]) -> None:
    """Say which loss terms (or gradients) were non-finite, and how often: an update
    skips those steps (counted in its ``nonfinite_skips``) and goes on."""
    if skipped:
        detail = ", ".join(f"{term} ({count}x)" for term, count in skipped.items())
        warn(
            f"non-finite loss term: {detail}; those steps were skipped and training goes "
            "on from the last good weights",
            RuntimeWarning,
            stacklevel=3,
        )


def make_gradients(
    policy: Policy,
    config: LossSettings,
    optimizers: dict[str, Adam],
    shared: bool = False,
    backend: GradBackend = "auto",
) -> Gradients:
    """The gradient backend ``backend`` names (``ppo.grad_backend``): "auto" takes the
    numpy one where it covers the policy and autograd otherwise. ``optimizers`` may hold
    only some of the policy's weights (TRPO's critic): the others get no gradient.
    ``shared``: gradients in shared memory and the critic's share in a worker process
    (numpy only; needs optimizers built with ``shared=True``)."""
    if backend == "torch":
        return TorchGradients(policy, config, optimizers)
    reason = NumpyGradients.unsupported(policy)
    if reason is None:
        return NumpyGradients(policy, config, optimizers, shared)
    if backend == "numpy":
        raise ConfigError(
            f'ppo.grad_backend = "numpy" cannot train this policy: {reason} (the numpy '
            "gradients cover MLP policies of one agent on its own observation); use "
            '"auto" or "torch"'
        )
    return TorchGradients(policy, config, optimizers)


def _owner(optimizers: dict[str, Adam], param: nn.Parameter) -> str | None:
    """The key of the optimizer that holds ``param``, if one does."""
    for key, opt in optimizers.items():
        if any(p is param for p in opt.params):
            return key
    return None


def _kl_stop(kl: float, target_kl: float | None) -> bool:
    # A NaN KL does not stop: its terms are non-finite and the update skips the step.
    return target_kl is not None and kl > target_kl


class TorchGradients:
    """Autograd on the Policy (every policy)."""

    def __init__(self, policy: Policy, config: LossSettings, optimizers: dict[str, Adam]) -> None:
        self.policy, self.config, self.optimizers = policy, config, optimizers
        self.actor_key = _owner(optimizers, policy.actor_parameters()[0])
        self.critic_key = _owner(optimizers, policy.critic_parameters()[0])

    def minibatches(self, batch: Batch, count: int, generator: torch.Generator) -> Iterator[Batch]:
        return batch.minibatches(count, generator)

    def step(
        self,
        mb: Batch,
        *,
        fit_policy: bool,
        fit_value: bool,
        clip_coef: float | None = None,
        target_kl: float | None = None,
    ) -> tuple[Terms, Grads]:
        cfg, policy = self.config, self.policy
        terms: Terms = {}
        losses: dict[str, Tensor] = {}  # each optimizer's loss
        # A shared encoder runs once for the actor and the critic (policy.share_encoder).
        # A recurrent policy's rows are sequence chunks (mb.sequences); the losses average
        # over the chunks' real, valid steps (mb.loss).
        sequences = mb.sequences
        features = policy.features(mb.obs, mb.agent, sequences) if policy.share_encoder else None
        if fit_policy:
            assert clip_coef is not None and self.actor_key is not None
            params = policy.dist_params(mb.obs, mb.action_mask, mb.agent, features, sequences)
            logprob = mb.loss(policy.head.log_prob(params, mb.actions))
            # Reported, not trained on, without an entropy bonus: out of the backward pass.
            with torch.set_grad_enabled(bool(cfg.ent_coef)):
                entropy = mb.loss(policy.head.entropy(params))
            named = policy_terms(
                logprob,
                mb.loss(mb.logprob),
                mb.loss(mb.advantages),
                entropy,
                clip_coef,
                cfg.norm_adv,
            )
            with torch.no_grad():  # one synchronizing read for all four
                terms.update(zip(named, torch.stack(list(named.values())).tolist(), strict=True))
            stop = _kl_stop(terms["approx_kl"], target_kl)
            terms["kl_stop"] = float(stop)
            if stop:
                del terms["loss_pi"], terms["entropy"]
            else:
                loss = named["loss_pi"]
                losses[self.actor_key] = (
                    loss - cfg.ent_coef * named["entropy"] if cfg.ent_coef else loss
                )
        if fit_value:
            assert self.critic_key is not None
            values = mb.loss(policy.value_raw(mb.obs, mb.critic_obs, mb.agent, features, sequences))
            value = value_terms(values, mb.loss(mb.values), mb.loss(mb.returns), cfg.vf_clip_coef)[
                "loss_v"
            ]
            terms["loss_v"] = float(value.detach())
            # vf_coef weighs the value term where one optimizer holds both networks.
            scaled = value * cfg.vf_coef if self.critic_key == self.actor_key else value
            prior = losses.get(self.critic_key)
            losses[self.critic_key] = scaled if prior is None else prior + scaled
        grads: Grads = {}
        for key, loss in losses.items():
            opt = self.optimizers[key]
            opt.zero_grad(set_to_none=True)
            loss.backward()
            grad = opt.flat_grad()
            assert grad is not None
            grads[key] = grad
        return terms, grads

    def rest(self) -> None:
        """Nothing runs between updates."""

    def close(self) -> None:
        """Nothing to release."""


class NumpyGradients:
    """The same terms and gradients in numpy, for MLP policies on single observations."""

    @staticmethod
    def unsupported(policy: Policy) -> str | None:
        """Why this backend cannot serve ``policy``, or None where it can."""
        head = policy.head
        if policy.device.type != "cpu":
            return f"its update runs on {policy.device.type} (device), where numpy cannot reach"
        if policy.state_size:
            return "it has memory (policy.memory)"
        if policy.share_encoder:
            return "its actor and critic share an encoder"
        if policy.spec.obs_entries:  # rows of frames, one-hots or Dict entries
            return "its observations are structured (an image, Dict, Tuple or Discrete one)"
        if policy.config.encoder != "mlp":  # the backward pass is the MLP's (kernels.backward)
            return f"its encoder is {policy.config.encoder!r}, not the MLP"
        if policy.per_agent:
            return "it has one actor per agent"
        if policy.agent_id:
            return "its networks read an agent id"
        if policy.critic_dim is not None:
            return "its critic reads a global state"
        if not isinstance(head, CategoricalHead | MultiCategoricalHead | DiagGaussianHead):
            return f"its action head is a {type(head).__name__}"
        if isinstance(head, DiagGaussianHead) and head.log_std.dim() != 1:
            return "its Gaussian log-std is not one vector"
        if policy.config.activation not in ("tanh", "relu"):
            return f"its activation is {policy.config.activation}"
        return None

    @staticmethod
    def supports(policy: Policy) -> bool:
        return NumpyGradients.unsupported(policy) is None

    def __init__(
        self,
        policy: Policy,
        config: LossSettings,
        optimizers: dict[str, Adam],
        shared: bool = False,
    ) -> None:
        assert self.supports(policy)
        self.policy, self.config, self.optimizers = policy, config, optimizers
        # Flat gradients in shared memory, where a CriticWorker writes the critic's.
        self.shared = shared
        self.worker: CriticWorker | None = None
        self.worker_lost = False
        self.activation = policy.config.activation
        self.actor_modules = [m for m in policy.actor.modules() if isinstance(m, nn.Linear)]
        head: Any = policy.head
        self.actor_modules.append(head.linear)
        self.critic_modules = [m for m in policy.critic.modules() if isinstance(m, nn.Linear)]
        self._batch: tuple[Batch, NumpyBatch] | None = None  # the last batch, as numpy
        self._flats: tuple[Tensor, ...] = ()
        self._bind()

    def _bind(self) -> None:
        """Numpy views of the current weights and of one flat gradient buffer per optimizer.
        The buffers move when an optimizer grows or is built anew, so every ``step`` checks
        (while every optimizer keeps its flat buffer, the views made last time hold)."""
        flats = tuple(opt.flat for opt in self.optimizers.values())
        if len(flats) == len(self._flats) and all(
            a is b for a, b in zip(flats, self._flats, strict=True)
        ):
            return
        self._flats = flats
        self.close()  # a worker's views are of the old buffers

        def dense(modules: list[nn.Linear]) -> list[kernels.Dense]:
            return [
                kernels.Dense(m.weight.detach().numpy(), m.bias.detach().numpy(), copy=False)
                for m in modules
            ]

        self.actor = dense(self.actor_modules)
        self.critic = dense(self.critic_modules)
        head: Any = self.policy.head
        spec = self.policy.spec
        log_std = head.log_std.detach().numpy() if isinstance(head, DiagGaussianHead) else None
        self.head = kernels.numpy_head(spec.action_kind, spec.nvec, log_std)
        self.flat_grads: dict[str, Tensor] = {}
        grad_of: dict[int, tuple[str, np.ndarray]] = {}
        for key, opt in self.optimizers.items():
            flat = shared_zeros(opt.flat) if self.shared else None  # before any view
            if flat is None:
                self.shared = False
                flat = torch.zeros_like(opt.flat)
            self.flat_grads[key] = flat
            for param, view in zip(opt.params, opt.views(flat), strict=True):
                grad_of[id(param)] = (key, view.numpy())

        def grads(
            modules: list[nn.Linear],
        ) -> tuple[str | None, list[tuple[np.ndarray, np.ndarray]]]:
            if id(modules[0].weight) not in grad_of:
                return None, []  # a network no optimizer here trains
            key = grad_of[id(modules[0].weight)][0]
            return key, [(grad_of[id(m.weight)][1], grad_of[id(m.bias)][1]) for m in modules]

        self.actor_key, self.actor_grads = grads(self.actor_modules)
        self.critic_key, self.critic_grads = grads(self.critic_modules)
        owned = log_std is not None and id(head.log_std) in grad_of  # not TRPO's critic fit
        self.log_std_grad = grad_of[id(head.log_std)][1] if owned else None
        # The critic's loss counts vf_coef times where one optimizer holds both networks.
        value_scale = self.config.vf_coef if self.actor_key == self.critic_key else 1.0
        # The critic's whole share of a minibatch (what a worker process runs too).
        self.critic_step = CriticShare(
            self.critic, self.critic_grads, self.activation, self.config.vf_clip_coef, value_scale
        )

    def minibatches(
        self, batch: Batch, count: int, generator: torch.Generator
    ) -> Iterator[NumpyBatch]:
        # The numpy view of a batch once per update, not per epoch: some ten .numpy()
        # calls, a few percent of an epoch of one 256-row minibatch (case 2).
        if self._batch is None or self._batch[0] is not batch:
            self._batch = (batch, batch.numpy())
        return self._batch[1].minibatches(count, generator)

    def step(
        self,
        mb: NumpyBatch,
        *,
        fit_policy: bool,
        fit_value: bool,
        clip_coef: float | None = None,
        target_kl: float | None = None,
    ) -> tuple[Terms, Grads]:
        self._bind()
        # With a worker, the critic's share runs there while this process does the actor's.
        submitted = fit_value and self._submit(mb)
        terms: Terms = {}
        fit_actor = False
        if fit_policy:
            assert clip_coef is not None and self.actor_key is not None
            fit_actor = not self._actor_share(mb, clip_coef, target_kl, terms)
        if fit_value:
            value = self._collect() if submitted else None
            if value is None:
                value = self.critic_step(mb.obs, mb.returns, mb.values)
            terms["loss_v"] = value
        if self.actor_key == self.critic_key and fit_actor != fit_value:
            # One optimizer, one network fitted: the other's gradient is 0.
            for weight, bias in self.critic_grads if fit_actor else self.actor_grads:
                weight.fill(0.0)
                bias.fill(0.0)
            if not fit_actor and self.log_std_grad is not None:
                self.log_std_grad.fill(0.0)
        keys = {self.actor_key} if fit_actor else set()
        keys |= {self.critic_key} if fit_value else set()
        return terms, {key: self.flat_grads[key] for key in keys if key is not None}

    def _actor_share(
        self, mb: NumpyBatch, clip_coef: float, target_kl: float | None, terms: Terms
    ) -> bool:
        """The policy terms into ``terms`` and, unless the KL stop binds (returned), the
        actor's gradient into its flat buffer."""
        hidden = kernels.forward(self.actor, self.activation, mb.obs)
        logprob, entropy, residuals = self.head.terms(hidden[-1], mb.actions, mb.action_mask)
        named, d_logprob = kernels.policy_terms_numpy(
            logprob, mb.logprob, mb.advantages, entropy, clip_coef, self.config.norm_adv
        )
        terms.update(named)
        stop = _kl_stop(terms["approx_kl"], target_kl)
        terms["kl_stop"] = float(stop)
        if stop:
            del terms["loss_pi"], terms["entropy"]
            return True
        d_out, d_log_std = self.head.backward(residuals, d_logprob, -self.config.ent_coef)
        kernels.backward(self.actor, self.activation, hidden, d_out, self.actor_grads)
        if d_log_std is not None:
            assert self.log_std_grad is not None
            self.log_std_grad[...] = d_log_std
        return False

    # The critic's share in a second process (critic_worker.py).

    def _submit(self, mb: NumpyBatch) -> bool:
        """Hand the critic's share of ``mb`` to the worker, started (or grown) first;
        False where there is none to hand it to (not shared, lost, no critic optimizer)."""
        usable = self.shared and all(opt.shared for opt in self.optimizers.values())
        if self.worker_lost or not self.critic_grads or not usable:
            return False
        n = len(mb.obs)
        if self.worker is None or self.worker.rows < n:
            self.close()
            # Room to spare: a rollout's valid rows, and so its minibatches, vary in size.
            dtype = self.critic[0].weight.dtype
            weights = [
                (m.weight.detach().numpy(), m.bias.detach().numpy()) for m in self.critic_modules
            ]
            self.worker = CriticWorker(self.critic_step, weights, 2 * n, mb.obs.shape[1], dtype)
        if self.worker.submit(mb.obs, mb.returns, mb.values):
            return True
        self._lose_worker()
        return False

    def _collect(self) -> float | None:
        """The submitted minibatch's value loss (its gradient is written), or None."""
        assert self.worker is not None
        loss = self.worker.result()
        if loss is None:
            self._lose_worker()
        return loss

    def _lose_worker(self) -> None:
        self.close()
        self.worker_lost = True
        warn(
            "the critic's worker process exited or stopped answering; the update goes on "
            "in this process",
            RuntimeWarning,
            stacklevel=4,
        )

    def rest(self) -> None:
        """The update's last minibatch is done: the worker blocks until the next update."""
        if self.worker is not None:
            self.worker.rest()

    def close(self) -> None:
        """Stop the worker, if one runs (the next step that needs one starts another)."""
        if self.worker is not None:
            self.worker.close()
            self.worker = None


def critic_process_possible(policy: Policy, backend: GradBackend = "auto") -> bool:
    """Whether the critic's share (the numpy backend's) can run in a worker beside this
    process for ``policy``."""
    return backend != "torch" and NumpyGradients.supports(policy) and critic_worker.available()
