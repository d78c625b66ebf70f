"""Checkpoints: a folder of safetensors and JSON, written atomically, loaded without pickle.

Layout of one checkpoint folder::

    meta.json            format version, resolved config, policy description (spaces,
                         network shape), counters, and the structure of the training state
    policy.safetensors   the policy's state_dict: weights and observation normalizer
    state.safetensors    every tensor of the training state (optimizer moments, RNG states,
                         reward scaler, episode accumulators, and the environments' state
                         where it is arrays: see envs.py)
    envs.pkl             (optional) the environments pickled, for envs whose state is not
                         arrays; read only by ``train --resume --trust-env-state`` (unpickling
                         runs code), after its SHA-256 in meta.json matches (a check against
                         damage, not forgery: whoever can write the file can write the digest)

A run folder keeps ``checkpoints/iter_NNNNNNNN`` (the last ``keep``), ``checkpoints/final``
and ``checkpoints/latest``, a one-line file naming the newest complete checkpoint.
A checkpoint is written to a hidden temporary folder, every file flushed and fsynced,
then renamed into place; ``latest`` is replaced atomically after that. A crash at any
moment leaves the previous checkpoint and pointer intact. Loading reads files inside the
checkpoint folder only and refuses symbolic links.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import warnings
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from trustrl.learner.policy import MultiAgentPolicy, Policy

FORMAT_VERSION = 1
META = "meta.json"
POLICY_FILE = "policy.safetensors"
STATE_FILE = "state.safetensors"
ENV_FILE = "envs.pkl"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or loaded; the message says what is wrong."""


# Nested training state <-> (JSON skeleton, flat tensors). Tensors and arrays are moved
# out into a safetensors file; the skeleton keeps everything else and where each went.


def flatten_state(state: Any) -> tuple[Any, dict[str, torch.Tensor]]:
    tensors: dict[str, torch.Tensor] = {}

    def walk(value: Any, path: str) -> Any:
        if isinstance(value, torch.Tensor):
            # A copy: optimizer moments and parameters are views of flat buffers
            # (optim.py), and safetensors refuses tensors that share memory.
            tensors[path] = value.detach().cpu().clone()
            return {"__tensor__": path}
        if isinstance(value, np.ndarray):
            tensors[path] = torch.from_numpy(np.array(value, order="C"))  # a copy, too
            return {"__ndarray__": path}
        if isinstance(value, dict):
            if all(isinstance(k, str) for k in value):
                return {k: walk(v, f"{path}.{k}") for k, v in value.items()}
            return {"__items__": [[k, walk(v, f"{path}.{k}")] for k, v in value.items()]}
        if isinstance(value, list | tuple):
            return [walk(v, f"{path}.{i}") for i, v in enumerate(value)]
        if isinstance(value, float) and not np.isfinite(value):
            return {"__float__": repr(value)}
        if value is None or isinstance(value, bool | int | float | str):
            return value
        raise TypeError(f"cannot store {type(value).__name__} at {path} in a checkpoint")

    return walk(state, "state"), tensors


def unflatten_state(skeleton: Any, tensors: dict[str, torch.Tensor]) -> Any:
    def walk(value: Any) -> Any:
        if isinstance(value, dict):
            if "__tensor__" in value:
                return tensors[value["__tensor__"]]
            if "__ndarray__" in value:
                return tensors[value["__ndarray__"]].numpy()
            if "__float__" in value:
                return float(value["__float__"])
            if "__items__" in value:
                return {k: walk(v) for k, v in value["__items__"]}
            return {k: walk(v) for k, v in value.items()}
        if isinstance(value, list):
            return [walk(v) for v in value]
        return value

    return walk(skeleton)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_file(path: Path, write: Any) -> None:
    write(path)
    with path.open("rb+") as handle:
        os.fsync(handle.fileno())


@dataclass
class Snapshot:
    """Everything one checkpoint holds, copied out of the live objects: training can go
    on while it is written."""

    weights: dict[str, torch.Tensor]
    description: dict[str, Any]
    meta: dict[str, Any]
    skeleton: Any
    tensors: dict[str, torch.Tensor]
    env_state: bytes | None


def snapshot(
    policy: Policy | MultiAgentPolicy,
    meta: dict[str, Any],
    training_state: dict[str, Any],
    env_state: bytes | None = None,
) -> Snapshot:
    skeleton, tensors = flatten_state(training_state)
    weights = {k: v.detach().clone() for k, v in policy.state_dict().items()}
    return Snapshot(weights, policy.describe(), dict(meta), skeleton, tensors, env_state)


def write_checkpoint(
    folder: Path,
    policy: Policy | MultiAgentPolicy,
    meta: dict[str, Any],
    training_state: dict[str, Any],
    env_state: bytes | None = None,
) -> Path:
    """Write one complete checkpoint at ``folder`` atomically (temp folder, then rename)."""
    return write_snapshot(folder, snapshot(policy, meta, training_state, env_state))


