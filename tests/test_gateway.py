"""The gateway (``trustrl serve --listen``): agents over gRPC, trusted with nothing.

In this process (no Ray): a learner over an ``Inbox`` with its gateway on a loopback
port (``Served``): thin agents acting with the ONNX model it hands out, back-pressure,
and tokens of one learner refused by another. With ``trustrl serve`` in a process of its
own (Ray, a private loopback instance the command starts and stops): an agent that
trains CartPole over gRPC, and every refusal answered with its status and counted under
its reason (no token, a wrong one, one revoked while the learner runs, a message over
the limit, chunks that do not fit, 1,170 messages mutated from valid ones), after which
the learner still trains and its memory has not grown; and the Ray token file it
leaves is readable by its owner alone.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

grpc = pytest.importorskip("grpc")

import trustrl  # noqa: E402
from tests.test_serve import AGENT_SCRIPT  # noqa: E402
from trustrl.remote import credentials  # noqa: E402
from trustrl.remote.messages import SERVICE, to_message  # noqa: E402
from trustrl.remote.proto import trustrl_pb2 as pb  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
APP = textwrap.dedent(
    """
    total_steps = 10000000
    [env]
    num_envs = 1
    [rollout]
    num_steps = 64
    [agent]
    observation_shape = [3]
    action_kind = "discrete"
    action_choices = [2]
    """
)


class Client:
    """The gateway's three calls, raw: each with the token given, replies as messages."""

    def __init__(self, url: str) -> None:
        self.channel = grpc.insecure_channel(url.removeprefix("grpc://"))
        self.calls = {
            name: self.channel.unary_unary(
                f"/{SERVICE}/{name}",
                request_serializer=lambda m: m if isinstance(m, bytes) else m.SerializeToString(),
                response_deserializer=reply.FromString,
            )
            for name, reply in (
                ("Fetch", pb.FetchReply),
                ("Submit", pb.SubmitReply),
                ("Status", pb.StatusReply),
            )
        }

    def __call__(self, name: str, request: Any, token: str | None, timeout: float = 30) -> Any:
        metadata = (("authorization", f"Bearer {token}"),) if token is not None else None
        return self.calls[name](request, metadata=metadata, timeout=timeout)

    def refusal(self, name: str, request: Any, token: str | None) -> tuple[Any, str]:
        """The status code and details of a call that must fail."""
        with pytest.raises(grpc.RpcError) as failed:
            self(name, request, token)
        return failed.value.code(), failed.value.details()

    def close(self) -> None:
        self.channel.close()


def full_chunk(rng: np.random.Generator, version: int, seq: int, length: int = 0) -> pb.Chunk:
    """A valid full chunk for APP's spaces (obs (3,), two actions)."""
    length = length or int(rng.integers(1, 40))
    ending = str(rng.choice(["terminated", "truncated", "cut"]))
    obs = rng.normal(size=(length, 3))
    chunk = pb.Chunk(agent="", source="fuzz", seq=seq, version=version, ending=ending)
    to_message(obs.astype(np.float32), chunk.obs)
    to_message(rng.integers(0, 2, length), chunk.actions)
    to_message(np.log(np.full(length, 0.5, np.float32)), chunk.logprob)
    to_message(rng.normal(size=length + 1).astype(np.float32), chunk.values)
    to_message(np.ones(length, np.float32), chunk.rewards)
    to_message(obs.mean(0), chunk.obs_mean)
    to_message(((obs - obs.mean(0)) ** 2).sum(0), chunk.obs_m2)
    chunk.obs_count = float(length)
    if ending != "cut":
        chunk.episode_return, chunk.episode_length = float(length), length
    return chunk


def thin_chunk(rng: np.random.Generator, version: int, seq: int) -> pb.Chunk:
    length = int(rng.integers(1, 40))
    ending = str(rng.choice(["terminated", "truncated", "cut"]))
    rows = length + (ending != "terminated")
    chunk = pb.Chunk(agent="", source="thin", seq=seq, version=version, ending=ending)
    to_message(rng.normal(size=(rows, 3)).astype(np.float32), chunk.obs)
    to_message(rng.integers(0, 2, length), chunk.actions)
    to_message(rng.normal(size=length).astype(np.float32), chunk.rewards)
    return chunk


def _set(chunk: pb.Chunk, name: str, array: np.ndarray) -> None:
    to_message(array, getattr(chunk, name))


def _array(chunk: pb.Chunk, name: str) -> np.ndarray:
    from trustrl.remote.messages import to_numpy

    return to_numpy(getattr(chunk, name), name).copy()


