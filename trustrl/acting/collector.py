"""The collector: a policy snapshot in, a rollout batch out (the runner contract,
contract.py).

It owns everything that lives between iterations on the acting side (the env, the
current observations, which rows are mid-reset, episode accumulators, the reward
scaler and the sampling generator) and nothing of the learner's: it acts with the
snapshot's numpy weights and a copy of its observation statistics, and reports what
it saw as a statistics delta for the learner to merge. The same class runs in the
trainer's process and inside a Ray runner.

Observation statistics. By default (``obs_stats="rollout"``) the statistics that act
are the snapshot's, frozen for the whole rollout, and the learner folds the delta in
once per iteration. ``obs_stats="step"`` updates the acting copy at every step as
well (SB3's ``VecNormalize`` habit); the delta and the learner's merge are the same.

A row is trained on only when it is *valid*: its agent was acting (not finished while
others play on) and the step was not the NEXT_STEP reset step after an episode end
(see rollout.py). Single-agent is one group of ``num_envs`` rows.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

import gymnasium as gym
import numpy as np

from trustrl.acting.inference import Inference
from trustrl.acting.memory import chunk_layout
from trustrl.config import Config, ObsStats
from trustrl.contract import EpisodeStats, GroupBatch, PolicySnapshot, RolloutBatch, Runner
from trustrl.envs.gym import GymRows, make_row_env
from trustrl.envs.rows import AgentGroup, EnvState, GroupObs, GroupStep, RowEnv
from trustrl.envs.spaces import SpaceSpec
from trustrl.normalize import MeanStd, RunningStats


class _Lane:
    """Per-group acting state: (rows,) arrays, rows = num_envs x agents of the group."""

    def __init__(self, rows: int, agents: tuple[str, ...], observed: GroupObs) -> None:
        self.agent_names = agents
        self.agent = np.arange(rows) % len(agents)  # (rows,) agent index of each row
        self.discounted_return = np.zeros(rows)  # for reward scaling
        self.episode_return = np.zeros(rows)  # raw reward so far
        self.episode_length = np.zeros(rows, dtype=np.int64)
        self.resetting = np.zeros(rows, dtype=bool)  # the next step of this row is a reset
        # Recurrent policies: each row's state (sized at the first collect) and whether its
        # next step starts an episode (its state is reset before it).
        self.state = np.zeros((rows, 0), np.float32)
        self.starting = np.ones(rows, dtype=bool)
        self.observe(observed)

    def observe(self, observed: GroupObs) -> None:
        self.obs = observed.obs  # (rows, obs_dim)
        self.mask = observed.mask  # (rows, A) or None
        self.critic_obs = observed.critic_obs  # (rows, critic_dim) or None
        self.alive = observed.alive  # (rows,) or None

    def clear(self) -> None:
        self.resetting[:] = False
        self.starting[:] = True
        self.state[:] = 0.0
        self.discounted_return[:] = 0.0
        self.episode_return[:] = 0.0
        self.episode_length[:] = 0

    def state_dict(self) -> dict[str, Any]:
        return {
            "discounted_return": self.discounted_return.copy(),
            "episode_return": self.episode_return.copy(),
            "episode_length": self.episode_length.copy(),
            "resetting": self.resetting.copy(),
            "state": self.state.copy(),
            "starting": self.starting.copy(),
            "obs": self.obs.copy(),
            "mask": self.mask.copy() if self.mask is not None else None,
            "critic_obs": self.critic_obs.copy() if self.critic_obs is not None else None,
            "alive": self.alive.copy() if self.alive is not None else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.discounted_return = state["discounted_return"].copy()
        self.episode_return = state["episode_return"].copy()
        self.episode_length = state["episode_length"].copy()
        self.resetting = state["resetting"].copy()
        if "state" in state:  # checkpoints from before recurrent policies have none
            self.state = state["state"].copy()
            self.starting = state["starting"].copy()
        self.observe(
            GroupObs(
                state["obs"].copy(),
                _copy(state["mask"]),
                _copy(state["critic_obs"]),
                _copy(state["alive"]),
            )
        )


class _RawSteps:
    """A rollout's env outcomes as the env reported them, (T, rows) per field."""

    def __init__(self, num_steps: int, rows: int) -> None:
        self.reward = np.zeros((num_steps, rows))  # float64: episode returns sum these
        self.terminated = np.zeros((num_steps, rows), dtype=bool)
        self.truncated = np.zeros((num_steps, rows), dtype=bool)
        self.dropped = np.zeros((num_steps, rows), dtype=bool)  # a dropped episode's end
        # A termination that is a life lost, the game going on (episodic life): trained on
        # as an end, reported as part of the game's episode.
        self.continues = np.zeros((num_steps, rows), dtype=bool)
        self.drops = 0


