"""Configuration: frozen dataclasses, validated on construction, loaded from TOML.

Every field carries a docstring; the CLI turns them into ``--help``. A bad value is
refused where it is built, with a message that names the field, the value and what
is allowed. Derived sizes are properties and never written back.

Resolution order for ``trustrl train ENV_ID``: the dataclass defaults, then the
preset shipped for ``ENV_ID`` and the algorithm (``trustrl/presets/<algo>/<env>.toml``, or
with ``--preset NAME`` the named one, ``trustrl/presets/<algo>/<env>/<NAME>.toml``), then
the user's ``--config FILE``, then command-line flags.
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
import types
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

Activation = Literal["tanh", "relu"]
Backend = Literal["auto", "sync", "async", "vector"]
ObsStats = Literal["rollout", "step"]
Algo = Literal["ppo", "trpo"]
ActorMode = Literal["shared", "per_agent"]
CriticInput = Literal["global", "agent_state", "agent_centric", "local"]
NonFinite = Literal["error", "drop"]
MemoryKind = Literal["none", "lstm", "gru"]
ActionKind = Literal["discrete", "multidiscrete", "box"]


class ConfigError(ValueError):
    """A configuration value or file that cannot be used; the message says why."""


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def describe_value(value: object) -> str:
    """A value as a user wrote it, with its type: 'the string "no"', 'the integer 0'."""
    if isinstance(value, bool):
        return f"the boolean {str(value).lower()}"
    if isinstance(value, str):
        return f'the string "{value}"'
    if isinstance(value, int):
        return f"the integer {value}"
    if isinstance(value, float):
        return f"the number {value!r}"
    if isinstance(value, list | tuple):
        return f"the list {list(value)!r}"
    if isinstance(value, dict):
        return f"the table {value!r}"
    return f"{type(value).__name__} {value!r}"


_SCALARS: dict[type, str] = {
    bool: "true or false",
    int: "an integer",
    float: "a number",
    str: "a string",
}


def _type_ok(value: object, hint: Any) -> bool:
    """Whether ``value`` has the annotated type (bool is not a number here)."""
    origin, args = get_origin(hint), get_args(hint)
    if origin in (Union, types.UnionType):
        return any(_type_ok(value, option) for option in args)
    if hint is type(None):
        return value is None
    if origin is Literal:
        return isinstance(value, str) and value in args
    if origin is tuple:
        return isinstance(value, list | tuple) and all(_type_ok(v, args[0]) for v in value)
    if origin is dict:
        return isinstance(value, dict) and all(
            isinstance(k, str) and _type_ok(v, args[1]) for k, v in value.items()
        )
    if hint is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, hint)


def _expected(hint: Any) -> str:
    """What a field of type ``hint`` takes, in words."""
    origin, args = get_origin(hint), get_args(hint)
    if origin in (Union, types.UnionType):
        words = " or ".join(_expected(a) for a in args if a is not type(None))
        return words + (" (or left unset)" if type(None) in args else "")
    if origin is Literal:
        return "one of " + ", ".join(map(str, args))
    if origin is tuple:
        return f"a list of {_expected(args[0]).split(' ', 1)[1]}s"
    if origin is dict:
        return "a table of names to values (numbers, true or false, strings)"
    if dataclasses.is_dataclass(hint):
        return "a table"
    return _SCALARS[hint]


_HINTS: dict[type, dict[str, Any]] = {}


def _check_types(instance: Any, prefix: str) -> None:
    """Every field's type, before any range check: a bool takes only true/false, a number
    is not a string, a list field wants a list, a field of choices takes one of them (TOML
    and Python callers alike)."""
    cls = type(instance)
    hints = _HINTS.get(cls)
    if hints is None:
        hints = _HINTS[cls] = get_type_hints(cls)
    for f in dataclasses.fields(instance):
        value, hint = getattr(instance, f.name), hints[f.name]
        if _type_ok(value, hint):
            continue
        got = describe_value(value)
        if get_origin(hint) is dict and isinstance(value, dict):
            got = ", ".join(
                f"{k} = {describe_value(v)}"
                for k, v in value.items()
                if not _type_ok(v, get_args(hint)[1])
            )
        raise ConfigError(f"{prefix}{f.name} must be {_expected(hint)}, got {got}")


def _is_number(value: object) -> bool:
    """A finite int or float (True and False are not numbers here)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _check_widths(name: str, value: object, empty: str) -> None:
    """Layer widths: a list of positive integers (``empty`` says what none means)."""
    _require(
        isinstance(value, tuple | list)
        and all(isinstance(h, int) and not isinstance(h, bool) and h > 0 for h in value),
        f"{name} must be positive integers (empty: {empty}), got {value!r}",
    )


def _check_positive(name: str, value: float) -> None:
    _require(_is_number(value) and value > 0, f"{name} must be > 0, got {value!r}")


def _check_non_negative(name: str, value: float) -> None:
    _require(_is_number(value) and value >= 0, f"{name} must be >= 0, got {value!r}")


