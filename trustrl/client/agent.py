"""External agents: ``trustrl.Agent``, for applications that own their loop.

::

    agent = trustrl.Agent.connect("cartpole", address="127.0.0.1:6379")  # trustrl serve
    agent = trustrl.Agent.local(trustrl.resolve("CartPole-v1"))       # learner in-process

    obs = app.reset()
    action = agent.act(obs)                    # the first step of an episode: no reward
    while True:
        obs, reward, done, time_limit = app.step(action)
        if done or time_limit:
            agent.end_episode(reward, truncated=time_limit and not done)
            obs = app.reset()
            action = agent.act(obs)
        else:
            action = agent.act(obs, reward=reward)  # the reward of the previous action

``act`` runs the policy here, in numpy, on the newest snapshot this agent holds: it
never waits on the network. Two background threads talk to the learner: one ships
finished chunks (the wire format: remote/wire.py), sleeping while there are none; the
other waits for new policy versions with a long poll (the learner answers when one is
published, or after ``WATCH_SECONDS``). The agent switches to a new version between
chunks, so every chunk is one version's. While the learner is unreachable the agent goes
on acting, keeps up to ``queue_size`` chunks (dropping the oldest past that, counted in
``status()``), and retries with backoff; when the learner is back the queue drains.

A connected agent imports the acting side and the wire format only: no torch, and Ray
only in ``Agent.connect``. ``Agent.local`` is the exception by design: it runs the
learner (the run layer, torch) in this process, and imports it when called.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import threading
import uuid
import warnings
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from trustrl.acting.inference import Inference
from trustrl.config import Config
from trustrl.envs import layout
from trustrl.envs.spaces import SpaceSpec
from trustrl.normalize import MeanStd, RunningStats
from trustrl.remote.wire import Chunk, LinkError, decode_snapshot, encode_chunk

if TYPE_CHECKING:
    from trustrl.remote.external import ExternalRunner
    from trustrl.remote.inbox import Inbox
    from trustrl.run.trainer import Trainer

MIN_BACKOFF, MAX_BACKOFF = 0.05, 5.0
WATCH_SECONDS = 5.0
"""The longest an idle agent's long poll for a new policy lasts before it asks again."""
SEND_BATCH = 256  # chunks per call to the learner
FULL_PAUSE = 0.5
"""How long the shipping thread waits when the learner's queue is full and its reply
names no wait of its own."""
TOKEN_VARIABLE = "TRUSTRL_TOKEN"


class Link(Protocol):
    """How an agent reaches the inbox (``Inbox``'s methods of the same names): in-process,
    or a Ray actor by name. A call that cannot reach the learner raises LinkError."""

    def info(self) -> dict[str, Any]: ...
    def submit_many(self, chunks: list[bytes]) -> list[dict[str, Any]]: ...
    def latest(self, have: int, timeout: float = 0.0, watcher: str = "") -> dict[str, Any]: ...
    def wake(self, watcher: str) -> None: ...
    def close(self) -> None: ...


class LocalLink:
    """The inbox of a learner in this process."""

    def __init__(self, inbox: Inbox) -> None:
        self.inbox = inbox

    def info(self) -> dict[str, Any]:
        return self.inbox.info()

    def submit_many(self, chunks: list[bytes]) -> list[dict[str, Any]]:
        return self.inbox.submit_many(chunks)

    def latest(self, have: int, timeout: float = 0.0, watcher: str = "") -> dict[str, Any]:
        return self.inbox.latest(have, timeout, watcher)

    def wake(self, watcher: str) -> None:
        self.inbox.wake(watcher)

    def close(self) -> None:
        pass


@dataclass
class _Episode:
    """The open chunk: the steps acted since the chunk began, with one version."""

    inference: Inference
    version: int
    obs: list[np.ndarray] = field(default_factory=list)  # normalized, (obs_dim,) each
    raw: list[np.ndarray] = field(default_factory=list)  # rows as given, for the statistics
    actions: list[np.ndarray] = field(default_factory=list)
    outs: list[np.ndarray] = field(default_factory=list)  # head outputs
    noise: list[np.ndarray] = field(default_factory=list)
    masks: list[np.ndarray] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)  # scaled, one per finished step
    # A recurrent policy's: the state each step was acted from, and each step's value.
    states: list[np.ndarray] = field(default_factory=list)
    values: list[float] = field(default_factory=list)


