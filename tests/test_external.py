"""External agents without Ray: the wire format, packing, the inbox and its spool, the
agent's checks and chunking, the unreachable learner, and Agent.local training."""

from __future__ import annotations

import dataclasses
import pickle
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import pytest

import trustrl
from trustrl.client.agent import Agent, LocalLink
from trustrl.config import ConfigError
from trustrl.contract import PolicySnapshot
from trustrl.envs.rows import AgentGroup
from trustrl.learner.policy import Policy
from trustrl.learner.rollout import Rollout
from trustrl.normalize import RunningStats
from trustrl.remote.external import ExternalRunner, external_groups, learner_info, pack
from trustrl.remote.inbox import Inbox
from trustrl.remote.wire import (
    Chunk,
    ChunkError,
    LinkError,
    decode_chunk,
    decode_snapshot,
    encode_chunk,
    encode_snapshot,
)

SPACES = {"observation_shape": [3], "action_kind": "discrete", "action_choices": [2]}


def config(**overrides: Any) -> trustrl.Config:
    table = {"quiet": True, "agent": dict(SPACES), "env": {"num_envs": 1}}
    table["rollout"] = {"num_steps": 16}
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(table.get(key), dict):
            table[key] = {**table[key], **value}
        else:
            table[key] = value
    return trustrl.resolve("my-app", overrides=table)


def group(agents: tuple[str, ...] = ("",)) -> AgentGroup:
    (only,) = external_groups(config())
    return AgentGroup("g", agents, only.spec)


def chunk(length: int, ending: str = "terminated", seed: int = 0, **fields: Any) -> Chunk:
    rng = np.random.default_rng(seed)
    values = {
        "agent": "",
        "source": "test",
        "seq": seed,
        "version": 0,
        "ending": ending,
        "obs": rng.normal(size=(length, 3)).astype(np.float32),
        "actions": rng.integers(0, 2, size=length),
        "logprob": rng.normal(size=length).astype(np.float32),
        "values": rng.normal(size=length + 1).astype(np.float32),
        "rewards": rng.normal(size=length).astype(np.float32),
        "action_mask": None,
        "obs_delta": None,
        "episode_return": 1.0 if ending != "cut" else None,
        "episode_length": length if ending != "cut" else None,
    }
    values.update(fields)
    return Chunk(**values)


def reference_advantages(c: Chunk, gamma: float, lam: float) -> np.ndarray:
    """Per chunk, by the definition: A_t = sum_k (gamma lam)^k delta_{t+k}, the bootstrap
    values[L] (zeroed by termination)."""
    n = len(c)
    v = c.values.astype(np.float64)
    bootstrap = 0.0 if c.ending == "terminated" else v[n]
    next_v = np.append(v[1:n], bootstrap)
    delta = c.rewards + gamma * next_v - v[:n]
    return np.array(
        [sum((gamma * lam) ** (k - t) * delta[k] for k in range(t, n)) for t in range(n)]
    )


def test_packed_chunks_give_each_chunk_its_own_gae() -> None:
    chunks = [
        chunk(7, "terminated", 1),
        chunk(1, "truncated", 2),
        chunk(12, "cut", 3),
        chunk(5, "terminated", 4),
        chunk(30, "truncated", 5),
    ]
    batch = pack(group(), chunks, num_steps=16)
    assert batch.valid.sum() == sum(len(c) for c in chunks)
    rollout = Rollout.from_batch(batch)
    rollout.compute_advantages(0.9, 0.8)
    advantages, valid = rollout.advantages.numpy(), batch.valid
    # Each chunk's rows, found by their logprob (distinct random numbers).
    for c in chunks:
        rows = np.argwhere(np.isin(batch.logprob, c.logprob) & valid)
        order = np.argsort([list(c.logprob).index(batch.logprob[t, n]) for t, n in rows])
        got = np.array([advantages[t, n] for t, n in rows[order]])
        np.testing.assert_allclose(got, reference_advantages(c, 0.9, 0.8), rtol=1e-5, atol=1e-5)


