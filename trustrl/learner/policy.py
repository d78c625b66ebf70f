"""The actor-critic: observation normalizer, actor MLP with an action head, critic MLP.

The normalizer lives inside the policy (``RunningMeanStd``, computing with normalize.py's
numpy ``MeanStd``), so one ``state_dict`` holds everything needed to act. Actor and
critic are separate networks: TRPO and the separate-optimizer PPO setting step them
independently, and a critic loss can never reach actor weights.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any, cast

import numpy as np
import torch
from torch import Tensor, nn

from trustrl.acting import parts
from trustrl.acting.conv import cnn_settings
from trustrl.config import ConfigError, PolicyConfig
from trustrl.envs.layout import Entry
from trustrl.envs.rows import AgentGroup
from trustrl.envs.spaces import SpaceSpec
from trustrl.learner.cnn import ConvEncoder
from trustrl.learner.heads import (
    ActionHead,
    CategoricalHead,
    DiagGaussianHead,
    MultiCategoricalHead,
    StackedLinear,
)
from trustrl.learner.memory import Memory, Sequences, keep_gate_bias, memory_init
from trustrl.normalize import MeanStd, RunningStats

ACTIVATIONS: dict[str, type[nn.Module]] = {"tanh": nn.Tanh, "relu": nn.ReLU}


class RunningMeanStd(nn.Module):
    """A normalizer that is part of the model: ``MeanStd``'s statistics as float64
    buffers, so that they ride along in ``state_dict``; ``forward`` standardizes and clips
    a tensor. Every update is ``MeanStd``'s, on numpy views of the buffers (``numpy``)."""

    mean: Tensor
    var: Tensor
    count: Tensor

    def __init__(
        self, shape: tuple[int, ...] | int = (), clip: float = 10.0, epsilon: float = 1e-8
    ):
        super().__init__()
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        self.clip = clip
        self.epsilon = epsilon
        self.register_buffer("mean", torch.zeros(shape, dtype=torch.float64))
        self.register_buffer("var", torch.ones(shape, dtype=torch.float64))
        self.register_buffer("count", torch.zeros((), dtype=torch.float64))
        self._numpy: tuple[Tensor, MeanStd] | None = None

    @property
    def numpy(self) -> MeanStd:
        """The statistics as a ``MeanStd`` over views of the buffers (cached while they are
        the same tensors; ``load_state_dict`` copies in place, so the views stay valid)."""
        cached = self._numpy
        # _buffers directly: nn.Module's attribute lookup is slow for a per-step call.
        if cached is None or cached[0] is not self._buffers["mean"]:
            arrays = (self.mean.numpy(), self.var.numpy(), self.count.numpy())
            cached = self._numpy = (
                self.mean,
                MeanStd(arrays[0].shape, self.clip, self.epsilon, arrays),
            )
        return cached[1]

    def update(self, batch: Tensor | np.ndarray) -> None:
        """Fold in a batch of shape (B, *shape) (``MeanStd.update``)."""
        self.numpy.update(batch.detach().cpu().numpy() if isinstance(batch, Tensor) else batch)

    def stats(self) -> RunningStats:
        """A copy of the statistics, for a policy snapshot."""
        return self.numpy.stats()

    def merge(self, delta: RunningStats) -> None:
        """Fold in a runner's delta (``MeanStd.merge``): the learner's one way of taking in
        observations."""
        self.numpy.merge(delta)

    def forward(self, x: Tensor) -> Tensor:
        width = self.mean.shape[-1] if self.mean.dim() == 1 else None
        if width is not None and x.shape[-1] > width:
            # A structured row: its leading columns are the float vectors (envs/layout.py).
            return torch.cat([self.forward(x[..., :width]), x[..., width:].to(x.dtype)], -1)
        # A twin on an accelerator shares these CPU statistics (learner/updates/device.py).
        scale = torch.rsqrt(self.var.to(x.device, x.dtype) + self.epsilon)
        return ((x - self.mean.to(x.device, x.dtype)) * scale).clamp(-self.clip, self.clip)


