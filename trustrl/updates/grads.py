"""One PPO minibatch's losses and their gradients: autograd, or by hand in numpy.

The update loop (ppo.py) asks a backend for the policy terms (loss, entropy, KL estimate,
clip fraction), the value loss, and then the flat gradient of each optimizer's loss.

* ``TorchGradients`` builds the losses of losses.py on the Policy and runs autograd. It
  serves every policy (per-agent actors, agent ids, global-state critics) and is the
  reference the numpy backend is tested against.
* ``NumpyGradients`` does the same arithmetic with a hand-written backward pass, for
  the policies single-agent training uses: MLP actor and critic on the observation,
  categorical, multi-categorical or diagonal Gaussian head. Why by hand: a CartPole-sized
  minibatch step is some 550 small torch ops (autograd's included) at a few microseconds
  of dispatch each, several times the arithmetic; numpy's per-op cost is about a
  microsecond and the backward of an MLP is a handful of matmuls. The weights and the
  gradients are numpy views of the optimizers' flat torch buffers (optim.py): no copies.
  ``tests/test_grads.py`` checks losses and gradients against ``TorchGradients`` for every
  head, activation, mask and loss option, and whole updates against each other.
"""

from __future__ import annotations

import itertools
import math
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
from torch import Tensor, nn

from trustrl.config import PPOConfig
from trustrl.distributions import (
    LOG_SQRT_2PI,
    MASKED_LOGIT,
    CategoricalHead,
    DiagGaussianHead,
    MultiCategoricalHead,
    log_softmax_array,
    row_sum,
    tanh_array,
)
from trustrl.losses import (
    approx_kl,
    clip_fraction,
    clipped_surrogate,
    normalize_advantages,
    value_loss,
)
from trustrl.optim import Adam, share_memory
from trustrl.policy import Policy
from trustrl.rollout import Batch, NumpyBatch
from trustrl.updates.critic_worker import CriticWorker

_LOG_SQRT_2PI = np.float32(LOG_SQRT_2PI)


class Gradients(Protocol):
    def bind(self) -> None:
        """Called at the start of every update: the optimizers' buffers may be new."""

    def minibatches(self, batch: Batch, count: int, generator: torch.Generator) -> Iterator[Any]:
        """One epoch of ``batch``'s minibatches (``Batch.minibatches``), in the form this
        backend's ``policy_terms`` and ``value_term`` take."""

    def policy_terms(self, mb: Any, clip_coef: float) -> tuple[float, float, float, float]:
        """(surrogate loss, mean entropy, approx KL, clip fraction) of a minibatch from
        ``minibatches``; keeps what the gradient needs."""

    def start_value(self, mb: Any) -> None:
        """Called before ``policy_terms`` on a minibatch whose value term will be asked
        for: a backend with a critic worker starts it there."""

    def value_term(self, mb: Any) -> float:
        """The value loss of a minibatch from ``minibatches``; keeps what the gradient
        needs."""

    def gradient(self, key: str, policy: bool, value: bool) -> Tensor | None:
        """The flat gradient (in ``optimizers[key]``'s layout) of that optimizer's loss
        made of the last policy terms (``policy - ent_coef * entropy``) and/or value term
        (times ``vf_coef`` when one optimizer holds both networks)."""


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


def make_gradients(
    policy: Policy, config: LossSettings, optimizers: dict[str, Adam], shared: bool = False
) -> Gradients:
    """The numpy backend where it covers the policy, autograd otherwise. ``optimizers``
    may hold only some of the policy's weights (TRPO's critic): the others get no gradient.
    ``shared``: gradients in shared memory, for ``NumpyGradients.start_worker``."""
    if NumpyGradients.supports(policy):
        return NumpyGradients(policy, config, optimizers, shared)
    return TorchGradients(policy, config, optimizers)