def test_multi_agent_chunks_fill_their_agents_columns() -> None:
    g = group(("a", "b"))
    chunks = [chunk(4, seed=1, agent="a"), chunk(6, seed=2, agent="b"), chunk(3, seed=3, agent="b")]
    batch = pack(g, chunks, num_steps=4)
    columns = batch.valid.shape[1]
    assert columns % 2 == 0
    for c in chunks:
        _, cols = np.nonzero(np.isin(batch.logprob, c.logprob) & batch.valid)
        assert set(cols % 2) == {g.agents.index(c.agent)}


def test_chunk_round_trip_and_statistics() -> None:
    stats = RunningStats.of(np.random.default_rng(0).normal(size=(5, 3)))
    original = chunk(5, "cut", 9, obs_delta=stats, episode_return=None, episode_length=None)
    where, back = decode_chunk(encode_chunk(original), [group()])
    assert where == 0 and back.ending == "cut" and back.seq == 9
    np.testing.assert_array_equal(back.obs, original.obs)
    np.testing.assert_array_equal(back.values, original.values)
    assert back.obs_delta is not None and back.obs_delta.count == 5
    np.testing.assert_allclose(back.obs_delta.m2, stats.m2)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"obs": np.zeros((5, 4), np.float32)},
            "array 'obs' is float32[5, 4], expected float32[5, 3]",
        ),
        ({"values": np.zeros(5, np.float32)}, "array 'values' is float32[5], expected float32[6]"),
        ({"rewards": np.array([0, 0, np.nan, 0, 0], np.float32)}, "'rewards' holds NaN"),
        ({"actions": np.array([0, 1, 2, 0, 1])}, "actions outside 0..[1]"),
        ({"agent": "robot"}, "agent 'robot' is not one of the learner's agents"),
        ({"ending": "crashed"}, "ending 'crashed'"),
    ],
)
def test_a_chunk_that_does_not_fit_is_refused_naming_the_field(change, message) -> None:
    with pytest.raises(ChunkError, match=None) as error:
        decode_chunk(encode_chunk(chunk(5, **change)), [group()])
    assert message in str(error.value)


def test_pickles_and_junk_are_refused_unread() -> None:
    class Boom:
        def __reduce__(self):  # would run at unpickling
            return (exec, ("raise SystemExit('unpickled!')",))

    for data in (pickle.dumps(Boom()), b"\x00" * 12, "text", {"obs": [1, 2]}):
        with pytest.raises(ChunkError):
            decode_chunk(data, [group()])


def test_snapshot_round_trip_keeps_the_layer_order() -> None:
    spec = group().spec
    policy = Policy(spec, trustrl.PolicyConfig(hidden_sizes=(8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8)))
    snapshot = PolicySnapshot.of([policy], 5)
    back = decode_snapshot(encode_snapshot(snapshot))
    assert back.version == 5
    assert list(back.groups[0].weights) == list(snapshot.groups[0].weights)


def test_inbox_spools_before_acknowledging_and_a_new_inbox_finds_what_was_left(
    tmp_path: Path,
) -> None:
    groups = [group()]
    inbox = Inbox(groups, {}, spool=tmp_path / "inbox")
    data = [encode_chunk(chunk(3, seed=i)) for i in range(4)]
    assert inbox.submit(data[0])["retry"]  # no policy published yet
    inbox.publish(0, b"snapshot")
    assert all(inbox.submit(d)["ok"] for d in data)
    assert inbox.submit(data[1])["ok"] and inbox.status()["duplicates"] == 1
    assert len(list((tmp_path / "inbox").glob("*.chunk"))) == 4
    assert [c.seq for _, c in inbox.take(0, [10**9], 0, 0)["chunks"]] == [0, 1, 2, 3]
    inbox.release(1)  # a checkpoint covers chunks 0 and 1
    again = Inbox(groups, {}, spool=tmp_path / "inbox")
    assert [c.seq for _, c in again.take(0, [10**9], 0, 0)["chunks"]] == [2, 3]
    again.publish(0, b"snapshot")
    assert again.submit(data[3])["ok"] and again.status()["duplicates"] == 1
    bad = again.submit(encode_chunk(chunk(3, obs=np.zeros((3, 2), np.float32))))
    assert not bad["ok"] and "expected float32[3, 3]" in bad["error"]


