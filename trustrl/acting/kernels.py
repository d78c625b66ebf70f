"""The numpy kernels: the MLP's forward pass (plain and stacked per agent) and backward
pass, and the action heads' numpy twins (``NumpyCategorical``, ``NumpyGaussian``).

Both numpy paths run their networks here: the collector's acting (inference.py) and the
hand-written PPO gradients (learner/updates/grads.py). Torch's ``Policy`` is the reference;
``tests/test_kernels.py`` holds the forward pass equal to it and the backward pass equal
to autograd. Why numpy at all: on CartPole-sized networks torch spends longer
dispatching each op than computing it, and numpy's per-op cost is several times lower
(``docs/performance.md``).

Layout: a network is a list of ``Dense`` layers, hidden layers followed by the
activation, the last layer linear (an actor's head, a critic's value).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Protocol

import numpy as np

_ZERO, _ONE = np.float32(0.0), np.float32(1.0)

# One read-only vector of ones per dtype, grown as needed; ``ones`` hands out its prefix.
_ONES: dict[np.dtype, np.ndarray] = {}


def ones(n: int, dtype: np.dtype) -> np.ndarray:
    """n ones (read-only), the operand of the sums done as matmuls below: made once, as
    ``np.ones``' Python wrapper costs about what the sum it serves does."""
    vector = _ONES.get(dtype)
    if vector is None or len(vector) < n:
        vector = np.ones(max(n, 256), dtype=dtype)
        vector.flags.writeable = False
        _ONES[dtype] = vector
    return vector[:n]


class Dense:
    """y = x @ W.T + b for one layer, from torch's layout: ``weight`` (out, in) and ``bias``
    (out,), or stacked per agent, (A, out, in) and (A, out), where each row goes through
    its own agent's weights (``agent`` (rows,) at call time).

    ``matrix`` is what ``x`` multiplies: W.T, (in, out); for a stacked layer every agent's
    at once, (in, A * out), so one matmul gives every agent's output and each row keeps its
    own. With ``copy`` (acting from a snapshot) it is a C-ordered copy, the faster operand
    of a small matmul; without (the gradient path) a transposed view of ``weight``, so that
    the optimizer's in-place steps are seen with no copy per step. A stacked layer's matrix
    is always a copy; the gradient path does not take stacked layers (``backward``).
    """

    __slots__ = ("bias", "matrix", "out", "stacked", "weight")

    def __init__(self, weight: np.ndarray, bias: np.ndarray, copy: bool = True) -> None:
        self.stacked = weight.ndim == 3
        if self.stacked:
            agents, out, inp = weight.shape
            self.matrix = weight.transpose(2, 0, 1).reshape(inp, agents * out).copy()
        else:
            self.matrix = weight.T.copy() if copy else weight.T
        self.weight = weight.copy() if copy else weight
        self.bias = bias.copy() if copy else bias
        self.out = bias.shape[-1]

    def __call__(self, x: np.ndarray, agent: np.ndarray | None = None) -> np.ndarray:
        y = x @ self.matrix
        if not self.stacked:
            y += self.bias
            return y
        if agent is None:
            raise ValueError("per-agent layers need the agent index of every row")
        rows = np.arange(len(x))
        return y.reshape(len(x), -1, self.out)[rows, agent] + self.bias[agent]


def activate(activation: str, y: np.ndarray) -> np.ndarray:
    """tanh or relu of ``y``, in place."""
    if activation == "tanh":
        return np.tanh(y, out=y)
    return np.maximum(y, _ZERO, out=y)


def forward(
    layers: Sequence[Dense], activation: str, x: np.ndarray, agent: np.ndarray | None = None
) -> list[np.ndarray]:
    """Every layer's input, then the network's output: ``len(layers) + 1`` arrays, the
    inputs of layers 1.. being the hidden activations the backward pass needs."""
    hidden = [x]
    last = len(layers) - 1
    for i, layer in enumerate(layers):
        y = layer(hidden[-1], agent)
        hidden.append(activate(activation, y) if i < last else y)
    return hidden


def output(
    layers: Sequence[Dense], activation: str, x: np.ndarray, agent: np.ndarray | None = None
) -> np.ndarray:
    """The network's output alone (acting keeps no hidden layer)."""
    last = len(layers) - 1
    for i, layer in enumerate(layers):
        x = layer(x, agent)
        if i < last:
            activate(activation, x)
    return x