def _check_int(name: str, value: int, minimum: int) -> None:
    _require(
        isinstance(value, int) and not isinstance(value, bool) and value >= minimum,
        f"{name} must be an integer >= {minimum}, got {value!r}",
    )


def _check_unit(name: str, value: float, *, closed: bool) -> None:
    interval = "[0, 1]" if closed else "(0, 1)"
    ok = _is_number(value) and (0 <= value <= 1 if closed else 0 < value < 1)
    _require(ok, f"{name} must be in {interval}, got {value!r}")


def _check_minibatches(name: str, minibatches: int, batch_size: int) -> None:
    _require(
        minibatches <= batch_size,
        f"{name} must be <= environments x rollout.num_steps = {batch_size}, got {minibatches}",
    )


@dataclass(frozen=True)
class EnvConfig:
    """How environments are built and how their signals are scaled."""

    num_envs: int = 8
    """Environments stepped together; each contributes one row of the rollout."""
    backend: Backend = "auto"
    """Vector backend: sync (in-process), async (subprocesses, shared memory), vector (the env's own vectorized implementation, e.g. CartPole), or auto (vector where Gymnasium provides one, otherwise sync)."""
    kwargs: dict[str, int | float | bool | str] = field(default_factory=dict)
    """Keyword arguments for the environment constructor."""
    normalize_obs: bool = False
    """Normalize observations with running mean/variance (part of the saved model)."""
    normalize_reward: bool = False
    """Scale rewards by the running standard deviation of the discounted return."""
    obs_clip: float = 10.0
    """Normalized observations are clipped to [-obs_clip, obs_clip]."""
    reward_clip: float = 10.0
    """Scaled rewards are clipped to [-reward_clip, reward_clip]."""
    clip_reward: bool = False
    """Train on the sign of each reward (-1, 0 or 1), as the Atari presets do (Mnih et al. 2015); episode returns are still reported as the env gave them."""
    image_keys: tuple[str, ...] = ()
    """Float Box observation entries to take as images (through the CNN, scaled by nothing, never normalized): Dict keys, Tuple indices as text, or "" for a whole Box observation. uint8 and bool Boxes of 2 or 3 dimensions are images without it."""
    flat_keys: tuple[str, ...] = ()
    """bool Box observation entries (0/1 grids such as MinAtar's) to take flat, as 0/1 features for the MLP, instead of as images through the CNN: the network gymnax's MinAtar agents use. Dict keys, Tuple indices as text, or "" for a whole Box observation; kept as bytes in the rollout, never normalized."""
    obs_stats: ObsStats = "rollout"
    """When the observation statistics that act are updated: rollout (the policy snapshot's, frozen for a rollout; the learner merges what the rollout saw once per iteration) or step (the collector's copy also takes in every step, as SB3's VecNormalize does)."""
    nonfinite: NonFinite = "error"
    """A NaN or infinite observation or reward from the env: error (stop the run, naming the env, row, step and entries) or drop (end that episode there, untrained from the bad step on and not reported, reset its env and go on; counted in dropped_episodes; sync and async backends, Gymnasium envs)."""
    frame_stack: int = 0
    """Observations stacked along a new first axis, the newest last (Gymnasium's FrameStackObservation; sync and async backends): 0 is the env's default, 4 for ALE ids ((4, 84, 84) grayscale frames) and none for any other env."""
    episodic_life: bool = True
    """ALE ids: a lost life ends the training episode while the game goes on, the next reset taking one no-op step instead of starting a new game (SB3's EpisodicLifeEnv, as CleanRL and the zoo train Atari); returns are still reported per whole game, and evaluation and videos always play whole games. Other envs: no effect."""

    def __post_init__(self) -> None:
        _check_types(self, "env.")
        _check_int("env.num_envs", self.num_envs, 1)
        _require(isinstance(self.kwargs, dict), f"env.kwargs must be a table, got {self.kwargs!r}")
        _check_positive("env.obs_clip", self.obs_clip)
        _check_positive("env.reward_clip", self.reward_clip)
        _check_int("env.frame_stack", self.frame_stack, 0)


@dataclass(frozen=True)
class RolloutConfig:
    """How much experience one iteration collects and how it is credited."""

    num_steps: int = 128
    """Steps per environment per iteration; a rollout holds num_steps x num_envs rows."""
    gamma: float = 0.99
    """Discount factor."""
    gae_lambda: float = 0.95
    """GAE lambda: 0 is one-step TD, 1 is Monte Carlo."""
    sequence_length: int = 16
    """Recurrent policies (policy.memory): the longest sequence chunk the update trains on (RLlib's max_seq_len, MAPPO's data_chunk_length). A row's rollout is cut into chunks at every episode start and every sequence_length steps; each chunk starts from the hidden state it was acted with. At most rollout.num_steps; no effect without memory."""

    def __post_init__(self) -> None:
        _check_types(self, "rollout.")
        _check_int("rollout.num_steps", self.num_steps, 1)
        _check_int("rollout.sequence_length", self.sequence_length, 1)
        _check_unit("rollout.gamma", self.gamma, closed=True)
        _check_unit("rollout.gae_lambda", self.gae_lambda, closed=True)


