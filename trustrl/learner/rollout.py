"""The one rollout buffer and the GAE sweep.

Rows. A rollout is (T, N, ...) with N = num_envs (x agents, later). Row t of env i
holds the observation the policy acted on, the action, its log-probability and value,
and what the environment returned for that step.

Episode boundaries under Gymnasium's NEXT_STEP autoreset. When step t ends an
episode, the env returns the true final observation; the step after that ignores the
action, resets, and returns the new episode's first observation with reward 0. We
keep that "reset row" in the buffer with ``valid = False``: it is never trained on,
and the value the policy computed on it, V(final observation), is exactly the
bootstrap a truncated episode needs. So ``next_values[t] = values[t + 1]`` holds for
every row, and one vectorized delta plus one reversed sweep does all the credit
assignment. Only termination zeroes the bootstrap; termination and truncation both
stop the accumulation.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Generic, Self, TypeVar

import numpy as np
import torch
from torch import Tensor

from trustrl.acting.memory import chunk_layout
from trustrl.learner.memory import Sequences

if TYPE_CHECKING:
    from trustrl.contract import GroupBatch
    from trustrl.envs.rows import AgentGroup


def gae(
    rewards: Tensor,
    values: Tensor,
    next_values: Tensor,
    terminated: Tensor,
    truncated: Tensor,
    gamma: float,
    lam: float,
) -> tuple[Tensor, Tensor]:
    """Generalized advantage estimation (Schulman et al. 2016) in one reversed sweep.

    All inputs are (T, N) float tensors. ``next_values[t]`` is V of the observation that
    step t returned (the final observation when step t ended the episode).
    Returns (advantages, returns), both (T, N), with returns = advantages + values.
    """
    # Bootstrap through time limits: a truncated state is not terminal (Pardo et al. 2018).
    # In numpy throughout: the same element-wise float32 arithmetic, where torch's per-op
    # dispatch (slower still when it runs between numpy calls, docs/performance.md) would
    # dominate (T steps of two ops).
    r, v, nv = rewards.numpy(), values.numpy(), next_values.numpy()
    term, trunc = terminated.numpy(), truncated.numpy()
    d = r + gamma * nv * (1.0 - term) - v
    c = gamma * lam * (1.0 - term) * (1.0 - trunc)
    advantages = np.empty_like(d)
    running = np.zeros_like(d[0])
    for t in range(len(d) - 1, -1, -1):
        running = d[t] + c[t] * running
        advantages[t] = running
    return torch.from_numpy(advantages), torch.from_numpy(advantages + v)


class Rollout:
    """Preallocated (T, N) storage filled by the collector and read by the update."""

    def __init__(
        self,
        num_steps: int,
        num_rows: int,
        obs_dim: int,
        action_shape: tuple[int, ...],
        action_dtype: type[np.float32] | type[np.int64],
        mask_dim: int | None = None,
        critic_dim: int | None = None,
        num_agents: int = 1,
        obs_dtype: Any = np.float32,
    ) -> None:
        t, n = num_steps, num_rows
        self.num_steps, self.num_rows = t, n
        # (T, N, obs_dim), normalized as acted on; uint8 rows of frames stay bytes.
        self.obs = torch.zeros((t, n, obs_dim), dtype=getattr(torch, np.dtype(obs_dtype).name))
        # (T, N, critic_dim) critic input where it is not the observation (a global state).
        self.critic_obs = torch.zeros((t, n, critic_dim)) if critic_dim is not None else None
        # (N,) agent index of each row: rows are (env, agent) pairs, agent fastest.
        self.agent = torch.arange(n) % num_agents
        self.actions = torch.from_numpy(
            np.zeros((t, n, *action_shape), action_dtype)
        )  # (T, N, *act)
        self.logprob = torch.zeros((t, n))  # (T, N), frozen at collection time
        self.values = torch.zeros((t, n))  # (T, N)
        self.rewards = torch.zeros((t, n))  # (T, N), after reward scaling
        self.terminated = torch.zeros((t, n))  # (T, N), 1.0 where step t terminated
        self.truncated = torch.zeros((t, n))  # (T, N), 1.0 where step t hit a time limit
        # (T, N), False on reset rows and on rows of agents that already finished.
        self.valid = torch.zeros((t, n), dtype=torch.bool)
        # (T, N, A) allowed actions, only for masked discrete policies.
        self.action_mask = (
            torch.ones((t, n, mask_dim), dtype=torch.bool) if mask_dim is not None else None
        )
        self.last_value = torch.zeros(n)  # (N,), V of the observation after the last step
        self.advantages = torch.zeros((t, n))  # (T, N)
        self.returns = torch.zeros((t, n))  # (T, N)
        # Recurrent policies: (T, N) episode starts, (C, state_size) chunk-start states,
        # the chunks' longest length (contract.GroupBatch).
        self.starts: Tensor | None = None
        self.states: Tensor | None = None
        self.sequence_length = 0

    @classmethod
    def for_group(cls, group: AgentGroup, num_steps: int, num_envs: int) -> Rollout:
        """Storage for one agent group: a row per (env, agent of the group)."""
        spec = group.spec
        return cls(
            num_steps,
            num_envs * group.num_agents,
            spec.obs_dim,
            spec.action_shape,
            spec.action_dtype,
            spec.mask_dim,
            group.critic_dim,
            group.num_agents,
            spec.obs_dtype,
        )

    @classmethod
    def from_batch(
        cls, batch: GroupBatch, num_agents: int = 1, sequence_length: int = 0
    ) -> Rollout:
        """The learner's rollout over a runner's arrays (zero-copy where the dtypes agree:
        the endings become float flags for GAE). A recurrent policy's batch trains on
        chunks of ``sequence_length`` steps, the collector's."""
        steps, rows = batch.valid.shape
        rollout = cls.__new__(cls)
        rollout.num_steps, rollout.num_rows = steps, rows
        rollout.agent = torch.arange(rows) % num_agents
        for name in ("obs", "actions", "logprob", "values", "rewards", "valid", "last_value"):
            setattr(rollout, name, _tensor(getattr(batch, name)))
        for name in ("critic_obs", "action_mask"):
            array = getattr(batch, name)
            setattr(rollout, name, _tensor(array) if array is not None else None)
        rollout.terminated = torch.from_numpy(batch.terminated.astype(np.float32))
        rollout.truncated = torch.from_numpy(batch.truncated.astype(np.float32))
        rollout.advantages = torch.zeros((steps, rows))
        rollout.returns = torch.zeros((steps, rows))
        rollout.starts = _tensor(batch.starts) if batch.starts is not None else None
        rollout.states = _tensor(batch.states) if batch.states is not None else None
        rollout.sequence_length = sequence_length
        return rollout

    def compute_advantages(self, gamma: float, lam: float) -> None:
        values = self.values.numpy()
        next_values = torch.from_numpy(np.concatenate([values[1:], self.last_value.numpy()[None]]))
        self.advantages, self.returns = gae(
            self.rewards, self.values, next_values, self.terminated, self.truncated, gamma, lam
        )

    def training_batch(self) -> Batch:
        """What an update trains on: the valid rows (``flat``), or a recurrent policy's
        sequence chunks (``chunks``)."""
        if self.states is not None:
            return self.chunks()
        return self.flat()

    def chunks(self) -> SequenceBatch:
        """A recurrent policy's rollout as sequence chunks (acting/memory.py's
        ``chunk_layout``): each row cut at its episode starts and every
        ``sequence_length`` steps, each chunk padded to that length by repeating its last
        step (padding follows the real steps, so it changes none of their outputs) and
        starting from the state it was acted with. Rows (C x L) chunk by chunk; the losses
        average over ``loss_rows`` (real, valid steps) only."""
        assert self.starts is not None and self.states is not None
        length = self.sequence_length
        chunk_rows, firsts, lengths = chunk_layout(self.starts.numpy(), length)
        offsets = np.arange(length)
        steps = firsts[:, None] + np.minimum(offsets, lengths[:, None] - 1)  # (C, L)
        index = (steps * self.num_rows + chunk_rows[:, None]).reshape(-1)
        real = (offsets < lengths[:, None]).reshape(-1)
        loss_rows = real & self.valid.numpy().reshape(-1)[index]
        batch = self._gather(index)
        return SequenceBatch(batch, self.states, length, torch.from_numpy(loss_rows))

    def flat(self) -> Batch:
        """The valid rows as one flat batch (a gather: reset rows are dropped)."""
        return self._gather(np.flatnonzero(self.valid.numpy()))

    def _gather(self, index: np.ndarray) -> Batch:
        """The (T, N) rows at flat ``index`` (step-major) as a batch, gathered in numpy
        (see ``gae``)."""

        def rows(x: Tensor) -> Tensor:
            array = x.numpy()
            return torch.from_numpy(array.reshape(-1, *array.shape[2:]).take(index, 0))

        return Batch(
            obs=rows(self.obs),
            actions=rows(self.actions),
            logprob=rows(self.logprob),
            values=rows(self.values),
            advantages=rows(self.advantages),
            returns=rows(self.returns),
            action_mask=rows(self.action_mask) if self.action_mask is not None else None,
            critic_obs=rows(self.critic_obs) if self.critic_obs is not None else None,
            agent=torch.from_numpy(np.tile(self.agent.numpy(), self.num_steps).take(index)),
        )