def backward(
    layers: Sequence[Dense],
    activation: str,
    hidden: Sequence[np.ndarray],
    d_out: np.ndarray,
    grads: Sequence[tuple[np.ndarray, np.ndarray]],
) -> None:
    """Given d loss / d output (rows, out) and ``forward``'s ``hidden``, write each layer's
    d loss / d weight (out, in) and d loss / d bias (out,) into ``grads`` (the optimizer's
    flat gradient buffer, as views). Plain layers only."""
    delta = d_out
    for i in range(len(layers) - 1, -1, -1):
        grad_weight, grad_bias = grads[i]
        np.matmul(delta.T, hidden[i], out=grad_weight)
        # A sum over rows as a matmul: several times faster than np.sum(axis=0) on
        # minibatch-sized arrays.
        np.matmul(ones(len(delta), delta.dtype), delta, out=grad_bias)
        if i == 0:
            break
        weight = layers[i].weight
        # One output (a critic's value): an outer product by broadcasting, which OpenBLAS
        # runs far slower as a matmul with an inner dimension of 1.
        delta = delta * weight if len(weight) == 1 else delta @ weight
        h = hidden[i]  # the activation's output, which fed layer i
        if activation == "tanh":
            slope = h * h
            np.subtract(_ONE, slope, out=slope)  # tanh' = 1 - tanh^2
            delta *= slope
        else:
            delta *= h > 0


# Reductions along a short last axis: the heads' log-softmax (a few actions) and sums.


def log_softmax_array(logits: np.ndarray) -> np.ndarray:
    """Log-softmax over the last axis of (n, K) logits."""
    shifted = logits - row_max(logits)
    return shifted - np.log(row_sum(np.exp(shifted)))


def row_max(x: np.ndarray) -> np.ndarray:
    """(n, K) -> (n, 1), each row's maximum. numpy's reduction along a short last axis
    is slow, so up to 16 columns it runs as elementwise maxima of the columns instead."""
    columns = x.shape[1]
    if columns > 16:
        return x.max(-1, keepdims=True)
    out = x[:, :1].copy()
    for k in range(1, columns):
        np.maximum(out, x[:, k : k + 1], out=out)
    return out


def row_sum(x: np.ndarray) -> np.ndarray:
    """(n, K) -> (n, 1), each row's sum, as a matmul with ones: faster than ``x.sum(-1)``
    along a short last axis."""
    return x @ ones(x.shape[1], x.dtype)[:, None]


# The action heads' numpy twins. Each torch head in learner/heads.py has its twin here,
# for the two numpy paths: acting (inference.py: noise, act, mode, log-prob) and the
# hand-written gradients (learner/updates/grads.py: log-prob, entropy and their backward pass to
# the head's outputs). They live beside the numpy MLP rather than beside their torch
# heads so that the acting side (a Ray runner, an external agent) never imports torch;
# ``tests/test_distributions.py`` holds each twin equal to its head.

# A finite stand-in for -inf: exp() of it is exactly 0 in float32, and 0 * it is 0, so
# entropies and KLs over masked actions stay finite (an -inf would give NaN there).
MASKED_LOGIT = -1e8
LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)  # the Gaussian log-density's constant
_LOG_SQRT_2PI = np.float32(LOG_SQRT_2PI)


