"""A policy's memory core in torch: one LSTM or GRU layer between the encoder and the heads
(its numpy twin, acting/memory.py, acts with the same weights)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from trustrl.acting.memory import state_size


@dataclass(frozen=True)
class Sequences:
    """How a recurrent policy's rows (C * L of them) are laid out: C chunks of ``length``
    steps each, chunk by chunk; ``state`` (C, state_size) is each chunk's start state and
    ``resets`` (L, C), where given, flags steps that start an episode inside a chunk."""

    state: Tensor
    length: int
    resets: Tensor | None = None


class Memory(nn.Module):
    """``torch.nn.LSTM`` or ``torch.nn.GRU`` of one layer over (L, C, features) sequences,
    each sequence starting from its (C, state_size) state (an LSTM's ``[h, c]``, a GRU's
    ``h``)."""

    def __init__(self, kind: str, in_features: int, size: int) -> None:
        super().__init__()
        self.kind = kind
        self.rnn = nn.LSTM(in_features, size) if kind == "lstm" else nn.GRU(in_features, size)
        self.size = size
        self.out_features = size
        self.state_size = state_size(kind, size)

    def forward(
        self, x: Tensor, state: Tensor, resets: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """(L, C, in) inputs and (C, state_size) start states -> ((L, C, size) outputs,
        (C, state_size) final states). ``resets`` (L, C) bool zeroes a sequence's state
        before the steps it flags (an episode starting inside it), step by step; without
        any, the whole sequence is one call of the torch module."""
        if resets is not None and bool(resets[1:].any()):
            outputs = []
            for t in range(len(x)):
                state = state * (~resets[t]).to(state.dtype)[:, None]
                out, state = self(x[t : t + 1], state)
                outputs.append(out)
            return torch.cat(outputs), state
        if resets is not None:
            state = state * (~resets[0]).to(state.dtype)[:, None]
        size = self.size
        h = state[:, :size].unsqueeze(0).contiguous()
        if self.kind == "lstm":
            c = state[:, size:].unsqueeze(0).contiguous()
            out, (h, c) = self.rnn(x, (h, c))
            return out, torch.cat([h[0], c[0]], 1)
        out, h = self.rnn(x, h)
        return out, h[0]


def memory_init(memory: Memory) -> None:
    """Orthogonal recurrent and input weights (gain 1), zero biases: CleanRL's
    ``ppo_atari_lstm`` initialisation."""
    for name, param in memory.rnn.named_parameters():
        if name.startswith("bias"):
            nn.init.zeros_(param)
        else:
            nn.init.orthogonal_(param, 1.0)