def test_a_finished_inbox_takes_what_agents_finished_and_says_it_is_finished(
    tmp_path: Path,
) -> None:
    # A finished learner takes no more batches, so a full queue would never drain: chunks
    # that agents finished before they heard are still spooled, and the reply tells them.
    inbox = Inbox([group()], {}, spool=tmp_path / "inbox", capacity=3)
    inbox.publish(0, b"snapshot")
    assert inbox.submit(encode_chunk(chunk(3, seed=0))) == {"ok": True}
    full = inbox.submit(encode_chunk(chunk(3, seed=1)))
    assert full["retry"] and full["full"]
    inbox.finish()
    late = [inbox.submit(encode_chunk(chunk(3, seed=i))) for i in (1, 2)]
    assert late == [{"ok": True, "finished": True}] * 2
    assert len(list((tmp_path / "inbox").glob("*.chunk"))) == 3


def test_agents_of_a_learner_resumed_before_their_version_get_its_versions_again() -> None:
    # A learner resumed from a checkpoint publishes versions older than the one its agents
    # hold; their chunks would be drained for lag and the learner would wait forever for
    # chunks, so the (long) poll hands the older version out at once.
    inbox = Inbox([group()], {})
    inbox.publish(4, b"resumed at 4")
    start = time.perf_counter()
    reply = inbox.latest(7, timeout=30.0)
    assert time.perf_counter() - start < 5.0
    assert reply["version"] == 4 and reply["data"] == b"resumed at 4"
    assert inbox.latest(4)["data"] is None


def test_damaged_spool_files_are_counted_named_and_kept_aside(tmp_path: Path) -> None:
    spool = tmp_path / "inbox"
    inbox = Inbox([group()], {}, spool=spool)
    inbox.publish(0, b"snapshot")
    for i in range(3):
        assert inbox.submit(encode_chunk(chunk(3, seed=i)))["ok"]
    (spool / "000000000001.chunk").write_bytes(b"\x00" * 40)  # a truncated write
    (spool / "notes.chunk").write_bytes(b"not a chunk")  # a name the inbox did not write
    with pytest.warns(RuntimeWarning, match="2 spool file") as caught:
        again = Inbox([group()], {}, spool=spool)
    message = str(caught[0].message)
    assert "000000000001.chunk" in message and "notes.chunk" in message
    assert again.status()["damaged"] == 2
    assert [c.seq for _, c in again.take(0, [10**9], 0, 0)["chunks"]] == [0, 2]
    damaged = spool / "damaged"
    assert sorted(p.name for p in damaged.iterdir()) == ["000000000001.chunk", "notes.chunk"]
    assert (damaged / "000000000001.chunk").read_bytes() == b"\x00" * 40  # kept as it was
    again.release(10**9)  # a checkpoint covers everything: the damaged files stay
    assert len(list(damaged.iterdir())) == 2
    # A second damaged file of the same name does not overwrite the first.
    (spool / "notes.chunk").write_bytes(b"other")
    with pytest.warns(RuntimeWarning, match="1 spool file"):
        Inbox([group()], {}, spool=spool)
    assert (damaged / "notes.chunk").read_bytes() == b"not a chunk"
    assert (damaged / "notes.1.chunk").read_bytes() == b"other"