class _Acting:
    """One lane's sampling for one rollout: every step's random draws, drawn up front, and
    the actor's outputs per step, from which ``finish`` computes the log-probabilities and
    values of the whole rollout at once."""

    def __init__(
        self, inference: Inference, rng: np.random.Generator, num_steps: int, agent: np.ndarray
    ) -> None:
        self.inference = inference
        self.agent = agent
        self.noise = inference.noise(rng, num_steps, agent)  # (T, rows, width)
        self.out = np.empty_like(self.noise)  # (T, rows, width) head outputs
        # A shared encoder gives each step's values with its actions (act_valued): the
        # rollout's are kept here instead of running the encoder over it again.
        recurrent = inference.state_size > 0
        self.values = (
            np.empty(self.noise.shape[:2], np.float32) if inference.shared or recurrent else None
        )
        # A recurrent policy's state before each step, and the steps that start an episode.
        self.states = np.empty((num_steps, len(agent), inference.state_size), np.float32)
        self.starts = np.zeros((num_steps, len(agent)), bool)

    def finish(self, view: dict[str, np.ndarray]) -> None:
        """The rollout's log-probabilities and values, from what the steps stored."""
        steps, rows, width = self.out.shape
        agent = np.tile(self.agent, steps)
        mask = view.get("action_mask")
        critic = view.get("critic_obs")
        inference = self.inference
        logprob = inference.log_prob(
            self.out.reshape(-1, width),
            view["actions"].reshape(steps * rows, *view["actions"].shape[2:]),
            mask.reshape(steps * rows, -1) if mask is not None else None,
            self.noise.reshape(-1, width),
            agent,
        )
        view["logprob"][:] = logprob.reshape(steps, rows)
        if self.values is not None:
            view["values"][:] = self.values
            return
        values = inference.value(
            view["obs"].reshape(steps * rows, -1),
            critic.reshape(steps * rows, -1) if critic is not None else None,
            agent,
        )
        view["values"][:] = values.reshape(steps, rows)


def _normalized(
    norm: MeanStd | None,
    x: np.ndarray,
    update: bool,
    live: np.ndarray | None,
    out: np.ndarray | None,
) -> np.ndarray:
    """x normalized (into ``out`` when given); with ``update``, the live rows (all when
    ``live`` is None) taken into the statistics first."""
    if norm is not None:
        return norm.update_normalize(x, out, live) if update else norm.normalize_array(x, out)
    if out is None:
        return x
    out[...] = x
    return out


def _drop(lane: _Lane, out: _RawSteps, t: int, rows: np.ndarray) -> None:
    """Rows whose episode the env dropped at step t (a non-finite value): the episode ends,
    truncated, at step t - 1 (bootstrapping from the last finite observation) and step t
    becomes its reset step, never trained on (see rollout.py); the episode is not
    reported. At t = 0 its last step was the previous rollout's."""
    out.drops += int(rows.sum())
    if t == 0:
        lane.resetting |= rows
        lane.episode_return[rows] = lane.episode_length[rows] = 0
        lane.discounted_return[rows] = 0.0
        return
    ended = out.terminated[t - 1] | out.truncated[t - 1]
    out.dropped[t - 1] |= rows & ~ended  # an episode that had ended is reported as it was
    out.truncated[t - 1] |= rows


def _copy(array: np.ndarray | None) -> np.ndarray | None:
    return array.copy() if array is not None else None