def _tensor(array: np.ndarray) -> Tensor:
    """A tensor over the array's memory; a copy where it is read-only (arrays Ray hands
    over from its object store are)."""
    return torch.from_numpy(array if array.flags.writeable else array.copy())


# The fields of a batch, in the order of its constructor's arguments.
_FIELDS = (
    *("obs", "actions", "logprob", "values", "advantages", "returns"),
    *("action_mask", "critic_obs", "agent"),
)

ArrayT = TypeVar("ArrayT", Tensor, np.ndarray)


class _Rows(Generic[ArrayT]):
    """Flat training samples: every field's first dimension is the sample index. Batch
    holds tensors; its ``numpy()`` view, NumpyBatch, holds arrays over the same memory."""

    __slots__ = _FIELDS

    obs: ArrayT  # (B, obs_dim)
    actions: ArrayT  # (B, *act)
    logprob: ArrayT  # (B,)
    values: ArrayT  # (B,)
    advantages: ArrayT  # (B,)
    returns: ArrayT  # (B,)
    action_mask: ArrayT | None  # (B, A) or None
    critic_obs: ArrayT | None  # (B, critic_dim) or None: the critic reads obs
    agent: ArrayT  # (B,)

    def __init__(
        self,
        obs: ArrayT,
        actions: ArrayT,
        logprob: ArrayT,
        values: ArrayT,
        advantages: ArrayT,
        returns: ArrayT,
        action_mask: ArrayT | None,
        critic_obs: ArrayT | None,
        agent: ArrayT,
    ) -> None:
        self.obs, self.actions, self.logprob, self.values = obs, actions, logprob, values
        self.advantages, self.returns = advantages, returns
        self.action_mask, self.critic_obs, self.agent = action_mask, critic_obs, agent

    @property
    def sequences(self) -> Sequences | None:
        """How the rows are laid out for a memory core (None: independent rows)."""
        return None

    def loss(self, x: Tensor) -> Tensor:
        """The rows of ``x`` (per row of this batch) that the losses average over: all."""
        return x

    def minibatches(self, count: int, generator: torch.Generator) -> Iterator[Self]:
        """One epoch: ``count`` minibatches in random order. The shuffled batch is gathered
        once; the minibatches are slices (views) of it. One minibatch is the whole batch,
        whose order no loss depends on: no shuffle, no gather."""
        if count <= 1:
            yield self
            return
        size = len(self)
        step = max(1, math.ceil(size / count))
        shuffled = self[torch.randperm(size, generator=generator).numpy()]
        for start in range(0, size, step):
            yield shuffled[start : start + step]

    def __len__(self) -> int:
        return len(self.obs)

    def __getitem__(self, index: np.ndarray | slice) -> Self:
        """Rows by index array (a gather) or by slice (views, no copy)."""

        def maybe(x: ArrayT | None) -> ArrayT | None:
            return x[index] if x is not None else None

        return type(self)(
            self.obs[index],
            self.actions[index],
            self.logprob[index],
            self.values[index],
            self.advantages[index],
            self.returns[index],
            maybe(self.action_mask),
            maybe(self.critic_obs),
            self.agent[index],
        )


