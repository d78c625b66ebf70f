"""The gateway's schema and messages: the committed protoc output matches
``trustrl/remote/proto/trustrl.proto``, and arrays, chunks and policies survive the trip
through their messages exactly (remote/messages.py), with every malformed array refused
as ``encoding``.

To regenerate the Python code after editing the .proto (grpcio-tools, in the dev extra)::

    cd trustrl/remote/proto && python -m grpc_tools.protoc -I. --python_out=. \\
        --pyi_out=. trustrl.proto
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from trustrl.contract import GroupSnapshot, PolicySnapshot
from trustrl.normalize import RunningStats
from trustrl.remote import messages
from trustrl.remote.proto import trustrl_pb2 as pb
from trustrl.remote.wire import (
    Chunk,
    ChunkError,
    decode_chunk,
    decode_snapshot,
    encode_chunk,
    encode_snapshot,
)

PROTO = Path(messages.__file__).parent / "proto"


@pytest.mark.skipif(
    importlib.util.find_spec("grpc_tools") is None, reason="needs grpcio-tools (dev extra)"
)
def test_the_committed_python_code_is_protocs_output_for_the_proto(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", f"-I{PROTO}", f"--python_out={tmp_path}",
         f"--pyi_out={tmp_path}", str(PROTO / "trustrl.proto")],
        check=True,
    )  # fmt: skip
    for name in ("trustrl_pb2.py", "trustrl_pb2.pyi"):
        assert (tmp_path / name).read_text() == (PROTO / name).read_text(), (
            f"{name} is stale: regenerate it (this file's docstring says how)"
        )


def test_the_service_has_exactly_three_calls() -> None:
    service = pb.DESCRIPTOR.services_by_name["Gateway"]
    assert service.full_name == messages.SERVICE
    assert [m.name for m in service.methods] == ["Fetch", "Submit", "Status"]


@pytest.mark.parametrize("dtype", sorted(messages.DTYPES))
def test_arrays_round_trip_in_every_dtype(dtype: str) -> None:
    rng = np.random.default_rng(0)
    array = (rng.normal(size=(3, 2, 4)) * 5).astype(dtype)
    back = messages.to_numpy(messages.to_message(array), "x")
    assert back.dtype == array.dtype and back.shape == array.shape
    np.testing.assert_array_equal(back, array)
    empty = messages.to_numpy(messages.to_message(np.zeros((0, 4), dtype)), "x")
    assert empty.shape == (0, 4)


@pytest.mark.parametrize(
    "change",
    [
        {"dtype": "float16"},
        {"dtype": "object"},
        {"dtype": ""},
        {"shape": [3, 3]},
        {"shape": [-1, 8]},
        {"shape": [1] * 9},
        {"shape": [2**62, 2**62]},
        {"data": b"\x00" * 31},
        {"dtype": "bool", "shape": [32], "data": b"\x02" * 32},
    ],
    ids=str,
)
def test_an_array_whose_dtype_shape_and_bytes_disagree_is_refused(change: dict) -> None:
    message = messages.to_message(np.zeros((2, 4), np.float32))
    for key, value in change.items():
        if key == "shape":
            message.shape[:] = value
        else:
            setattr(message, key, value)
    with pytest.raises(ChunkError) as refused:
        messages.to_numpy(message, "obs")
    assert refused.value.reason == "encoding"
    assert "'obs'" in str(refused.value)


def chunk(length: int = 5, ending: str = "truncated") -> Chunk:
    rng = np.random.default_rng(length)
    obs = rng.normal(size=(length, 4))
    return Chunk(
        agent="",
        source="abc",
        seq=7,
        version=3,
        ending=ending,
        obs=obs.astype(np.float32),
        actions=rng.integers(0, 2, length),
        logprob=rng.normal(size=length).astype(np.float32),
        values=rng.normal(size=length + 1).astype(np.float32),
        rewards=np.ones(length, np.float32),
        action_mask=None,
        obs_delta=RunningStats.of(obs),
        episode_return=float(length) if ending != "cut" else None,
        episode_length=length if ending != "cut" else None,
    )


@pytest.mark.parametrize("ending", ["terminated", "truncated", "cut"])
def test_a_chunk_message_is_the_agents_chunk_with_its_sender(ending: str) -> None:
    import gymnasium as gym

    from trustrl.envs.rows import AgentGroup
    from trustrl.envs.spaces import SpaceSpec

    spec = SpaceSpec.from_spaces(
        gym.spaces.Box(-np.inf, np.inf, (4,), np.float32), gym.spaces.Discrete(2)
    )
    groups = [AgentGroup("default", ("",), spec)]
    sent = chunk(ending=ending)
    message = pb.Chunk.FromString(messages.chunk_message(encode_chunk(sent)).SerializeToString())
    assert not messages.is_thin(message)
    data = messages.payload(
        messages.chunk_metadata(message, "robot"), messages.chunk_arrays(message)
    )
    _, got = decode_chunk(data, groups)
    assert (got.sender, got.source, got.seq, got.version, got.ending) == (
        "robot", "robot/abc", 7, 3, ending
    )  # fmt: skip
    for name in ("obs", "actions", "logprob", "values", "rewards"):
        np.testing.assert_array_equal(getattr(got, name), getattr(sent, name))
    assert got.obs_delta is not None and sent.obs_delta is not None
    np.testing.assert_array_equal(got.obs_delta.m2, sent.obs_delta.m2)
    assert (got.episode_return, got.episode_length) == (sent.episode_return, sent.episode_length)


def test_a_policy_message_holds_the_snapshot() -> None:
    weights = {
        "actor.0.weight": np.arange(12, dtype=np.float32).reshape(3, 4),
        "obs_normalizer.count": np.array(5.0),
        "head.log_std": np.zeros(2, np.float32),
    }
    snapshot = PolicySnapshot(9, (GroupSnapshot({"spec": {"obs_shape": [4]}}, weights),))
    message = pb.Policy.FromString(messages.policy_message(snapshot).SerializeToString())
    back = messages.policy_snapshot(message)
    assert back.version == 9 and back.groups[0].description == {"spec": {"obs_shape": [4]}}
    assert list(back.groups[0].weights) == list(weights)  # the module's order
    for name, array in weights.items():
        np.testing.assert_array_equal(back.groups[0].weights[name], array)
        assert back.groups[0].weights[name].shape == array.shape
    again = decode_snapshot(encode_snapshot(back))
    assert again.groups[0].weights["obs_normalizer.count"].shape == ()