def test_a_resumed_inbox_numbers_new_chunks_past_what_a_checkpoint_released(
    tmp_path: Path,
) -> None:
    spool = tmp_path / "inbox"
    inbox = Inbox([group()], {}, spool=spool)
    inbox.publish(0, b"snapshot")
    for i in range(3):
        assert inbox.submit(encode_chunk(chunk(3, seed=i)))["ok"]
    assert inbox.take(0, [10**9], 0, 0)["last"] == 2
    inbox.release(2)  # the checkpoint: the spool is empty now
    resumed = Inbox([group()], {}, spool=spool)
    resumed.release(2)  # ExternalRunner.load_state_dict, before any agent is heard
    resumed.publish(1, b"snapshot")
    assert resumed.submit(encode_chunk(chunk(3, seed=7)))["ok"]
    resumed.release(2)  # a checkpoint before the new chunk is trained on keeps it
    taken = resumed.take(0, [10**9], 1, 1)
    assert [c.seq for _, c in taken["chunks"]] == [7] and taken["last"] == 3


def test_the_inbox_long_poll_answers_a_new_version_at_once_and_wakes_on_request() -> None:
    inbox = Inbox([group()], {})
    inbox.publish(0, b"zero")
    assert inbox.latest(-1, timeout=30)["data"] == b"zero"  # newer already: no wait
    replies: list[dict[str, Any]] = []
    waiter = threading.Thread(target=lambda: replies.append(inbox.latest(0, 30, "w")))
    waiter.start()
    inbox.publish(1, b"one")
    waiter.join(timeout=10)
    assert replies and replies[0]["version"] == 1 and replies[0]["data"] == b"one"
    waiter = threading.Thread(target=lambda: replies.append(inbox.latest(1, 30, "w")))
    waiter.start()
    while "w" not in inbox.waiting:  # until it waits
        time.sleep(0.01)
    inbox.wake("w")
    waiter.join(timeout=10)
    assert not waiter.is_alive() and replies[1]["data"] is None


