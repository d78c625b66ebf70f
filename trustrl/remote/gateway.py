"""The gateway: agents in any language reach a learner through gRPC, trusted with nothing.

``trustrl serve ... --listen HOST:PORT`` runs a gRPC server (grpcio) in the serving
process, in front of the same inbox that Ray agents deliver to (inbox.py). It offers the
three calls of ``proto/trustrl.proto`` and nothing else:

* **Fetch**: the newest policy (version, description, weights as arrays, and on request
  the same policy as an ONNX model), a long poll like ``Inbox.latest``;
* **Submit**: chunks of experience, full (what the Python ``Agent`` sends) or thin (what
  the agent saw and did, a structured observation's entries raw; thin.py checks each
  entry, packs them into the policy's rows and computes the rest with the acting
  version's weights);
  each becomes the wire format's payload and goes through ``Inbox.submit``, which
  checks it field by field, spools and queues it, recorded with the agent's name;
* **Status**: the learner's settings for agents, its version, and the gateway's counts,
  refusals per reason included.

Every call carries a token (``authorization: Bearer <token>`` metadata) that
``Credentials`` (credentials.py) checks against the run folder's ``agents.json``, read
again when it changes. Requests arrive as bytes and are parsed by protobuf only after
the token is let in and the size is within ``max_message_bytes``: nothing is unpickled,
evaluated or used as a path. Each refusal is answered with a gRPC status and counted
under its reason (``REASONS``), which ``Status`` reports.

Back-pressure: a chunk of a version more than ``runners.max_version_lag`` away from the
learner's is answered STALE (it would be drained unread), and one that finds the
inbox's queue full (as many steps as the learner can use before they go stale) RETRY;
the reply then says so (``pressure``) and how long to wait (``slow_down_seconds``).
"""

from __future__ import annotations

import json
import threading
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from trustrl.acting.inference import Inference
from trustrl.config import Config, ConfigError
from trustrl.contract import PolicySnapshot
from trustrl.envs.rows import AgentGroup
from trustrl.normalize import MeanStd
from trustrl.remote import messages, thin
from trustrl.remote.credentials import REFUSALS, Credentials
from trustrl.remote.messages import SERVICE
from trustrl.remote.proto import trustrl_pb2 as pb
from trustrl.remote.wire import REASONS as CHUNK_REASONS
from trustrl.remote.wire import (
    ChunkError,
    LinkError,
    check_header,
    decode_snapshot,
    encode_chunk,
)

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
GRPC_LIMIT_FACTOR = 2
"""gRPC itself refuses a message over ``GRPC_LIMIT_FACTOR x max_message_bytes`` before
it is read (uncounted: the gateway never sees it); one between the two is read, refused
and counted as ``too_large``."""
MAX_WAIT_SECONDS = 30.0
"""The longest a Fetch long poll waits, whatever the agent asks."""
WORKERS = 256
"""Threads serving calls; each waiting long poll holds one."""
MAX_CONCURRENT_RPCS = 1024
"""Calls in progress past which gRPC answers RESOURCE_EXHAUSTED at once."""
MAX_STREAMS = 4096
"""Thin-chunk streams (sender, source, agent) whose reward statistics are kept; the
least recently used is forgotten past that."""
SLOW_DOWN_SECONDS = {"queue_full": 1.0, "lagging": 0.25}
GATEWAY_REASONS = ("too_large", "malformed", "encoding")
"""Refusals of the gateway's own: a message over the size limit, one protobuf cannot
parse, an array whose dtype, shape and bytes disagree (messages.to_numpy)."""
REASONS = (*REFUSALS, *GATEWAY_REASONS, *CHUNK_REASONS)
"""Every reason a call or a chunk is refused for, as ``Status`` counts them."""
STATUS_CODES = {
    "no_token": grpc.StatusCode.UNAUTHENTICATED,
    "bad_token": grpc.StatusCode.UNAUTHENTICATED,
    "other_learner": grpc.StatusCode.UNAUTHENTICATED,
    "revoked": grpc.StatusCode.PERMISSION_DENIED,
    "too_large": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "malformed": grpc.StatusCode.INVALID_ARGUMENT,
}