class TorchGradients:
    """Autograd on the Policy (every policy)."""

    def __init__(self, policy: Policy, config: LossSettings, optimizers: dict[str, Adam]) -> None:
        self.policy, self.config, self.optimizers = policy, config, optimizers
        self.terms: dict[str, Tensor] = {}

    def bind(self) -> None:
        self.terms = {}

    def minibatches(self, batch: Batch, count: int, generator: torch.Generator) -> Iterator[Batch]:
        return batch.minibatches(count, generator)

    def policy_terms(self, mb: Batch, clip_coef: float) -> tuple[float, float, float, float]:
        policy = self.policy
        params = policy.dist_params(mb.obs, mb.action_mask, mb.agent)
        logprob = policy.head.log_prob(params, mb.actions)
        advantages = normalize_advantages(mb.advantages) if self.config.norm_adv else mb.advantages
        loss, log_ratio = clipped_surrogate(logprob, mb.logprob, advantages, clip_coef)
        if self.config.ent_coef:
            entropy = policy.head.entropy(params).mean()
        else:  # reported, not trained on: keep it out of the backward pass
            with torch.no_grad():
                entropy = policy.head.entropy(params).mean()
        self.terms["policy"], self.terms["entropy"] = loss, entropy
        with torch.no_grad():  # one synchronizing read for all four
            values = torch.stack(
                [loss, entropy, approx_kl(log_ratio), clip_fraction(log_ratio, clip_coef)]
            ).tolist()
        return values[0], values[1], values[2], values[3]

    def start_value(self, mb: Batch) -> None:
        """Nothing ahead of time: autograd's value term is built when asked."""

    def value_term(self, mb: Batch) -> float:
        new_values = self.policy.value_raw(mb.obs, mb.critic_obs, mb.agent)
        loss = value_loss(new_values, mb.values, mb.returns, self.config.vf_clip_coef)
        self.terms["value"] = loss
        return float(loss.detach())

    def gradient(self, key: str, policy: bool, value: bool) -> Tensor | None:
        cfg = self.config
        loss: Tensor | None = None
        if policy:
            loss = self.terms["policy"]
            if cfg.ent_coef:
                loss = loss - cfg.ent_coef * self.terms["entropy"]
        if value:
            scaled = self.terms["value"] * (cfg.vf_coef if key == "all" else 1.0)
            loss = scaled if loss is None else loss + scaled
        if loss is None:
            return None
        opt = self.optimizers[key]
        opt.zero_grad(set_to_none=True)
        loss.backward()
        return opt.flat_grad()