def _arrays(group: AgentGroup, steps: int, rows: int) -> dict[str, np.ndarray]:
    """A rollout's (T, rows, ...) arrays for one group, by ``GroupBatch`` field name."""
    spec = group.spec
    arrays = {
        "obs": np.empty((steps, rows, spec.obs_dim), spec.obs_dtype),  # uint8: frames
        "actions": np.empty((steps, rows, *spec.action_shape), spec.action_dtype),
        "logprob": np.empty((steps, rows), np.float32),
        "values": np.empty((steps, rows), np.float32),
        "rewards": np.empty((steps, rows), np.float32),
        "terminated": np.empty((steps, rows), bool),
        "truncated": np.empty((steps, rows), bool),
        "valid": np.ones((steps, rows), bool),
    }
    if group.critic_dim is not None:
        arrays["critic_obs"] = np.empty((steps, rows, group.critic_dim), np.float32)
    if spec.mask_dim is not None:
        arrays["action_mask"] = np.ones((steps, rows, spec.mask_dim), bool)
    return arrays


class _Seen:
    """The raw inputs a rollout's statistics take in, (T, rows, dim) with the (T, rows)
    rows that count (agents still acting), for the delta sent to the learner: the leading
    ``vector_dim`` columns of an observation's row (its float vectors)."""

    def __init__(self, steps: int, rows: int, vector_dim: int, critic_dim: int | None) -> None:
        self.obs = np.empty((steps, rows, vector_dim), np.float32)
        self.critic = np.empty((steps, rows, critic_dim), np.float32) if critic_dim else None
        self.alive = np.ones((steps, rows), bool)

    def record(self, t: int, lane: _Lane) -> None:
        self.obs[t] = lane.obs[:, : self.obs.shape[2]]
        if self.critic is not None and lane.critic_obs is not None:
            self.critic[t] = lane.critic_obs
        if lane.alive is not None:
            self.alive[t] = lane.alive

    def deltas(self) -> tuple[RunningStats, RunningStats | None]:
        critic = RunningStats.of(self.critic[self.alive]) if self.critic is not None else None
        return RunningStats.of(self.obs[self.alive]), critic


class _GroupRollout:
    """One group's rollout in the making: its (T, rows) storage by ``GroupBatch`` field,
    its sampling (every step's draws, taken now), the env's raw outcomes and, when training
    with a normalizer, the raw inputs its statistics delta takes in."""

    def __init__(
        self,
        group: AgentGroup,
        lane: _Lane,
        inference: Inference,
        rng: np.random.Generator,
        num_steps: int,
        train: bool,
    ) -> None:
        rows = len(lane.agent)
        self.lane, self.inference = lane, inference
        self.view = _arrays(group, num_steps, rows)
        self.seen = (
            _Seen(num_steps, rows, group.spec.vector_dim, group.critic_dim)
            if train and inference.obs_normalizer is not None
            else None
        )
        self.acting = _Acting(inference, rng, num_steps, lane.agent)
        self.raw = _RawSteps(num_steps, rows)

    def outcome(self, t: int, step: GroupStep, observed: GroupObs) -> None:
        """What step t returned for the group's rows."""
        raw, lane = self.raw, self.lane
        raw.reward[t] = step.reward
        raw.terminated[t] = step.terminated
        raw.truncated[t] = step.truncated
        if step.continues is not None:
            raw.continues[t] = step.continues
        was_alive = lane.alive
        lane.observe(observed)
        if step.dropped is not None:
            _drop(lane, raw, t, step.dropped)
        if not self.inference.state_size:  # only a recurrent policy's state is reset
            return
        # The step after a reset step starts an episode: step t was one where the row's
        # episode ended at t - 1 (at t = 0: in the last rollout, or dropped just now). A
        # multi-agent row starts where its agent is back (alive again, after the env's
        # reset step: it may have finished long before the others).
        if lane.alive is not None and was_alive is not None:
            lane.starting = lane.alive & ~was_alive
        else:
            lane.starting = (
                lane.resetting.copy() if t == 0 else raw.terminated[t - 1] | raw.truncated[t - 1]
            )