class CountingInbox(Inbox):
    """An in-process inbox that counts the calls an agent makes to it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.calls: dict[str, int] = {"latest": 0, "submit_many": 0}

    def latest(self, have: int, timeout: float = 0.0, watcher: str = "") -> dict[str, Any]:
        self.calls["latest"] += 1
        return super().latest(have, timeout, watcher)

    def submit_many(self, chunks: list[bytes]) -> list[dict[str, Any]]:
        self.calls["submit_many"] += 1
        return super().submit_many(chunks)


def test_an_idle_agent_waits_quietly_and_still_takes_a_new_version_promptly() -> None:
    spec = group().spec
    inbox = CountingInbox([AgentGroup("g", ("",), spec)], _info(spec))
    policy = Policy(spec, trustrl.PolicyConfig())
    inbox.publish(0, encode_snapshot(PolicySnapshot.of([policy], 0)))
    agent = Agent(LocalLink(inbox), seed=0)
    try:
        time.sleep(10.0)  # idle: nothing to ship, no new version
        assert inbox.calls["submit_many"] == 0
        assert inbox.calls["latest"] <= 4, inbox.calls  # a long poll every WATCH_SECONDS
        inbox.publish(1, encode_snapshot(PolicySnapshot.of([policy], 1)))
        deadline = time.monotonic() + 5.0
        while agent.status()["version"] != 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert agent.status()["version"] == 1
        agent.act(np.zeros(3))
        agent.end_episode(1.0)
        assert agent.flush(10) and inbox.calls["submit_many"] >= 1
    finally:
        started = time.monotonic()
        agent.close()
    assert time.monotonic() - started < 2.0  # close ends the long poll, not waits it out
    assert not agent.watcher.is_alive() and not agent.thread.is_alive()


@pytest.fixture
def local(tmp_path: Path):
    agents: list[Agent] = []

    def make(**overrides: Any) -> Agent:
        agent = Agent.local(config(**overrides), tmp_path / f"run{len(agents)}", seed=0)
        agents.append(agent)
        return agent

    yield make
    for agent in agents:
        agent.close(flush_timeout=0)


def test_bad_input_gets_a_clear_error(local) -> None:
    agent = local()
    with pytest.raises(ValueError, match=r"shape \(4,\); expected shape \(3,\)"):
        agent.act(np.zeros(4))
    with pytest.raises(ValueError, match="dtype <U1"):
        agent.act(np.array(["a", "b", "c"]))
    with pytest.raises(ValueError, match="NaN or infinite entries at \\[1\\]"):
        agent.act(np.array([0.0, np.nan, 0.0]))
    with pytest.raises(ValueError, match="end_episode\\(\\) with no open episode"):
        agent.end_episode(1.0)
    with pytest.raises(ValueError, match="first step of an episode"):
        agent.act(np.zeros(3), reward=1.0)
    with pytest.raises(ValueError, match="takes no action mask"):
        agent.act(np.zeros(3), mask=[True, False])
    agent.act(np.zeros(3))
    with pytest.raises(ValueError, match="needs the reward of the previous action"):
        agent.act(np.zeros(3))
    with pytest.raises(ValueError, match="reward inf is not finite"):
        agent.act(np.zeros(3), reward=float("inf"))
    agent.act(np.zeros(3), reward=1.0)  # still usable after the errors
    agent.end_episode(1.0)
    assert agent.flush(10) and agent.status()["shipped"] == 1


@pytest.mark.filterwarnings("ignore:trustrl agent")  # 30 steps outpace the shipping thread
def test_masks_are_checked_and_obeyed(tmp_path: Path) -> None:

    spaces = gym.spaces.Dict(
        {"observation": gym.spaces.Box(-1, 1, (3,)), "action_mask": gym.spaces.MultiBinary(4)}
    )
    from trustrl.envs.spaces import SpaceSpec

    spec = SpaceSpec.from_spaces(spaces, gym.spaces.Discrete(4))
    inbox = Inbox([AgentGroup("g", ("",), spec)], _info(spec))
    policy = Policy(spec, trustrl.PolicyConfig())
    inbox.publish(0, encode_snapshot(PolicySnapshot.of([policy], 0)))
    agent = Agent(LocalLink(inbox), seed=0)
    try:
        with pytest.raises(ValueError, match="mask allows no action"):
            agent.act(np.zeros(3), mask=[False] * 4)
        with pytest.raises(ValueError, match=r"mask of shape \(2,\); expected \(4,\)"):
            agent.act(np.zeros(3), mask=[True, True])
        actions = {agent.act(np.zeros(3), mask=[False, False, True, False])}
        for _ in range(30):
            actions.add(agent.act(np.zeros(3), reward=0.0, mask=[False, False, True, False]))
        assert actions == {2}
    finally:
        agent.close(flush_timeout=0)


def _info(spec: Any) -> dict[str, Any]:
    return {
        "groups": [{"name": "g", "agents": [""], "spec": spec.to_json()}],
        "gamma": 0.99,
        "normalize_reward": False,
        "reward_clip": 10.0,
        "max_chunk_length": 5,
        "queue_size": 3,
        "env_id": "test",
    }


class FlakyLink:
    """An inbox behind a switch: while ``down``, every call fails as an unreachable
    learner's would."""

    def __init__(self, inbox: Inbox) -> None:
        self.inbox, self.down = inbox, False

    def _check(self) -> None:
        if self.down:
            raise LinkError("down")

    def info(self) -> dict[str, Any]:
        return self.inbox.info()

    def submit_many(self, chunks: list[bytes]) -> list[dict[str, Any]]:
        self._check()
        return self.inbox.submit_many(chunks)

    def latest(self, have: int, timeout: float = 0.0, watcher: str = "") -> dict[str, Any]:
        self._check()
        reply = self.inbox.latest(have, timeout, watcher)
        self._check()  # the learner went away during the long poll
        return reply

    def wake(self, watcher: str) -> None:
        self.inbox.wake(watcher)

    def close(self) -> None:
        pass