class MLP(nn.Sequential):
    """Hidden layers of ``hidden_sizes``, each followed by the activation."""

    def __init__(self, in_features: int, hidden_sizes: Sequence[int], activation: str) -> None:
        layers: list[nn.Module] = []
        for width in hidden_sizes:
            layers += [nn.Linear(in_features, width), ACTIVATIONS[activation]()]
            in_features = width
        super().__init__(*layers)
        self.out_features = in_features

    def forward(self, x: Tensor, agent: Tensor | None = None) -> Tensor:
        return super().forward(x)


def mlp(in_features: int, hidden_sizes: Sequence[int], activation: str) -> MLP:
    return MLP(in_features, hidden_sizes, activation)


def mlp_encoder(in_features: int, settings: dict[str, Any], num_agents: int | None) -> nn.Module:
    """The "mlp" encoder part (acting/parts.py): an MLP, or with ``num_agents`` one per
    agent, stacked."""
    hidden, activation = tuple(settings["hidden_sizes"]), settings["activation"]
    if num_agents is not None:
        return StackedMLP(num_agents, in_features, hidden, activation)
    return MLP(in_features, hidden, activation)


class Structured(nn.Module):
    """The encoder of a structured observation (envs/layout.py; acting/parts.py): the
    packed row's entries, each image through its own CNN (``front.<i>``), every other
    entry's columns as floats, then any extra columns (the agent id), concatenated into
    the registered encoder (``body``). Its numpy twin is ``parts.NumpyStructured``."""

    def __init__(
        self,
        entries: tuple[Entry, ...],
        settings: dict[str, Any],
        extra: int,
        num_agents: int | None,
    ) -> None:
        super().__init__()
        self.front = nn.ModuleDict()
        self.columns: list[tuple[int, int, str | None]] = []
        offset, features = 0, extra
        for index, entry in enumerate(entries):
            name = None
            if entry["kind"] == "image":
                name = str(index)
                cnn = ConvEncoder(**cnn_settings(entry, settings))
                self.front[name] = cnn
                features += cnn.out_features
            else:
                features += entry["width"]
            self.columns.append((offset, offset + entry["width"], name))
            offset += entry["width"]
        self.width = offset
        self.body = parts.encoder(settings["encoder"]).build_torch(features, settings, num_agents)
        self.out_features: int = self.body.out_features

    def forward(self, x: Tensor, agent: Tensor | None = None) -> Tensor:
        pieces = []
        for start, stop, name in self.columns:
            columns = x[:, start:stop]
            if name is not None:
                cnn = cast("ConvEncoder", self.front[name])
                # x.shape[0], not len(x): tracing (export) keeps the batch axis dynamic.
                pieces.append(cnn(columns.reshape(x.shape[0], *cnn.image_shape)))
            else:
                pieces.append(columns.to(torch.float32))
        if x.shape[1] > self.width:  # the agent id's columns
            pieces.append(x[:, self.width :].to(torch.float32))
        features = pieces[0] if len(pieces) == 1 else torch.cat(pieces, 1)
        return self.body(features, agent)


class SharedFeatures(nn.Module):
    """The critic's encoder where it shares the actor's (``policy.share_encoder``): no
    weights of its own; ``Policy.value_raw`` feeds the value layer the actor's features."""

    def __init__(self, out_features: int) -> None:
        super().__init__()
        self.out_features = out_features

    def forward(self, x: Tensor, agent: Tensor | None = None) -> Tensor:
        raise RuntimeError("a shared critic encoder is the actor's: call Policy.value_raw")


def build_encoder(
    entries: tuple[Entry, ...], in_features: int, settings: dict[str, Any], num_agents: int | None
) -> nn.Module:
    """A policy's encoder over rows of ``in_features`` columns: the registered encoder on a
    flat Box's row, ``Structured`` around it on a structured observation's."""
    if entries:
        width = sum(e["width"] for e in entries)
        return Structured(entries, settings, in_features - width, num_agents)
    return parts.encoder(settings["encoder"]).build_torch(in_features, settings, num_agents)


def orthogonal_init(module: nn.Module, gain: float) -> None:
    """Orthogonal weights, zero biases (Saxe et al. 2014; Andrychowicz et al. 2021, C57)."""
    for layer in module.modules():
        if isinstance(layer, nn.Linear):
            nn.init.orthogonal_(layer.weight, gain=gain)
            nn.init.zeros_(layer.bias)
        elif isinstance(layer, StackedLinear):
            for agent in range(layer.num_agents):
                nn.init.orthogonal_(layer.weight[agent], gain=gain)
            nn.init.zeros_(layer.bias)


