"""An agent's way to a learner's gateway over gRPC: ``trustrl.Agent.connect("grpc://HOST:PORT",
token=...)``.

``GrpcLink`` is a ``Link`` (client/agent.py) like ``LocalLink`` and serve's ``RayLink``:
the Agent acts, chunks and ships as it always does, and this link carries its calls
as the gateway's three (proto/trustrl.proto): ``info`` is Status, ``latest`` is Fetch (a
long poll; ``wake`` cancels it), ``submit_many`` is Submit, the agent's safetensors
chunks sent as messages of arrays. The Python agent sends full chunks (it computed the
log-probabilities and values itself); thin chunks are for agents without trustrl.

Failures: a learner that cannot be reached (UNAVAILABLE, a deadline passed) is a
LinkError, after which the agent queues and retries; a refused token is a
PermissionError that names the reason (the agent retries too, and says so in
``status()["last_error"]``: a token may be revoked while it runs). A reply under
back-pressure carries ``slow_down`` seconds, which the agent waits before shipping again.

Imports grpcio and protobuf, the wire format and the acting side: no torch, no Ray.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import grpc

from trustrl.remote import messages
from trustrl.remote.messages import SERVICE
from trustrl.remote.proto import trustrl_pb2 as pb
from trustrl.remote.wire import LinkError, encode_snapshot

CALL_SECONDS = 10.0
MAX_REPLY_BYTES = 1024 * 1024 * 1024
"""The largest policy this client takes (the learner is trusted; its size is not capped
by the few MiB of gRPC's default)."""
SEND_BYTES = 4 * 1024 * 1024
"""Chunks go in Submit calls of about this many bytes (well under the gateway's limit)."""
UNREACHABLE = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.INTERNAL,
}
REFUSED = {grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED}


def parse_url(url: str) -> tuple[str, bool]:
    """``grpc://HOST:PORT`` or ``grpcs://HOST:PORT`` (TLS) -> (target, tls)."""
    for scheme, tls in (("grpc://", False), ("grpcs://", True)):
        if url.startswith(scheme):
            target = url.removeprefix(scheme).rstrip("/")
            if ":" in target and target.rpartition(":")[2].isdigit():
                return target, tls
    raise ValueError(f"{url!r}: expected grpc://HOST:PORT, or grpcs://HOST:PORT for TLS")