class NumpyCategorical:
    """The numpy twin of ``CategoricalHead`` (one block) and ``MultiCategoricalHead``
    (a block per component), on raw logits (rows, sum(nvec))."""

    def __init__(self, nvec: Sequence[int]) -> None:
        self.nvec = list(nvec)
        self.width = sum(self.nvec)
        self.blocks = list(itertools.pairwise(np.cumsum([0, *self.nvec]).tolist()))

    def params(self, logits: np.ndarray, mask: np.ndarray | None) -> np.ndarray:
        """The head's ``forward`` after its linear layer: per-block log-softmax, masked
        logits at ``MASKED_LOGIT`` first."""
        if mask is not None:
            logits = np.where(mask, logits, np.float32(MASKED_LOGIT))
        if len(self.blocks) == 1:  # Discrete: no per-block copies
            return log_softmax_array(logits)
        log_probs = np.empty_like(logits)
        for lo, hi in self.blocks:
            log_probs[:, lo:hi] = log_softmax_array(logits[:, lo:hi])
        return log_probs

    def log_prob(
        self, params: np.ndarray, actions: np.ndarray, agent: np.ndarray | None = None
    ) -> np.ndarray:
        """(rows,) log-probabilities of ``actions`` (rows,) or (rows, components)."""
        rows = np.arange(len(params))
        if len(self.blocks) == 1:
            return params[rows, actions]
        logprob = np.zeros(len(params), dtype=params.dtype)
        for i, (lo, _) in enumerate(self.blocks):
            logprob += params[rows, lo + actions[:, i]]
        return logprob

    def entropy(self, params: np.ndarray, agent: np.ndarray | None = None) -> np.ndarray:
        """(rows,): the blocks' entropies summed, which is -sum p log p over every column."""
        return -row_sum(np.exp(params) * params)[:, 0]

    def noise(self, rng: np.random.Generator, steps: int, agent: np.ndarray) -> np.ndarray:
        """(steps, rows, width) standard Gumbel draws, -log E with E ~ Exp(1)."""
        noise = rng.standard_exponential((steps, len(agent), self.width), dtype=np.float32)
        # A draw of exactly 0 would give +inf and win even over a masked action.
        np.maximum(noise, np.finfo(np.float32).tiny, out=noise)
        np.log(noise, out=noise)
        return np.negative(noise, out=noise)

    def act(
        self,
        logits: np.ndarray,
        mask: np.ndarray | None,
        noise: np.ndarray | None,
        agent: np.ndarray | None = None,
    ) -> np.ndarray:
        """argmax(logits + Gumbel noise) per block: a sample (the Gumbel-max trick, as
        ``sample``; log-softmax only shifts a row, so the argmax needs none), or with
        ``noise`` None the mode."""
        if mask is not None:
            perturbed = np.where(mask, logits, np.float32(MASKED_LOGIT))
            if noise is not None:
                perturbed += noise
        else:
            perturbed = logits + noise if noise is not None else logits
        if len(self.blocks) == 1:
            return perturbed.argmax(-1)
        return np.stack([perturbed[:, lo:hi].argmax(-1) for lo, hi in self.blocks], -1)

    def terms(
        self, logits: np.ndarray, actions: np.ndarray, mask: np.ndarray | None
    ) -> tuple[np.ndarray, float, tuple]:
        """The gradient path's forward pass: (log-probabilities (rows,), the mean entropy
        over rows, what ``backward`` needs)."""
        params = self.params(logits, mask)
        probs = np.exp(params)
        # The mean over rows of each row's summed entropies: one sum over everything.
        entropy = -float((probs * params).sum()) / len(params)
        return self.log_prob(params, actions), entropy, (params, probs, actions, mask)

    def backward(
        self, residuals: tuple, d_logprob: np.ndarray, d_entropy: float
    ) -> tuple[np.ndarray, None]:
        """d loss / d logits (rows, width) for a loss with d loss / d logprob ``d_logprob``
        (rows,) and d loss / d (the mean entropy) ``d_entropy``, from ``terms``'
        residuals; no parameter of the head's own (a Gaussian's log-std) to differentiate."""
        params, probs, actions, mask = residuals
        n = len(params)
        # d logprob / d logits = onehot(action) - softmax, per block.
        d_out = -d_logprob[:, None] * probs
        rows = np.arange(n)
        for i, (lo, _) in enumerate(self.blocks):
            taken = actions if actions.ndim == 1 else actions[:, i]
            d_out[rows, lo + taken] += d_logprob
        if d_entropy:
            # d entropy / d logits_j = -p_j (log p_j + H) within each block.
            block_entropy = np.empty_like(params)
            plogp = probs * params
            for lo, hi in self.blocks:
                block_entropy[:, lo:hi] = -row_sum(plogp[:, lo:hi])
            d_out -= (np.float32(d_entropy) / n) * probs * (params + block_entropy)
        if mask is not None:
            d_out *= mask  # masked logits were replaced by a constant
        return d_out.astype(np.float32, copy=False), None


