"""Structured observations on the remote side (tests/envs.py's DotEnv: a channels-first
uint8 frame, "first", and a Dict of a bool grid, a float vector and a Discrete, "dict"):
Ray runners collecting asynchronously, external agents (``Agent.act`` takes the raw
observation and packs it; its chunks carry rows of ``spec.obs_dtype``, uint8 frames as
bytes), thin chunks over the gateway (raw entries, packed by the learner into the rows
the Agent would have sent), and a float frame where bytes are expected refused with one
line naming the entry, the expected and the received, nothing trained on it."""

from __future__ import annotations

import csv
import importlib.util
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import trustrl
from tests.envs import DotEnv
from trustrl.client.agent import Agent, LocalLink
from trustrl.contract import GroupSnapshot, PolicySnapshot
from trustrl.learner.policy import Policy
from trustrl.remote import thin
from trustrl.remote.external import external_groups, learner_config, learner_info, pack
from trustrl.remote.inbox import Inbox
from trustrl.remote.wire import ChunkError, decode_chunk, encode_chunk, encode_snapshot
from trustrl.run.trainer import Trainer

CHUNK = 5


def dot_config(kind: str, **overrides: Any) -> trustrl.Config:
    table: dict[str, Any] = {
        "quiet": True,
        "eval_episodes": 0,
        "env": {"num_envs": 2, "kwargs": {"kind": kind}, "normalize_obs": True},
        "rollout": {"num_steps": 32},
        "total_steps": 256,
        **overrides,
    }
    return trustrl.resolve("tests.envs:DotEnv", overrides=table)


def progress(run_dir: Path) -> list[dict[str, str]]:
    with (run_dir / "progress.csv").open() as f:
        return list(csv.DictReader(f))


def snapshot_of(config: trustrl.Config, spec: Any) -> PolicySnapshot:
    policy = Policy(spec, config.policy, normalize_obs=True, obs_clip=config.env.obs_clip)
    group = GroupSnapshot.of(policy)
    if spec.vector_dim:  # statistics far from (0, 1): normalizing with others shows
        rng = np.random.default_rng(1)
        group.weights["obs_normalizer.mean"][:] = rng.normal(size=spec.vector_dim)
        group.weights["obs_normalizer.var"][:] = rng.uniform(0.2, 3.0, size=spec.vector_dim)
        group.weights["obs_normalizer.count"][...] = 100.0
    return PolicySnapshot(2, (GroupSnapshot(group.description, group.weights),))


def play(kind: str, steps: int) -> tuple[Any, PolicySnapshot, dict, list[dict], list]:
    """An Agent over an Inbox acting ``steps`` steps of DotEnv(kind): the spec, the
    snapshot, the learner's info, the episodes as seen (raw observations) and the chunks
    the inbox took."""
    config, _ = learner_config(dot_config(kind))
    groups = external_groups(config)
    info = learner_info(config, groups)
    inbox = Inbox(groups, info)
    snapshot = snapshot_of(config, groups[0].spec)
    inbox.publish(snapshot.version, encode_snapshot(snapshot))
    agent = Agent(LocalLink(inbox), seed=3, max_chunk_length=CHUNK)
    env = DotEnv(kind)
    episodes: list[dict] = []
    obs, _ = env.reset(seed=0)
    episode: dict[str, Any] = {"obs": [obs], "rewards": []}
    action = agent.act(obs)
    for _ in range(steps):
        obs, reward, terminated, truncated, _ = env.step(action)
        episode["rewards"].append(reward)
        if terminated or truncated:
            agent.end_episode(reward, truncated=True, obs=obs)
            episode["final"] = obs
            episodes.append(episode)
            obs, _ = env.reset()
            episode = {"obs": [obs], "rewards": []}
            action = agent.act(obs)
        else:
            episode["obs"].append(obs)
            action = agent.act(obs, reward=reward)
    assert agent.flush(30) and agent.status()["rejected"] == 0
    agent.close()
    return groups[0].spec, snapshot, info, episodes, [chunk for _, _, chunk in inbox.queue]


def entries_of(observations: list[Any], spec: Any) -> dict[str, np.ndarray]:
    """A thin chunk's observation arrays for raw observations: the whole observation as
    ``obs``, a Dict's entries as ``obs/<key>``, each as the env handed it out."""
    if isinstance(observations[0], dict):
        return {
            f"obs/{e['key']}": np.stack([np.asarray(o[e["key"]]) for o in observations])
            for e in spec.obs_entries
        }
    return {"obs": np.stack(observations)}