def write_snapshot(folder: Path, state: Snapshot) -> Path:
    """``write_checkpoint`` of a snapshot taken earlier."""
    folder = Path(folder)
    tmp = folder.parent / f".tmp-{folder.name}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    try:
        tmp.mkdir(parents=True)
        # The weights carry their own description too, so a meta.json that was edited or
        # swapped cannot make them load as a policy for other spaces.
        _write_file(
            tmp / POLICY_FILE,
            lambda p: save_file(
                state.weights, str(p), metadata={"policy": json.dumps(state.description)}
            ),
        )
        _write_file(tmp / STATE_FILE, lambda p: save_file(state.tensors, str(p)))
        env_record = None
        env_state = state.env_state
        if env_state is not None:
            _write_file(tmp / ENV_FILE, lambda p: p.write_bytes(env_state))
            env_record = {"file": ENV_FILE, "sha256": hashlib.sha256(env_state).hexdigest()}
        document = {
            "format_version": FORMAT_VERSION,
            **state.meta,
            "policy": state.description,
            "training_state": state.skeleton,
            "env_state": env_record,
        }
        _write_file(tmp / META, lambda p: p.write_text(json.dumps(document, indent=1)))
        _fsync_dir(tmp)
        if folder.exists():
            # Replacing an existing folder (e.g. "final" on a resumed run): move it aside first.
            old = folder.parent / f".old-{folder.name}-{os.getpid()}"
            os.replace(folder, old)
            os.replace(tmp, folder)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, folder)
        _fsync_dir(folder.parent)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(
            f"could not write checkpoint {folder}: {exc.strerror or exc}; the previous "
            "checkpoint is intact"
        ) from None
    return folder