def mutate(rng: np.random.Generator, chunk: pb.Chunk, version: int) -> str:
    """Break ``chunk`` in one way, chosen at random; the reason it must be refused for
    (or "stale": a version too far from the learner's)."""
    thin = not chunk.HasField("logprob")
    length = len(_array(chunk, "rewards"))
    arrays = ["obs", "actions", "rewards"] + ([] if thin else ["logprob", "values"])
    floats = ["obs", "rewards"] + ([] if thin else ["logprob", "values"])
    kind = str(
        rng.choice(
            [
                "encoding", "array", "missing_array", "not_finite", "action_range", "agent",
                "ending", "numbering", "length", "mask", "stale",
                *([] if thin else ["obs_stats", "metadata"]),
                *(["unknown_array"] if thin else []),
            ]
        )
    )  # fmt: skip
    name = str(rng.choice(arrays))
    if kind == "encoding":
        message = getattr(chunk, name)
        how = int(rng.integers(3))
        if how == 0:
            message.dtype = str(rng.choice(["float16", "complex64", "object", "<f4", "", "x" * 99]))
        elif how == 1:
            message.shape[0] += int(rng.integers(1, 5))
        else:
            message.data = message.data[: -int(rng.integers(1, 4))]
    elif kind == "array":
        array = _array(chunk, name)
        how = int(rng.integers(2))
        if how == 0:
            wrong = {"float32": np.float64, "float64": np.float32, "int64": np.int32}
            _set(chunk, name, array.astype(wrong[array.dtype.name]))
        else:
            _set(chunk, name, np.concatenate([array, array[:1]]))  # one row too many
    elif kind == "missing_array":
        chunk.ClearField(str(rng.choice([a for a in arrays if a != "logprob"])))
    elif kind == "not_finite":
        name = str(rng.choice(floats))
        array = _array(chunk, name).astype(np.float32)
        array.reshape(-1)[int(rng.integers(array.size))] = rng.choice([np.nan, np.inf, -np.inf])
        _set(chunk, name, array)
    elif kind == "action_range":
        actions = _array(chunk, "actions")
        actions[int(rng.integers(length))] = int(rng.choice([-1, 2, 7, -(2**40)]))
        _set(chunk, "actions", actions)
    elif kind == "agent":
        chunk.agent = str(rng.choice(["agent_0", "x", "\x00agent", "../../etc"]))
    elif kind == "ending":
        chunk.ending = str(rng.choice(["done", "", "TERMINATED", "cut "]))
    elif kind == "numbering":
        field = str(rng.choice(["seq", "version"]))
        setattr(chunk, field, -int(rng.integers(1, 2**40)))
    elif kind == "length":
        _set(chunk, "rewards" if thin else "logprob", np.zeros(0, np.float32))
    elif kind == "mask":
        _set(chunk, "action_mask", np.ones((length, 2), bool))
    elif kind == "stale":
        chunk.version = version + int(rng.integers(2, 100))
    elif kind == "obs_stats":
        if rng.integers(2):
            chunk.obs_count = float(length + int(rng.integers(1, 5)))
        else:
            m2 = _array(chunk, "obs_m2")
            m2[int(rng.integers(3))] = -1.0
            _set(chunk, "obs_m2", m2)
    elif kind == "metadata":
        chunk.episode_return = float(rng.choice([np.nan, np.inf]))
    elif kind == "unknown_array":
        _set(chunk, str(rng.choice(["values", "obs_mean", "obs_m2"])), np.zeros(3, np.float32))
    return kind


# A learner in this process.


class Served:
    """A learner of APP's spaces (or ``env_id``'s) over an Inbox, with its gateway on a
    loopback port; stops with ``stop()``."""

    def __init__(
        self,
        run_dir: Path,
        *,
        env_id: str | None = None,
        train: bool = True,
        overrides: dict[str, Any] | None = None,
        **inbox: Any,
    ) -> None:
        from trustrl.remote.external import (
            ExternalRunner,
            external_groups,
            learner_config,
            learner_info,
            max_chunk,
            queue_capacity,
        )
        from trustrl.remote.gateway import GatewaySettings, gateway_for, start_server
        from trustrl.remote.inbox import Inbox
        from trustrl.run.trainer import Trainer

        config_file = run_dir.parent / f"{run_dir.name}.toml"
        config_file.write_text(APP)
        config = trustrl.resolve(
            env_id or "app",
            config_file=None if env_id else config_file,
            overrides={"quiet": True, **(overrides or {})},
        )
        config, _ = learner_config(config)
        groups = external_groups(config)
        info = learner_info(config, groups)
        options = {"capacity": queue_capacity(config, groups), **inbox}
        self.inbox = Inbox(groups, info, run_dir / "inbox", max_chunk(config), **options)
        self.settings = GatewaySettings("127.0.0.1:0", max_message_bytes=256 * 1024)
        self.gateway = gateway_for(
            config, groups, info, self.inbox, run_dir, self.settings, max_chunk(config)
        )
        self.runner = ExternalRunner(config, groups, self.gateway.watch(self.inbox))
        self.trainer = Trainer(config, run_dir, runner=self.runner)
        self.runner.publish(self.trainer.snapshot())
        self.server, where = start_server(self.gateway, self.settings, print)
        self.url = f"grpc://{where}"
        self.thread = threading.Thread(target=self.trainer.train, daemon=True)
        if train:  # else the learner published its policy and takes nothing
            self.thread.start()

    def stop(self) -> None:
        from trustrl.remote.gateway import stop_server

        self.runner.stop()
        if self.thread.is_alive():
            self.thread.join(60)
        stop_server(self.server)


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Callable[..., Served]]:
    made: list[Served] = []

    def make(name: str = "run", **options: Any) -> Served:
        made.append(Served(tmp_path / name, **options))
        return made[-1]

    yield make
    for learner in made:
        learner.stop()


