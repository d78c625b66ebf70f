"""A policy's memory core on the acting side: the numpy LSTM and GRU cells, and how a
rollout's rows are cut into the sequence chunks the update trains on.

The cells compute what ``torch.nn.LSTM`` and ``torch.nn.GRU`` (one layer) compute, from
their ``state_dict`` entries (``weight_ih_l0``, ``weight_hh_l0``, ``bias_ih_l0``,
``bias_hh_l0``; gates in torch's order: LSTM i, f, g, o; GRU r, z, n).
``tests/test_memory.py`` holds them equal to their torch twins over long sequences.

A state is one float32 row per policy row: an LSTM's ``[h, c]`` (2 x size columns), a
GRU's ``h`` (size columns). A policy with a critic memory of its own carries the actor's
columns, then the critic's (``Policy.state_size``).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from trustrl.acting.kernels import Dense


def _sigmoid(x: np.ndarray) -> np.ndarray:
    # tanh form: no overflow warning for large negative inputs, and float32 throughout.
    return 0.5 * (np.tanh(0.5 * x) + 1.0)


class NumpyCell:
    """One recurrent layer's step: ``(x (B, in), state (B, state_size), agent) -> (output
    (B, size), next state)``. ``kind`` is "lstm" or "gru". The weights are torch's layout,
    (gates x size, in), or stacked per agent (one layer per agent, learner/memory.py's
    ``StackedRNN``), (agents, gates x size, in), where each row takes its agent's. ``post``:
    the layers after the core (``policy.post_memory_sizes``), ``(output, agent) ->
    output``, applied to the output (not to the state)."""

    def __init__(
        self,
        kind: str,
        weights: dict[str, np.ndarray],
        prefix: str,
        post: Callable[[np.ndarray, np.ndarray | None], np.ndarray] | None = None,
    ) -> None:
        self.kind = kind
        self.post = post
        self.ih = Dense(weights[f"{prefix}weight_ih_l0"], weights[f"{prefix}bias_ih_l0"])
        self.hh = Dense(weights[f"{prefix}weight_hh_l0"], weights[f"{prefix}bias_hh_l0"])
        self.size = weights[f"{prefix}weight_hh_l0"].shape[-1]
        self.state_size = state_size(kind, self.size)

    def __call__(
        self, x: np.ndarray, state: np.ndarray, agent: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        out, state = self._core(x, state, agent)
        return (out, state) if self.post is None else (self.post(out, agent), state)

    def _core(
        self, x: np.ndarray, state: np.ndarray, agent: np.ndarray | None
    ) -> tuple[np.ndarray, np.ndarray]:
        size = self.size
        h = state[:, :size]
        if self.kind == "lstm":
            gates = self.ih(x, agent) + self.hh(h, agent)
            i, f = _sigmoid(gates[:, :size]), _sigmoid(gates[:, size : 2 * size])
            g, o = np.tanh(gates[:, 2 * size : 3 * size]), _sigmoid(gates[:, 3 * size :])
            c = f * state[:, size:] + i * g
            h = o * np.tanh(c)
            return h, np.concatenate([h, c], 1)
        gx = self.ih(x, agent)
        gh = self.hh(h, agent)
        r = _sigmoid(gx[:, :size] + gh[:, :size])
        z = _sigmoid(gx[:, size : 2 * size] + gh[:, size : 2 * size])
        n = np.tanh(gx[:, 2 * size :] + r * gh[:, 2 * size :])
        h = (1.0 - z) * n + z * h
        return h, h


def state_size(kind: str, size: int) -> int:
    """Columns of one memory core's state: an LSTM carries h and c, a GRU h."""
    return 2 * size if kind == "lstm" else size


def chunk_layout(starts: np.ndarray, length: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The sequence chunks of a rollout whose (T, rows) ``starts`` flags the steps that
    begin an episode: every row is cut at each episode start and every ``length`` steps
    after a cut. Returns (row, first step, steps) per chunk, (C,) arrays, row by row and in
    time within a row: the order the chunk-start states travel in (a join of batches
    along rows concatenates them)."""
    steps, rows = starts.shape
    cut = starts.copy()
    cut[0] = True
    chunk_rows, firsts, lengths = [], [], []
    for row in range(rows):
        begins = np.flatnonzero(cut[:, row])
        ends = np.append(begins[1:], steps)
        for begin, end in zip(begins.tolist(), ends.tolist(), strict=True):
            for first in range(begin, end, length):
                chunk_rows.append(row)
                firsts.append(first)
                lengths.append(min(length, end - first))
    return (
        np.asarray(chunk_rows, np.int64),
        np.asarray(firsts, np.int64),
        np.asarray(lengths, np.int64),
    )