class StackedMLP(nn.Module):
    """Per-agent MLPs evaluated together: one batched matmul per layer, no loop over agents."""

    def __init__(
        self, num_agents: int, in_features: int, hidden_sizes: tuple[int, ...], activation: str
    ) -> None:
        super().__init__()
        sizes = (in_features, *hidden_sizes)
        self.layers = nn.ModuleList(
            StackedLinear(num_agents, a, b) for a, b in itertools.pairwise(sizes)
        )
        self.activation = ACTIVATIONS[activation]()
        self.out_features = sizes[-1]

    def forward(self, x: Tensor, agent: Tensor) -> Tensor:
        for layer in self.layers:
            x = self.activation(layer(x, agent))
        return x


def memory_core(config: PolicyConfig, in_features: int, num_agents: int | None = None) -> Memory:
    """A side's memory core (``policy.memory``) on ``in_features`` features, with the hidden
    layers after it (``policy.post_memory_sizes``); ``num_agents`` set: one per agent."""
    post = None
    if config.post_memory_sizes:
        settings = {"hidden_sizes": config.post_memory_sizes, "activation": config.activation}
        post = mlp_encoder(config.memory_size, settings, num_agents)
    return Memory(config.memory, in_features, config.memory_size, num_agents, post)


def make_head(
    spec: SpaceSpec, in_features: int, config: PolicyConfig, num_agents: int | None = None
) -> nn.Module:
    """The action head; ``num_agents`` set: one output layer per agent, stacked."""
    if spec.action_kind == "discrete":
        return CategoricalHead(in_features, spec.nvec[0], num_agents)
    if spec.action_kind == "multidiscrete":
        return MultiCategoricalHead(in_features, spec.nvec, num_agents)
    return DiagGaussianHead(in_features, spec.action_shape[0], config.log_std_init, num_agents)