def test_long_episodes_are_cut_into_chunks_bootstrapped_at_the_cut() -> None:
    spec = group().spec
    inbox = Inbox([AgentGroup("g", ("",), spec)], _info(spec))
    policy = Policy(spec, trustrl.PolicyConfig())
    inbox.publish(0, encode_snapshot(PolicySnapshot.of([policy], 0)))
    agent = Agent(LocalLink(inbox), seed=0)  # chunks of 5 steps
    observations = np.random.default_rng(0).normal(size=(12, 3))
    agent.act(observations[0])
    for obs in observations[1:]:
        agent.act(obs, reward=1.0)
    agent.end_episode(1.0)
    assert agent.flush(10)
    agent.close()
    chunks = [c for _, c in inbox.take(0, [10**9], 0, 0)["chunks"]]
    assert [(len(c), c.ending) for c in chunks] == [(5, "cut"), (5, "cut"), (2, "terminated")]
    value = policy.value(observations[[5, 10]])  # the torch policy, raw observations
    np.testing.assert_allclose([chunks[0].values[-1], chunks[1].values[-1]], value, rtol=1e-5)
    assert chunks[2].values[-1] == 0.0
    assert chunks[2].episode_return == 12.0 and chunks[2].episode_length == 12
    assert chunks[0].episode_return is None


def test_an_unreachable_learner_is_queued_for_and_drained_when_back() -> None:
    spec = group().spec
    inbox = Inbox([AgentGroup("g", ("",), spec)], _info(spec))  # queue of 3 chunks
    policy = Policy(spec, trustrl.PolicyConfig())
    inbox.publish(0, encode_snapshot(PolicySnapshot.of([policy], 0)))
    link = FlakyLink(inbox)
    agent = Agent(link, seed=0)
    try:
        link.down = True
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for episode in range(5):  # keeps acting while the learner is away
                agent.act(np.zeros(3))
                agent.end_episode(float(episode))
        assert any("dropping the oldest" in str(w.message) for w in caught)
        status = agent.status()
        assert status["queued"] == 3 and status["dropped"] == 2
        assert not agent.flush(0.3) and not agent.status()["connected"]
        link.down = False
        assert agent.flush(15)
        assert agent.status()["shipped"] == 3 and agent.status()["connected"]
        returns = [c.episode_return for _, c in inbox.take(0, [10**9], 0, 0)["chunks"]]
        assert returns == [2.0, 3.0, 4.0]  # the newest kept, in order
    finally:
        agent.close(flush_timeout=0)


def play_cartpole(agent: Agent, seed: int, max_steps: int) -> None:
    """A hand-written CartPole-v1 loop acting through ``agent`` until its learner's run
    is finished (or ``max_steps``)."""
    env = gym.make("CartPole-v1")
    obs, _ = env.reset(seed=seed)
    action = agent.act(obs)
    steps = 0
    while not agent.status()["finished"] and steps < max_steps:
        obs, reward, terminated, truncated, _ = env.step(action)
        steps += 1
        if terminated or truncated:
            agent.end_episode(float(reward), truncated=truncated and not terminated)
            obs, _ = env.reset()
            action = agent.act(obs)
        else:
            action = agent.act(obs, reward=float(reward))


@pytest.mark.slow
def test_agent_local_trains_cartpole_from_a_hand_written_loop(tmp_path: Path) -> None:
    cfg = trustrl.resolve("CartPole-v1", overrides={"quiet": True, "seed": 3})
    agent = Agent.local(cfg, tmp_path / "run", seed=3)
    play_cartpole(agent, seed=3, max_steps=200_000)
    trainer = agent.learner
    agent.close()
    assert trainer.outcome.startswith("solved"), trainer.outcome
    assert trainer.eval_result is not None and trainer.eval_result.mean_return >= 475
    assert (tmp_path / "run" / "checkpoints" / "final").is_dir()
    assert (tmp_path / "run" / "progress.csv").is_file()