@dataclass(frozen=True)
class PolicyConfig:
    """Actor and critic networks."""

    hidden_sizes: tuple[int, ...] = (64, 64)
    """Hidden layer widths of the actor and of the critic MLP."""
    activation: Activation = "tanh"
    """Hidden-layer activation."""
    log_std_init: float = 0.0
    """Initial log standard deviation of Gaussian (Box) policies."""
    ortho_init: bool = True
    """Orthogonal init: gain sqrt(2) on hidden layers, 0.01 on the policy head, 1 on the value head."""
    encoder: str = "mlp"
    """What turns an observation into features, for the actor and the critic alike: mlp (hidden layers of hidden_sizes on the flat observation) or an encoder registered with trustrl.acting.parts.register_encoder. With images, Dict, Tuple or Discrete observations it reads the entries' features (each image through its CNN) concatenated."""
    cnn_channels: tuple[int, ...] = ()
    """Output channels of each conv layer of the image encoder; empty: the default for the image's size (the Nature CNN, 32-64-64 with kernels 8-4-3 and strides 4-2-1, for images of 36 pixels a side or more; MinAtar's one layer of 16 3x3 filters for smaller grids)."""
    cnn_kernels: tuple[int, ...] = ()
    """Square kernel size of each conv layer (with cnn_channels)."""
    cnn_strides: tuple[int, ...] = ()
    """Stride of each conv layer (with cnn_channels)."""
    cnn_linear: int = 0
    """Width of the linear layer after the convolutions (ReLU); 0: the default (512 for the Nature CNN, 128 for small grids)."""
    share_encoder: bool = False
    """The critic's value layer reads the actor's encoder features (one encoder, trained by both losses, run once per minibatch), as CleanRL's ppo_atari and SB3's CnnPolicy do; halves the convolutions of an image policy. PPO with one optimizer only (not TRPO, not pi_lr/vf_lr). With memory, the critic reads the actor's memory core too."""
    memory: MemoryKind = "none"
    """A recurrent core between the encoder and the heads: none, lstm or gru (one layer of memory_size units). The actor and the critic each have their own (one shared with share_encoder). Trained on sequence chunks of rollout.sequence_length steps; the hidden state is reset at every episode's start."""
    memory_size: int = 64
    """Hidden units of the memory core (policy.memory)."""
    post_memory_sizes: tuple[int, ...] = ()
    """Hidden layer widths after the memory core, each followed by the activation, before the heads (sb3-contrib's RecurrentPPO puts its net_arch there, after the LSTM; RLlib's post_fcnet_hiddens). Only with policy.memory."""
    memory_gate_bias: float = 0.0
    """Initial bias of the memory core's keep gate (the LSTM's forget gate, the GRU's update gate): positive values start the core carrying its state across steps, about sigmoid(bias) of it per step instead of half (1 for the LSTM in Jozefowicz et al. 2015); a cue needed 32 steps later is learned with 2 and mostly not with 0 (docs/memory.md). 0: every bias starts at zero, as CleanRL's ppo_atari_lstm. No effect without policy.memory (a preset can set it for both)."""

    def __post_init__(self) -> None:
        _check_types(self, "policy.")
        _check_widths(
            "policy.hidden_sizes",
            self.hidden_sizes,
            "the heads read the encoder's features directly",
        )
        layers = (self.cnn_channels, self.cnn_kernels, self.cnn_strides)
        _require(
            all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for f in layers for v in f)
            and len({len(f) for f in layers}) == 1,
            "policy.cnn_channels, policy.cnn_kernels and policy.cnn_strides must be lists of "
            "positive integers of one length (one entry per conv layer; all empty: the "
            f"default), got {list(self.cnn_channels)}, {list(self.cnn_kernels)} and "
            f"{list(self.cnn_strides)}",
        )
        _require(
            isinstance(self.cnn_linear, int) and self.cnn_linear >= 0,
            f"policy.cnn_linear must be a non-negative integer (0: the default), got "
            f"{self.cnn_linear!r}",
        )
        _check_int("policy.memory_size", self.memory_size, 1)
        _check_widths(
            "policy.post_memory_sizes",
            self.post_memory_sizes,
            "the heads read the memory core's output",
        )
        _require(
            _is_number(self.memory_gate_bias) and -10 <= self.memory_gate_bias <= 10,
            f"policy.memory_gate_bias must be a number in [-10, 10], got {self.memory_gate_bias!r}",
        )
        _require(
            not self.post_memory_sizes or self.memory != "none",
            f"policy.post_memory_sizes {list(self.post_memory_sizes)} needs a memory core "
            f'(policy.memory "lstm" or "gru"); without one, give the layers in '
            f"policy.hidden_sizes",
        )
        _require(
            _is_number(self.log_std_init) and -20 <= self.log_std_init <= 2,
            f"policy.log_std_init must be in [-20, 2], got {self.log_std_init!r}",
        )