class NumpyGradients:
    """The same losses and gradients in numpy, for MLP policies on single observations."""

    @staticmethod
    def supports(policy: Policy) -> bool:
        head = policy.head
        gaussian_ok = not isinstance(head, DiagGaussianHead) or head.log_std.dim() == 1
        return (
            not policy.per_agent
            and not policy.agent_id
            and policy.critic_dim is None
            and isinstance(head, CategoricalHead | MultiCategoricalHead | DiagGaussianHead)
            and gaussian_ok
            and policy.config.activation in ("tanh", "relu")
        )

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
        self._critic_done = False  # the worker computed this minibatch's critic share
        self._actor_done = False  # policy_terms already wrote the actor's gradient
        self.tanh = policy.config.activation == "tanh"
        head: Any = policy.head
        self.gaussian = isinstance(head, DiagGaussianHead)
        # Categorical heads as (start, stop) column blocks: one, or one per component.
        nvec = head.nvec if isinstance(head, MultiCategoricalHead) else [head.linear.out_features]
        self.blocks = list(itertools.pairwise(np.cumsum([0, *nvec]).tolist()))
        self.actor_layers = [m for m in policy.actor.modules() if isinstance(m, nn.Linear)]
        self.actor_layers.append(head.linear)
        self.critic_layers = [m for m in policy.critic.modules() if isinstance(m, nn.Linear)]
        self._ones_cache = np.ones(0, dtype=np.float32)
        # Each layer's output, kept from one minibatch to the next with its tensor view.
        self._outputs: dict[tuple[str, int], tuple[np.ndarray, Tensor]] = {}
        self._batch: tuple[Batch, NumpyBatch] | None = None  # the last batch, as numpy
        self._flats: tuple[Tensor, ...] = ()
        self.bind()

    def bind(self) -> None:
        """Numpy views of the current weights and of one flat gradient buffer per optimizer
        (the buffers move when an optimizer grows or is built anew; while every optimizer
        keeps its flat buffer, the views made last time are still the ones)."""
        flats = tuple(opt.flat for opt in self.optimizers.values())
        if len(flats) == len(self._flats) and all(
            a is b for a, b in zip(flats, self._flats, strict=True)
        ):
            return
        self._flats = flats
        self.stop_worker()  # its views are of the old buffers

        def weights(layers: list[nn.Linear]) -> list[tuple[np.ndarray, np.ndarray]]:
            return [(m.weight.detach().numpy(), m.bias.detach().numpy()) for m in layers]

        self.actor = weights(self.actor_layers)
        self.critic = weights(self.critic_layers)
        head: Any = self.policy.head
        self.log_std = head.log_std.detach().numpy() if self.gaussian else None
        self.flat_grads: dict[str, Tensor] = {}
        grad_of: dict[int, tuple[str, np.ndarray]] = {}
        for key, opt in self.optimizers.items():
            flat = torch.zeros_like(opt.flat)
            if self.shared:  # before any view of it is taken
                self.shared = share_memory(flat)
            self.flat_grads[key] = flat
            for param, view in zip(opt.params, opt.views(flat), strict=True):
                grad_of[id(param)] = (key, view.numpy())

        def grads(layers: list[nn.Linear]) -> list[tuple[str, np.ndarray, np.ndarray]]:
            out = []
            for m in layers:
                if id(m.weight) not in grad_of:
                    return []  # a network no optimizer here trains
                key, weight = grad_of[id(m.weight)]
                key_b, bias = grad_of[id(m.bias)]
                assert key == key_b
                out.append((key, weight, bias))
            return out

        self.actor_grads = grads(self.actor_layers)
        self.critic_grads = grads(self.critic_layers)
        self.log_std_grad = grad_of.get(id(head.log_std)) if self.gaussian else None
        self.actor_key = self.actor_grads[0][0] if self.actor_grads else None
        self.critic_key = self.critic_grads[0][0] if self.critic_grads else None
        # The critic's loss counts vf_coef times where one optimizer holds both networks.
        self.value_scale = np.float32(
            self.config.vf_coef if self.actor_key == self.critic_key else 1.0
        )

    # The critic's share in a second process (critic_worker.py).

    def start_worker(self, rows: int) -> None:
        """From now on, compute the critic's share of minibatches of up to ``rows`` rows in
        a forked process (needs ``shared`` and optimizers built with ``shared=True``). A
        worker already running with room enough is kept; after a lost one, nothing."""
        shared = self.shared and all(opt.shared for opt in self.optimizers.values())
        if self.worker_lost or not self.critic_grads or not shared:
            return
        if self.worker is not None and self.worker.rows >= rows:
            return
        self.stop_worker()
        weight = self.critic[0][0]
        self.worker = CriticWorker(self, rows, weight.shape[1], weight.dtype)

    def rest_worker(self) -> None:
        """The update's last minibatch is done: the worker blocks until the next update."""
        if self.worker is not None:
            self.worker.rest()

    def stop_worker(self) -> None:
        if self.worker is not None:
            self.worker.close()
            self.worker = None

    def _lose_worker(self) -> None:
        self.stop_worker()
        self.worker_lost = True
        warnings.warn(
            "the critic's worker process exited or stopped answering; the update goes on "
            "in this process",
            RuntimeWarning,
            stacklevel=3,
        )

    def _settle(self) -> None:
        """Wait for a submitted minibatch whose result nobody asked for (a KL stop)."""
        if self.worker is not None and self.worker.pending and self.worker.result() is None:
            self._lose_worker()

    def critic_step(self, obs: np.ndarray, returns: np.ndarray, old_values: np.ndarray) -> float:
        """The critic's whole share of a minibatch: value loss, and its gradient written
        into the flat buffer (a worker's job; ``value_term`` and ``gradient`` in one)."""
        loss = self._value_loss(obs, returns, old_values)
        hidden, d_values = self._value
        self._backward(
            self.critic, self.critic_grads, hidden, (self.value_scale * d_values)[:, None]
        )
        return loss

    def minibatches(
        self, batch: Batch, count: int, generator: torch.Generator
    ) -> Iterator[NumpyBatch]:
        # The numpy view of a batch once per update, not per epoch: some ten .numpy()
        # calls, a few percent of an epoch of one 256-row minibatch (case 2).
        if self._batch is None or self._batch[0] is not batch:
            self._batch = (batch, batch.numpy())
        return self._batch[1].minibatches(count, generator)

    # Forward and backward through an MLP.

    def _ones(self, n: int) -> np.ndarray:
        if len(self._ones_cache) != n:
            self._ones_cache = np.ones(n, dtype=np.float32)
        return self._ones_cache

    def _forward(
        self, net: str, layers: list[tuple[np.ndarray, np.ndarray]], x: np.ndarray
    ) -> list[np.ndarray]:
        """Every layer's input, then the output (the last layer has no activation). The
        arrays are ``net``'s buffers, which its next forward pass overwrites: the update
        takes each minibatch's gradient before it runs the next."""
        hidden = [x]
        last = len(layers) - 1
        for i, (weight, bias) in enumerate(layers):
            y, view = self._output(net, i, (len(x), len(bias)), weight.dtype)
            np.matmul(hidden[-1], weight.T, out=y)
            y += bias
            if i < last:
                if self.tanh:
                    tanh_array(y, view)
                else:
                    np.maximum(y, np.float32(0.0), out=y)
            hidden.append(y)
        return hidden

    def _output(
        self, net: str, layer: int, shape: tuple[int, int], dtype: np.dtype
    ) -> tuple[np.ndarray, Tensor]:
        """A buffer for a layer's output (the weights' dtype), and its tensor view."""
        out = self._outputs.get((net, layer))
        if out is None or out[0].shape != shape or out[0].dtype != dtype:
            array = np.empty(shape, dtype=dtype)
            out = self._outputs[net, layer] = (array, torch.from_numpy(array))
        return out

    def _backward(
        self,
        layers: list[tuple[np.ndarray, np.ndarray]],
        grads: list[tuple[str, np.ndarray, np.ndarray]],
        hidden: list[np.ndarray],
        d_out: np.ndarray,
    ) -> None:
        """Write the weight gradients given the output's gradient (into the flat buffers)."""
        delta = d_out
        for i in range(len(layers) - 1, -1, -1):
            _, grad_weight, grad_bias = grads[i]
            np.matmul(delta.T, hidden[i], out=grad_weight)
            # A sum over rows as a matmul: several times faster than np.sum(axis=0).
            np.matmul(self._ones(len(delta)), delta, out=grad_bias)
            if i == 0:
                break
            weight = layers[i][0]
            # One output (a critic's value): an outer product. As a matmul with an inner
            # dimension of 1 it took OpenBLAS 26 µs at 256 x 64, broadcasting 9.
            delta = delta * weight if len(weight) == 1 else delta @ weight
            h = hidden[i]  # the activation's output, which feeds layer i
            if self.tanh:
                slope = h * h
                np.subtract(np.float32(1.0), slope, out=slope)
                delta *= slope
            else:
                delta *= h > 0

    # The losses.

    def policy_terms(self, mb: NumpyBatch, clip_coef: float) -> tuple[float, float, float, float]:
        obs = mb.obs
        actions = mb.actions
        advantages = mb.advantages
        old_logprob = mb.logprob
        n = len(obs)
        hidden = self._forward("actor", self.actor, obs)
        out = hidden[-1]
        if self.gaussian:
            assert self.log_std is not None
            inv_std = np.exp(-self.log_std)
            z = (actions - out) * inv_std
            logprob = row_sum(np.float32(-0.5) * z * z - self.log_std - _LOG_SQRT_2PI)[:, 0]
            entropy = float(np.sum(np.float32(0.5) + _LOG_SQRT_2PI + self.log_std))
            cache: tuple = (z, inv_std)
        else:
            mask = mb.action_mask
            if mask is not None:
                out = np.where(mask, out, np.float32(MASKED_LOGIT))
            rows = np.arange(n)
            if len(self.blocks) == 1:  # Discrete: no per-block copies
                log_probs = log_softmax_array(out)
                logprob = log_probs[rows, actions]
            else:
                log_probs = np.empty_like(out)
                logprob = np.zeros(n, dtype=np.float32)
                for i, (lo, hi) in enumerate(self.blocks):
                    log_probs[:, lo:hi] = log_softmax_array(out[:, lo:hi])
                    logprob += log_probs[rows, lo + actions[:, i]]
            probs = np.exp(log_probs)
            # The mean over rows of each row's summed entropies: one sum over everything.
            entropy = -float((probs * log_probs).sum()) / n
            cache = (probs, log_probs, mask)

        # Means as sums / n throughout: ndarray.mean's Python wrapper costs more than the
        # arithmetic on a minibatch.
        if self.config.norm_adv:
            centered = advantages - float(advantages.sum()) / n
            if n < 2:
                advantages = centered
            else:  # torch's std: unbiased
                advantages = centered / (math.sqrt(float(centered @ centered) / (n - 1)) + 1e-8)
        log_ratio = logprob - old_logprob
        ratio = np.exp(log_ratio)
        unclipped = ratio * advantages
        clipped = np.minimum(np.maximum(ratio, 1.0 - clip_coef), 1.0 + clip_coef) * advantages
        loss = -float(np.minimum(unclipped, clipped).sum()) / n
        kl = (float(ratio.sum()) - n - float(log_ratio.sum())) / n
        fraction = np.count_nonzero(np.abs(ratio - 1.0) > clip_coef) / n
        # d loss / d logprob: the unclipped branch's gradient where min picks it (ties too:
        # both branches then carry the same gradient), zero where the clipped one is flat.
        d_logprob = np.where(unclipped <= clipped, -(advantages * ratio) / n, np.float32(0.0))
        self._policy = (hidden, actions, d_logprob.astype(np.float32, copy=False), cache)
        # With the critic in the worker meanwhile, the actor's gradient now rather than
        # after waiting for it (wasted only on a step that is then skipped).
        self._actor_done = self.worker is not None and self.worker.pending
        if self._actor_done:
            self._policy_backward()
        return loss, entropy, kl, fraction

    def start_value(self, mb: NumpyBatch) -> None:
        self._settle()
        worker = self.worker
        if (
            worker is not None
            and len(mb.obs) <= worker.rows
            and not worker.submit(mb.obs, mb.returns, mb.values)
        ):
            self._lose_worker()

    def value_term(self, mb: NumpyBatch) -> float:
        worker = self.worker
        if worker is not None and worker.pending:
            loss = worker.result()
            if loss is not None:
                self._critic_done = True  # and its gradient is written
                return loss
            self._lose_worker()
        self._critic_done = False
        return self._value_loss(mb.obs, mb.returns, mb.values)

    def _value_loss(self, obs: np.ndarray, returns: np.ndarray, old: np.ndarray) -> float:
        hidden = self._forward("critic", self.critic, obs)
        values = hidden[-1][:, 0]
        n = len(values)
        error = values - returns
        unclipped = error * error
        d_values = (2.0 / n) * error
        clip = self.config.vf_clip_coef
        if clip is None:
            loss = float(unclipped.sum()) / n
        else:
            clipped_values = old + np.clip(values - old, -clip, clip)
            clipped_error = clipped_values - returns
            clipped = clipped_error * clipped_error
            loss = float(np.maximum(unclipped, clipped).sum()) / n
            inside = np.abs(values - old) <= clip
            d_clipped = (2.0 / n) * clipped_error * inside
            # torch.max's gradient: the larger branch's, split evenly on a tie.
            d_values = np.where(
                unclipped > clipped,
                d_values,
                np.where(unclipped < clipped, d_clipped, 0.5 * (d_values + d_clipped)),
            )
        self._value = (hidden, d_values.astype(np.float32, copy=False))
        return loss

    def gradient(self, key: str, policy: bool, value: bool) -> Tensor | None:
        wrote_actor = policy and self.actor_key == key
        wrote_critic = value and self.critic_key == key
        if not (wrote_actor or wrote_critic):
            return None
        self._settle()
        if not (wrote_actor and wrote_critic) and self.actor_key == self.critic_key:
            # One optimizer, one loss term: the other network's gradient is 0.
            for _, weight, bias in self.critic_grads if wrote_actor else self.actor_grads:
                weight.fill(0.0)
                bias.fill(0.0)
            if not wrote_actor and self.log_std_grad is not None:
                self.log_std_grad[1].fill(0.0)
        if wrote_actor and not self._actor_done:
            self._policy_backward()
        if wrote_critic and not self._critic_done:
            hidden, d_values = self._value
            self._backward(
                self.critic, self.critic_grads, hidden, (self.value_scale * d_values)[:, None]
            )
        return self.flat_grads[key]

    def _policy_backward(self) -> None:
        hidden, actions, d_logprob, cache = self._policy
        ent_coef = np.float32(self.config.ent_coef)
        n = len(d_logprob)
        if self.gaussian:
            z, inv_std = cache
            d_out = d_logprob[:, None] * z * inv_std
            assert self.log_std_grad is not None
            _, grad_log_std = self.log_std_grad
            # d logprob / d log_std = z^2 - 1; the entropy's is 1 per dimension.
            np.sum(d_logprob[:, None] * (z * z - 1.0), axis=0, out=grad_log_std)
            grad_log_std -= ent_coef
        else:
            probs, log_probs, mask = cache
            # d logprob / d logits = onehot(action) - softmax, per block.
            d_out = -d_logprob[:, None] * probs
            rows = np.arange(n)
            for i, (lo, _) in enumerate(self.blocks):
                taken = actions if actions.ndim == 1 else actions[:, i]
                d_out[rows, lo + taken] += d_logprob
            if ent_coef:
                # d entropy / d logits_j = -p_j (log p_j + H) within each block.
                block_entropy = np.empty_like(log_probs)
                plogp = probs * log_probs
                for lo, hi in self.blocks:
                    block_entropy[:, lo:hi] = -row_sum(plogp[:, lo:hi])
                d_out += (ent_coef / n) * probs * (log_probs + block_entropy)
            if mask is not None:
                d_out *= mask  # masked logits were replaced by a constant
        self._backward(self.actor, self.actor_grads, hidden, d_out.astype(np.float32, copy=False))