class GrpcLink:
    """The gateway at ``url`` with ``token``; ``ca``: a PEM file of the certificates to
    trust for grpcs:// (default: the system's); ``timeout``: how long ``info`` waits for
    the learner to come up."""

    def __init__(
        self, url: str, token: str, *, ca: str | Path | None = None, timeout: float = 60.0
    ) -> None:
        target, tls = parse_url(url)
        self.url = url
        self.timeout = timeout
        options = [
            ("grpc.max_receive_message_length", MAX_REPLY_BYTES),
            # A learner that restarts is found again within the agent's own backoff, not
            # gRPC's default of up to two minutes between reconnection attempts.
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 5000),
        ]
        if tls:
            roots = Path(ca).read_bytes() if ca is not None else None
            credentials = grpc.ssl_channel_credentials(root_certificates=roots)
            self.channel = grpc.secure_channel(target, credentials, options=options)
        else:
            self.channel = grpc.insecure_channel(target, options=options)
        self.metadata = (("authorization", f"Bearer {token}"),)
        self.calls = {
            name: self.channel.unary_unary(
                f"/{SERVICE}/{name}",
                request_serializer=request.SerializeToString,
                response_deserializer=reply.FromString,
            )
            for name, request, reply in (
                ("Fetch", pb.FetchRequest, pb.FetchReply),
                ("Submit", pb.SubmitRequest, pb.SubmitReply),
                ("Status", pb.StatusRequest, pb.StatusReply),
            )
        }
        self.lock = threading.Lock()
        self.polls: dict[str, Any] = {}  # watcher -> its long poll in flight (a future)
        self.finished = False

    def _call(self, name: str, request: Any, wait: float = 0.0) -> Any:
        try:
            return self.calls[name](request, metadata=self.metadata, timeout=CALL_SECONDS + wait)
        except grpc.RpcError as exc:
            raise self._error(exc) from None

    def _error(self, exc: grpc.RpcError) -> Exception:
        code, details = exc.code(), exc.details()  # type: ignore[attr-defined]
        if code in REFUSED:
            return PermissionError(f"the gateway at {self.url} refused the token: {details}")
        if code in UNREACHABLE:
            return LinkError(f"gateway {self.url} unreachable ({code.name}: {details})")
        return ValueError(f"the gateway at {self.url} answered {code.name}: {details}")

    def info(self) -> dict[str, Any]:
        """The learner's settings (Status), waiting up to ``timeout`` for it to come up."""
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                reply = self._call("Status", pb.StatusRequest())
                return dict(json.loads(reply.learner_json))
            except LinkError:
                if time.monotonic() > deadline:
                    raise LinkError(
                        f"no gateway answered at {self.url} within {self.timeout:g} s (is "
                        "`trustrl serve ... --listen HOST:PORT` running there?)"
                    ) from None
                time.sleep(0.5)

    def status(self) -> pb.StatusReply:
        """The gateway's Status reply (its counts and refusals per reason)."""
        return self._call("Status", pb.StatusRequest())

    def submit_many(self, chunks: list[bytes]) -> list[dict[str, Any]]:
        replies: list[dict[str, Any]] = []
        batch: list[pb.Chunk] = []
        size = 0
        for data in chunks:
            batch.append(messages.chunk_message(data))
            size += len(data)
            if size >= SEND_BYTES:
                replies += self._submit(batch)
                batch, size = [], 0
        if batch:
            replies += self._submit(batch)
        return replies

    def _submit(self, batch: list[pb.Chunk]) -> list[dict[str, Any]]:
        reply = self._call("Submit", pb.SubmitRequest(chunks=batch))
        if len(reply.results) != len(batch):
            raise LinkError(f"the gateway answered {len(reply.results)} results for {len(batch)}")
        slow_down = float(reply.slow_down_seconds)
        out = []
        for result in reply.results:
            if result.outcome == pb.ACCEPTED:
                answer: dict[str, Any] = {"ok": True}
            elif result.outcome == pb.STALE:
                answer = {"ok": True, "stale": True}
            elif result.outcome == pb.RETRY:
                answer = {"ok": False, "retry": True, "full": reply.pressure == "queue_full"}
            else:
                answer = {"ok": False, "error": f"{result.reason}: {result.error}"}
            if slow_down > 0:
                answer["slow_down"] = slow_down
            out.append(answer)
        return out

    def latest(self, have: int, timeout: float = 0.0, watcher: str = "") -> dict[str, Any]:
        request = pb.FetchRequest(have=have, wait_seconds=timeout)
        future = self.calls["Fetch"].future(
            request, metadata=self.metadata, timeout=CALL_SECONDS + timeout
        )
        with self.lock:
            self.polls[watcher] = future
        try:
            reply = future.result()
        except grpc.FutureCancelledError:  # woken (the agent closes)
            return {"version": have, "data": None, "finished": self.finished}
        except grpc.RpcError as exc:
            raise self._error(exc) from None
        finally:
            with self.lock:
                self.polls.pop(watcher, None)
        self.finished = reply.finished
        data = None
        if reply.HasField("policy") and reply.version != have:
            data = encode_snapshot(messages.policy_snapshot(reply.policy))
        return {"version": reply.version, "data": data, "finished": reply.finished}

    def wake(self, watcher: str) -> None:
        with self.lock:
            future = self.polls.get(watcher)
        if future is not None:
            future.cancel()

    def close(self) -> None:
        self.channel.close()