def test_agent_local_with_spaces_from_the_config_trains_trpo_and_resumes(tmp_path: Path) -> None:
    cfg = config(algo="trpo", total_steps=96, checkpoint_every=2)
    assert cfg.agent.observation_shape == (3,)
    agent = Agent.local(cfg, tmp_path / "run", seed=0)
    rng = np.random.default_rng(0)
    while not agent.status()["finished"]:
        obs = rng.normal(size=3)
        action = agent.act(obs)
        for _ in range(int(rng.integers(1, 9))):  # the reward: 1 for action 1
            action = agent.act(rng.normal(size=3), reward=float(action == 1))
        agent.end_episode(float(action == 1))
    trainer = agent.learner
    agent.close()
    assert trainer.outcome == "finished" and trainer.env_steps >= 96
    assert trainer.eval_result is None  # no env to evaluate on
    more = dataclasses.replace(cfg, total_steps=200)
    resumed = trustrl.Trainer(more, tmp_path / "run", resume=True, runner=_runner(more))
    assert resumed.iteration == trainer.iteration and resumed.env_steps == trainer.env_steps


def _runner(cfg: trustrl.Config) -> Any:
    groups = external_groups(cfg)
    return ExternalRunner(cfg, groups, Inbox(groups, learner_info(cfg, groups)))


def test_a_global_state_critic_is_refused_for_external_agents() -> None:
    cfg = trustrl.resolve("mpe2:simple_spread_v3", overrides={"quiet": True})
    if cfg.multiagent.critic_input == "local":
        cfg = trustrl.resolve(
            "mpe2:simple_spread_v3", overrides={"multiagent": {"critic_input": "global"}}
        )
    with pytest.raises(ConfigError, match=r"multiagent\.critic_input = 'local'"):
        external_groups(cfg)


def test_multi_agent_ppo_trains_one_agent_per_actor_id(tmp_path: Path) -> None:
    from mpe2 import simple_spread_v3

    cfg = trustrl.resolve(
        "mpe2:simple_spread_v3",
        overrides={
            "quiet": True,
            "total_steps": 200,
            "eval_episodes": 0,
            "env": {"num_envs": 1},
            "rollout": {"num_steps": 50},
            "multiagent": {"critic_input": "local"},
        },
    )
    env = simple_spread_v3.parallel_env(max_cycles=25, continuous_actions=False)
    first = Agent.local(cfg, tmp_path / "run", agent=env.possible_agents[0], seed=0)
    agents = {env.possible_agents[0]: first}
    for i, name in enumerate(env.possible_agents[1:], 1):
        agents[name] = first.sibling(name, seed=i)
    observations, _ = env.reset(seed=0)
    actions = {name: agents[name].act(obs) for name, obs in observations.items()}
    while not first.status()["finished"]:
        observations, rewards, terminations, truncations, _ = env.step(actions)
        if all(terminations.values()) or all(truncations.values()):
            for name, agent in agents.items():
                agent.end_episode(rewards[name], truncated=not terminations[name])
            observations, _ = env.reset()
            actions = {name: agents[name].act(obs) for name, obs in observations.items()}
        else:
            actions = {
                name: agents[name].act(obs, reward=rewards[name])
                for name, obs in observations.items()
            }
    trainer = first.learner
    for agent in agents.values():
        agent.close()
    assert trainer.outcome == "finished" and trainer.iteration == 4
    rows = (tmp_path / "run" / "progress.csv").read_text().splitlines()
    header = rows[0].split(",")
    assert all(f"{name}/episode_return" in header for name in env.possible_agents)


def test_the_inbox_drains_chunks_outside_the_lag_bound_and_takes_a_batch_at_a_time() -> None:
    inbox = Inbox([group()], {})
    inbox.publish(3, b"snapshot")
    for i, version in enumerate([0, 1, 2, 3, 3, 3]):
        assert inbox.submit(encode_chunk(chunk(4, seed=i, version=version)))["ok"]
    taken = inbox.take(0, [8], version=3, max_lag=1)
    assert taken["drained"] == 2 and taken["last"] == 3  # versions 0 and 1 drained
    assert [c.seq for _, c in taken["chunks"]] == [2, 3]  # 8 steps: two chunks of 4
    rest = inbox.take(0, [100], version=3, max_lag=1)
    assert [c.seq for _, c in rest["chunks"]] == [4, 5] and rest["drained"] == 0


def test_connect_asks_for_the_address(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with pytest.raises(ValueError, match="address='HOST:PORT' as `trustrl serve` printed it"):
        Agent.connect("cartpole")
