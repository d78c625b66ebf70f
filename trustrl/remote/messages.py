"""The gateway's messages (proto/trustrl.proto) to and from the wire format's objects.

Arrays travel as raw little-endian bytes with a dtype name and a shape; ``to_numpy``
reads one back only if the three agree (a known dtype, at most ``MAX_DIMS`` dimensions,
none negative, exactly the bytes they need), else a ChunkError with reason
``"encoding"``. A chunk message becomes the wire format's safetensors payload
(``chunk_payload``), so that the inbox checks it, spools it and queues it exactly as a
chunk that came through Ray. No grpcio, no Ray, no torch: protobuf and numpy, for the
gateway and its Python client alike.
"""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np

from trustrl.contract import GroupSnapshot, PolicySnapshot
from trustrl.remote.proto import trustrl_pb2 as pb
from trustrl.remote.wire import CHUNK_FORMAT, ChunkError

SERVICE = "trustrl.gateway.v1.Gateway"
"""The gRPC service of proto/trustrl.proto: calls are /SERVICE/Fetch, /Submit, /Status."""
DTYPES = {
    name: np.dtype(name).newbyteorder("<")
    for name in ("float32", "float64", "int64", "int32", "int8", "uint8", "bool")
}
MAX_DIMS = 8
CHUNK_ARRAYS = (
    "obs",
    "actions",
    "rewards",
    "action_mask",
    "logprob",
    "values",
    "obs_mean",
    "obs_m2",
    "states",
)
"""The Chunk message's array fields, by the names the wire format gives them."""
ENTRY_PREFIX = "obs/"
"""A thin chunk's raw observation entries (the message's ``obs_entries``) go by
``obs/<key>`` among its arrays (thin.py)."""
MAX_KEY = 100
"""The longest entry key taken (a policy's keys are its observation space's)."""


def to_numpy(message: pb.Array, name: str) -> np.ndarray:
    """The array ``message`` holds (a read-only view of its bytes, native byte order)."""
    dtype = DTYPES.get(message.dtype)
    if dtype is None:
        raise ChunkError(
            f"array {name!r}: dtype {message.dtype[:32]!r} is not one of {sorted(DTYPES)}",
            "encoding",
        )
    shape = tuple(message.shape)
    if len(shape) > MAX_DIMS or any(d < 0 for d in shape):
        raise ChunkError(
            f"array {name!r}: shape {list(shape[: MAX_DIMS + 1])} (at most {MAX_DIMS} "
            "dimensions, none negative)",
            "encoding",
        )
    size = math.prod(shape)  # Python ints: no overflow, however large the dims claimed
    if size * dtype.itemsize != len(message.data):
        raise ChunkError(
            f"array {name!r}: {dtype.name}{list(shape)} needs {size * dtype.itemsize:,} bytes, "
            f"got {len(message.data):,}",
            "encoding",
        )
    array = np.frombuffer(message.data, dtype=dtype).reshape(shape)
    if dtype.kind == "b" and array.view(np.uint8).max(initial=0) > 1:
        raise ChunkError(f"array {name!r}: bool bytes must be 0 or 1", "encoding")
    return array.astype(dtype.newbyteorder("="), copy=False)


def to_message(array: np.ndarray, out: pb.Array | None = None) -> pb.Array:
    array = np.asarray(array)
    dtype = DTYPES.get(array.dtype.name)
    if dtype is None:
        raise ValueError(f"dtype {array.dtype} does not travel; use one of {sorted(DTYPES)}")
    message = out if out is not None else pb.Array()
    message.dtype = dtype.name
    message.shape[:] = array.shape
    message.data = np.ascontiguousarray(array, dtype=dtype).tobytes()
    return message


# Chunks.


def chunk_arrays(message: pb.Chunk) -> dict[str, np.ndarray]:
    """The arrays a chunk message sets, by name, the raw observation entries of a thin
    chunk as ``obs/<key>`` (a ChunkError for one that does not decode)."""
    arrays = {
        name: to_numpy(getattr(message, name), name)
        for name in CHUNK_ARRAYS
        if message.HasField(name)
    }
    for key, array in message.obs_entries.items():
        if len(key) > MAX_KEY:
            raise ChunkError(
                f"obs_entries key {key[:40]!r}... is over {MAX_KEY} characters", "unknown_array"
            )
        name = ENTRY_PREFIX + key
        arrays[name] = to_numpy(array, name)
    return arrays


def is_thin(message: pb.Chunk) -> bool:
    """A thin chunk carries no log-probabilities: the learner computes them (thin.py)."""
    return not message.HasField("logprob")


def chunk_metadata(message: pb.Chunk, sender: str) -> dict[str, str]:
    """The wire format's metadata for a chunk message (decode_chunk parses and checks
    it). ``source`` is prefixed with the sender's name: one agent's numbering can never
    make another's chunks look like duplicates."""
    metadata = {
        "format": CHUNK_FORMAT,
        "agent": message.agent,
        "source": f"{sender}/{message.source}",
        "seq": str(message.seq),
        "version": str(message.version),
        "ending": message.ending,
        "sender": sender,
    }
    if message.HasField("obs_mean") or message.HasField("obs_m2") or message.obs_count:
        metadata["obs_count"] = repr(message.obs_count)
    if message.HasField("episode_return"):
        metadata["episode_return"] = repr(message.episode_return)
    if message.HasField("episode_length"):
        metadata["episode_length"] = str(message.episode_length)
    return metadata


def payload(metadata: dict[str, str], tensors: dict[str, np.ndarray]) -> bytes:
    """The safetensors bytes of a chunk (what the inbox takes and spools)."""
    from safetensors.numpy import save

    return save({k: np.ascontiguousarray(v) for k, v in tensors.items()}, metadata)


def chunk_message(data: bytes) -> pb.Chunk:
    """A wire-format chunk (the Python agent's safetensors bytes) as a message."""
    from safetensors.numpy import load

    tensors = load(data)
    header = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])
    metadata: dict[str, str] = header.get("__metadata__") or {}
    message = pb.Chunk(
        agent=metadata.get("agent", ""),
        source=metadata.get("source", ""),
        seq=int(metadata.get("seq", 0)),
        version=int(metadata.get("version", 0)),
        ending=metadata.get("ending", ""),
    )
    for name, array in tensors.items():
        to_message(array, getattr(message, name))
    if "obs_count" in metadata:
        message.obs_count = float(metadata["obs_count"])
    if "episode_return" in metadata:
        message.episode_return = float(metadata["episode_return"])
        message.episode_length = int(metadata["episode_length"])
    return message


# Policies.


def policy_message(snapshot: PolicySnapshot, onnx: bytes = b"") -> pb.Policy:
    message = pb.Policy(
        version=snapshot.version,
        description_json=json.dumps([group.description for group in snapshot.groups]),
        onnx=onnx,
    )
    for index, group in enumerate(snapshot.groups):
        for name, array in group.weights.items():
            to_message(array, message.weights.add(group=index, name=name).array)
    return message


def policy_snapshot(message: pb.Policy) -> PolicySnapshot:
    """The snapshot a policy message holds (the learner's: trusted, but checked as any
    array is)."""
    descriptions: list[dict[str, Any]] = json.loads(message.description_json)
    weights: list[dict[str, np.ndarray]] = [{} for _ in descriptions]
    for weight in message.weights:
        weights[weight.group][weight.name] = to_numpy(weight.array, weight.name)
    return PolicySnapshot(
        message.version,
        tuple(GroupSnapshot(d, w) for d, w in zip(descriptions, weights, strict=True)),
    )