def test_a_token_for_one_learner_is_refused_by_another(served: Callable[..., Served]) -> None:
    one, other = served("one"), served("other")
    token = credentials.add(one.gateway.credentials.path.parent, "robot")
    credentials.add(other.gateway.credentials.path.parent, "robot")
    client = Client(other.url)
    try:
        code, details = client.refusal("Status", pb.StatusRequest(), token)
        assert code == grpc.StatusCode.UNAUTHENTICATED and "another learner" in details
        assert other.gateway.refused["other_learner"] == 1
        assert Client(one.url)("Status", pb.StatusRequest(), token).agent == "robot"
    finally:
        client.close()


def test_back_pressure_a_full_queue_and_stale_versions_are_named(
    served: Callable[..., Served],
) -> None:
    learner = served(capacity=50, train=False)  # a learner that takes nothing: the queue fills
    token = credentials.add(learner.gateway.credentials.path.parent, "fast")
    client = Client(learner.url)
    rng = np.random.default_rng(0)
    version = learner.gateway.version
    try:
        first = client("Submit", pb.SubmitRequest(chunks=[full_chunk(rng, version, 0, 60)]), token)
        assert first.results[0].outcome == pb.ACCEPTED and first.pressure == ""
        full = client("Submit", pb.SubmitRequest(chunks=[full_chunk(rng, version, 1, 5)]), token)
        assert full.results[0].outcome == pb.RETRY
        assert full.pressure == "queue_full" and full.slow_down_seconds > 0
        stale = client(
            "Submit", pb.SubmitRequest(chunks=[full_chunk(rng, version + 5, 2, 5)]), token
        )
        assert stale.results[0].outcome == pb.STALE
        assert stale.pressure == "lagging" and stale.slow_down_seconds > 0
        counts = client("Status", pb.StatusRequest(), token).counts
        assert (counts["accepted"], counts["retry"], counts["stale"]) == (1, 1, 1)
    finally:
        client.close()


@pytest.mark.skipif(importlib.util.find_spec("onnxruntime") is None, reason="needs onnxruntime")
def test_thin_agents_acting_with_the_onnx_model_train_the_learner(
    served: Callable[..., Served],
) -> None:
    """An agent that knows nothing of trustrl: it fetches the ONNX model, samples from
    its ``params`` output, and sends what it saw and did; the learner trains on it."""
    import onnxruntime

    learner = served()
    token = credentials.add(learner.gateway.credentials.path.parent, "thin")
    client = Client(learner.url)
    rng = np.random.default_rng(0)
    have, session, seq, sent = -1, None, 0, Counter()
    try:
        while learner.trainer.iteration < 3:
            reply = client("Fetch", pb.FetchRequest(have=have, onnx=True), token)
            if reply.HasField("policy"):
                assert reply.policy.onnx, "a single-agent policy comes with its ONNX model"
                session = onnxruntime.InferenceSession(
                    reply.policy.onnx, providers=["CPUExecutionProvider"]
                )
                have = reply.version
            assert session is not None
            obs = rng.normal(size=(33, 3)).astype(np.float32)  # 32 steps and a bootstrap row
            deterministic, log_probs = session.run(None, {"obs": obs[:32]})
            assert deterministic.shape == (32,) and log_probs.shape == (32, 2)
            np.testing.assert_allclose(np.exp(log_probs).sum(1), 1.0, rtol=1e-5)
            actions = (rng.random(32)[:, None] > np.exp(log_probs).cumsum(1)).sum(1)
            chunk = pb.Chunk(source="onnx", seq=seq, version=have, ending="cut")
            _set(chunk, "obs", obs)
            _set(chunk, "actions", actions.astype(np.int64))
            _set(chunk, "rewards", (actions == 1).astype(np.float32))
            result = client("Submit", pb.SubmitRequest(chunks=[chunk]), token).results[0]
            sent[pb.Outcome.Name(result.outcome)] += 1
            assert result.outcome != pb.REFUSED, result.error
            seq += 1
        assert sent["ACCEPTED"] >= 6  # three batches of 64 steps
        assert learner.gateway.senders["thin"] == sent["ACCEPTED"]
    finally:
        client.close()