class Policy(nn.Module):
    """Actor-critic over flat float32 observations (B, obs_dim).

    Multi-agent groups use the same module with an agent index per row: ``num_agents``
    agents share the spaces; ``per_agent`` gives each its own actor (stacked weights),
    otherwise one actor serves all, with the agent's one-hot id appended when
    ``agent_id``. The critic is one per group, shared by its agents, reading the
    observation or ``critic_dim`` features of a global state (plus the agent id).
    """

    def __init__(
        self,
        spec: SpaceSpec,
        config: PolicyConfig | None = None,
        normalize_obs: bool = False,
        obs_clip: float = 10.0,
        num_agents: int = 1,
        per_agent: bool = False,
        agent_id: bool = False,
        critic_dim: int | None = None,
        value_norm: bool = False,
    ) -> None:
        super().__init__()
        config = config or PolicyConfig()
        self.spec = spec
        self.config = config
        self.num_agents = num_agents
        self.per_agent = per_agent
        self.agent_id = agent_id
        self.critic_dim = critic_dim
        # The normalizer covers the row's float vectors (all of a flat Box's row, none of a
        # frame's: images are scaled inside the model).
        self.obs_normalizer = (
            RunningMeanStd(spec.vector_dim, clip=obs_clip)
            if normalize_obs and spec.vector_dim
            else None
        )
        self.critic_normalizer = (
            RunningMeanStd(critic_dim, clip=obs_clip) if normalize_obs and critic_dim else None
        )
        # Value normalization: the critic predicts standardized returns.
        self.value_normalizer = RunningMeanStd((), clip=1e6) if value_norm else None
        # The parts (acting/parts.py): an encoder each for the actor and the critic, then
        # the action head and the value layer. Built in this order: the initial weights
        # depend on the order the modules draw from torch's generator.
        settings, entries = asdict(config), spec.obs_entries
        id_width = num_agents if agent_id else 0
        self.actor: nn.Module
        self.head: ActionHead
        # The memory core (policy.memory): between each side's encoder and its output layer.
        self.actor_memory: Memory | None = None
        self.critic_memory: Memory | None = None
        if per_agent:
            self.actor = build_encoder(entries, spec.obs_dim, settings, num_agents)
            features: int = self.actor.out_features  # type: ignore[assignment]
            if config.memory != "none":  # one core per agent, stacked
                self.actor_memory = memory_core(config, features, num_agents)
                features = self.actor_memory.out_features
            self.head = make_head(spec, features, config, num_agents)  # type: ignore[assignment]
        else:
            self.actor = build_encoder(entries, spec.obs_dim + id_width, settings, None)
            features = self.actor.out_features  # type: ignore[assignment]
            if config.memory != "none":
                self.actor_memory = memory_core(config, features)
                features = self.actor_memory.out_features
            self.head = make_head(spec, features, config)  # type: ignore[assignment]
        critic_in = (critic_dim or spec.obs_dim) + id_width
        self.share_encoder = config.share_encoder
        critic_encoder: nn.Module
        if config.share_encoder:  # the critic's value layer reads the actor's features
            if critic_dim is not None:
                raise ConfigError(
                    "policy.share_encoder: this critic reads a global state "
                    "(multiagent.critic_input), not the actor's observation"
                )
            critic_encoder = SharedFeatures(features)
        else:
            # A critic reading a global state (multi-agent) reads a flat vector.
            critic_encoder = build_encoder(
                entries if critic_dim is None else (), critic_in, settings, None
            )
        critic_features = cast("int", critic_encoder.out_features)
        if config.memory != "none" and not config.share_encoder:
            self.critic_memory = memory_core(config, critic_features)
            critic_features = self.critic_memory.out_features
        self.critic = nn.Sequential(critic_encoder, nn.Linear(critic_features, 1))
        if config.ortho_init:
            orthogonal_init(self.actor, math.sqrt(2))
            orthogonal_init(self.critic[0], math.sqrt(2))
            for memory in (self.actor_memory, self.critic_memory):
                if memory is not None:
                    memory_init(memory)
                    if memory.post is not None:
                        orthogonal_init(memory.post, math.sqrt(2))
            # A near-uniform initial policy keeps every action explorable.
            orthogonal_init(self.head.linear, 0.01)  # type: ignore[attr-defined]
            orthogonal_init(self.critic[1], 1.0)
        if config.memory_gate_bias:
            for memory in (self.actor_memory, self.critic_memory):
                if memory is not None:
                    keep_gate_bias(memory, config.memory_gate_bias)

    # The pieces the updates use.

    @property
    def device(self) -> torch.device:
        """Where the weights are: the CPU, or an accelerator for a twin the update trains
        there (learner/updates/device.py)."""
        return self.head.linear.weight.device  # type: ignore[attr-defined, no-any-return]

    @property
    def state_size(self) -> int:
        """Columns of a row's recurrent state: the actor memory's, then the critic's own
        (0: no memory)."""
        return sum(m.state_size for m in (self.actor_memory, self.critic_memory) if m)

    def _remember(
        self,
        memory: Memory,
        x: Tensor,
        sequences: Sequences | None,
        offset: int,
        agent: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Rows (C * L, features), chunk by chunk (``Sequences``), through ``memory`` from
        the chunks' states (their columns from ``offset``) -> (outputs (C * L, size),
        final states (C, memory's state_size)). ``agent`` (C * L,): the rows' agents, for
        per-agent cores (a chunk is one row's, so one agent's)."""
        if sequences is None:
            raise ValueError(
                "this policy has memory (policy.memory): give the rows' sequences and states"
            )
        length = sequences.length
        chunks = x.shape[0] // length
        state = sequences.state[:, offset : offset + memory.state_size]
        chunk_agent = agent.reshape(chunks, length)[:, 0] if agent is not None else None
        out, final = memory(x.reshape(chunks, length, -1).transpose(0, 1), state, agent=chunk_agent)
        return out.transpose(0, 1).reshape(chunks * length, -1), final

    def normalize(self, obs: Tensor) -> Tensor:
        return self.obs_normalizer(obs) if self.obs_normalizer is not None else obs

    def normalize_critic(self, critic_obs: Tensor) -> Tensor:
        if self.critic_normalizer is None:
            return critic_obs
        return self.critic_normalizer(critic_obs)

    def _with_id(self, x: Tensor, agent: Tensor | None) -> Tensor:
        if not self.agent_id:
            return x
        if agent is None:
            raise ValueError("this policy appends agent ids: give the agent index of every row")
        return torch.cat([x, nn.functional.one_hot(agent, self.num_agents).to(x.dtype)], -1)

    def features(
        self, obs: Tensor, agent: Tensor | None = None, sequences: Sequences | None = None
    ) -> Tensor:
        """The actor's encoder output, through its memory core where it has one (with
        ``policy.share_encoder``, the critic's too). A recurrent policy's rows come in
        ``sequences``: chunk by chunk, each chunk's steps in order."""
        features = self.encode(obs, agent)
        if self.actor_memory is not None:
            features = self._remember(self.actor_memory, features, sequences, 0, agent)[0]
        return features

    def encode(self, obs: Tensor, agent: Tensor | None = None) -> Tensor:
        """The actor's encoder on its rows: per-agent encoders take each row's agent, a
        shared one reads the agent's id where the policy appends it."""
        if self.per_agent:
            if agent is None:
                raise ValueError("per-agent actors need the agent index of every row")
            return cast("Tensor", self.actor(obs, agent))
        return cast("Tensor", self.actor(self._with_id(obs, agent)))

    def dist_params(
        self,
        obs: Tensor,
        mask: Tensor | None = None,
        agent: Tensor | None = None,
        features: Tensor | None = None,
        sequences: Sequences | None = None,
    ) -> Tensor:
        """The action head's parameters; ``features`` given (``features(obs, agent)``,
        computed once for the actor and a shared critic), the encoder is not run again."""
        if features is None:
            features = self.features(obs, agent, sequences)
        if self.per_agent:
            return self.head.forward(features, mask, agent)
        return self.head.forward(features, mask)

    def value_raw(
        self,
        obs: Tensor,
        critic_obs: Tensor | None = None,
        agent: Tensor | None = None,
        features: Tensor | None = None,
        sequences: Sequences | None = None,
    ) -> Tensor:
        """The critic's output (standardized when value normalization is on)."""
        if self.share_encoder:  # the value layer on the actor's features
            if features is None:
                features = self.features(obs, agent, sequences)
            return self.critic[1](features).squeeze(-1)
        x = self._with_id(critic_obs if critic_obs is not None else obs, agent)
        if self.critic_memory is None:
            return self.critic(x).squeeze(-1)
        offset = self.actor_memory.state_size if self.actor_memory is not None else 0
        x, _ = self._remember(self.critic_memory, self.critic[0](x), sequences, offset)
        return self.critic[1](x).squeeze(-1)

    def critic_value(
        self,
        obs: Tensor,
        critic_obs: Tensor | None = None,
        agent: Tensor | None = None,
        sequences: Sequences | None = None,
    ) -> Tensor:
        """The critic's value of normalized inputs, in reward units (``value`` is the same
        from raw observations)."""
        raw = self.value_raw(obs, critic_obs, agent, sequences=sequences)
        norm = self.value_normalizer
        if norm is None:
            return raw
        return raw * norm.var.sqrt().to(raw.device, raw.dtype) + norm.mean.to(raw.device, raw.dtype)

    def value_targets(
        self, returns: Tensor, old_values: Tensor, rows: Callable[[Tensor], Tensor] | None = None
    ) -> tuple[Tensor, Tensor]:
        """Returns and old values in the units of ``value_raw``; with value normalization
        this first folds the returns into the running statistics (those ``rows`` selects:
        a sequence batch's real steps, ``Batch.loss``)."""
        norm = self.value_normalizer
        if norm is None:
            return returns, old_values
        norm.update(rows(returns) if rows is not None else returns)
        mean = norm.mean.to(returns.device, returns.dtype)
        std = norm.var.sqrt().to(returns.device, returns.dtype) + 1e-8
        return (returns - mean) / std, (old_values - mean) / std

    def actor_parameters(self) -> list[nn.Parameter]:
        memory = self.actor_memory
        return [
            *self.actor.parameters(),
            *(memory.parameters() if memory is not None else ()),
            *self.head.parameters(),  # type: ignore[attr-defined]
        ]

    def critic_parameters(self) -> list[nn.Parameter]:
        memory = self.critic_memory
        return [*self.critic.parameters(), *(memory.parameters() if memory is not None else ())]

    def step_memory(
        self,
        obs: Tensor,
        state: Tensor,
        agent: Tensor | None = None,
        critic: bool = True,
    ) -> tuple[Tensor, Tensor]:
        """One step of a recurrent policy on normalized ``obs`` (B, obs_dim) from ``state``
        (B, state_size): (the actor's features, for ``dist_params``; the next states: the
        actor core's columns, then the critic core's, which stay as they were without
        ``critic``: acting where the critic's input, a global state, is not at hand)."""
        actor_memory = self.actor_memory
        assert actor_memory is not None
        sequences = Sequences(state, 1)
        features, after = self._remember(actor_memory, self.encode(obs, agent), sequences, 0, agent)
        if self.critic_memory is not None:
            split = actor_memory.state_size
            critic_after = state[:, split:]
            if critic:
                x = self.critic[0](self._with_id(obs, agent))
                critic_after = self._remember(self.critic_memory, x, sequences, split)[1]
            after = torch.cat([after, critic_after], 1)
        return features, after

    @torch.inference_mode()
    def step(
        self,
        obs: Tensor,
        mask: Tensor | None = None,
        generator: torch.Generator | None = None,
        critic_obs: Tensor | None = None,
        agent: Tensor | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Sampling in torch on normalized obs: (actions, logprob, value). The collector acts
        with the numpy equivalent (inference.py); this is the reference it is tested against."""
        params = self.dist_params(obs, mask, agent)
        actions = self.head.sample(params, generator)
        return (
            actions,
            self.head.log_prob(params, actions),
            self.critic_value(obs, critic_obs, agent),
        )

    def register_agent(self) -> list[tuple[nn.Parameter, nn.Parameter, int]]:
        """Add one agent: a fresh actor of its own in per-agent mode, a new id column for
        the actor and the critic when ids are appended (zero weights: every existing
        agent's outputs are unchanged).

        Returns (old parameter, new parameter, dimension grown) for each replaced
        parameter, for ``trustrl.learner.optim.Adam.grow``.
        """
        grown: list[tuple[nn.Parameter, nn.Parameter, int]] = []

        def replace(name: str, value: Tensor, dim: int) -> None:
            owner, _, leaf = name.rpartition(".")
            module = self.get_submodule(owner)
            old = getattr(module, leaf)
            new = nn.Parameter(value)
            setattr(module, leaf, new)
            grown.append((old, new, dim))

        if self.per_agent:
            fresh = Policy(self.spec, self.config, num_agents=1, per_agent=True)
            fresh_params = dict(fresh.named_parameters())
            for name, param in list(self.named_parameters()):
                if name.startswith(("actor.", "actor_memory.", "head.")):
                    added = fresh_params[name].detach().to(param.device)
                    replace(name, torch.cat([param.detach(), added], 0), 0)
        if self.agent_id:
            names = (
                ["critic.0.0.weight"] if self.per_agent else ["actor.0.weight", "critic.0.0.weight"]
            )
            params = dict(self.named_parameters())
            for name in names:
                weight = params[name].detach()
                replace(name, torch.cat([weight, weight.new_zeros(len(weight), 1)], 1), 1)
        self.num_agents += 1
        return grown

    # The user-facing API.

    @torch.inference_mode()
    def act(self, obs: Any, deterministic: bool = True, mask: Any = None, state: Any = None) -> Any:
        """Action(s) for the env from raw observation(s).

        ``obs`` is one observation (as the env returns it, a dict with 'observation' and
        'action_mask' included) or a batch; the answer has the same batching. A mask may
        also be given directly (e.g. from ``info["action_mask"]``).

        A policy with memory (``policy.memory``) answers ``(actions, state)``: pass that
        state with the next observation of the same episode, and None (zeros) at an
        episode's start; a state is a float32 row of ``state_size`` per observation.
        """
        if self.state_size:
            return self._act_recurrent(obs, deterministic, mask, state)
        spec = self.spec
        single = spec.is_single(obs)
        if single:
            obs = _add_batch_dim(obs)
            if mask is not None:
                mask = np.asarray(mask)[None]
        flat, dict_mask = spec.split(obs)
        if mask is None:
            mask = dict_mask
        mask_t = torch.as_tensor(np.asarray(mask, dtype=bool)) if mask is not None else None
        x = self.normalize(torch.as_tensor(flat))
        params = self.dist_params(x, mask_t)
        actions = self.head.mode(params) if deterministic else self.head.sample(params)
        env_actions = spec.to_env(actions.numpy())
        return env_actions[0] if single else env_actions

    def _act_recurrent(self, obs: Any, deterministic: bool, mask: Any, state: Any) -> Any:
        spec = self.spec
        single = spec.is_single(obs)
        if single:
            obs = _add_batch_dim(obs)
            mask = np.asarray(mask)[None] if mask is not None else None
            state = np.asarray(state, np.float32)[None] if state is not None else None
        flat, dict_mask = spec.split(obs)
        mask = mask if mask is not None else dict_mask
        rows = len(flat)
        if state is None:
            state = np.zeros((rows, self.state_size), np.float32)
        state_t = torch.as_tensor(np.asarray(state, np.float32))
        x = self.normalize(torch.as_tensor(flat))
        mask_t = torch.as_tensor(np.asarray(mask, dtype=bool)) if mask is not None else None
        features, after = self.step_memory(x, state_t)
        params = self.dist_params(x, mask_t, features=features)
        actions = self.head.mode(params) if deterministic else self.head.sample(params)
        env_actions = spec.to_env(actions.numpy())
        next_state = after.numpy()
        if single:
            return env_actions[0], next_state[0]
        return env_actions, next_state

    @torch.inference_mode()
    def value(self, obs: Any, state: Any = None) -> Any:
        """The critic's estimate of the return from raw observation(s), as ``act`` takes
        them: the observation normalizer is applied and, with value normalization, the
        output is put back into reward units (of the rewards the critic was trained on:
        scaled ones when ``env.normalize_reward`` is on). One observation gives a float,
        a batch a float32 array (B,).

        Single-agent policies only: a multi-agent group's critic reads a global state and
        the agent's id (``MultiAgentPolicy`` has no ``value``).
        """
        if self.critic_dim is not None or self.num_agents > 1:
            raise ValueError(
                "Policy.value reads one observation per row: this policy's critic takes a "
                "global state and agent ids (multi-agent)"
            )
        single = self.spec.is_single(obs)
        if single:
            obs = _add_batch_dim(obs)
        flat, _ = self.spec.split(obs)
        sequences = None
        if self.state_size:  # a recurrent critic: from ``state`` (``act``'s), zeros if None
            rows = np.zeros((len(flat), self.state_size), np.float32)
            if state is not None:
                rows[:] = np.asarray(state, np.float32).reshape(len(flat), -1)
            sequences = Sequences(torch.from_numpy(rows), 1)
        x = self.normalize(torch.as_tensor(flat))
        values = self.critic_value(x, sequences=sequences).numpy()
        return float(values[0]) if single else values

    def describe(self) -> dict[str, Any]:
        """What it takes to rebuild this module (stored in checkpoints as JSON)."""
        return {
            "spec": self.spec.to_json(),
            "policy": {
                k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self.config).items()
            },
            "normalize_obs": self.obs_normalizer is not None,
            "obs_clip": self.obs_normalizer.clip if self.obs_normalizer is not None else 10.0,
            "num_agents": self.num_agents,
            "per_agent": self.per_agent,
            "agent_id": self.agent_id,
            "critic_dim": self.critic_dim,
            "value_norm": self.value_normalizer is not None,
        }

    @classmethod
    def from_description(cls, description: dict[str, Any]) -> Policy:
        policy_table = dict(description["policy"])
        for name in ("hidden_sizes", "cnn_channels", "cnn_kernels", "cnn_strides"):
            if name in policy_table:
                policy_table[name] = tuple(policy_table[name])
        return cls(
            SpaceSpec.from_json(description["spec"]),
            PolicyConfig(**policy_table),
            normalize_obs=description["normalize_obs"],
            obs_clip=description["obs_clip"],
            num_agents=description.get("num_agents", 1),
            per_agent=description.get("per_agent", False),
            agent_id=description.get("agent_id", False),
            critic_dim=description.get("critic_dim"),
            value_norm=description.get("value_norm", False),
        )


def _add_batch_dim(obs: Any) -> Any:
    if isinstance(obs, dict):
        return {k: np.asarray(v)[None] for k, v in obs.items()}
    return np.asarray(obs)[None]


class MultiAgentPolicy(nn.Module):
    """One ``Policy`` per agent group; acts on PettingZoo observation dicts."""

    def __init__(self, groups: list[AgentGroup], policies: list[Policy]) -> None:
        super().__init__()
        self.groups = groups
        self.policies = nn.ModuleList(policies)

    @property
    def members(self) -> list[Policy]:
        return cast("list[Policy]", list(self.policies))

    def describe(self) -> dict[str, Any]:
        return {
            "groups": [
                {"name": g.name, "agents": list(g.agents), "policy": p.describe()}
                for g, p in zip(self.groups, self.members, strict=True)
            ]
        }

    @classmethod
    def from_description(cls, description: dict[str, Any]) -> MultiAgentPolicy:
        groups, policies = [], []
        for entry in description["groups"]:
            policy = Policy.from_description(entry["policy"])
            groups.append(
                AgentGroup(entry["name"], tuple(entry["agents"]), policy.spec, policy.critic_dim)
            )
            policies.append(policy)
        return cls(groups, policies)

    @property
    def state_size(self) -> int:
        """Columns of one agent's recurrent state (0: no memory)."""
        return max(p.state_size for p in self.members)

    @torch.inference_mode()
    def act(
        self, observations: dict[str, Any], deterministic: bool = True, state: Any = None
    ) -> Any:
        """Actions for the agents present in ``observations`` (a PettingZoo obs dict).

        With memory (``policy.memory``) the answer is ``(actions, states)``: ``state`` is
        the dict of each agent's state from the last call (None, or an agent missing from
        it: zeros, an episode's start)."""
        actions: dict[str, Any] = {}
        states: dict[str, np.ndarray] = {}
        for group, policy in zip(self.groups, self.members, strict=True):
            present = [a for a in group.agents if a in observations]
            if not present:
                continue
            raw = [observations[a] for a in present]
            for name, obs in zip(present, raw, strict=True):
                if not group.spec.is_single(obs):
                    raise ValueError(
                        f"{name}: expected one observation of shape {group.spec.obs_shape}, "
                        f"got shape {np.shape(obs)}"
                    )
            if group.spec.dict_obs:
                batch: Any = {
                    "observation": np.stack([r["observation"] for r in raw]),
                    "action_mask": np.stack([r["action_mask"] for r in raw]),
                }
            else:
                batch = np.stack([np.asarray(r, dtype=np.float32) for r in raw])
            flat, mask = group.spec.split(batch)
            agent = torch.tensor([group.agents.index(a) for a in present])
            x = policy.normalize(torch.as_tensor(flat))
            mask_t = torch.as_tensor(mask) if mask is not None else None
            features = None
            if policy.state_size:
                given = state or {}
                before = np.zeros((len(present), policy.state_size), np.float32)
                for row, name in enumerate(present):
                    if given.get(name) is not None:
                        before[row] = given[name]
                # The critic's columns stay as they were: its input, a global state, is not
                # at hand here, and acting does not need it.
                features, after = policy.step_memory(
                    x, torch.from_numpy(before), agent, critic=False
                )
                states.update(zip(present, after.numpy(), strict=True))
            params = policy.dist_params(x, mask_t, agent, features)
            chosen = policy.head.mode(params) if deterministic else policy.head.sample(params)
            for a, action in zip(present, group.spec.to_env(chosen.numpy()), strict=True):
                actions[a] = action
        return (actions, states) if self.state_size else actions


def check_agents(policy: MultiAgentPolicy, env: Any, env_id: str) -> None:
    """Refuse an env whose agents or spaces the policy was not trained for, naming them."""
    missing = [a for g in policy.groups for a in g.agents if a not in env.possible_agents]
    if missing:
        raise ValueError(
            f"this policy acts for agents {', '.join(missing)}, which {env_id} does not have "
            f"(its agents: {', '.join(env.possible_agents)})"
        )
    for group in policy.groups:
        for agent in group.agents:
            spec = SpaceSpec.from_spaces(env.observation_space(agent), env.action_space(agent))
            if not group.spec.compatible(spec):
                raise ValueError(
                    f"this policy was trained for {agent} with {group.spec.summary()}; "
                    f"{env_id}'s {agent} has {spec.summary()}"
                )
