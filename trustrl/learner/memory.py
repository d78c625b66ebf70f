"""A policy's memory core in torch: one LSTM or GRU layer between the encoder and the heads,
and any hidden layers after it (its numpy twin, acting/memory.py, acts with the same
weights)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch
from torch import Tensor, nn

from trustrl.acting.memory import state_size


@dataclass(frozen=True)
class Sequences:
    """How a recurrent policy's rows (C * L of them) are laid out: C chunks of ``length``
    steps each, chunk by chunk; ``state`` (C, state_size) is each chunk's start state (a
    chunk never holds an episode start after its first step: ``chunk_layout`` cuts there)."""

    state: Tensor
    length: int


class StackedRNN(nn.Module):
    """One LSTM or GRU layer per agent, stored stacked under ``torch.nn.LSTM``'s names:
    ``weight_ih_l0`` (A, gates x size, in), ``weight_hh_l0`` (A, gates x size, size),
    ``bias_ih_l0`` and ``bias_hh_l0`` (A, gates x size); each sequence goes through its
    agent's. Stepped in time (torch's fused module has no per-row weights); each step's
    gates are two ``StackedLinear``-style matmuls against every agent's weights at once."""

    weight_ih_l0: nn.Parameter
    weight_hh_l0: nn.Parameter
    bias_ih_l0: nn.Parameter
    bias_hh_l0: nn.Parameter

    def __init__(self, kind: str, in_features: int, size: int, num_agents: int) -> None:
        super().__init__()
        self.kind, self.size = kind, size
        references = [_rnn(kind, in_features, size) for _ in range(num_agents)]
        for name in ("weight_ih_l0", "weight_hh_l0", "bias_ih_l0", "bias_hh_l0"):
            stacked = torch.stack([getattr(r, name).detach() for r in references])
            self.register_parameter(name, nn.Parameter(stacked))

    def _linear(self, x: Tensor, weight: Tensor, bias: Tensor, agent: Tensor) -> Tensor:
        agents, out, inp = weight.shape
        every = (x @ weight.permute(2, 0, 1).reshape(inp, agents * out)).view(-1, agents, out)
        rows = torch.arange(len(x), device=x.device)
        return every[rows, agent] + bias[agent]

    def step(self, x: Tensor, state: Tensor, agent: Tensor) -> Tensor:
        """(C, in) inputs, (C, state_size) states, (C,) agents -> the next states."""
        size = self.size
        h = state[:, :size]
        gx = self._linear(x, self.weight_ih_l0, self.bias_ih_l0, agent)
        gh = self._linear(h, self.weight_hh_l0, self.bias_hh_l0, agent)
        if self.kind == "lstm":
            i, f, g, o = (gx + gh).chunk(4, 1)
            c = torch.sigmoid(f) * state[:, size:] + torch.sigmoid(i) * torch.tanh(g)
            return torch.cat([torch.sigmoid(o) * torch.tanh(c), c], 1)
        r = torch.sigmoid(gx[:, :size] + gh[:, :size])
        z = torch.sigmoid(gx[:, size : 2 * size] + gh[:, size : 2 * size])
        n = torch.tanh(gx[:, 2 * size :] + r * gh[:, 2 * size :])
        return (1.0 - z) * n + z * h


def _rnn(kind: str, in_features: int, size: int) -> nn.LSTM | nn.GRU:
    return nn.LSTM(in_features, size) if kind == "lstm" else nn.GRU(in_features, size)


Outputs = tuple[Tensor, Tensor]  # a core's outputs over the steps, and its final states


class Memory(nn.Module):
    """``torch.nn.LSTM`` or ``torch.nn.GRU`` of one layer over (L, C, features) sequences,
    each sequence starting from its (C, state_size) state (an LSTM's ``[h, c]``, a GRU's
    ``h``); with ``num_agents``, one layer per agent (``StackedRNN``), each sequence
    taking its agent's."""

    def __init__(
        self,
        kind: str,
        in_features: int,
        size: int,
        num_agents: int | None = None,
        post: nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.kind = kind
        self.rnn: nn.Module = (
            StackedRNN(kind, in_features, size, num_agents)
            if num_agents is not None
            else _rnn(kind, in_features, size)
        )
        self.size = size
        # The layers after the core (policy.post_memory_sizes): ``forward(x, agent)`` on
        # (rows, size) outputs, per agent where the core is.
        self.post = post
        self.out_features: int = post.out_features if post is not None else size  # type: ignore[assignment]
        self.state_size = state_size(kind, size)

    def forward(
        self,
        x: Tensor,
        state: Tensor,
        resets: Tensor | None = None,
        agent: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """(L, C, in) inputs and (C, state_size) start states -> ((L, C, out_features)
        outputs, (C, state_size) final states). ``resets`` (L, C) bool zeroes a sequence's
        state before the steps it flags (an episode starting inside it), step by step;
        without any, the whole sequence is one call of the torch module. ``agent`` (C,):
        each sequence's agent, for per-agent layers."""
        out, state = self._core(x, state, resets, agent)
        if self.post is None:
            return out, state
        steps, chunks = out.shape[:2]
        rows_agent = agent.repeat(steps) if agent is not None else None  # time-major rows
        out = self.post(out.reshape(steps * chunks, -1), rows_agent)
        return out.reshape(steps, chunks, -1), state

    def _core(
        self, x: Tensor, state: Tensor, resets: Tensor | None, agent: Tensor | None
    ) -> Outputs:
        """``forward`` without the layers after the core: (L, C, size) outputs."""
        if isinstance(self.rnn, StackedRNN):
            if agent is None:
                raise ValueError("per-agent memory needs the agent index of every sequence")
            outputs = []
            for t in range(len(x)):
                if resets is not None:
                    state = state * (~resets[t]).to(state.dtype)[:, None]
                state = self.rnn.step(x[t], state, agent)
                outputs.append(state[:, : self.size])
            return torch.stack(outputs), state
        if resets is not None and bool(resets[1:].any()):
            outputs = []
            for t in range(len(x)):
                state = state * (~resets[t]).to(state.dtype)[:, None]
                out, state = self._core(x[t : t + 1], state, None, None)
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
        elif isinstance(memory.rnn, StackedRNN):  # each agent's matrix on its own
            for agent in range(len(param)):
                nn.init.orthogonal_(param[agent], 1.0)
        else:
            nn.init.orthogonal_(param, 1.0)


@torch.no_grad()
def keep_gate_bias(memory: Memory, bias: float) -> None:
    """Start the core keeping its state (``policy.memory_gate_bias``): the gate that carries
    the state over a step, the LSTM's forget gate f (gates i, f, g, o) or the GRU's update
    gate z (r, z, n; h' = (1 - z) n + z h), gets ``bias`` (input bias) and 0 (recurrent
    bias), so a step starts by keeping about sigmoid(bias) of the state instead of half
    (Gers et al. 2000; Jozefowicz et al. 2015: 1 for the LSTM's forget gate)."""
    size = memory.size
    keep = slice(size, 2 * size)  # f in i, f, g, o; z in r, z, n
    cast("Tensor", memory.rnn.bias_ih_l0)[..., keep] = bias
    cast("Tensor", memory.rnn.bias_hh_l0)[..., keep] = 0.0