@dataclass(frozen=True)
class GatewaySettings:
    """``trustrl serve --listen HOST:PORT [--tls-cert FILE --tls-key FILE | --insecure]
    [--max-message-mb N]``."""

    listen: str
    tls_cert: str | None = None
    tls_key: str | None = None
    insecure: bool = False
    max_message_bytes: int = MAX_MESSAGE_BYTES

    def __post_init__(self) -> None:
        host, _ = split_address(self.listen)
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ConfigError("--tls-cert and --tls-key go together: give both, or neither")
        if self.tls_cert is not None and self.insecure:
            raise ConfigError("--insecure and --tls-cert: give one")
        if not is_loopback(host) and self.tls_cert is None and not self.insecure:
            raise ConfigError(
                f"--listen {self.listen}: an address other than loopback needs TLS "
                "(--tls-cert FILE --tls-key FILE), or --insecure to send tokens and policies "
                "in the clear"
            )
        if self.max_message_bytes < 1024:
            raise ConfigError(f"max message size {self.max_message_bytes} bytes is too small")


def split_address(address: str) -> tuple[str, int]:
    """HOST:PORT (or [IPv6]:PORT) -> (host, port); a ConfigError for anything else."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ConfigError(f"--listen {address!r}: expected HOST:PORT, e.g. 127.0.0.1:50051")
    return host.strip("[]"), int(port)


def is_loopback(host: str) -> bool:
    return host == "localhost" or host.startswith("127.") or host == "::1"


class Gateway:
    """The three calls over an inbox (anything with ``submit_many`` and ``status``, as
    ``Inbox`` and serve's ``RemoteInbox``); the learner tells it of each new policy
    (``publish``) and of the run's end (``finish``), through ``watch``."""

    def __init__(
        self,
        inbox: Any,
        groups: Sequence[AgentGroup],
        info: dict[str, Any],
        credentials: Credentials,
        *,
        max_lag: int,
        max_length: int,
        max_message_bytes: int = MAX_MESSAGE_BYTES,
    ) -> None:
        self.inbox = inbox
        self.groups = list(groups)
        self.info = info
        self.learner_json = json.dumps(info)
        self.credentials = credentials
        self.max_lag = max_lag
        self.max_length = max_length
        self.max_message_bytes = max_message_bytes
        self.condition = threading.Condition()
        self.version = -1
        self.finished = False
        self.snapshots: dict[int, PolicySnapshot] = {}  # the versions within max_lag
        self.inferences: dict[tuple[int, int], Inference] = {}
        self.policy: tuple[int, pb.Policy, bytes | None] | None = None  # newest, encoded
        self.onnx_lock = threading.Lock()
        self.streams: OrderedDict[tuple[str, str, str], thin.Stream] = OrderedDict()
        self.count_lock = threading.Lock()  # the counters below
        self.counts: Counter[str] = Counter()
        self.refused: Counter[str] = Counter({reason: 0 for reason in REASONS})
        self.senders: Counter[str] = Counter()  # chunks accepted per agent name

    # The learner's side.

    def watch(self, inbox: Any) -> Published:
        """``inbox`` (the learner's side of it) with each publish and finish told to this
        gateway too."""
        return Published(inbox, self)

    def publish(self, version: int, data: bytes) -> None:
        snapshot = decode_snapshot(data)
        with self.condition:
            self.version = version
            self.snapshots[version] = snapshot
            for old in [v for v in self.snapshots if abs(version - v) > self.max_lag]:
                del self.snapshots[old]
            self.inferences = {k: v for k, v in self.inferences.items() if k[0] in self.snapshots}
            self.condition.notify_all()

    def finish(self) -> None:
        with self.condition:
            self.finished = True
            self.condition.notify_all()

    # The calls: request bytes in, reply bytes out.

    def fetch(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        self._admit(request, context)
        message = self._parse(pb.FetchRequest, request, context)
        wait = min(max(message.wait_seconds, 0.0), MAX_WAIT_SECONDS)
        remaining = context.time_remaining()
        if remaining is not None:
            wait = min(wait, max(remaining - 1.0, 0.0))  # answer within the caller's deadline
        with self.condition:
            finished = self.finished
            self.condition.wait_for(
                lambda: self.version != message.have or self.finished != finished, wait
            )
            version, finished, snapshot = (
                self.version,
                self.finished,
                self.snapshots.get(self.version),
            )
        reply = pb.FetchReply(version=version, finished=finished)
        if snapshot is not None and version != message.have:
            reply.policy.CopyFrom(self._policy(snapshot, message.onnx))
        self._count(self.counts, "fetched")
        return reply.SerializeToString()

    def submit(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        sender = self._admit(request, context)
        message = self._parse(pb.SubmitRequest, request, context)
        results = [pb.ChunkResult() for _ in message.chunks]
        payloads: list[tuple[int, bytes]] = []
        for index, chunk in enumerate(message.chunks):
            try:
                data = self._payload(chunk, sender)
            except ChunkError as exc:
                self._refuse_chunk(results[index], exc.reason, str(exc))
                continue
            if data is None:
                results[index].outcome = pb.STALE
                self._count(self.counts, "stale")
            else:
                payloads.append((index, data))
        full = False
        if payloads:
            try:
                replies = self.inbox.submit_many([data for _, data in payloads])
            except LinkError as exc:
                context.abort(grpc.StatusCode.UNAVAILABLE, f"the learner's inbox: {exc}")
            for (index, _), reply in zip(payloads, replies, strict=True):
                if reply.get("ok"):
                    results[index].outcome = pb.ACCEPTED
                    self._count(self.counts, "accepted")
                    self._count(self.senders, sender)
                elif reply.get("retry"):
                    results[index].outcome = pb.RETRY
                    self._count(self.counts, "retry")
                    full = full or bool(reply.get("full"))
                else:
                    reason = str(reply.get("reason", "payload"))
                    self._refuse_chunk(results[index], reason, str(reply.get("error", "")))
        pressure = (
            "queue_full"
            if full
            else "lagging"
            if any(r.outcome == pb.STALE for r in results)
            else ""
        )
        reply = pb.SubmitReply(
            results=results, pressure=pressure, slow_down_seconds=SLOW_DOWN_SECONDS.get(pressure, 0)
        )
        return reply.SerializeToString()

    def status(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        sender = self._admit(request, context)
        self._parse(pb.StatusRequest, request, context)
        with self.condition:
            version, finished = self.version, self.finished
        with self.count_lock:
            counts, refused = dict(self.counts), dict(self.refused)
        try:
            inbox = self.inbox.status()
            counts.update({f"inbox_{k}": int(v) for k, v in inbox.items() if isinstance(v, int)})
        except LinkError:
            pass  # the counts of the gateway alone
        return pb.StatusReply(
            version=version,
            finished=finished,
            agent=sender,
            learner_json=self.learner_json,
            counts=counts,
            refused=refused,
        ).SerializeToString()

    # Inside.

    def _admit(self, request: bytes, context: grpc.ServicerContext) -> str:
        """The caller's name, or the call aborted with its reason (counted): a token that
        is not let in, a request over the size limit."""
        token = None
        for key, value in context.invocation_metadata():
            if key == "authorization" and isinstance(value, str):
                token = value.removeprefix("Bearer ").strip()
        verdict = self.credentials.check(token)
        if verdict.name is None:
            self._abort(context, verdict.reason, verdict.message)
        assert verdict.name is not None
        if len(request) > self.max_message_bytes:
            self._abort(
                context,
                "too_large",
                f"{len(request):,} bytes is over the limit of {self.max_message_bytes:,}",
            )
        return verdict.name

    def _parse(self, kind: Any, request: bytes, context: grpc.ServicerContext) -> Any:
        try:
            return kind.FromString(request)
        except Exception as exc:  # protobuf's DecodeError, or a RuntimeError of upb's
            self._abort(context, "malformed", f"not a {kind.__name__} message ({exc})")

    def _count(self, counter: Counter[str], key: str) -> None:
        with self.count_lock:
            counter[key] += 1

    def _abort(self, context: grpc.ServicerContext, reason: str, message: str) -> None:
        self._count(self.refused, reason)
        context.abort(STATUS_CODES[reason], f"{reason}: {message}")

    def _refuse_chunk(self, result: pb.ChunkResult, reason: str, error: str) -> None:
        result.outcome, result.reason, result.error = pb.REFUSED, reason, error[:2000]
        self._count(self.refused, reason)

    def _payload(self, message: pb.Chunk, sender: str) -> bytes | None:
        """The wire-format payload of a chunk message, None for a stale one; a ChunkError
        for one that does not fit."""
        where = check_header(
            self.groups, message.agent, message.ending, message.version, message.seq
        )
        with self.condition:
            newest = self.version
            snapshot = self.snapshots.get(message.version)
        if abs(newest - message.version) > self.max_lag:
            return None
        tensors = messages.chunk_arrays(message)
        if not messages.is_thin(message):
            return messages.payload(messages.chunk_metadata(message, sender), tensors)
        if snapshot is None:
            return None  # a version this learner never published (another run's)
        group = self.groups[where]
        memory = self.info.get("memory")
        thin.check_thin(tensors, group.spec, message.ending, self.max_length, memory)
        header = {
            "agent": message.agent,
            "source": f"{sender}/{message.source}",
            "seq": message.seq,
            "version": message.version,
            "ending": message.ending,
            "sender": sender,
        }
        chunk = thin.thicken(
            tensors,
            header,
            group.spec,
            self._inference(message.version, where, snapshot),
            group.agents.index(message.agent),
            self._stream((sender, message.source, message.agent)),
            float(self.info["gamma"]),
            memory["sequence_length"] if memory else 0,
        )
        return encode_chunk(chunk)

    def _inference(self, version: int, group: int, snapshot: PolicySnapshot) -> Inference:
        with self.condition:
            inference = self.inferences.get((version, group))
            if inference is None:
                inference = self.inferences[version, group] = Inference(snapshot.groups[group])
            return inference

    def _stream(self, key: tuple[str, str, str]) -> thin.Stream:
        with self.condition:
            stream = self.streams.get(key)
            if stream is None:
                scaler = (
                    MeanStd((), clip=float(self.info["reward_clip"]))
                    if self.info["normalize_reward"]
                    else None
                )
                stream = self.streams[key] = thin.Stream(scaler)
                while len(self.streams) > MAX_STREAMS:
                    self.streams.popitem(last=False)
            self.streams.move_to_end(key)
            return stream

    def streams_state(self) -> list[dict[str, Any]]:
        """The thin-chunk streams' reward statistics and open episodes, oldest first (for
        the learner's checkpoint: a resumed learner scales a thin agent's rewards by the
        statistics it had)."""
        with self.condition:
            return [
                {
                    "key": list(key),
                    "scaler": s.scaler.state_dict() if s.scaler is not None else None,
                    "discounted": s.discounted,
                    "episode_return": s.episode_return,
                    "episode_length": s.episode_length,
                    "last_seq": s.last_seq,
                }
                for key, s in self.streams.items()
            ]

    def load_streams(self, entries: list[dict[str, Any]]) -> None:
        """Streams as ``streams_state`` gave them (a checkpoint's)."""
        for entry in entries:
            sender, source, agent = (str(part) for part in entry["key"])
            stream = self._stream((sender, source, agent))
            if stream.scaler is not None and entry["scaler"] is not None:
                stream.scaler.load_state_dict(entry["scaler"])
            stream.discounted = float(entry["discounted"])
            stream.episode_return = float(entry["episode_return"])
            stream.episode_length = int(entry["episode_length"])
            stream.last_seq = int(entry["last_seq"])

    def _policy(self, snapshot: PolicySnapshot, onnx: bool) -> pb.Policy:
        """The newest policy's message (encoded once per version), with its ONNX model
        when asked for (exported once per version, on the first request)."""
        with self.onnx_lock:
            if self.policy is None or self.policy[0] != snapshot.version:
                self.policy = (snapshot.version, messages.policy_message(snapshot), None)
            version, message, model = self.policy
            if onnx and model is None:
                model = onnx_model(snapshot)
                self.policy = (version, message, model)
        if not onnx or not model:
            return message
        with_model = pb.Policy()
        with_model.CopyFrom(message)
        with_model.onnx = model
        return with_model


def onnx_model(snapshot: PolicySnapshot) -> bytes:
    """The snapshot's policy as ONNX (run/export.py's sampling actor), or b"" where export
    does not serve it (several groups, per-agent weights)."""
    import torch

    from trustrl.learner.policy import Policy
    from trustrl.run.export import ExportError
    from trustrl.run.export import onnx_model as export

    if len(snapshot.groups) != 1:
        return b""
    group = snapshot.groups[0]
    policy = Policy.from_description(group.description)
    policy.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in group.weights.items()})
    try:
        return export(policy, {"exported_by": "trustrl gateway", "version": snapshot.version})
    except ExportError:
        return b""


class Published:
    """The learner's side of an inbox, with each publish and finish told to the gateway."""

    def __init__(self, inbox: Any, gateway: Gateway) -> None:
        self.inbox, self.gateway = inbox, gateway

    def publish(self, version: int, data: bytes) -> None:
        self.inbox.publish(version, data)
        self.gateway.publish(version, data)

    def take(
        self, timeout: float, needs: Sequence[int], version: int, max_lag: int
    ) -> dict[str, Any]:
        return dict(self.inbox.take(timeout, needs, version, max_lag))

    def release(self, upto: int) -> None:
        self.inbox.release(upto)

    def finish(self) -> None:
        self.inbox.finish()
        self.gateway.finish()

    def streams_state(self) -> list[dict[str, Any]]:
        return self.gateway.streams_state()

    def load_streams(self, entries: list[dict[str, Any]]) -> None:
        self.gateway.load_streams(entries)


def gateway_for(
    config: Config,
    groups: Sequence[AgentGroup],
    info: dict[str, Any],
    inbox: Any,
    run_dir: Path,
    settings: GatewaySettings,
    max_length: int,
) -> Gateway:
    """The gateway of a learner whose run folder (and so whose ``agents.json``) is
    ``run_dir``."""
    return Gateway(
        inbox,
        groups,
        info,
        Credentials(run_dir),
        max_lag=config.runners.max_version_lag,
        max_length=max_length,
        max_message_bytes=settings.max_message_bytes,
    )


def start_server(
    gateway: Gateway, settings: GatewaySettings, warn: Callable[[str], None]
) -> tuple[grpc.Server, str]:
    """The gRPC server of ``gateway``, listening as ``settings`` say; (server, the address
    it listens on: HOST:PORT, the port chosen by the system for port 0)."""
    host, port = split_address(settings.listen)

    def handler(call: Callable[[bytes, grpc.ServicerContext], bytes]) -> grpc.RpcMethodHandler:
        return grpc.unary_unary_rpc_method_handler(call)  # bytes in, bytes out

    service = grpc.method_handlers_generic_handler(
        SERVICE,
        {
            "Fetch": handler(gateway.fetch),
            "Submit": handler(gateway.submit),
            "Status": handler(gateway.status),
        },
    )
    server = grpc.server(
        ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="trustrl-gateway"),
        handlers=[service],
        options=[
            ("grpc.max_receive_message_length", GRPC_LIMIT_FACTOR * settings.max_message_bytes),
            ("grpc.max_send_message_length", -1),
            ("grpc.so_reuseport", 0),  # a port in use is an error, not a shared listener
        ],
        maximum_concurrent_rpcs=MAX_CONCURRENT_RPCS,
    )
    bind = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        if settings.tls_cert is not None and settings.tls_key is not None:
            key, cert = Path(settings.tls_key).read_bytes(), Path(settings.tls_cert).read_bytes()
            bound = server.add_secure_port(bind, grpc.ssl_server_credentials([(key, cert)]))
        else:
            if not is_loopback(host):
                warn(
                    f"warning: the gateway listens on {bind} without TLS (--insecure): agents' "
                    "tokens, policies and experience cross the network in the clear"
                )
            bound = server.add_insecure_port(bind)
    except (OSError, RuntimeError) as exc:
        raise ConfigError(f"--listen {settings.listen}: cannot listen there ({exc})") from None
    server.start()
    return server, f"{host}:{bound}" if ":" not in host else f"[{host}]:{bound}"


def stop_server(server: grpc.Server, grace: float = 2.0) -> None:
    """Stop taking calls; those in progress get ``grace`` seconds."""
    server.stop(grace).wait()