class Batch(_Rows[Tensor]):
    __slots__ = ()

    def __init__(
        self,
        obs: Tensor,
        actions: Tensor,
        logprob: Tensor,
        values: Tensor,
        advantages: Tensor,
        returns: Tensor,
        action_mask: Tensor | None = None,
        critic_obs: Tensor | None = None,
        agent: Tensor | None = None,
    ) -> None:
        if agent is None:
            agent = torch.zeros(len(obs), dtype=torch.long)
        super().__init__(
            obs, actions, logprob, values, advantages, returns, action_mask, critic_obs, agent
        )

    def to(self, device: torch.device) -> Batch:
        """The same rows on ``device`` (a twin's update on an accelerator,
        updates/device.py); this batch itself where it is there already. Frames stay uint8
        on the way: the model scales them."""
        if self.obs.device == device:
            return self

        def move(x: Tensor | None) -> Tensor | None:
            return x.to(device) if x is not None else None

        return Batch(*(move(getattr(self, name)) for name in _FIELDS))  # type: ignore[arg-type]

    def numpy(self) -> NumpyBatch:
        """The same rows as numpy arrays over the same memory. The numpy gradients take
        their minibatches from it: indexing arrays costs a fraction of indexing tensors,
        whose ops run slowly between numpy calls (docs/performance.md)."""

        def maybe(x: Tensor | None) -> np.ndarray | None:
            return x.numpy() if x is not None else None

        return NumpyBatch(
            self.obs.numpy(),
            self.actions.numpy(),
            self.logprob.numpy(),
            self.values.numpy(),
            self.advantages.numpy(),
            self.returns.numpy(),
            maybe(self.action_mask),
            maybe(self.critic_obs),
            self.agent.numpy(),
        )


