"""The numpy kernels: the MLP's forward pass (plain and stacked per agent) and backward
pass, and the row reductions of the heads' numpy twins.

Both numpy paths run their networks here: the collector's acting (inference.py) and the
hand-written PPO gradients (updates/grads.py). Torch's ``Policy`` is the reference;
``tests/test_kernels.py`` holds the forward pass equal to it and the backward pass equal
to autograd. Why numpy at all: on CartPole-sized networks torch spends longer
dispatching each op than computing it, and numpy's per-op cost is several times lower
(``docs/performance.md``).

Layout: a network is a list of ``Dense`` layers, hidden layers followed by the
activation, the last layer linear (an actor's head, a critic's value).
"""

from __future__ import annotations

from collections.abc import Sequence

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