class NumpyGaussian:
    """The numpy twin of ``DiagGaussianHead``, on the means (rows, d); ``log_std`` (d,),
    or (A, d) for per-agent heads, may be a live view of the torch parameter."""

    def __init__(self, log_std: np.ndarray) -> None:
        self.log_std = log_std
        self.width = log_std.shape[-1]

    def _rows(self, values: np.ndarray, agent: np.ndarray | None) -> np.ndarray:
        """Per-agent values (A, ...) picked for each row; shared ones as they are."""
        return values[agent] if self.log_std.ndim == 2 else values

    def params(self, means: np.ndarray, mask: np.ndarray | None) -> np.ndarray:
        """The means are the varying part of the parameters; the log-std is the head's."""
        return means

    def log_prob(
        self, params: np.ndarray, actions: np.ndarray, agent: np.ndarray | None = None
    ) -> np.ndarray:
        log_std = self._rows(self.log_std, agent)
        return _log_density((actions - params) * np.exp(-log_std), log_std)

    def log_prob_of_noise(self, noise: np.ndarray, agent: np.ndarray | None) -> np.ndarray:
        """``log_prob`` of the actions ``act`` made with ``noise`` = std z: -z.z / 2 -
        (sum(log std) + d log sqrt(2 pi)). The draw itself, not actions - means, which
        loses digits when a mean is large against its std."""
        z = noise / self._rows(np.exp(self.log_std), agent)
        logprob = np.einsum("ij,ij->i", z, z) * np.float32(-0.5)
        logprob -= self._rows(self.log_std.sum(-1) + self.width * _LOG_SQRT_2PI, agent)
        return logprob.astype(np.float32, copy=False)

    def entropy(self, params: np.ndarray, agent: np.ndarray | None = None) -> np.ndarray:
        """(rows,): state-independent, sum(1/2 + log sqrt(2 pi) + log std)."""
        per_agent = (np.float32(0.5) + _LOG_SQRT_2PI + self.log_std).sum(-1)
        return np.broadcast_to(self._rows(per_agent, agent), (len(params),))

    def noise(self, rng: np.random.Generator, steps: int, agent: np.ndarray) -> np.ndarray:
        """(steps, rows, d) draws std z, z ~ N(0, I): what ``act`` adds to the means."""
        z = rng.standard_normal((steps, len(agent), self.width), dtype=np.float32)
        z *= self._rows(np.exp(self.log_std), agent)
        return z

    def act(
        self,
        means: np.ndarray,
        mask: np.ndarray | None,
        noise: np.ndarray | None,
        agent: np.ndarray | None = None,
    ) -> np.ndarray:
        """mean + std z (``sample``), or with ``noise`` None the mean (``mode``)."""
        return means + noise if noise is not None else means

    def terms(
        self, means: np.ndarray, actions: np.ndarray, mask: np.ndarray | None
    ) -> tuple[np.ndarray, float, tuple]:
        """The gradient path's forward pass: (log-probabilities (rows,), the mean entropy,
        what ``backward`` needs). A shared log-std only (per-agent heads train by
        autograd)."""
        assert self.log_std.ndim == 1
        inv_std = np.exp(-self.log_std)
        z = (actions - means) * inv_std
        entropy = float(np.sum(np.float32(0.5) + _LOG_SQRT_2PI + self.log_std))
        return _log_density(z, self.log_std), entropy, (z, inv_std)

    def backward(
        self, residuals: tuple, d_logprob: np.ndarray, d_entropy: float
    ) -> tuple[np.ndarray, np.ndarray]:
        """(d loss / d means (rows, d), d loss / d log_std (d,)) for a loss with d loss /
        d logprob ``d_logprob`` (rows,) and d loss / d mean entropy ``d_entropy``."""
        z, inv_std = residuals
        d_means = d_logprob[:, None] * z * inv_std
        # d logprob / d log_std = z^2 - 1; the entropy's is 1 per dimension.
        d_log_std = np.sum(d_logprob[:, None] * (z * z - 1.0), axis=0)
        d_log_std += np.float32(d_entropy)
        return d_means, d_log_std


def _log_density(z: np.ndarray, log_std: np.ndarray) -> np.ndarray:
    """(rows,) log N(a; mean, std) from z = (a - mean) / std."""
    return row_sum(np.float32(-0.5) * z * z - log_std - _LOG_SQRT_2PI)[:, 0]