@dataclass(frozen=True)
class PPOConfig:
    """The PPO update: clipped surrogate, minibatch epochs, KL early stop."""

    learning_rate: float = 2.5e-4
    """Adam step size of the shared loss (actor and critic in one optimizer)."""
    pi_lr: float | None = None
    """Actor step size. Setting pi_lr and vf_lr trains the actor and the critic with separate optimizers and losses; leaving both unset uses the shared loss."""
    vf_lr: float | None = None
    """Critic step size (with pi_lr: separate optimizers)."""
    anneal_lr: bool = True
    """Decay step sizes linearly to zero over the run."""
    update_epochs: int = 4
    """Passes over the rollout for the policy."""
    vf_epochs: int | None = None
    """Passes for the critic when optimizers are separate (default: update_epochs); the critic keeps fitting after the policy stopped on KL."""
    num_minibatches: int = 4
    """Minibatches per pass."""
    clip_coef: float = 0.2
    """Surrogate clipping range epsilon."""
    anneal_clip: bool = False
    """Decay clip_coef linearly to zero over the run."""
    vf_clip_coef: float | None = None
    """Clip the value update to this range around the old values (unset: no clipping)."""
    ent_coef: float = 0.0
    """Entropy bonus coefficient."""
    vf_coef: float = 0.5
    """Value-loss coefficient in the shared loss. It weighs the mean squared error itself, as SB3 and Tianshou do; CleanRL and gymnax halve the error first, so their 0.5 is 0.25 here."""
    max_grad_norm: float = 0.5
    """Global gradient-norm clip."""
    target_kl: float | None = None
    """Stop the policy epochs before a step whose measured KL exceeds this (unset: never)."""
    norm_adv: bool = True
    """Normalize advantages per minibatch."""
    critic_process: bool = False
    """Compute the critic's share of each minibatch step in a second process (a fresh interpreter, numpy only) that polls while an update runs (numpy gradients, Linux, 2+ CPUs): identical results, faster updates where a core is otherwise idle. Off by default: the poll takes a core, which several trainings side by side need (docs/performance.md)."""
    grad_backend: Literal["auto", "numpy", "torch"] = "auto"
    """How each minibatch's gradients are computed: numpy (a hand-written backward pass, for MLP policies of one agent on its own observation), torch (autograd on every policy: the reference the numpy pass is tested against; critic_process then does nothing), or auto (numpy where the policy allows it, else torch). The two agree up to float rounding."""

    @property
    def separate_optimizers(self) -> bool:
        return self.pi_lr is not None

    def __post_init__(self) -> None:
        _check_types(self, "ppo.")
        _check_positive("ppo.learning_rate", self.learning_rate)
        _require(
            (self.pi_lr is None) == (self.vf_lr is None),
            f"ppo.pi_lr and ppo.vf_lr must be set together (separate optimizers) or both left "
            f"unset (shared loss), got pi_lr={self.pi_lr!r}, vf_lr={self.vf_lr!r}",
        )
        if self.pi_lr is not None and self.vf_lr is not None:
            _check_positive("ppo.pi_lr", self.pi_lr)
            _check_positive("ppo.vf_lr", self.vf_lr)
        _check_int("ppo.update_epochs", self.update_epochs, 1)
        if self.vf_epochs is not None:
            _check_int("ppo.vf_epochs", self.vf_epochs, 1)
            _require(
                self.separate_optimizers,
                f"ppo.vf_epochs needs separate optimizers (set ppo.pi_lr and ppo.vf_lr), "
                f"got vf_epochs={self.vf_epochs!r}",
            )
        _check_int("ppo.num_minibatches", self.num_minibatches, 1)
        _check_unit("ppo.clip_coef", self.clip_coef, closed=False)
        if self.vf_clip_coef is not None:
            _check_positive("ppo.vf_clip_coef", self.vf_clip_coef)
        _check_non_negative("ppo.ent_coef", self.ent_coef)
        _check_non_negative("ppo.vf_coef", self.vf_coef)
        _check_positive("ppo.max_grad_norm", self.max_grad_norm)
        if self.target_kl is not None:
            _check_positive("ppo.target_kl", self.target_kl)

    def check_batch(self, batch_size: int) -> None:
        """Refuse minibatches of no rows: more minibatches than the update's rows."""
        _check_minibatches("ppo.num_minibatches", self.num_minibatches, batch_size)