class Agent:
    """One acting agent: ``act`` and ``end_episode``; see the module docstring.

    Build it with ``Agent.local(config)`` or ``Agent.connect(name, address)``. ``agent``
    names the agent in a multi-agent learner (one of its env's agent ids); single-agent
    learners take any number of agents under the default "". ``seed`` seeds this agent's
    action sampling (default: fresh entropy).
    """

    def __init__(
        self,
        link: Link,
        *,
        agent: str = "",
        seed: int | None = None,
        max_chunk_length: int | None = None,
        queue_size: int | None = None,
        timeout: float = 60.0,
        learner: _LearnerThread | None = None,
    ) -> None:
        self.link = link
        info = link.info()
        self.info = info
        groups = info["groups"]
        where = [i for i, g in enumerate(groups) if agent in g["agents"]]
        if not where:
            names = [a for g in groups for a in g["agents"]]
            raise ValueError(f"agent {agent!r} is not one of the learner's agents {names}")
        self.agent = agent
        self.group = where[0]
        self.agent_index = np.array([groups[self.group]["agents"].index(agent)])
        self.spec = SpaceSpec.from_json(groups[self.group]["spec"])
        self.max_chunk_length = max_chunk_length or int(info["max_chunk_length"])
        self.queue_size = queue_size or int(info["queue_size"])
        if self.max_chunk_length < 1 or self.queue_size < 1:
            raise ValueError(
                f"max_chunk_length ({self.max_chunk_length}) and queue_size "
                f"({self.queue_size}) must be >= 1"
            )
        self.gamma = float(info["gamma"])
        # A recurrent policy (external.memory_info): the state carried from step to step of
        # an episode (None: zeros, an episode's start), sent at a chunk's first step and
        # every sequence_length steps after.
        memory = info.get("memory")
        self.sequence_length = int(memory["sequence_length"]) if memory else 0
        self.state: np.ndarray | None = None
        self.reward_scaler = (
            MeanStd((), clip=float(info["reward_clip"])) if info["normalize_reward"] else None
        )
        self.discounted = 0.0
        self.rng = np.random.default_rng(seed)
        self.source = uuid.uuid4().hex
        self.seq = 0
        self.episode: _Episode | None = None
        self.episode_return = 0.0
        self.episode_length = 0
        # Shared with the shipping thread, under the lock.
        self.lock = threading.Condition()
        self.queue: deque[bytes] = deque()
        self.snapshot: tuple[int, Inference] | None = None
        self.counts = {
            "shipped": 0,
            "dropped": 0,
            "rejected": 0,
            "retries": 0,
            "stale": 0,  # delivered, but of a version the learner no longer trains on
            "slowed": 0,  # deliveries the learner deferred: its queue was full
        }
        self.connected = True
        self.finished = False
        self.last_error = ""
        self.closed = False
        self.owns_link = True  # False for a sibling: the connection is another agent's
        self.owns_learner = True  # likewise
        # Agent.local's learner, in step with this thread (see _deliver); no shipping
        # or watching thread then.
        self._learner = learner
        self.thread = threading.Thread(target=self._ship, name="trustrl-agent", daemon=True)
        self.watcher = threading.Thread(target=self._watch, name="trustrl-agent-watch", daemon=True)
        if learner is None:
            self.thread.start()
            self.watcher.start()
        else:
            self._fetch()
        if not self._wait_for_snapshot(timeout):
            self.close(flush_timeout=0)
            raise LinkError(f"no policy from the learner within {timeout:g} s")

    # Building one.

    @classmethod
    def local(
        cls,
        config: Config,
        run_dir: str | Path | None = None,
        *,
        overwrite: bool = False,
        agent: str = "",
        seed: int | None = None,
    ) -> Agent:
        """An agent whose learner runs in this process, on a thread: the run folder is
        written as by ``trustrl train`` (``agent.learner`` is the Trainer). Training
        stops at ``total_steps``; ``close()`` stops it earlier, with a checkpoint."""
        from trustrl.remote.external import (
            ExternalRunner,
            external_groups,
            learner_config,
            learner_info,
            max_chunk,
        )
        from trustrl.remote.inbox import Inbox
        from trustrl.run.trainer import Trainer

        config, notes = learner_config(config)
        groups = external_groups(config)
        inbox = Inbox(groups, learner_info(config, groups), max_length=max_chunk(config))
        runner = ExternalRunner(config, groups, inbox)
        trainer = Trainer(config, run_dir, overwrite=overwrite, runner=runner)
        trainer.notes += notes
        runner.publish(trainer.snapshot())
        learner = _LearnerThread(trainer, runner)
        learner.start()
        try:
            return cls(LocalLink(inbox), agent=agent, seed=seed, learner=learner)
        except BaseException:
            learner.stop()
            raise

    @classmethod
    def connect(
        cls,
        name: str,
        address: str | None = None,
        *,
        agent: str = "",
        seed: int | None = None,
        max_chunk_length: int | None = None,
        queue_size: int | None = None,
        timeout: float = 60.0,
        token: str | None = None,
        ca: str | Path | None = None,
    ) -> Agent:
        """An agent of a ``trustrl serve`` learner.

        Through its gateway: ``name`` is the URL it printed, ``grpc://HOST:PORT`` (or
        ``grpcs://`` with TLS; ``ca``: a PEM file of the certificates to trust, default
        the system's), and ``token`` this agent's (``trustrl agents add``; default: the
        ``TRUSTRL_TOKEN`` environment variable). No Ray is imported.

        Through Ray, for trusted processes inside the cluster: ``name`` is the learner's
        ``--name``, on the cluster at ``address`` (the one ``trustrl serve`` printed;
        default: the ``RAY_ADDRESS`` environment variable)."""
        link: Link
        if name.startswith(("grpc://", "grpcs://")):
            from trustrl.remote.grpc_link import GrpcLink

            token = token or os.environ.get(TOKEN_VARIABLE)
            if not token:
                raise ValueError(
                    f"Agent.connect({name!r}) needs this agent's token: token='...' as "
                    f"`trustrl agents add RUN_DIR NAME` printed it (or set {TOKEN_VARIABLE})"
                )
            link = GrpcLink(name, token, ca=ca, timeout=timeout)
        else:
            from trustrl.remote.serve import RayLink

            address = address or os.environ.get("RAY_ADDRESS")
            if not address:
                raise ValueError(
                    "Agent.connect needs the Ray address of the learner's cluster: "
                    "address='HOST:PORT' as `trustrl serve` printed it (or set RAY_ADDRESS)"
                )
            link = RayLink(name, address, timeout=timeout)
        try:
            return cls(
                link,
                agent=agent,
                seed=seed,
                max_chunk_length=max_chunk_length,
                queue_size=queue_size,
                timeout=timeout,
            )
        except BaseException:
            link.close()
            raise

    # Acting.

    def act(self, obs: Any, reward: float | None = None, mask: Any = None) -> int | np.ndarray:
        """The action for ``obs``; ``reward`` is the previous action's (none on an
        episode's first step), ``mask`` the allowed discrete actions (optional).

        ``obs`` is one observation as the env hands it out: an array for a Box (a frame
        of its own dtype, uint8 or bool, for an image), a dict for a Dict space, a tuple
        for a Tuple, an int for a Discrete. A structured observation is packed into the
        row the policy reads (envs/layout.py), each entry checked against its space: a
        ValueError names the entry, what it expected and what it got."""
        raw = self._observation(obs)
        episode = self.episode
        if episode is not None and episode.actions:
            self._reward(reward, "act")
            if len(episode.actions) >= self.max_chunk_length:
                # Cut here: the chunk is bootstrapped from this observation's value.
                bootstrap = self._value(episode.inference, raw)
                self._ship_chunk(episode, "cut", bootstrap)
                episode = None
        elif reward is not None:
            raise ValueError(
                f"act(reward={reward!r}) on the first step of an episode: the reward is for "
                "the previous action, and there is none yet"
            )
        if episode is None:
            episode = self.episode = self._begin()
        inference = episode.inference
        x = self._normalize(inference, raw)
        allowed = self._mask(mask)
        noise = inference.noise(self.rng, 1, self.agent_index)[0]
        allowed_rows = allowed[None] if allowed is not None else None
        if inference.state_size:
            state = self._state(inference)
            episode.states.append(state)
            action, out, value, after = inference.act_recurrent(
                x[None], allowed_rows, noise, state[None], None, self.agent_index
            )
            episode.values.append(float(value[0]))
            self.state = after[0]
        else:
            action, out = inference.act(x[None], allowed_rows, noise, self.agent_index)
        episode.obs.append(x)
        episode.raw.append(raw)
        episode.actions.append(action[0])
        episode.outs.append(out[0])
        episode.noise.append(noise[0])
        if allowed is not None:
            episode.masks.append(allowed)
        self.episode_length += 1
        chosen = self.spec.to_env(action)[0]
        return int(chosen) if self.spec.action_kind == "discrete" else chosen

    def end_episode(self, reward: float, truncated: bool = False, obs: Any = None) -> None:
        """Close the episode with the last action's ``reward``; ``truncated`` (a time
        limit, not a terminal state) bootstraps from V(``obs``), the final observation,
        or without it from the last observation acted on."""
        episode = self.episode
        if episode is None or not episode.actions:
            raise ValueError("end_episode() with no open episode: call act() first")
        self._reward(reward, "end_episode")
        bootstrap = 0.0
        if truncated:
            last = self._observation(obs) if obs is not None else episode.raw[-1]
            bootstrap = self._value(episode.inference, last)
        self._ship_chunk(episode, "truncated" if truncated else "terminated", bootstrap)
        self.episode = None
        self.state = None  # the next episode starts from zeros
        self.discounted = 0.0
        self.episode_return, self.episode_length = 0.0, 0

    def sibling(self, agent: str, seed: int | None = None) -> Agent:
        """Another agent of the same learner, over this one's connection: for a
        multi-agent learner, one ``Agent`` per agent id of its env. Closing a sibling
        leaves the connection (and an ``Agent.local`` learner) to this agent."""
        other = Agent(
            self.link,
            agent=agent,
            seed=seed,
            max_chunk_length=self.max_chunk_length,
            queue_size=self.queue_size,
            learner=self._learner,
        )
        other.owns_link = False
        other.owns_learner = False
        return other

    @property
    def version(self) -> int:
        """The policy version acting now (the open chunk's)."""
        if self.episode is not None:
            return self.episode.version
        with self.lock:
            assert self.snapshot is not None
            return self.snapshot[0]

    @property
    def learner(self) -> Trainer:
        """The Trainer of ``Agent.local``."""
        if self._learner is None:
            raise AttributeError("only Agent.local has its learner in this process")
        return self._learner.trainer

    def status(self) -> dict[str, Any]:
        """Chunks shipped, queued, dropped (queue full), rejected (by the learner, with
        ``last_error``), send retries; whether the learner was reachable at the last try
        and whether its run has finished."""
        with self.lock:
            status = {
                **self.counts,
                "queued": len(self.queue),
                "version": self.snapshot[0] if self.snapshot else -1,
                "connected": self.connected,
                "finished": self.finished,
                "last_error": self.last_error,
            }
        if self._learner is not None and self._learner.error is not None:
            status["learner_error"] = repr(self._learner.error)
        return status

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until every finished chunk is delivered; whether it was within ``timeout``."""
        with self.lock:
            return self.lock.wait_for(lambda: not self.queue, timeout)

    def close(self, flush_timeout: float = 10.0) -> None:
        """Deliver what is queued (up to ``flush_timeout`` seconds), stop the shipping
        thread, and with ``Agent.local`` stop the learner (with a checkpoint). An open
        episode is not shipped. Raises the local learner's error, if it failed."""
        if self.closed:
            return
        if flush_timeout > 0:
            self.flush(flush_timeout)
        with self.lock:
            self.closed = True
            self.lock.notify_all()
        if self.watcher.is_alive():
            with contextlib.suppress(Exception):  # an unreachable learner holds no poll
                self.link.wake(self.source)
        if self.thread.is_alive():
            self.thread.join(timeout=5.0)
        if self.watcher.is_alive():
            self.watcher.join(timeout=WATCH_SECONDS + 1.0)
        if self.owns_link:
            self.link.close()
        if self._learner is not None and self.owns_learner:
            self._learner.stop()
            if self._learner.error is not None:
                raise self._learner.error

    def __enter__(self) -> Agent:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # Inside.

    def _observation(self, obs: Any) -> np.ndarray:
        """``obs`` as a row: a flat Box's as float64, a structured observation's packed
        (``spec.obs_dtype``, envs/layout.py); a ValueError naming the expected shape, or
        the entry that does not fit."""
        spec = self.spec
        if spec.dict_obs and isinstance(obs, dict):
            obs = obs.get("observation")
        if spec.obs_entries:
            return structured_row(spec, obs)
        array = np.asarray(obs)
        if array.dtype.kind not in "biuf":
            raise ValueError(
                f"observation of dtype {array.dtype}; expected numbers of shape "
                f"{spec.obs_shape} (float32)"
            )
        if array.shape != spec.obs_shape:
            raise ValueError(f"observation of shape {array.shape}; expected shape {spec.obs_shape}")
        row = array.astype(np.float64).reshape(spec.obs_dim)
        if not np.isfinite(row).all():
            bad = np.flatnonzero(~np.isfinite(row))[:8].tolist()
            raise ValueError(f"observation holds NaN or infinite entries at {bad}")
        return row

    def _mask(self, mask: Any) -> np.ndarray | None:
        spec = self.spec
        if mask is None:
            return None if spec.mask_dim is None else np.ones(spec.mask_dim, bool)
        if spec.mask_dim is None and spec.action_kind != "discrete":
            raise ValueError(f"a mask is for discrete actions; this policy's are {spec.summary()}")
        if spec.mask_dim is None:
            raise ValueError(
                "this learner's policy takes no action mask (serve an env whose observations "
                "carry one, or a masked discrete space)"
            )
        array = np.asarray(mask)
        if array.shape != (spec.mask_dim,):
            raise ValueError(f"mask of shape {array.shape}; expected ({spec.mask_dim},)")
        allowed = array.astype(bool)
        if not allowed.any():
            raise ValueError("mask allows no action: at least one entry must be True")
        return allowed

    def _reward(self, reward: float | None, where: str) -> None:
        if reward is None:
            raise ValueError(
                f"{where}() needs the reward of the previous action (reward=0.0 if there was none)"
            )
        try:
            value = float(reward)
        except (TypeError, ValueError):
            raise ValueError(f"reward {reward!r} is not a number") from None
        if not math.isfinite(value):
            raise ValueError(f"reward {value} is not finite")
        assert self.episode is not None
        self.episode_return += value
        if self.reward_scaler is not None:
            self.discounted = self.discounted * self.gamma + value
            value = self.reward_scaler.update_and_scale([self.discounted], [value])[0]
        self.episode.rewards.append(value)

    def _normalize(self, inference: Inference, raw: np.ndarray) -> np.ndarray:
        """The row the policy reads: the normalizer covers the vector columns (all of a
        flat row); a row of bytes (frames, one-hots) stays bytes."""
        norm = inference.obs_normalizer
        if norm is None:
            return raw.astype(self.spec.obs_dtype, copy=False)
        return norm.normalize_array(raw[None])[0]

    def _value(self, inference: Inference, raw: np.ndarray) -> float:
        """V(``raw``): a bootstrap; a recurrent critic's seen from the state now."""
        x = self._normalize(inference, raw)
        if inference.state_size:
            state = self._state(inference)[None]
            return float(inference.value_recurrent(x[None], state, None, self.agent_index)[0])
        return float(inference.value(x[None], None, self.agent_index)[0])

    def _state(self, inference: Inference) -> np.ndarray:
        """The recurrent state the next step acts from (zeros at an episode's start)."""
        if self.state is None or len(self.state) != inference.state_size:
            self.state = np.zeros(inference.state_size, np.float32)
        return self.state

    def _begin(self) -> _Episode:
        """A new chunk, on the newest snapshot this agent holds."""
        with self.lock:
            assert self.snapshot is not None
            version, inference = self.snapshot
        return _Episode(inference, version)

    def _ship_chunk(self, episode: _Episode, ending: str, bootstrap: float) -> None:
        inference = episode.inference
        steps = len(episode.actions)
        obs = np.stack(episode.obs).astype(self.spec.obs_dtype, copy=False)
        actions = np.stack(episode.actions)
        masks = np.stack(episode.masks) if episode.masks else None
        agent = np.repeat(self.agent_index, steps)
        logprob = inference.log_prob(
            np.stack(episode.outs), actions, masks, np.stack(episode.noise), agent
        ).astype(np.float32)
        states = None
        if inference.state_size:  # values as acted, states every sequence_length steps
            values = np.asarray(episode.values, np.float32)
            states = np.stack(episode.states[:: self.sequence_length]).astype(np.float32)
        else:
            values = inference.value(obs, None, agent).astype(np.float32)
        ended = ending != "cut"
        chunk = Chunk(
            agent=self.agent,
            source=self.source,
            seq=self.seq,
            version=episode.version,
            ending=ending,
            obs=obs,
            actions=actions.astype(np.float32 if self.spec.action_kind == "box" else np.int64),
            logprob=logprob,
            values=np.append(values, np.float32(bootstrap)).astype(np.float32),
            rewards=np.asarray(episode.rewards, np.float32),
            action_mask=masks,
            obs_delta=RunningStats.of(
                np.stack(episode.raw)[:, : self.spec.vector_dim].astype(np.float64)
            )
            if inference.obs_normalizer is not None
            else None,
            episode_return=self.episode_return if ended else None,
            episode_length=self.episode_length if ended else None,
            states=states,
        )
        self.seq += 1
        data = encode_chunk(chunk)
        if self._learner is not None:
            self._deliver(data)
            return
        with self.lock:
            if len(self.queue) >= self.queue_size:
                self.queue.popleft()
                self.counts["dropped"] += 1
                if self.counts["dropped"] == 1:
                    warnings.warn(
                        f"trustrl agent: {self.queue_size} chunks are queued (the learner "
                        "is unreachable, or slower than this agent); dropping the oldest "
                        "(status() counts them)",
                        RuntimeWarning,
                        stacklevel=3,
                    )
            self.queue.append(data)
            self.lock.notify_all()

    def _deliver(self, data: bytes) -> None:
        """Agent.local: hand the chunk to the inbox here, and when it completes a batch
        wait for the learner's update (it runs while this loop waits, instead of fighting
        it for the interpreter lock, which slowed a CartPole update some 40 times), then
        take the new policy."""
        assert self._learner is not None
        inbox: Inbox = self._learner.runner.inbox
        reply = inbox.submit(data)
        with self.lock:
            self._count(reply)
        inbox.wait_until_taken()
        self._fetch()

    def _count(self, reply: dict[str, Any]) -> None:
        """An inbox's reply to a delivered chunk, counted (under the lock)."""
        if reply.get("stale"):  # delivered, and dropped: its version is too old
            self.counts["stale"] += 1
        elif reply.get("ok"):
            self.counts["shipped"] += 1
        else:
            self.counts["rejected"] += 1
            self.last_error = str(reply.get("error", ""))

    def _fetch(self, timeout: float = 0.0) -> None:
        """The learner's newest snapshot, if other than this agent's (newer, or older after
        the learner resumed from a checkpoint), waiting up to
        ``timeout`` seconds for one (a long poll); whether the run finished."""
        with self.lock:
            have = self.snapshot[0] if self.snapshot else -1
        latest = self.link.latest(have, timeout, self.source)
        with self.lock:
            self.finished = bool(latest["finished"])
            self.connected = True
        if latest["data"] is None:
            return
        snapshot = decode_snapshot(latest["data"])
        inference = Inference(snapshot.groups[self.group])
        with self.lock:
            self.snapshot = (snapshot.version, inference)
            self.lock.notify_all()

    def _wait_for_snapshot(self, timeout: float) -> bool:
        with self.lock:
            return self.lock.wait_for(lambda: self.snapshot is not None, timeout)

    def _ship(self) -> None:
        """The shipping thread: deliver the queue in order, asleep while it is empty; on a
        failure, back off and try again."""
        backoff = MIN_BACKOFF
        while True:
            with self.lock:
                self.lock.wait_for(lambda: self.queue or self.closed)
                if self.closed:
                    return
                batch = list(itertools.islice(self.queue, SEND_BATCH))
            try:
                # One call for everything queued: a call per chunk would need the
                # interpreter lock per chunk, which a busy application loop holds.
                replies = self.link.submit_many(batch)
                pause = 0.0  # back-pressure: the learner asks this agent to slow down
                with self.lock:
                    for data, reply in zip(batch, replies, strict=True):
                        pause = max(pause, float(reply.get("slow_down", 0.0)))
                        if reply.get("retry"):
                            if not reply.get("full"):
                                raise LinkError("the learner is starting")
                            pause = max(pause, FULL_PAUSE)  # its queue is full: keep the rest
                            self.counts["slowed"] += 1
                            break
                        if self.queue and self.queue[0] is data:  # not dropped meanwhile
                            self.queue.popleft()
                        self._count(reply)
                        self.finished = self.finished or bool(reply.get("finished"))
                    self.connected = True
                    self.lock.notify_all()
                    if pause > 0:
                        self.lock.wait_for(lambda: self.closed, pause)
                backoff = MIN_BACKOFF
            except Exception as exc:  # a LinkError, or anything else: never end the thread
                backoff = self._back_off(exc, backoff)

    def _watch(self) -> None:
        """The watching thread: one long poll after another for a newer policy (the
        learner answers as soon as one is published); on a failure, back off and try
        again."""
        backoff = MIN_BACKOFF
        while True:
            with self.lock:
                if self.closed:
                    return
            try:
                self._fetch(WATCH_SECONDS)
                backoff = MIN_BACKOFF
            except Exception as exc:  # a LinkError, or anything else: never end the thread
                backoff = self._back_off(exc, backoff)

    def _back_off(self, exc: Exception, backoff: float) -> float:
        """A failed call to the learner: counted, then ``backoff`` seconds of waiting
        (``close()`` cuts it short, new chunks do not); returns the next, doubled up to
        MAX_BACKOFF."""
        with self.lock:
            self.connected = not isinstance(exc, LinkError)
            self.counts["retries"] += 1
            self.last_error = f"{type(exc).__name__}: {exc}"
            first = self.counts["retries"] == 1
            self.lock.wait_for(lambda: self.closed, backoff)
        if first and not isinstance(exc, LinkError):
            warnings.warn(f"trustrl agent: {self.last_error}", RuntimeWarning, stacklevel=1)
        return min(backoff * 2, MAX_BACKOFF)