@pytest.mark.parametrize("kind", ["first", "dict"])
def test_an_agent_packs_what_the_env_hands_out_and_thin_chunks_become_the_same(
    kind: str,
) -> None:
    """Agent.act takes DotEnv's observations as they are (a uint8 frame, a dict): its
    chunks hold rows of ``spec.obs_dtype`` (a frame's bytes as they were), statistics of
    the vector columns only, and pack into a rollout of that dtype; the thin chunk of the
    same raw observations becomes the same chunk on the learner's side."""
    from trustrl.acting.inference import Inference

    spec, snapshot, info, episodes, chunks = play(kind, 80)
    assert chunks and {c.ending for c in chunks} == {"cut", "truncated"}
    assert spec.obs_dtype == (np.uint8 if kind == "first" else np.float32)
    for chunk in chunks:
        assert chunk.obs.dtype == spec.obs_dtype and chunk.obs.shape == (len(chunk), spec.obs_dim)
        if kind == "first":  # no normalizer: the frame's own bytes
            assert chunk.obs_delta is None and chunk.obs.max() == 255
        else:
            assert chunk.obs_delta is not None and chunk.obs_delta.mean.shape == (2,)
        decode_chunk(encode_chunk(chunk), [external_groups(dot_config(kind))[0]])
    (group,) = external_groups(dot_config(kind))
    assert pack(group, chunks, 32).obs.dtype == spec.obs_dtype

    inference = Inference(snapshot.groups[0])
    stream = thin.Stream(None)
    index = 0
    for episode in episodes:
        seen = episode["obs"]
        for start in range(0, len(episode["rewards"]), CHUNK):
            chunk = chunks[index]
            index += 1
            stop = start + len(chunk)
            rows = seen[start : stop + 1] if chunk.ending == "cut" else [*seen[start:stop]]
            if chunk.ending == "truncated":
                rows.append(episode["final"])
            arrays = {
                **entries_of(rows, spec),
                "actions": chunk.actions,
                "rewards": np.asarray(episode["rewards"][start:stop], np.float32),
            }
            header = {"agent": "", "source": "s", "seq": chunk.seq, "version": 2}
            header |= {"ending": chunk.ending, "sender": "robot"}
            assert thin.check_thin(arrays, spec, chunk.ending, 1000) == len(chunk)
            made = thin.thicken(arrays, header, spec, inference, 0, stream, info["gamma"])
            assert made.obs.dtype == spec.obs_dtype
            np.testing.assert_allclose(made.obs, chunk.obs, rtol=1e-6, atol=1e-6)
            np.testing.assert_allclose(made.logprob, chunk.logprob, rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(made.values, chunk.values, rtol=1e-5, atol=1e-5)
            if chunk.obs_delta is not None:
                assert made.obs_delta is not None
                np.testing.assert_allclose(made.obs_delta.mean, chunk.obs_delta.mean, rtol=1e-6)
                np.testing.assert_allclose(made.obs_delta.m2, chunk.obs_delta.m2, rtol=1e-6)
    assert index == len(chunks)


def test_bad_observations_are_refused_naming_the_entry_and_nothing_is_shipped() -> None:
    config, _ = learner_config(dot_config("dict"))
    groups = external_groups(config)
    inbox = Inbox(groups, learner_info(config, groups))
    snapshot = snapshot_of(config, groups[0].spec)
    inbox.publish(snapshot.version, encode_snapshot(snapshot))
    agent = Agent(LocalLink(inbox), seed=0)
    obs, _ = DotEnv("dict").reset(seed=0)
    cases = [
        ({**obs, "grid": obs["grid"].astype(np.float32)}, "observation entry 'grid': expected a "
         r"frame of dtype bool \(shape \(6, 6, 2\)\), got float32"),
        ({**obs, "grid": obs["grid"][:, :, 0]}, r"entry 'grid': expected shape \(6, 6, 2\), got "
         r"shape \(6, 6\)"),
        ({"grid": obs["grid"], "vec": obs["vec"]}, "missing the key 'count'"),
        ({**obs, "count": 9}, r"observation entry 'count': value 9 is outside \[0, 8\]"),
        ({**obs, "vec": np.array([np.nan, 0.0])}, "observation entry 'vec' holds NaN"),
        (obs["grid"], "expected a structured observation"),
    ]  # fmt: skip
    for bad, message in cases:
        with pytest.raises(ValueError, match=message):
            agent.act(bad)
    agent.act(obs)  # still usable
    agent.end_episode(1.0)
    assert agent.flush(10) and agent.status()["shipped"] == 1
    agent.close()

    frames = Agent(LocalLink(_inbox("first")), seed=0)
    frame, _ = DotEnv("first").reset(seed=0)
    with pytest.raises(ValueError, match=r"the observation: expected a frame of dtype uint8 "
                       r"\(shape \(2, 6, 6\)\), got float32"):  # fmt: skip
        frames.act(frame.astype(np.float32))
    assert frames.episode is None or not frames.episode.actions
    frames.close()


def _inbox(kind: str) -> Inbox:
    config, _ = learner_config(dot_config(kind))
    groups = external_groups(config)
    inbox = Inbox(groups, learner_info(config, groups))
    snapshot = snapshot_of(config, groups[0].spec)
    inbox.publish(snapshot.version, encode_snapshot(snapshot))
    return inbox


@pytest.mark.parametrize(
    ("kind", "change", "reason", "message"),
    [
        ("first", {"obs": np.zeros((4, 2, 6, 6), np.float32)}, "array",
         r"the observation \('obs'\): expected image uint8\[4, 2, 6, 6\], got float32\["),
        ("dict", {"obs/grid": np.zeros((4, 6, 6, 2), np.float32)}, "array",
         r"entry 'grid' \('obs/grid'\): expected image bool\[4, 6, 6, 2\], got float32"),
        ("dict", {"obs/grid": None}, "missing_array", "entry 'grid' .* is missing"),
        ("dict", {"obs/count": np.full(4, 9)}, "array", "value 9 is outside 0..8"),
        ("dict", {"obs/vec": np.full((4, 2), np.inf, np.float32)}, "not_finite", "'vec'"),
        ("dict", {"obs": np.zeros((4, 75), np.float32)}, "unknown_array", "not \\['obs'\\]"),
        ("dict", {"obs/other": np.zeros(4)}, "unknown_array", "obs/other"),
    ],
    ids=["float-frame", "float-grid", "missing", "count-range", "inf", "packed", "unknown"],
)  # fmt: skip
def test_a_thin_entry_that_does_not_fit_is_refused_naming_it(
    kind: str, change: dict, reason: str, message: str
) -> None:
    (group,) = external_groups(dot_config(kind))
    env = DotEnv(kind)
    observations = [env.reset(seed=0)[0]] + [env.step(0)[0] for _ in range(3)]
    arrays = {
        **entries_of(observations, group.spec),
        "actions": np.zeros(3, np.int64),
        "rewards": np.zeros(3, np.float32),
    }
    for name, value in change.items():
        if value is None:
            del arrays[name]
        else:
            arrays[name] = value
    with pytest.raises(ChunkError, match=message) as refused:
        thin.check_thin(arrays, group.spec, "cut", 1000)
    assert refused.value.reason == reason
    assert "\n" not in str(refused.value)


# Agent.local: the learner in this process trains on the agent's chunks.


@pytest.mark.parametrize("kind", ["first", "dict"])
def test_agent_local_trains_on_structured_observations(kind: str, tmp_path: Path) -> None:
    config = dot_config(kind, total_steps=3 * 64, seed=1)
    agent = Agent.local(config, tmp_path / "run", seed=1)
    taken: list[Any] = []
    collect = agent._learner.runner.collect  # type: ignore[union-attr]

    def spy(snapshot: Any, train: bool = True) -> Any:
        batch = collect(snapshot, train)
        taken.append(batch.groups[0].obs.dtype)
        return batch

    agent._learner.runner.collect = spy  # type: ignore[method-assign,union-attr]
    env = DotEnv(kind)
    obs, _ = env.reset(seed=1)
    action = agent.act(obs)
    while not agent.status()["finished"]:
        obs, reward, _, truncated, _ = env.step(action)
        if truncated:
            agent.end_episode(reward, truncated=True, obs=obs)
            obs, _ = env.reset()
            action = agent.act(obs)
        else:
            action = agent.act(obs, reward=reward)
    status = agent.status()
    trainer = agent.learner
    agent.close()
    assert status["rejected"] == 0 and status["shipped"] >= 24, status
    assert trainer.env_steps >= 3 * 64 and trainer.outcome == "finished"
    rows = progress(tmp_path / "run")
    assert len(rows) == 3 and all(r["loss_v"] not in ("", "nan") for r in rows)
    expected = np.uint8 if kind == "first" else np.float32
    assert taken and set(taken) == {np.dtype(expected)}


# The gateway: thin chunks of raw entries over gRPC.


class Gatewayed:
    """A DotEnv learner over an Inbox with its gateway on a loopback port (as
    tests/test_gateway.py's Served, for an env with keyword arguments)."""

    def __init__(self, run_dir: Path, kind: str, train: bool) -> None:
        from trustrl.remote.external import ExternalRunner, max_chunk, queue_capacity
        from trustrl.remote.gateway import GatewaySettings, gateway_for, start_server

        config, _ = learner_config(dot_config(kind, total_steps=10_000_000))
        groups = external_groups(config)
        info = learner_info(config, groups)
        self.inbox = Inbox(
            groups, info, run_dir / "inbox", max_chunk(config), queue_capacity(config, groups)
        )
        self.settings = GatewaySettings("127.0.0.1:0")
        self.gateway = gateway_for(
            config, groups, info, self.inbox, run_dir, self.settings, max_chunk(config)
        )
        self.spec = groups[0].spec
        self.runner = ExternalRunner(config, groups, self.gateway.watch(self.inbox))
        self.trainer = Trainer(config, run_dir, runner=self.runner)
        self.runner.publish(self.trainer.snapshot())
        self.server, where = start_server(self.gateway, self.settings, print)
        self.target = where
        self.thread = threading.Thread(target=self.trainer.train, daemon=True)
        if train:
            self.thread.start()

    def stop(self) -> None:
        from trustrl.remote.gateway import stop_server

        self.runner.stop()
        if self.thread.is_alive():
            self.thread.join(60)
        stop_server(self.server)


@pytest.fixture
def gatewayed(tmp_path: Path) -> Iterator[Callable[..., Gatewayed]]:
    pytest.importorskip("grpc")
    made: list[Gatewayed] = []

    def make(kind: str, train: bool = True) -> Gatewayed:
        made.append(Gatewayed(tmp_path / f"{kind}-{len(made)}", kind, train))
        return made[-1]

    yield make
    for learner in made:
        learner.stop()


def thin_message(
    observations: list[Any], spec: Any, version: int, seq: int, ending: str = "cut"
) -> Any:
    """A thin chunk message of DotEnv observations: a frame in ``obs``, a Dict's entries
    in ``obs_entries``; a bootstrap row unless ``ending`` is terminated."""
    from trustrl.remote.messages import to_message
    from trustrl.remote.proto import trustrl_pb2 as pb

    steps = len(observations) - (ending != "terminated")
    chunk = pb.Chunk(source="thin", seq=seq, version=version, ending=ending)
    for name, array in entries_of(observations, spec).items():
        target = chunk.obs if name == "obs" else chunk.obs_entries[name.removeprefix("obs/")]
        to_message(array, target)
    to_message(np.zeros(steps, np.int64), chunk.actions)
    to_message(np.ones(steps, np.float32), chunk.rewards)
    return chunk


def call(target: str, token: str, name: str, request: Any) -> Any:
    import grpc

    from trustrl.remote.messages import SERVICE
    from trustrl.remote.proto import trustrl_pb2 as pb

    replies: dict[str, Any] = {"Submit": pb.SubmitReply, "Status": pb.StatusReply}
    with grpc.insecure_channel(target) as channel:
        method = channel.unary_unary(
            f"/{SERVICE}/{name}",
            request_serializer=lambda m: m.SerializeToString(),
            response_deserializer=replies[name].FromString,
        )
        return method(request, metadata=(("authorization", f"Bearer {token}"),), timeout=30)


@pytest.mark.time_limit(120)
def test_thin_chunks_of_uint8_frames_and_dict_entries_over_the_gateway(
    gatewayed: Callable[..., Gatewayed],
) -> None:
    """Thin chunks of raw uint8 frames are accepted and queued as rows of bytes; a float
    frame is refused with a reason naming the entry, nothing queued; Dict entries
    sent raw train the learner."""
    from trustrl.remote import credentials
    from trustrl.remote.proto import trustrl_pb2 as pb

    learner = gatewayed("first", train=False)
    token = credentials.add(learner.gateway.credentials.path.parent, "thin")
    env = DotEnv("first")
    frames = [env.reset(seed=0)[0]] + [env.step(0)[0] for _ in range(8)]
    version = learner.gateway.version
    good = thin_message(frames, learner.spec, version, 0)
    floats = thin_message([f.astype(np.float32) for f in frames], learner.spec, version, 1)
    reply = call(learner.target, token, "Submit", pb.SubmitRequest(chunks=[good, floats]))
    accepted, refused = reply.results
    assert accepted.outcome == pb.ACCEPTED, accepted.error
    assert refused.outcome == pb.REFUSED and refused.reason == "array"
    assert refused.error == (
        "the observation ('obs'): expected image uint8[9, 2, 6, 6], got float32[9, 2, 6, 6]"
    )
    assert learner.gateway.refused["array"] == 1
    ((_, _, chunk),) = learner.inbox.queue  # the float frame queued nothing
    assert chunk.obs.dtype == np.uint8 and chunk.obs.shape == (8, 72) and chunk.sender == "thin"
    np.testing.assert_array_equal(chunk.obs, np.stack(frames[:8]).reshape(8, 72))

    learner = gatewayed("dict")
    token = credentials.add(learner.gateway.credentials.path.parent, "thin")
    env = DotEnv("dict")
    seq = 0
    while learner.trainer.iteration < 2:  # episodes of 8 steps, truncated
        episode = [env.reset(seed=seq)[0]] + [env.step(seq % 2)[0] for _ in range(8)]
        chunk = thin_message(episode, learner.spec, learner.gateway.version, seq, "truncated")
        reply = call(learner.target, token, "Submit", pb.SubmitRequest(chunks=[chunk]))
        assert reply.results[0].outcome in (pb.ACCEPTED, pb.RETRY, pb.STALE), reply
        if reply.results[0].outcome == pb.RETRY:  # the queue is full: the learner is busy
            time.sleep(0.05)
        seq += 1
    status = call(learner.target, token, "Status", pb.StatusRequest())
    assert status.counts["accepted"] >= 8 and sum(status.refused.values()) == 0


@pytest.mark.time_limit(120)
def test_a_full_chunk_of_float_rows_where_bytes_are_expected_is_refused(
    gatewayed: Callable[..., Gatewayed],
) -> None:
    """The Python client's full chunk, over gRPC: rows of bytes accepted, float rows
    refused (the error names the row's entries)."""
    from trustrl.remote import credentials, messages
    from trustrl.remote.proto import trustrl_pb2 as pb

    learner = gatewayed("first", train=False)
    token = credentials.add(learner.gateway.credentials.path.parent, "full")
    inbox = Inbox([learner.runner.groups[0]], learner.gateway.info)
    snapshot = learner.trainer.snapshot()
    inbox.publish(snapshot.version, encode_snapshot(snapshot))
    agent = Agent(LocalLink(inbox), seed=0)
    env = DotEnv("first")
    agent.act(env.reset(seed=0)[0])
    for _ in range(4):
        agent.act(env.step(0)[0], reward=1.0)
    agent.end_episode(1.0)
    assert agent.flush(10)
    agent.close()
    ((_, _, chunk),) = inbox.queue
    good = messages.chunk_message(encode_chunk(chunk))
    bad = pb.Chunk()
    bad.CopyFrom(good)
    bad.seq = 1
    messages.to_message(chunk.obs.astype(np.float32), bad.obs)
    reply = call(learner.target, token, "Submit", pb.SubmitRequest(chunks=[good, bad]))
    assert reply.results[0].outcome == pb.ACCEPTED, reply.results[0].error
    assert reply.results[1].outcome == pb.REFUSED and reply.results[1].reason == "array"
    assert reply.results[1].error == (
        "array 'obs' is float32[5, 72], expected uint8[5, 72] (each row packs the "
        "observation (image uint8 (2, 6, 6), 72 columns))"
    )
    assert len(learner.inbox.queue) == 1


# Ray runners, asynchronous collection.


@pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="needs trustrl[ray]")
@pytest.mark.xdist_group("ray")
@pytest.mark.time_limit(150)
def test_a_ray_runner_collects_structured_observations_asynchronously(tmp_path: Path) -> None:
    """One runner, asynchronous collection: DotEnv's uint8 frames reach the learner as
    bytes and its Dict rows as float32, and both train (two runs on one loopback Ray
    instance of the test's, stopped at the end)."""
    from trustrl.remote.cluster import RayCluster

    with RayCluster(num_cpus=2) as cluster:
        for kind, dtype in (("first", np.uint8), ("dict", np.float32)):
            runners_table = {"count": 1, "async_collection": True, "ray_address": cluster.address}
            config = dot_config(kind, runners=runners_table, total_steps=3 * 64)
            trainer = Trainer(config, tmp_path / kind)
            runners: Any = trainer.collector
            collect, taken = runners.collect, list[np.dtype]()

            def spy(
                snapshot: Any, train: bool = True, collect: Any = collect, taken: list = taken
            ) -> Any:
                batch = collect(snapshot, train)
                taken.append(batch.groups[0].obs.dtype)
                return batch

            runners.collect = spy
            trainer.train()
            rows = progress(tmp_path / kind)
            assert [float(r["env_steps"]) for r in rows] == [64.0, 128.0, 192.0]
            assert all(r["loss_v"] not in ("", "nan") for r in rows)
            assert set(taken) == {np.dtype(dtype)}, (kind, taken)