class NumpyHead(Protocol):
    """What the numpy paths ask of a head's twin (``numpy_head``)."""

    width: int

    def params(self, out: np.ndarray, mask: np.ndarray | None) -> np.ndarray: ...
    def log_prob(
        self, params: np.ndarray, actions: np.ndarray, agent: np.ndarray | None = None
    ) -> np.ndarray: ...
    def entropy(self, params: np.ndarray, agent: np.ndarray | None = None) -> np.ndarray: ...
    def noise(self, rng: np.random.Generator, steps: int, agent: np.ndarray) -> np.ndarray: ...
    def act(
        self,
        out: np.ndarray,
        mask: np.ndarray | None,
        noise: np.ndarray | None,
        agent: np.ndarray | None = None,
    ) -> np.ndarray: ...
    def terms(
        self, out: np.ndarray, actions: np.ndarray, mask: np.ndarray | None
    ) -> tuple[np.ndarray, float, tuple]: ...
    def backward(
        self, residuals: tuple, d_logprob: np.ndarray, d_entropy: float
    ) -> tuple[np.ndarray, np.ndarray | None]: ...


def numpy_head(
    action_kind: str, nvec: Sequence[int], log_std: np.ndarray | None
) -> NumpyCategorical | NumpyGaussian:
    """The twin of the head for an action space (``SpaceSpec.action_kind`` and ``nvec``);
    a Gaussian's needs the head's ``log_std``."""
    if action_kind == "box":
        assert log_std is not None
        return NumpyGaussian(log_std)
    return NumpyCategorical(nvec)


# The losses' numpy twins (losses.py holds the torch forms): each also returns the
# derivative the hand-written backward pass starts from.


def policy_terms_numpy(
    logprob: np.ndarray,
    old_logprob: np.ndarray,
    advantages: np.ndarray,
    entropy: float,
    clip_coef: float,
    norm_adv: bool = True,
) -> tuple[dict[str, float], np.ndarray]:
    """``policy_terms`` in numpy, and d loss_pi / d logprob (rows,); ``entropy`` is the
    minibatch's mean (the numpy heads' ``terms`` give it so).

    Means as sums / n throughout: ndarray.mean's Python wrapper costs more than the
    arithmetic on a minibatch."""
    n = len(logprob)
    if norm_adv:
        advantages = normalize_advantages_numpy(advantages)
    log_ratio = logprob - old_logprob
    ratio = np.exp(log_ratio)
    unclipped = ratio * advantages
    clipped = np.minimum(np.maximum(ratio, 1.0 - clip_coef), 1.0 + clip_coef) * advantages
    terms = {
        "loss_pi": -float(np.minimum(unclipped, clipped).sum()) / n,
        "entropy": entropy,
        "approx_kl": (float(ratio.sum()) - n - float(log_ratio.sum())) / n,
        "clip_fraction": np.count_nonzero(np.abs(ratio - 1.0) > clip_coef) / n,
    }
    # The unclipped branch's gradient where min picks it (ties too: both branches then
    # carry the same gradient), zero where the clipped one is flat.
    d_logprob = np.where(unclipped <= clipped, -(advantages * ratio) / n, np.float32(0.0))
    return terms, d_logprob.astype(np.float32, copy=False)


def value_terms_numpy(
    values: np.ndarray, old_values: np.ndarray, returns: np.ndarray, clip_coef: float | None
) -> tuple[dict[str, float], np.ndarray]:
    """``value_terms`` in numpy, and d loss_v / d values (rows,)."""
    n = len(values)
    error = values - returns
    unclipped = error * error
    d_values = (2.0 / n) * error
    if clip_coef is None:
        loss = float(unclipped.sum()) / n
    else:
        clipped_values = old_values + np.clip(values - old_values, -clip_coef, clip_coef)
        clipped_error = clipped_values - returns
        clipped = clipped_error * clipped_error
        loss = float(np.maximum(unclipped, clipped).sum()) / n
        inside = np.abs(values - old_values) <= clip_coef
        d_clipped = (2.0 / n) * clipped_error * inside
        # torch.max's gradient: the larger branch's, split evenly on a tie.
        d_values = np.where(
            unclipped > clipped,
            d_values,
            np.where(unclipped < clipped, d_clipped, 0.5 * (d_values + d_clipped)),
        )
    return {"loss_v": loss}, d_values.astype(np.float32, copy=False)


def normalize_advantages_numpy(advantages: np.ndarray) -> np.ndarray:
    """``normalize_advantages`` in numpy (float sums: see ``policy_terms_numpy``)."""
    n = len(advantages)
    centered = advantages - float(advantages.sum()) / n
    if n < 2:
        return centered
    return centered / (math.sqrt(float(centered @ centered) / (n - 1)) + 1e-8)