class NumpyBatch(_Rows[np.ndarray]):
    __slots__ = ()


class SequenceBatch(Batch):
    """A recurrent policy's training rows: C chunks of ``length`` steps (``Rollout.chunks``),
    each chunk's start ``state`` (C, state_size), and ``loss_rows`` (C x L,) bool, the rows
    the losses average over. Minibatches are whole chunks."""

    __slots__ = ("length", "loss_rows", "state")

    def __init__(self, rows: Batch, state: Tensor, length: int, loss_rows: Tensor) -> None:
        super().__init__(
            rows.obs,
            rows.actions,
            rows.logprob,
            rows.values,
            rows.advantages,
            rows.returns,
            rows.action_mask,
            rows.critic_obs,
            rows.agent,
        )
        self.state, self.length, self.loss_rows = state, length, loss_rows

    @property
    def sequences(self) -> Sequences:
        return Sequences(self.state, self.length)

    def to(self, device: torch.device) -> SequenceBatch:
        if self.obs.device == device:
            return self
        rows = Batch.to(self, device)
        return SequenceBatch(rows, self.state.to(device), self.length, self.loss_rows.to(device))

    def loss(self, x: Tensor) -> Tensor:
        return x[self.loss_rows]

    def minibatches(self, count: int, generator: torch.Generator) -> Iterator[SequenceBatch]:
        """One epoch: the chunks in random order, in ``count`` minibatches of whole chunks."""
        if count <= 1:
            yield self
            return
        chunks = len(self.state)
        step = max(1, math.ceil(chunks / count))
        order = torch.randperm(chunks, generator=generator).numpy()
        for start in range(0, chunks, step):
            yield self.take(order[start : start + step])

    def take(self, chunks: np.ndarray) -> SequenceBatch:
        """The chunks ``chunks`` (indices) as a batch of their own."""
        index = (chunks[:, None] * self.length + np.arange(self.length)).reshape(-1)
        plain = Batch(
            self.obs,
            self.actions,
            self.logprob,
            self.values,
            self.advantages,
            self.returns,
            self.action_mask,
            self.critic_obs,
            self.agent,
        )
        return SequenceBatch(plain[index], self.state[chunks], self.length, self.loss_rows[index])