@dataclass(frozen=True)
class TRPOConfig:
    """The TRPO update: natural-gradient policy step under a hard KL bound, critic by Adam."""

    max_kl: float = 0.01
    """KL radius: an accepted policy step has mean KL(old || new) <= max_kl."""
    anneal_kl: bool = False
    """Shrink the KL radius linearly to zero over the run (max_kl * (1 - progress)), as ppo.anneal_lr does the step size: late updates move the policy less."""
    cg_iters: int = 10
    """Conjugate-gradient iterations for F x = g."""
    cg_damping: float = 0.1
    """Damping added to the Fisher-vector product (F + damping I) v."""
    cg_residual_tol: float = 1e-10
    """Conjugate gradient stops early once the squared residual norm falls below this."""
    line_search_steps: int = 10
    """Backtracking tries; each shrinks the step by line_search_shrink."""
    line_search_shrink: float = 0.8
    """Step shrink factor between line-search tries."""
    vf_lr: float = 1e-3
    """Critic Adam step size."""
    train_vf_iters: int = 5
    """Passes over the rollout for the critic."""
    minibatches: int = 4
    """Critic minibatches per pass."""
    norm_adv: bool = True
    """Normalize advantages over the batch."""

    def __post_init__(self) -> None:
        _check_types(self, "trpo.")
        _check_positive("trpo.max_kl", self.max_kl)
        _check_int("trpo.cg_iters", self.cg_iters, 1)
        _check_non_negative("trpo.cg_damping", self.cg_damping)
        _check_non_negative("trpo.cg_residual_tol", self.cg_residual_tol)
        _check_int("trpo.line_search_steps", self.line_search_steps, 1)
        _check_unit("trpo.line_search_shrink", self.line_search_shrink, closed=False)
        _check_positive("trpo.vf_lr", self.vf_lr)
        _check_int("trpo.train_vf_iters", self.train_vf_iters, 1)
        _check_int("trpo.minibatches", self.minibatches, 1)

    def check_batch(self, batch_size: int) -> None:
        """Refuse critic minibatches of no rows: more minibatches than the update's rows."""
        _check_minibatches("trpo.minibatches", self.minibatches, batch_size)


@dataclass(frozen=True)
class MultiAgentConfig:
    """Multi-agent (PettingZoo) settings; ignored for single-agent envs."""

    actor: ActorMode = "shared"
    """shared: one actor per group of agents with equal spaces; per_agent: one actor per agent (stacked weights, evaluated in one batched matmul)."""
    agent_id: bool = True
    """Append each agent's one-hot id to the critic's input, and to the actor's in shared mode."""
    critic_input: CriticInput = "global"
    """global (MAPPO): the env's state(), or all agents' observations concatenated; agent_state (MAPPO's agent-specific global state): that global state followed by the agent's own observation; agent_centric: the agent's own observation, then every other agent's in possible_agents order (all agents' views, laid out the same way for every agent); local (IPPO): the agent's own observation."""
    value_norm: bool = False
    """Normalize value targets with running statistics of the returns."""

    def __post_init__(self) -> None:
        _check_types(self, "multiagent.")


@dataclass(frozen=True)
class AgentConfig:
    """External agents (``trustrl serve``, ``trustrl.Agent``): applications that run their own loop and call ``agent.act(obs, reward)``."""

    observation_shape: tuple[int, ...] | None = None
    """Observation shape for an application with no Gymnasium env (unset: the spaces come from env_id)."""
    action_kind: ActionKind = "discrete"
    """With observation_shape: discrete, multidiscrete or box actions."""
    action_choices: tuple[int, ...] = (2,)
    """With observation_shape: choices of a discrete action (one number), or of each multidiscrete component."""
    action_low: tuple[float, ...] = (-1.0,)
    """With observation_shape and box actions: the lower bounds (one per action dimension; one number: every dimension)."""
    action_high: tuple[float, ...] = (1.0,)
    """With observation_shape and box actions: the upper bounds (as action_low; they fix the action's size)."""
    max_chunk_length: int = 256
    """An agent ships a long episode in chunks of at most this many steps (bootstrapped at the cut), so the learner is not starved."""
    queue_size: int = 1000
    """Finished chunks an agent keeps while the learner is unreachable; past it the oldest are dropped (and counted)."""

    def __post_init__(self) -> None:
        _check_types(self, "agent.")
        if self.observation_shape is not None:
            _require(
                len(self.observation_shape) > 0 and all(d >= 1 for d in self.observation_shape),
                f"agent.observation_shape must be positive sizes, got {list(self.observation_shape)}",
            )
        _require(
            len(self.action_choices) > 0 and all(n >= 1 for n in self.action_choices),
            f"agent.action_choices must be positive counts, got {list(self.action_choices)}",
        )
        _require(
            self.action_kind != "discrete" or len(self.action_choices) == 1,
            f"agent.action_choices of discrete actions is one number, got {list(self.action_choices)}",
        )
        low, high = self.action_low, self.action_high
        _require(
            len(low) in (1, len(high)) and len(high) >= 1,
            f"agent.action_low has {len(low)} bounds for {len(high)} in agent.action_high; "
            "give one number or one per dimension",
        )
        _require(
            all(math.isfinite(x) for x in (*low, *high))
            and all(
                a < b for a, b in zip(low * len(high) if len(low) == 1 else low, high, strict=True)
            ),
            f"agent.action_low {list(low)} must be finite and below agent.action_high {list(high)}",
        )
        _check_int("agent.max_chunk_length", self.max_chunk_length, 1)
        _check_int("agent.queue_size", self.queue_size, 1)