def test_a_recurrent_learner_takes_chunks_with_their_states_and_refuses_them_without(
    served: Callable[..., Served],
) -> None:
    """policy.memory over the gateway: the Python client sends its chunks with the states
    it acted from, and the learner trains on them; a thin chunk without its states is
    refused, naming what is missing."""
    memory = {"policy": {"memory": "gru", "memory_size": 8}, "rollout": {"sequence_length": 8}}
    learner = served(overrides=memory)
    token = credentials.add(learner.gateway.credentials.path.parent, "py")
    agent = trustrl.Agent.connect(learner.url, token=token, seed=0)
    client = Client(learner.url)
    rng = np.random.default_rng(0)
    try:
        while learner.trainer.iteration < 2:
            action = agent.act(rng.normal(size=3))
            for _ in range(int(rng.integers(1, 30))):  # the reward: 1 for action 1
                action = agent.act(rng.normal(size=3), reward=float(action == 1))
            agent.end_episode(float(action == 1))
        version = client("Status", pb.StatusRequest(), token).version
        thin = thin_chunk(rng, version, 0)
        reply = client("Submit", pb.SubmitRequest(chunks=[thin]), token)
        result = reply.results[0]
        assert result.outcome == pb.REFUSED and result.reason == "missing_array"
        assert "states missing" in result.error
    finally:
        agent.close(flush_timeout=0)
        client.close()
    assert learner.trainer.iteration >= 2


def test_thin_agents_reward_statistics_are_in_the_learners_checkpoint(
    served: Callable[..., Served],
) -> None:
    """The learner scales a thin agent's rewards by statistics only it keeps: they go into
    its checkpoint (the runner's state) and a resumed learner's gateway takes them back."""
    from trustrl.run.checkpoint import flatten_state, unflatten_state

    rewarded = {"env": {"normalize_reward": True}}
    learner = served(train=False, overrides=rewarded)
    token = credentials.add(learner.gateway.credentials.path.parent, "thin")
    client = Client(learner.url)
    rng = np.random.default_rng(0)
    try:
        for seq in range(3):
            reply = client("Submit", pb.SubmitRequest(chunks=[thin_chunk(rng, 0, seq)]), token)
            assert reply.results[0].outcome == pb.ACCEPTED, reply.results[0].error
    finally:
        client.close()
    streams = learner.gateway.streams_state()
    assert len(streams) == 1 and streams[0]["last_seq"] == 2
    assert float(streams[0]["scaler"]["count"]) > 0
    skeleton, tensors = flatten_state(learner.runner.state_dict())
    state = unflatten_state(json.loads(json.dumps(skeleton)), tensors)
    resumed = served("resumed", train=False, overrides=rewarded)
    resumed.runner.load_state_dict(state)
    again = resumed.gateway.streams_state()
    assert [e["key"] for e in again] == [e["key"] for e in streams]
    for name in ("discounted", "episode_return", "episode_length", "last_seq"):
        assert again[0][name] == streams[0][name]
    for name in ("mean", "var", "count"):
        np.testing.assert_array_equal(again[0]["scaler"][name], streams[0]["scaler"][name])