class Collector(Runner):
    """The acting side's runner: steps a run's environments (as rows, envs/rows.py) with a
    policy snapshot and returns the rollout as a ``RolloutBatch`` (contract.py). It holds
    everything that lives between rollouts on the acting side (the current observations,
    episode accumulators, the reward scaler, the sampling generator) and nothing of the
    learner's; the trainer's process and every Ray runner run this same class."""

    def __init__(
        self,
        envs: RowEnv | gym.vector.VectorEnv,
        seed: int,
        gamma: float,
        normalize_reward: bool = False,
        reward_clip: float = 10.0,
        num_steps: int = 128,
        obs_stats: ObsStats = "rollout",
        name: str = "local",
        clip_reward: bool = False,
        sequence_length: int = 16,
    ) -> None:
        self.rows: RowEnv = GymRows(envs) if isinstance(envs, gym.vector.VectorEnv) else envs
        self.num_envs = self.rows.num_envs
        self.gamma = gamma
        self.num_steps = num_steps
        self.obs_stats = obs_stats
        self.name = name
        self.rng = np.random.default_rng(seed)  # action sampling
        self.reward_scaler = MeanStd((), clip=reward_clip) if normalize_reward else None
        self.clip_reward = clip_reward
        self.sequence_length = sequence_length  # recurrent policies' chunks
        observed = self.rows.reset(seed)
        self.groups = self.rows.groups
        self.lanes = [
            _Lane(self.num_envs * g.num_agents, g.agents, o)
            for g, o in zip(self.groups, observed, strict=True)
        ]

    @property
    def spec(self) -> SpaceSpec:
        """The spaces of the first (for single-agent envs, the only) group."""
        return self.groups[0].spec

    @property
    def envs(self) -> Any:
        """The underlying environment object (a Gymnasium vector env for single-agent)."""
        return getattr(self.rows, "envs", self.rows)

    def reset(self, seed: int) -> None:
        """Start fresh episodes in every env (unfinished episodes are dropped)."""
        for lane, observed in zip(self.lanes, self.rows.reset(seed), strict=True):
            lane.observe(observed)
            lane.clear()

    def collect(self, snapshot: PolicySnapshot, train: bool = True) -> RolloutBatch:
        """``num_steps`` steps of every env with the snapshot's policies, one per group.
        With ``train``, the reward scaler learns and the batch carries the observation
        statistics delta; without (an evaluation-like pass), neither."""
        # Numpy weights and acting copies of the statistics, from the snapshot alone.
        inferences = [Inference(group) for group in snapshot.groups]
        if len(inferences) != len(self.lanes):
            raise ValueError(
                f"the snapshot holds {len(inferences)} policies for {len(self.lanes)} groups"
            )
        start = time.perf_counter()
        rollouts = [
            _GroupRollout(group, lane, inference, self.rng, self.num_steps, train)
            for group, lane, inference in zip(self.groups, self.lanes, inferences, strict=True)
        ]
        # Per step only what acting needs: the inputs, the actor, the action, and the env's
        # raw outcome. The random draws come in one call per rollout; log-probabilities,
        # values, validity, episodes and reward scaling are settled per rollout, as
        # whole-array operations where a step would spend one numpy call each on a handful
        # of rows.
        update_stats = train and self.obs_stats == "step"
        for t in range(self.num_steps):
            actions = []
            for rollout in rollouts:
                if rollout.seen is not None:
                    rollout.seen.record(t, rollout.lane)
                actions.append(self._act(rollout, t, update_stats))
            observed, steps = self.rows.step(actions)
            for rollout, step, after in zip(rollouts, steps, observed, strict=True):
                rollout.outcome(t, step, after)
        stats = EpisodeStats()
        groups = tuple(self._finish(rollout, stats, train) for rollout in rollouts)
        return RolloutBatch(
            groups,
            stats,
            snapshot.version,
            self.name,
            self.num_steps * self.num_envs,
            time.perf_counter() - start,
        )

    def _finish(self, rollout: _GroupRollout, stats: EpisodeStats, train: bool) -> GroupBatch:
        """One group's batch once its steps are taken: log-probabilities and values of the
        whole rollout, validity, episodes and rewards settled, the statistics delta, and
        the value of the observation after the last step."""
        lane, inference, view, record = rollout.lane, rollout.inference, rollout.view, rollout.seen
        acting = rollout.acting
        acting.finish(view)
        self._settle(lane, view, rollout.raw, stats, train)
        x, critic_x = self._inputs(lane, inference, update=False)
        obs_delta, critic_delta = record.deltas() if record is not None else (None, None)
        starts = states = None
        if inference.state_size:
            starts = acting.starts
            rows, firsts, _ = chunk_layout(starts, self.sequence_length)
            states = acting.states[firsts, rows]
            # The bootstrap: the next step's state (zeros where an episode starts there).
            state = np.where(lane.starting[:, None], np.float32(0.0), lane.state)
            last_value = inference.value_recurrent(x, state, critic_x, lane.agent)
        else:
            last_value = inference.value(x, critic_x, lane.agent)
        return GroupBatch(
            obs=view["obs"],
            critic_obs=view.get("critic_obs"),
            actions=view["actions"],
            logprob=view["logprob"],
            values=view["values"],
            rewards=view["rewards"],
            terminated=view["terminated"],
            truncated=view["truncated"],
            valid=view["valid"],
            action_mask=view.get("action_mask"),
            last_value=last_value.astype(np.float32),
            obs_delta=obs_delta,
            critic_delta=critic_delta,
            starts=starts,
            states=states,
        )

    def _inputs(
        self,
        lane: _Lane,
        inference: Inference,
        update: bool,
        out: np.ndarray | None = None,
        critic_out: np.ndarray | None = None,
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """The lane's policy inputs, normalized; written into ``out`` / ``critic_out``
        (rollout rows) when given. With ``update``, the statistics take them in first."""
        # Rows of agents that finished while others play on repeat their final
        # observation: the statistics take in only the live rows.
        x = _normalized(inference.obs_normalizer, lane.obs, update, lane.alive, out)
        critic = lane.critic_obs
        if critic is not None:
            critic = _normalized(
                inference.critic_normalizer, critic, update, lane.alive, critic_out
            )
        return x, critic

    def _act(self, rollout: _GroupRollout, t: int, train: bool) -> np.ndarray:
        lane, inference, view, acting = (
            rollout.lane,
            rollout.inference,
            rollout.view,
            rollout.acting,
        )
        critic_row = view["critic_obs"][t] if "critic_obs" in view else None
        x, critic_x = self._inputs(lane, inference, train, view["obs"][t], critic_row)
        if inference.state_size:
            if lane.state.shape[1] != inference.state_size:  # the first recurrent rollout
                lane.state = np.zeros((len(lane.agent), inference.state_size), np.float32)
            lane.state[lane.starting] = 0.0
            acting.starts[t] = lane.starting
            acting.states[t] = lane.state
            assert acting.values is not None
            actions, acting.out[t], acting.values[t], lane.state = inference.act_recurrent(
                x, lane.mask, acting.noise[t], lane.state, critic_x, lane.agent
            )
        elif acting.values is not None:
            actions, acting.out[t], acting.values[t] = inference.act_valued(
                x, lane.mask, acting.noise[t], lane.agent
            )
        else:
            actions, acting.out[t] = inference.act(x, lane.mask, acting.noise[t], lane.agent)
        view["actions"][t] = actions
        if lane.alive is not None:  # rows of agents still playing; _settle does the rest
            view["valid"][t] = lane.alive
        if "action_mask" in view and lane.mask is not None:
            view["action_mask"][t] = lane.mask
        return actions

    def _settle(
        self,
        lane: _Lane,
        view: dict[str, np.ndarray],
        out: _RawSteps,
        stats: EpisodeStats,
        train: bool,
    ) -> None:
        """The rollout's validity, rewards and endings from the raw steps; the episodes that
        ended, in step order; the reward scaling, step by step as it would have run live."""
        valid = view["valid"]  # (T, rows): alive, from _act (every row of a Gymnasium env)
        # A row's step is the reset step (not trained on) after it ended. An env reports
        # no reward and no ending on a reset step or for a finished agent's row; the
        # masks below make sure of it.
        valid[0] &= ~lane.resetting
        valid[1:] &= ~(out.terminated[:-1] | out.truncated[:-1])
        reward = np.where(valid, out.reward, 0.0)
        terminated = out.terminated & valid
        truncated = out.truncated & valid & ~terminated
        done = terminated | truncated
        view["terminated"][:] = terminated
        view["truncated"][:] = truncated
        self._track_episodes(lane, reward, valid, done, stats, out.dropped, out.continues)
        stats.dropped += out.drops
        if self.clip_reward:  # trained on the sign; reported as the env gave them (above)
            reward = np.sign(reward)
        if self.reward_scaler is None:
            view["rewards"][:] = reward
        else:
            view["rewards"][:] = self._scale(lane, reward, valid, done, train)
        lane.resetting = done[-1].copy()

    def _track_episodes(
        self,
        lane: _Lane,
        reward: np.ndarray,
        valid: np.ndarray,
        done: np.ndarray,
        stats: EpisodeStats,
        dropped: np.ndarray,
        continues: np.ndarray,
    ) -> None:
        """(T, rows) arrays: episodes that ended are reported (not those ``dropped``); the
        rest carry over, and so does a game whose termination ``continues`` (a life lost)."""
        start = np.zeros(reward.shape[1], dtype=np.int64)  # first step of each row's episode
        names = lane.agent_names
        for t, row in np.argwhere(done):  # in step order
            begin = start[row]
            if continues[t, row]:
                lane.episode_return[row] += reward[begin : t + 1, row].sum()
                lane.episode_length[row] += valid[begin : t + 1, row].sum()
                start[row] = t + 1
                continue
            if not dropped[t, row]:
                episode_return = lane.episode_return[row] + reward[begin : t + 1, row].sum()
                stats.returns.append(float(episode_return))
                length = lane.episode_length[row] + valid[begin : t + 1, row].sum()
                stats.lengths.append(int(length))
                stats.agents.append(names[row % len(names)])
            lane.episode_return[row] = lane.episode_length[row] = 0
            start[row] = t + 1
        unfinished = np.arange(len(reward))[:, None] >= start
        lane.episode_return += np.where(unfinished, reward, 0.0).sum(0)
        lane.episode_length += (valid & unfinished).sum(0)

    def _scale(
        self, lane: _Lane, reward: np.ndarray, valid: np.ndarray, done: np.ndarray, train: bool
    ) -> np.ndarray:
        """(T, rows) rewards / std(discounted return) (Engstrom et al. 2020's reward
        scaling), step by step as it would have run live: step t's scale has seen the
        discounted returns up to step t."""
        scaler = self.reward_scaler
        assert scaler is not None
        gamma = self.gamma
        if reward.shape[1] == 1:  # one row: Python floats, no numpy call per step
            discounted = float(lane.discounted_return[0])
            fold: list[float | None] = []
            columns = (reward[:, 0].tolist(), valid[:, 0].tolist(), done[:, 0].tolist())
            for r, ok, end in zip(*columns, strict=True):
                discounted = discounted * gamma + r
                fold.append(discounted if train and ok else None)
                if end:
                    discounted = 0.0
            lane.discounted_return[0] = discounted
            return np.array(scaler.update_and_scale(fold, columns[0]))[:, None]
        out = np.empty_like(reward)
        for t in range(len(reward)):
            lane.discounted_return = lane.discounted_return * gamma + reward[t]
            if train:
                scaler.update(lane.discounted_return[valid[t]])
            lane.discounted_return[done[t]] = 0.0
            out[t] = scaler.scale_array(reward[t])
        return out

    def state_dict(self) -> dict[str, Any]:
        return {
            "rng": self.rng.bit_generator.state,
            "reward_scaler": self.reward_scaler.state_dict() if self.reward_scaler else None,
            "lanes": [lane.state_dict() for lane in self.lanes],
        }

    def load_state_dict(self, state: dict[str, Any], env_state: EnvState = None) -> None:
        """Restore the acting side. With ``env_state`` (captured mid-episode), the episodes
        in flight continue exactly; without, the envs keep their fresh episodes."""
        self.rng.bit_generator.state = state["rng"]
        if self.reward_scaler is not None and state["reward_scaler"] is not None:
            self.reward_scaler.load_state_dict(state["reward_scaler"])
        if env_state is None:
            return
        self.rows.restore(env_state)
        for lane, lane_state in zip(self.lanes, state["lanes"], strict=True):
            lane.load_state_dict(lane_state)

    def capture(self) -> EnvState:
        """The environments' state for exact resume (see envs.EnvState)."""
        return self.rows.capture()

    def close(self) -> None:
        self.rows.close()


def make_collector(config: Config, seed: int, num_envs: int, name: str = "local") -> Collector:
    """The collector of a run, over ``num_envs`` of its environments: the trainer's own
    (all of them) or one Ray runner's share."""
    runners = replace(config.runners, count=0, envs_per_runner=None, async_collection=False)
    local = replace(config, runners=runners, env=replace(config.env, num_envs=num_envs))
    return Collector(
        make_row_env(local),
        seed,
        gamma=config.rollout.gamma,
        normalize_reward=config.env.normalize_reward,
        reward_clip=config.env.reward_clip,
        num_steps=config.rollout.num_steps,
        obs_stats=config.env.obs_stats,
        name=name,
        clip_reward=config.env.clip_reward,
        sequence_length=config.rollout.sequence_length,
    )