@dataclass(frozen=True)
class RunnersConfig:
    """Rollout runners on Ray: where the envs run, and how a lost runner or a late batch is handled."""

    count: int = 0
    """Rollout runners as Ray actors (0: every env in this process, no Ray). Needs pip install 'trustrl[ray]'."""
    envs_per_runner: int | None = None
    """Environments on each runner (unset: env.num_envs split evenly over the runners)."""
    ray_address: str | None = None
    """Ray cluster to join (unset: start a local, loopback-only instance for the run)."""
    timeout: float = 120.0
    """Seconds a runner may take for one rollout before it is replaced."""
    failures: int = 3
    """Stop the run after this many runner failures in a row."""
    async_collection: bool = False
    """Runners keep collecting with the newest snapshot they have while the learner updates on each runner's batch as it arrives (needs count > 0; not reproducible run to run)."""
    max_version_lag: int = 1
    """Asynchronous collection and external agents: a batch collected by a policy more than this many updates old is dropped, not trained on."""
    async_batches: int | None = None
    """Asynchronous collection: runner rollouts per update, the first that arrive from any runners (unset: one per runner, so an update trains on as many rows as a synchronous one while the runners already collect the next)."""

    @property
    def rollouts_per_update(self) -> int:
        """Asynchronous collection: runner rollouts joined for one update."""
        return self.async_batches or self.count

    def __post_init__(self) -> None:
        _check_types(self, "runners.")
        _check_int("runners.count", self.count, 0)
        if self.envs_per_runner is not None:
            _check_int("runners.envs_per_runner", self.envs_per_runner, 1)
        _check_positive("runners.timeout", self.timeout)
        _check_int("runners.failures", self.failures, 1)
        _check_int("runners.max_version_lag", self.max_version_lag, 0)
        if self.async_batches is not None:
            _check_int("runners.async_batches", self.async_batches, 1)
        _require(
            not self.async_collection or self.count > 0,
            "runners.async_collection needs runners.count > 0 (the embedded default collects "
            "in step with the learner)",
        )