def structured_row(spec: SpaceSpec, obs: Any) -> np.ndarray:
    """One structured observation (a frame, a dict, a tuple, an int: as the env hands it
    out) packed into its row (``spec.obs_dtype``); each entry checked first, so that a
    ValueError names the entry, the expected and the received shape or dtype."""
    entries = spec.obs_entries
    if all(e["key"] == "" for e in entries):
        batch: Any = np.asarray(obs)[None]
    else:
        batch = {}
        for entry in entries:
            value = np.asarray(layout.pick(obs, entry["key"]))
            batch[entry["key"]] = value[None]
    for entry in entries:
        value = batch if entry["key"] == "" else batch[entry["key"]]
        where = f"observation entry {entry['key']!r}" if entry["key"] else "the observation"
        shape, dtype = tuple(entry["shape"]), entry["dtype"]
        if value.shape[1:] != shape:
            raise ValueError(f"{where}: expected shape {shape}, got shape {value.shape[1:]}")
        if entry["kind"] == "image" and value.dtype.name != dtype:
            raise ValueError(
                f"{where}: expected a frame of dtype {dtype} (shape {shape}), got {value.dtype}"
            )
        if value.dtype.kind not in "biuf":
            raise ValueError(f"{where}: expected numbers, got dtype {value.dtype}")
        if value.dtype.kind == "f" and not np.isfinite(value).all():
            raise ValueError(f"{where} holds NaN or infinite values")
        if entry["kind"] == "binary" and ((value != 0) & (value != 1)).any():
            raise ValueError(f"{where}: a MultiBinary observation is 0 or 1")
        if entry["kind"] == "onehot" and (value.dtype.kind == "f" and (value % 1 != 0).any()):
            raise ValueError(f"{where}: expected whole numbers, got {value.reshape(-1)[:8]}")
    return layout.pack(entries, batch, spec.obs_dim, spec.obs_dtype)[0]


class _LearnerThread:
    """``Agent.local``'s learner: ``Trainer.train`` on a thread."""

    def __init__(self, trainer: Trainer, runner: ExternalRunner) -> None:
        self.trainer, self.runner = trainer, runner
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="trustrl-learner", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def _run(self) -> None:
        try:
            self.trainer.train()
        except BaseException as exc:  # reported by close() and status()
            self.error = exc
        finally:
            self.runner.inbox.finish()

    def stop(self) -> None:
        self.runner.stop()
        self.thread.join()