class BackgroundWriter:
    """Runs checkpoint writes on one background thread, one at a time, in order.

    A write is mostly waiting on the disk (a checkpoint is a handful of fsyncs); with the
    snapshot taken on the training thread, training goes on meanwhile. ``submit`` first
    waits for the write before it, so at most one is in flight, and ``wait`` (called
    before the run returns) re-raises the error of a failed write: a write is never lost
    silently, and a failed one leaves the previous checkpoint and ``latest`` intact, as
    a synchronous write would.
    """

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._pending: Future[Any] | None = None

    def submit(self, write: Callable[[], Any]) -> None:
        self.wait()
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="trustrl-checkpoint")
        self._pending = self._pool.submit(write)

    def wait(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def close(self) -> None:
        try:
            self.wait()
        finally:
            if self._pool is not None:
                self._pool.shutdown()
                self._pool = None


def write_atomic(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` so that a crash leaves the old or the new file."""
    tmp = path.parent / f".{path.name}.tmp"
    tmp.write_text(text)
    with tmp.open("rb+") as handle:
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def set_latest(checkpoints: Path, name: str) -> None:
    write_atomic(checkpoints / "latest", name + "\n")


def prune(checkpoints: Path, keep: int) -> None:
    """Keep the newest ``keep`` iteration checkpoints (and always ``final``), and remove
    temporary folders left by killed processes."""
    numbered = sorted(p for p in checkpoints.glob("iter_*") if p.is_dir())
    for old in numbered[:-keep] if keep > 0 else numbered:
        shutil.rmtree(old, ignore_errors=True)
    for leftover in [*checkpoints.glob(".tmp-*"), *checkpoints.glob(".old-*")]:
        pid = leftover.name.rsplit("-", 1)[-1]
        if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
            shutil.rmtree(leftover, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


CHECKPOINT_NAME = re.compile(r"iter_\d{8}|final")
"""What ``latest`` may name: a checkpoint folder beside it, never a path elsewhere."""


def _refuse_link(path: Path) -> None:
    if path.is_symlink():
        raise CheckpointError(
            f"{path} is a symbolic link (to {os.readlink(path)}); trustrl does not follow "
            "links inside a run folder, which could point anywhere"
        )


def _complete(folder: Path) -> bool:
    """A checkpoint folder with its description; links refused, not followed."""
    _refuse_link(folder)
    if not folder.is_dir():
        return False
    _refuse_link(folder / META)
    return (folder / META).is_file()


def resolve_checkpoint(path: str | Path) -> Path:
    """A run folder, a checkpoints folder or a checkpoint folder -> the checkpoint folder.

    Run folders resolve to the newest complete checkpoint: the one ``latest`` names (which
    is ``final`` once training finished), else ``final``, else the newest ``iter_*`` (a
    kill between a checkpoint's rename and the pointer's update), with a warning naming
    the one loaded when ``latest`` had to be skipped. Loading never leaves the folder:
    ``latest`` names a sibling folder only, and links are refused.
    """
    path = Path(path)
    if path.is_file():
        raise CheckpointError(
            f"{path} is a file, not a trustrl checkpoint folder (trustrl never loads pickled "
            "files such as .pt or .pkl)"
        )
    if not path.exists():
        raise CheckpointError(f"{path} does not exist")
    if (path / META).exists() or (path / META).is_symlink():
        _refuse_link(path / META)
        return path
    checkpoints = path / "checkpoints"
    _refuse_link(checkpoints)
    if not checkpoints.is_dir():
        checkpoints = path
    pointer = checkpoints / "latest"
    skipped = None
    if pointer.exists() or pointer.is_symlink():
        _refuse_link(pointer)
        name = pointer.read_text(errors="replace").strip()
        if not CHECKPOINT_NAME.fullmatch(name):
            raise CheckpointError(
                f"{pointer} names {name!r}, which is not a checkpoint of this run folder "
                "(iter_NNNNNNNN or final)"
            )
        if _complete(checkpoints / name):
            return checkpoints / name
        skipped = f"{pointer} names {name}, which is missing or incomplete"
    numbered = sorted(checkpoints.glob("iter_*"), reverse=True)
    for candidate in [checkpoints / "final", *numbered]:
        if _complete(candidate):
            if skipped:
                warnings.warn(f"{skipped}; loaded {candidate} instead", UserWarning, stacklevel=2)
            return candidate
    raise CheckpointError(f"no checkpoint found in {path} (expected {META} or checkpoints/latest)")


def read_meta(folder: Path) -> dict[str, Any]:
    _refuse_link(folder / META)
    try:
        meta = json.loads((folder / META).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:  # ValueError: bad JSON or not UTF-8 text
        raise CheckpointError(f"{folder / META} is unreadable: {exc}") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"{folder / META} is not a trustrl checkpoint description")
    version = meta.get("format_version")
    if version != FORMAT_VERSION:
        raise CheckpointError(
            f"{folder} has checkpoint format version {version!r}; this trustrl reads version "
            f"{FORMAT_VERSION}"
        )
    return meta


def _load_tensors(path: Path) -> dict[str, torch.Tensor]:
    _refuse_link(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint file {path} is missing")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as exc:
        raise CheckpointError(f"checkpoint file {path} is damaged or truncated: {exc}") from None


def differences(a: Any, b: Any, prefix: str = "") -> list[str]:
    """Where two nested JSON-like values differ: "path (a vs b)" for each leaf."""
    if isinstance(a, dict) and isinstance(b, dict):
        out: list[str] = []
        for key in sorted(set(a) | set(b)):
            out += differences(a.get(key), b.get(key), f"{prefix}{key}.")
        return out
    return [] if a == b else [f"{prefix[:-1]} ({a!r} vs {b!r})"]


def load_policy(path: str | Path) -> Policy:
    """A trained policy (with its normalizers) from a run folder or checkpoint folder:
    ``trustrl.load_policy``. A multi-agent run gives a ``MultiAgentPolicy``. No pickle
    anywhere; loading never leaves the folder given."""
    folder = resolve_checkpoint(path)
    meta = read_meta(folder)
    description = meta.get("policy")
    try:
        policy: Any
        if isinstance(description, dict) and "groups" in description:
            policy = MultiAgentPolicy.from_description(description)
        else:
            policy = Policy.from_description(description)  # type: ignore[arg-type]
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise CheckpointError(
            f"{folder / META} does not describe a trustrl policy ({type(exc).__name__}: {exc})"
        ) from None
    weights = folder / POLICY_FILE
    state = _load_tensors(weights)
    try:
        with safe_open(str(weights), framework="pt") as handle:
            stored = (handle.metadata() or {}).get("policy")
        saved = json.loads(stored) if stored else None
    except (SafetensorError, OSError, ValueError) as exc:
        raise CheckpointError(f"checkpoint file {weights} is damaged: {exc}") from None
    if saved is not None and saved != description:
        differs = ", ".join(differences(saved, description))
        raise CheckpointError(
            f"{weights} was saved for another policy than {folder / META} describes: {differs}"
        )
    try:
        policy.load_state_dict(state)
    except RuntimeError as exc:
        raise CheckpointError(f"{weights} does not fit the described policy: {exc}") from None
    policy.eval()
    return policy


def load_checkpoint(path: str | Path) -> tuple[Path, dict[str, Any], Policy, dict[str, Any]]:
    """(folder, meta, policy, training state) for resuming."""
    folder = resolve_checkpoint(path)
    meta = read_meta(folder)
    policy = load_policy(folder)
    tensors = _load_tensors(folder / STATE_FILE)
    try:
        state = unflatten_state(meta["training_state"], tensors)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise CheckpointError(
            f"{folder / STATE_FILE} does not hold the training state {folder / META} "
            f"describes ({type(exc).__name__}: {exc})"
        ) from None
    return folder, meta, policy, state


def read_env_state(folder: Path, meta: dict[str, Any]) -> bytes | None:
    """The saved environment state, after checking its digest; None if none was saved."""
    record = meta.get("env_state")
    if not record:
        return None
    if not isinstance(record, dict) or record.get("file") != ENV_FILE:
        raise CheckpointError(f"{folder / META} names an unexpected environment state file")
    path = folder / ENV_FILE
    _refuse_link(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise CheckpointError(f"environment state {path} is unreadable: {exc}") from None
    if hashlib.sha256(data).hexdigest() != record["sha256"]:
        raise CheckpointError(
            f"environment state {path} does not match the digest in {folder / META}; "
            "refusing to load it"
        )
    return data