@dataclass(frozen=True)
class Config:
    """One training run."""

    env_id: str = "CartPole-v1"
    """A registered Gymnasium id, package.module:callable returning a Gymnasium env or a PettingZoo env, or family:name for PettingZoo families such as mpe2:simple_spread_v3. On the command line: the positional ENV_ID (this flag may say the same, not another)."""
    algo: Algo = "ppo"
    """Algorithm; selects the update step."""
    seed: int = 1
    """Seed of environments, weights, sampling and shuffling."""
    total_steps: int = 100_000
    """Environment steps to train for (summed over environments)."""
    run_dir: str | None = None
    """Run folder (default: runs/<env>__<algo>__<seed>__<time>)."""
    quiet: bool = False
    """Print nothing: no progress bar, no notes (warnings go through Python's warnings)."""
    torch_threads: int = 1
    """Torch intra-op threads. Small networks run fastest on one; results are reproducible for a given seed and thread count."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the update runs: "cuda" trains on the GPU (acting stays on the CPU, from weights copied once per update); "auto" takes the GPU where torch sees one and the policy reads images or has memory, the CPU otherwise (docs/pixels.md: an MLP's update runs faster on the CPU)."""
    eval_episodes: int = 10
    """Deterministic evaluation episodes at the end of training (0: none)."""
    checkpoint_every: int = 10
    """Write a checkpoint every this many iterations (the final one is always written)."""
    checkpoint_keep: int = 3
    """Iteration checkpoints to keep (the newest ones; the final checkpoint is always kept)."""
    eval_every: int = 0
    """Also evaluate deterministically every this many iterations (0: only at the end)."""
    target_return: float | None = None
    """Stop early once a deterministic evaluation (of eval_episodes episodes; none when it is 0) reaches this mean return. Evaluations for it run when the mean of the last 20 training episodes reaches it too."""
    env: EnvConfig = field(default_factory=EnvConfig)
    runners: RunnersConfig = field(default_factory=RunnersConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    ppo: PPOConfig = field(default_factory=PPOConfig)
    trpo: TRPOConfig = field(default_factory=TRPOConfig)
    multiagent: MultiAgentConfig = field(default_factory=MultiAgentConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)

    @property
    def num_envs(self) -> int:
        """Environments over all runners: each contributes a row (per agent) to a rollout."""
        runners = self.runners
        if runners.count and runners.envs_per_runner:
            return runners.count * runners.envs_per_runner
        return self.env.num_envs

    @property
    def runner_envs(self) -> int:
        """Environments on each runner."""
        return self.num_envs // max(self.runners.count, 1)

    @property
    def batch_size(self) -> int:
        """Rows of one update: every env's rollout, or with asynchronous collection
        ``runners.rollouts_per_update`` runners' rollouts."""
        if self.runners.async_collection:
            return self.runner_envs * self.runners.rollouts_per_update * self.rollout.num_steps
        return self.num_envs * self.rollout.num_steps

    @property
    def num_iterations(self) -> int:
        """Whole iterations covering total_steps (rounded up: never fewer steps than asked;
        the trainer says so and records the steps it runs)."""
        return -(-self.total_steps // self.batch_size)

    def __post_init__(self) -> None:
        _check_types(self, "")
        _require(
            isinstance(self.env_id, str) and self.env_id.strip() != "",
            f"env_id must be a Gymnasium id or package.module:callable, got {self.env_id!r}",
        )
        _check_int("seed", self.seed, 0)
        _check_int("total_steps", self.total_steps, 1)
        _check_int("torch_threads", self.torch_threads, 1)
        _check_int("eval_episodes", self.eval_episodes, 0)
        _check_int("checkpoint_every", self.checkpoint_every, 1)
        _check_int("checkpoint_keep", self.checkpoint_keep, 1)
        _check_int("eval_every", self.eval_every, 0)
        count = self.runners.count
        if count and not self.runners.envs_per_runner:
            _require(
                self.env.num_envs % count == 0,
                f"env.num_envs ({self.env.num_envs}) must be a multiple of runners.count "
                f"({count}), or set runners.envs_per_runner",
            )
        if self.target_return is not None:
            _require(
                _is_number(self.target_return),
                f"target_return must be a finite number, got {self.target_return!r}",
            )
        if self.policy.memory != "none":
            _require(
                self.rollout.sequence_length <= self.rollout.num_steps,
                f"rollout.sequence_length must be <= rollout.num_steps "
                f"({self.rollout.num_steps}) with policy.memory = {self.policy.memory!r}, "
                f"got {self.rollout.sequence_length}",
            )
        # The algorithm's section is the one of its name (as the update registry reads it).
        algorithm: PPOConfig | TRPOConfig = getattr(self, self.algo)
        algorithm.check_batch(self.batch_size)


SECTIONS: dict[str, type] = {
    "env": EnvConfig,
    "runners": RunnersConfig,
    "rollout": RolloutConfig,
    "policy": PolicyConfig,
    "ppo": PPOConfig,
    "trpo": TRPOConfig,
    "multiagent": MultiAgentConfig,
    "agent": AgentConfig,
}


def _coerce(cls: type, name: str, value: Any) -> Any:
    """TOML has no tuples: a tuple field's list (hidden sizes, conv layers) becomes one."""
    if not isinstance(value, list):
        return value
    hints = _HINTS.get(cls)
    if hints is None:
        hints = _HINTS[cls] = get_type_hints(cls)
    hint = hints.get(name)
    options = get_args(hint) if get_origin(hint) in (Union, types.UnionType) else (hint,)
    if any(get_origin(option) is tuple for option in options):
        return tuple(value)
    return value


def _build(cls: type, table: dict[str, Any], where: str) -> Any:
    known = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(table) - set(known))
    if unknown:
        prefix = f"{where}." if where else ""
        raise ConfigError(
            f"unknown key{'s' if len(unknown) > 1 else ''} "
            f"{', '.join(prefix + k for k in unknown)}; allowed: {', '.join(sorted(known))}"
        )
    kwargs: dict[str, Any] = {}
    for name, value in table.items():
        section = SECTIONS.get(name) if cls is Config else None
        if section is not None:
            if not isinstance(value, dict):
                raise ConfigError(f"[{name}] must be a table, got {value!r}")
            kwargs[name] = _build(section, value, name)
        else:
            kwargs[name] = _coerce(cls, name, value)
    try:
        return cls(**kwargs)
    except TypeError as exc:  # e.g. a wrongly typed value that breaks a comparison
        raise ConfigError(f"{where or 'config'}: {exc}") from None


def merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """Tables are merged key by key; any other value in ``override`` replaces ``base``'s."""
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict) and key != "kwargs":
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


# The runner keys that configs written before the [runners] section hold at the top level,
# and their names in the section: those run folders and checkpoints still load and resume.
_TOP_LEVEL_RUNNER_KEYS = {
    "runners": "count",
    "envs_per_runner": "envs_per_runner",
    "ray_address": "ray_address",
    "runner_timeout": "timeout",
    "runner_failures": "failures",
    "async_collection": "async_collection",
    "max_version_lag": "max_version_lag",
    "async_batches": "async_batches",
}