def test_an_address_other_than_loopback_needs_tls_or_insecure(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from trustrl import cli
    from trustrl.config import ConfigError
    from trustrl.remote.gateway import GatewaySettings

    with pytest.raises(ConfigError, match="needs TLS"):
        GatewaySettings("0.0.0.0:50051")
    GatewaySettings("0.0.0.0:50051", insecure=True)
    GatewaySettings("192.0.2.1:50051", tls_cert="cert.pem", tls_key="key.pem")
    GatewaySettings("[::1]:50051")
    with pytest.raises(ConfigError, match="go together"):
        GatewaySettings("127.0.0.1:1", tls_cert="cert.pem")
    with pytest.raises(ConfigError, match="HOST:PORT"):
        GatewaySettings("127.0.0.1")
    assert cli.main(["serve", "CartPole-v1", "--listen", "0.0.0.0:50051"]) == 2
    assert "needs TLS" in capsys.readouterr().err
    assert cli.main(["serve", "CartPole-v1", "--insecure"]) == 2
    assert "need --listen" in capsys.readouterr().err


@pytest.mark.skipif(not Path("/usr/bin/openssl").exists(), reason="needs openssl")
def test_over_tls_only_a_client_that_trusts_the_certificate_gets_in(
    served: Callable[..., Served], tmp_path: Path
) -> None:
    from trustrl.remote.gateway import GatewaySettings, start_server, stop_server
    from trustrl.remote.grpc_link import GrpcLink

    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost",
         "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    learner = served()
    token = credentials.add(learner.gateway.credentials.path.parent, "tls")
    settings = GatewaySettings("localhost:0", str(cert), str(key))
    server, where = start_server(learner.gateway, settings, print)
    try:
        link = GrpcLink(f"grpcs://{where}", token, ca=cert, timeout=5)
        assert link.status().agent == "tls"
        link.close()
        plain = Client(f"grpc://{where}")
        with pytest.raises(grpc.RpcError):
            plain("Status", pb.StatusRequest(), token, timeout=5)
        plain.close()
    finally:
        stop_server(server)


# ``trustrl serve`` in a process of its own.


def _private_ray(tmp_path: Path) -> dict[str, str]:
    """The environment of a ``trustrl serve`` whose Ray is its own: a private temp root
    (short: Ray's socket paths are limited) and a fresh home, where Ray writes the token
    it generates."""
    home = tmp_path / "home"
    home.mkdir()
    return {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "HOME": str(home),
        "RAY_TMPDIR": tempfile.mkdtemp(prefix="trg", dir="/tmp"),
        "RAY_USAGE_STATS_ENABLED": "0",
    }


class ServeProcess:
    """``trustrl serve ... --listen 127.0.0.1:0``, its gateway's URL read from its output."""

    def __init__(
        self, args: list[str], env: dict[str, str], log: Path, listen: str = "127.0.0.1:0"
    ) -> None:
        self.log = log
        self.process = subprocess.Popen(
            [sys.executable, "-m", "trustrl.cli", "serve", *args, "--listen", listen],
            env=env,
            cwd=ROOT,
            stdout=log.open("wb"),
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 180
        while not (found := re.search(r"gateway on (grpc://\S+):", self.output())):
            assert self.process.poll() is None, self.output()[-3000:]
            assert time.monotonic() < deadline, "no gateway line:\n" + self.output()[-3000:]
            time.sleep(0.2)
        self.url = found.group(1)
        import psutil

        self.main = psutil.Process(self.process.pid)
        self.children = self.main.children(recursive=True)  # Ray's, started by now

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def memory(self) -> int:
        """Resident bytes of the serving process and of its inbox actor (Ray's worker)."""
        import psutil

        total = self.main.memory_info().rss
        for child in self.main.children(recursive=True):
            try:
                if "Inbox" in " ".join(child.cmdline()):
                    total += child.memory_info().rss
            except psutil.Error:
                pass
        return total

    def stop(self) -> str:
        """Ctrl-C (a checkpoint, then Ray stopped); the output. Every process it started
        must be gone."""
        import psutil

        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
        try:
            self.process.wait(120)
        finally:
            if self.process.poll() is None:
                self.process.kill()
        _, alive = psutil.wait_procs(self.children, timeout=30)
        for process in alive:
            process.kill()
        assert not alive, f"left behind: {[p.pid for p in alive]}"
        return self.output()


def _progress(run_dir: Path) -> int:
    path = run_dir / "progress.csv"
    return max(0, len(path.read_text().splitlines()) - 1) if path.is_file() else 0


def _wait(predicate: Callable[[], bool], what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


ray_needed = pytest.mark.skipif(
    importlib.util.find_spec("ray") is None, reason="needs trustrl[ray]"
)


@ray_needed
@pytest.mark.xdist_group("ray")
@pytest.mark.time_limit(500)  # Ray's start and stop included
def test_refusals_are_answered_and_counted_and_the_learner_trains_on(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    tokens = {name: credentials.add(run_dir, name) for name in ("good", "doomed", "other")}
    foreign = credentials.add(tmp_path / "elsewhere", "good")
    config = tmp_path / "app.toml"
    config.write_text(APP)
    env = _private_ray(tmp_path)
    learner = ServeProcess(
        ["--config", str(config), "--run-dir", str(run_dir), "--max-message-mb", "0.25", "--quiet"],
        env,
        tmp_path / "serve.log",
    )
    client = Client(learner.url)
    try:
        # The Ray token file the learner's own instance created: its owner's alone.
        token_file = Path(env["HOME"]) / ".ray" / "auth_token"
        assert token_file.is_file()
        assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
        good = tokens["good"]
        status = client("Status", pb.StatusRequest(), good)
        assert status.agent == "good" and json.loads(status.learner_json)["groups"]
        version = client("Fetch", pb.FetchRequest(have=-1), good).version
        assert version >= 0
        expected: Counter[str] = Counter()

        def refused(token: str | None, code: Any, reason: str, request: Any = None) -> None:
            got, details = client.refusal("Status", request or pb.StatusRequest(), token)
            assert got == code and details.startswith(reason), (got, details)
            expected[reason] += 1

        refused(None, grpc.StatusCode.UNAUTHENTICATED, "no_token")
        refused("not-a-token", grpc.StatusCode.UNAUTHENTICATED, "bad_token")
        refused(good[:-2] + "xx", grpc.StatusCode.UNAUTHENTICATED, "bad_token")
        refused(foreign, grpc.StatusCode.UNAUTHENTICATED, "other_learner")
        assert client("Status", pb.StatusRequest(), tokens["doomed"]).agent == "doomed"
        from trustrl import cli

        assert cli.main(["agents", "revoke", str(run_dir), "doomed"]) == 0
        refused(tokens["doomed"], grpc.StatusCode.PERMISSION_DENIED, "revoked")
        assert client("Status", pb.StatusRequest(), tokens["other"]).agent == "other"
        refused(good, grpc.StatusCode.RESOURCE_EXHAUSTED, "too_large", b"\x00" * 300_000)
        big = pb.SubmitRequest(chunks=[full_chunk(np.random.default_rng(0), version, 0, 12_000)])
        code, details = client.refusal("Submit", big, good)
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and details.startswith("too_large")
        expected["too_large"] += 1

        # Mutated messages: each refused for the reason its mutation targets.
        before = learner.memory()
        rng = np.random.default_rng(33)
        seq = 1
        accepted = 0
        mutated = 0
        for index in range(1300):
            # The learner's version now: a chunk two updates behind it would be STALE
            # before its fields are looked at.
            version = client("Fetch", pb.FetchRequest(), good).version
            chunk = (full_chunk if rng.integers(3) else thin_chunk)(rng, version, seq)
            seq += 1
            if index % 10 == 0:  # a valid one now and then: the learner keeps training
                reply = client("Submit", pb.SubmitRequest(chunks=[chunk]), good)
                accepted += reply.results[0].outcome == pb.ACCEPTED
                continue
            if index % 25 == 1:
                data = pb.SubmitRequest(chunks=[chunk]).SerializeToString()
                cut = data + bytes(rng.choice([b"\x0a\x80", b"\x0b", b"\x0a\x05ab"]))
                code, details = client.refusal("Submit", cut, good)
                assert code == grpc.StatusCode.INVALID_ARGUMENT, details
                expected["malformed"] += 1
                mutated += 1
                continue
            mutated += 1
            kind = mutate(rng, chunk, version)
            result = client("Submit", pb.SubmitRequest(chunks=[chunk]), good).results[0]
            if kind == "stale":
                assert result.outcome == pb.STALE
                continue
            assert result.outcome == pb.REFUSED and result.reason == kind, (kind, result)
            expected[kind] += 1
        status = client("Status", pb.StatusRequest(), good)
        counted = {reason: n for reason, n in status.refused.items() if n}
        assert counted == dict(expected)
        from trustrl.remote.gateway import REASONS

        field_checks = set(REASONS) - {"payload", "malformed", "too_large"}
        assert field_checks - {"no_token", "bad_token", "other_learner", "revoked"} <= set(
            expected
        ), "every field check was reached"
        assert mutated >= 1000

        # The learner still trains, and its memory has not grown.
        trained = _progress(run_dir)
        rng = np.random.default_rng(1)
        deadline = time.monotonic() + 120
        while _progress(run_dir) < trained + 2:
            assert time.monotonic() < deadline, "the learner stopped training"
            version = client("Fetch", pb.FetchRequest(), good).version
            chunks = [full_chunk(rng, version, seq + i, 32) for i in range(8)]
            seq += 8
            client("Submit", pb.SubmitRequest(chunks=chunks), good)
        grown = learner.memory() - before
        assert grown < 50 * 1024 * 1024, f"resident memory grew by {grown / 2**20:.1f} MiB"
        print(f"\nfuzz: {mutated} mutated messages; refusals {dict(expected)}; "
              f"{accepted} valid chunks accepted; memory grew {grown / 2**20:.1f} MiB")  # fmt: skip
    finally:
        client.close()
        learner.stop()


@ray_needed
@pytest.mark.slow
@pytest.mark.xdist_group("ray")
@pytest.mark.time_limit(500)
def test_an_agent_over_grpc_trains_cartpole_with_trustrl_serve(tmp_path: Path) -> None:
    import gymnasium as gym

    run_dir = tmp_path / "run"
    token = credentials.add(run_dir, "cartpole-1")
    learner = ServeProcess(
        ["CartPole-v1", "--seed", "5", "--total-steps", "99840", "--run-dir", str(run_dir),
         "--quiet"],
        _private_ray(tmp_path),
        tmp_path / "serve.log",
    )  # fmt: skip
    started = time.monotonic()
    try:
        agent = trustrl.Agent.connect(learner.url, token=token, seed=1)
        env = gym.make("CartPole-v1")
        obs, _ = env.reset(seed=1)
        action = agent.act(obs)
        steps = 0
        while not agent.status()["finished"]:
            obs, reward, terminated, truncated, _ = env.step(action)
            steps += 1
            if terminated or truncated:
                agent.end_episode(reward, truncated=truncated and not terminated)
                obs, _ = env.reset()
                action = agent.act(obs)
            else:
                action = agent.act(obs, reward=reward)
            if steps % 50 == 0:
                # A simulator that waits for the learner, as an application that can
                # should: one that outran it by 100x on a loaded CI machine (3.5M steps
                # for the learner's 100k) had nearly all its chunks go stale, trained on
                # the few that got through, and ended at 452 once in about ten runs.
                while not (status := agent.status())["finished"] and status["queued"] > 2:
                    time.sleep(0.005)
            assert learner.process.poll() in (None, 0), learner.output()[-3000:]
        status = agent.status()
        agent.close()
        _wait(lambda: learner.process.poll() is not None, "the learner to finish")
        output = learner.stop()
        assert learner.process.returncode == 0, output[-3000:]
        evaluation = json.loads((run_dir / "eval.json").read_text())
        print(f"\nCartPole over gRPC: {steps} agent steps, {time.monotonic() - started:.1f} s, "
              f"evaluation {evaluation['mean_return']}; agent {json.dumps(status)}")  # fmt: skip
        assert evaluation["mean_return"] >= 475
        assert status["rejected"] == 0 and status["shipped"] > 0
    finally:
        learner.stop()


@pytest.fixture
def ray_cluster(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, dict[str, str]]]:
    """A one-node loopback Ray cluster with token authentication in a private temp root,
    outliving the learners that join it (as tests/test_serve.py's); (its address, the
    environment for processes that join it)."""
    from trustrl.remote import import_ray

    monkeypatch.setenv("RAY_TMPDIR", tempfile.mkdtemp(prefix="trg", dir="/tmp"))
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    import_ray(loopback=True)
    from ray.cluster_utils import Cluster

    ray_cli = Path(sys.executable).with_name("ray")
    subprocess.run([str(ray_cli), "get-auth-token", "--generate"], check=True, capture_output=True)
    head = Cluster(initialize_head=True, head_node_args={"num_cpus": 4, "include_dashboard": False})
    try:
        yield head.address, {**os.environ, "PYTHONPATH": str(ROOT)}
    finally:
        head.shutdown()


# The outage test's agent loop (tests/test_serve.py), over gRPC; the token comes from
# TRUSTRL_TOKEN.
GRPC_AGENT = AGENT_SCRIPT.replace(
    "CONNECT", "trustrl.Agent.connect(sys.argv[1], seed=int(sys.argv[2]))"
)


def _free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@ray_needed
@pytest.mark.xdist_group("ray")
@pytest.mark.time_limit(500)
def test_agents_over_grpc_lose_nothing_when_the_learner_is_killed_and_resumed(
    tmp_path: Path, ray_cluster: tuple[str, dict[str, str]]
) -> None:
    address, env = ray_cluster
    config = tmp_path / "app.toml"
    config.write_text(
        APP.replace("total_steps = 10000000", "total_steps = 6000\ncheckpoint_every = 4")
        + "queue_size = 100000\n"
    )
    run_dir = tmp_path / "run"
    tokens = {seed: credentials.add(run_dir, f"agent-{seed}") for seed in (1, 2)}
    listen = f"127.0.0.1:{_free_port()}"
    joined = ["--name", "outage", "--runners.ray-address", address, "--quiet"]
    first = ServeProcess(
        ["--config", str(config), "--run-dir", str(run_dir), *joined],
        env,
        tmp_path / "serve1.log",
        listen,
    )
    script = tmp_path / "agent.py"
    script.write_text(GRPC_AGENT)
    logs = {seed: tmp_path / f"agent{seed}.log" for seed in (1, 2)}
    agents = {
        seed: subprocess.Popen(
            [sys.executable, str(script), first.url, str(seed)],
            env={**env, "TRUSTRL_TOKEN": tokens[seed]},
            cwd=ROOT,
            stdout=logs[seed].open("wb"),
            stderr=subprocess.STDOUT,
        )
        for seed in (1, 2)
    }
    resumed = None
    try:
        _wait(lambda: _progress(run_dir) >= 6, "six iterations")
        first.process.send_signal(signal.SIGKILL)  # no checkpoint, no goodbye
        first.process.wait(30)
        killed_at = _progress(run_dir)
        spooled = {p.name for p in (run_dir / "inbox").glob("*.chunk")}
        time.sleep(3)  # the agents act on; their chunks queue
        resumed = ServeProcess(
            ["--resume", str(run_dir), *joined], env, tmp_path / "serve2.log", listen
        )
        _wait(lambda: resumed.process.poll() is not None, "the resumed learner to finish", 300)
        assert resumed.process.returncode == 0, resumed.output()[-3000:]
        results = []
        for seed, agent in agents.items():
            agent.wait(120)
            text = logs[seed].read_text(errors="replace")
            assert agent.returncode == 0, text[-3000:]
            results.append(json.loads(text.strip().splitlines()[-1]))
        print(f"\nlearner SIGKILLed after {killed_at} iterations ({len(spooled)} chunks spooled), "
              f"resumed on the same port; agents: {json.dumps(results)}")  # fmt: skip
        assert spooled, "the killed learner's unreleased chunks are on disk"
        for result in results:
            # Every chunk an agent finished was accepted (and so spooled before the
            # answer), answered stale (of a version the learner had moved past, or lost to
            # the kill), or is still queued at the agent (it came after the learner's
            # queue was full at the run's end: never acknowledged); none refused or dropped.
            assert result["dropped"] == result["rejected"] == 0, result
            assert result["shipped"] + result["stale"] + result["queued"] == result["produced"]
            assert result["shipped"] > 0 and result["retries"] > 0  # it saw the learner gone
        rows = (run_dir / "progress.csv").read_text().splitlines()[1:]
        iterations = [int(float(row.split(",")[0])) for row in rows]
        assert iterations == list(range(1, len(rows) + 1))
        # What the killed learner had acknowledged but not checkpointed was trained on by
        # the resumed one and released with its checkpoints.
        assert not spooled & {p.name for p in (run_dir / "inbox").glob("*.chunk")}
    finally:
        for agent in agents.values():
            if agent.poll() is None:
                agent.kill()
                agent.wait(10)
        if resumed is not None:
            resumed.stop()
        first.stop()


@ray_needed
@pytest.mark.slow
@pytest.mark.xdist_group("ray")
@pytest.mark.time_limit(600)
@pytest.mark.skipif(
    shutil.which("node") is None or shutil.which("npm") is None, reason="needs Node 20 and npm"
)
def test_a_javascript_agent_trains_cartpole_to_475(tmp_path: Path) -> None:
    """clients/js/cartpole.js: gRPC and ONNX Runtime in Node, thin chunks, no trustrl."""
    client = ROOT / "clients" / "js"
    subprocess.run(
        ["npm", "ci", "--no-audit", "--no-fund"], cwd=client, check=True, capture_output=True
    )
    run_dir = tmp_path / "run"
    token = credentials.add(run_dir, "js-1")
    learner = ServeProcess(
        ["CartPole-v1", "--seed", "5", "--total-steps", "99840", "--run-dir", str(run_dir),
         "--quiet"],
        _private_ray(tmp_path),
        tmp_path / "serve.log",
    )  # fmt: skip
    try:
        agent = subprocess.run(
            ["node", str(client / "cartpole.js"), learner.url, "--seed", "1", "--pace", "1"],
            env={**os.environ, "TRUSTRL_TOKEN": token},
            capture_output=True,
            text=True,
            timeout=450,
        )
        assert agent.returncode == 0, agent.stderr[-3000:]
        result = json.loads(agent.stdout.strip().splitlines()[-1])
        _wait(lambda: learner.process.poll() is not None, "the learner to finish")
        output = learner.stop()
        assert learner.process.returncode == 0, output[-3000:]
        evaluation = json.loads((run_dir / "eval.json").read_text())
        print(f"\nJavaScript agent: {json.dumps(result)}; evaluation {evaluation['mean_return']}")
        assert evaluation["mean_return"] >= 475
        assert result["finished"] and result["REFUSED"] == 0 and result["ACCEPTED"] > 0
    finally:
        learner.stop()