def _runner_keys_in_section(table: dict[str, Any]) -> dict[str, Any]:
    """``table`` with top-level runner keys (``runners = 2``, ``runner_timeout = 60``)
    moved into its ``runners`` table; a top-level ``runners`` that is an integer is the
    count."""
    current = table.get("runners", {})
    old_count = isinstance(current, int) and not isinstance(current, bool)
    moved = [
        key for key in table if key in _TOP_LEVEL_RUNNER_KEYS and (key != "runners" or old_count)
    ]
    if not moved:
        return table
    if not old_count and not isinstance(current, dict):
        raise ConfigError(f"[runners] must be a table, got {current!r}")
    section = {} if old_count else dict(current)
    for key in moved:
        name = _TOP_LEVEL_RUNNER_KEYS[key]
        _require(name not in section, f"{key} and runners.{name} are both set; keep runners.{name}")
        section[name] = table[key]
    return {**{k: v for k, v in table.items() if k not in moved}, "runners": section}


def config_from_dict(table: dict[str, Any]) -> Config:
    """Build a validated Config; unknown keys are errors. Runner keys at the top level
    (configs written before the ``[runners]`` section) are read into the section."""
    return _build(Config, _runner_keys_in_section(table), "")


def config_to_dict(config: Config) -> dict[str, Any]:
    """Plain TOML-ready data (None values are dropped: TOML has no null)."""

    def clean(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: clean(v) for k, v in value.items() if v is not None}
        if isinstance(value, tuple):
            return list(value)
        return value

    return clean(dataclasses.asdict(config))


def read_toml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    try:
        with path.open("rb") as handle:
            return tomllib.load(handle)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None


def preset_name(env_id: str) -> str:
    return env_id.replace(":", "_").replace("/", "_")


def _preset_folder(algo: str) -> Any:
    return resources.files("trustrl").joinpath("presets", algo)


def _read_preset(resource: Any) -> dict[str, Any]:
    """A preset file's settings; its ``env_id`` key only names the env (see PresetInfo)."""
    table = tomllib.loads(resource.read_text())
    table.pop("env_id", None)
    return table


def preset_table(algo: str, env_id: str, name: str | None = None) -> dict[str, Any] | None:
    """The preset shipped for this algorithm and env, if there is one: the default
    (``presets/<algo>/<env>.toml``), or the named one (``presets/<algo>/<env>/<name>.toml``)."""
    stem = preset_name(env_id)
    folder = _preset_folder(algo)
    resource = folder.joinpath(f"{stem}.toml") if name is None else folder / stem / f"{name}.toml"
    return _read_preset(resource) if resource.is_file() else None


@dataclass(frozen=True)
class PresetInfo:
    """One env's shipped presets for one algorithm, as a user names them."""

    algo: str
    env_id: str
    """The id typed on the command line (``mpe2:simple_spread_v3``, not the file's stem)."""
    named: tuple[str, ...]
    """Named presets besides the default, selected with ``--preset NAME``."""


def list_presets(algo: str | None = None) -> list[PresetInfo]:
    """Every shipped preset, by algorithm and env id.

    A file's stem is the env id with ``:`` and ``/`` replaced (``preset_name``); where
    that changes the id, the file says the id in an ``env_id`` key."""
    found = []
    for algo_folder in sorted(resources.files("trustrl").joinpath("presets").iterdir(), key=str):
        if not algo_folder.is_dir() or (algo is not None and algo_folder.name != algo):
            continue
        for entry in sorted(algo_folder.iterdir(), key=lambda e: e.name):
            if not entry.name.endswith(".toml"):
                continue
            stem = entry.name.removesuffix(".toml")
            env_id = tomllib.loads(entry.read_text()).get("env_id", stem)
            named_folder = algo_folder / stem
            named = (
                tuple(
                    sorted(
                        p.name.removesuffix(".toml")
                        for p in named_folder.iterdir()
                        if p.name.endswith(".toml")
                    )
                )
                if named_folder.is_dir()
                else ()
            )
            found.append(PresetInfo(algo_folder.name, env_id, named))
    return found


def available_presets(algo: str) -> list[str]:
    """The env ids with a default preset for ``algo``."""
    return [info.env_id for info in list_presets(algo)]


def resolve(
    env_id: str,
    algo: str = "ppo",
    config_file: str | Path | None = None,
    overrides: dict[str, Any] | None = None,
    preset: str | None = None,
) -> Config:
    """Defaults <- preset for (algo, env) <- config file <- overrides.

    ``preset`` names one of the env's named presets (``trustrl presets`` lists them),
    used in place of its default preset."""
    table: dict[str, Any] = {"env_id": env_id, "algo": algo}
    settings = preset_table(algo, env_id, preset)
    if preset is not None and settings is None:
        named = next(
            (i.named for i in list_presets(algo) if preset_name(i.env_id) == preset_name(env_id)),
            (),
        )
        choices = f"choose from {', '.join(named)}" if named else "it has none"
        raise ConfigError(f"no preset {preset!r} for {algo} on {env_id}; {choices}")
    layers = [settings, read_toml(config_file) if config_file is not None else None, overrides]
    for layer in layers:
        if layer:
            table = merge(table, _runner_keys_in_section(layer))
    return config_from_dict(table)
