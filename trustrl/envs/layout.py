"""Observation layouts: how a structured observation (an image, a Dict or Tuple of
entries, a Discrete or MultiDiscrete index, a MultiBinary vector) becomes one stored row.

A flat Box observation has no layout: its row is the float32 vector, as it always was.
Anything else is laid out as entries, each a run of columns of the row:

* ``vector``: a non-image Box, flattened to float32; the only entries the running
  normalizer touches, so they come first (the normalizer covers the row's leading
  ``vector_width`` columns);
* ``image``: a Box of uint8 or bool with 3 dimensions (2 for one channel), or a float Box
  named in ``env.image_keys``: the raw values, flattened; scaled inside the model;
* ``onehot``: a Discrete or MultiDiscrete observation, one 0/1 column per choice;
* ``binary``: a MultiBinary observation, or a bool Box named in ``env.flat_keys`` (a
  0/1 grid taken flat for the MLP instead of as an image), 0/1.

The row is uint8 when every entry fits a byte (images of uint8 or bool, one-hots,
binaries), so frames stay bytes from the env through the rollout to the update, and
float32 otherwise (a Dict of a frame and a float vector keeps its frame as float32 values
in the row: four times the bytes, the price of one row per step).
"""

from __future__ import annotations

import math
from typing import Any

import gymnasium as gym
import numpy as np

from trustrl.config import ConfigError

# An entry is a JSON-able dict (it travels in checkpoints inside the SpaceSpec):
#   key    where it is in the observation: a Dict key, a Tuple index as text, "" for all
#   kind   vector | image | onehot | binary
#   shape  the entry's own shape, as the env hands it out (without the batch axis)
#   dtype  its dtype name, as the env hands it out
#   width  columns of the row
#   nvec, start   (onehot) choices per component and the first index of each
Entry = dict[str, Any]

BYTE_KINDS = ("image", "onehot", "binary")


def is_image(space: gym.spaces.Box) -> bool:
    """A Box of uint8 or bool with 3 dimensions, or 2 (one channel)."""
    return space.dtype in (np.uint8, np.bool_) and len(space.shape) in (2, 3)


def channels_last(shape: tuple[int, ...]) -> bool:
    """Whether a 3-dimensional image shape is (H, W, C): channels first (C, H, W) when the
    first side is the smallest, as Gymnasium's FrameStackObservation gives (4, 84, 84)."""
    return not shape[0] < min(shape[1], shape[2])


def image_shape(entry: Entry) -> tuple[int, int, int]:
    """An image entry's shape as the image encoder takes it: 3 dimensions (a 2-dimensional
    frame is one channel, last)."""
    shape = tuple(entry["shape"])
    return (*shape, 1) if len(shape) == 2 else shape  # type: ignore[return-value]


def entries_of(
    space: gym.Space, image_keys: tuple[str, ...] = (), flat_keys: tuple[str, ...] = ()
) -> list[Entry]:
    """The layout of an observation space: [] for a flat Box that is not an image (the row
    is the float32 vector), else the entries, vectors first. ``image_keys`` and
    ``flat_keys`` (``env.image_keys``, ``env.flat_keys``) name entries to take as images,
    and bool grids to take flat. Anything else (a nested Dict, Text, Graph, Sequence) is
    refused, naming it."""
    both = set(image_keys) & set(flat_keys)
    if both:
        raise ConfigError(
            f"env.image_keys and env.flat_keys both name {sorted(both)}: an entry is taken "
            "as an image or flat, not both"
        )
    whole_taken = "" in image_keys or "" in flat_keys
    if isinstance(space, gym.spaces.Box) and not is_image(space) and not whole_taken:
        return []
    if isinstance(space, gym.spaces.Dict | gym.spaces.Tuple):
        items = (
            list(space.spaces.items())
            if isinstance(space, gym.spaces.Dict)
            else [(str(i), s) for i, s in enumerate(space.spaces)]
        )
        if not items:
            raise ConfigError(f"observation space {space} has no entries")
        entries = [_entry(str(key), sub, image_keys, flat_keys, space) for key, sub in items]
    else:
        entries = [_entry("", space, image_keys, flat_keys, space)]
    for field, keys in (("image_keys", image_keys), ("flat_keys", flat_keys)):
        unknown = set(keys) - {e["key"] for e in entries}
        if unknown:
            names = ", ".join(repr(e["key"]) for e in entries)
            raise ConfigError(
                f"env.{field} names {sorted(unknown)}, which the observation space does not "
                f"have (its entries: {names}; '' is a whole Box observation)"
            )
    return sorted(entries, key=lambda e: e["kind"] != "vector")  # stable: vectors first


def _entry(
    key: str,
    space: gym.Space,
    image_keys: tuple[str, ...],
    flat_keys: tuple[str, ...],
    whole: gym.Space,
) -> Entry:
    where = f"observation entry {key!r}" if key else "the observation"
    if key in flat_keys and not (isinstance(space, gym.spaces.Box) and space.dtype == np.bool_):
        raise ConfigError(
            f"{where} is named in env.flat_keys but is {space}: env.flat_keys takes bool "
            "Boxes (0/1 grids)"
        )
    if isinstance(space, gym.spaces.Box):
        shape = [int(d) for d in space.shape]
        dtype = np.dtype(space.dtype).name
        width = math.prod(shape)
        if key in flat_keys:  # a 0/1 grid, flat: the MLP reads its cells
            return {"key": key, "kind": "binary", "shape": shape, "dtype": dtype, "width": width}
        if is_image(space) or key in image_keys:
            if len(shape) not in (2, 3):
                raise ConfigError(
                    f"{where} is named in env.image_keys but has shape {tuple(shape)}: an "
                    "image has 2 or 3 dimensions"
                )
            return {"key": key, "kind": "image", "shape": shape, "dtype": dtype, "width": width}
        return {"key": key, "kind": "vector", "shape": shape, "dtype": dtype, "width": width}
    if isinstance(space, gym.spaces.Discrete):
        return {
            "key": key,
            "kind": "onehot",
            "shape": [],
            "dtype": "int64",
            "width": int(space.n),
            "nvec": [int(space.n)],
            "start": [int(space.start)],
        }
    if isinstance(space, gym.spaces.MultiDiscrete):
        if space.nvec.ndim != 1:
            raise ConfigError(f"{where}: MultiDiscrete observations must be one-dimensional")
        nvec = [int(n) for n in space.nvec]
        return {
            "key": key,
            "kind": "onehot",
            "shape": [len(nvec)],
            "dtype": "int64",
            "width": sum(nvec),
            "nvec": nvec,
            "start": [int(s) for s in np.broadcast_to(space.start, space.nvec.shape)],
        }
    if isinstance(space, gym.spaces.MultiBinary):
        shape = [int(d) for d in np.atleast_1d(space.n)]
        return {
            "key": key,
            "kind": "binary",
            "shape": shape,
            "dtype": "int8",
            "width": math.prod(shape),
        }
    nested = " (nested)" if space is not whole else ""
    raise ConfigError(
        f"{where} is {space}{nested}: trustrl takes a Box (vectors and images), Discrete, "
        "MultiDiscrete, MultiBinary, or a Dict or Tuple of those"
    )


def row_dtype(entries: list[Entry] | tuple[Entry, ...]) -> np.dtype:
    """uint8 when every entry fits a byte (frames of uint8 or bool, one-hots, binaries),
    else float32."""
    if entries and all(
        e["kind"] in ("onehot", "binary")
        or (e["kind"] == "image" and e["dtype"] in ("uint8", "bool"))
        for e in entries
    ):
        return np.dtype(np.uint8)
    return np.dtype(np.float32)


def vector_width(entries: list[Entry] | tuple[Entry, ...]) -> int:
    """The leading columns of a row the observation normalizer covers."""
    return sum(e["width"] for e in entries if e["kind"] == "vector")


def pick(raw: Any, key: str) -> Any:
    """An entry of a batch of structured observations: a Dict's key, a Tuple's index."""
    if key == "":
        return raw
    if isinstance(raw, dict):
        if key not in raw:
            raise ValueError(f"observation dict is missing the key {key!r} (it has {sorted(raw)})")
        return raw[key]
    if isinstance(raw, tuple | list):
        index = int(key)
        if index >= len(raw):
            raise ValueError(f"observation tuple has {len(raw)} entries, entry {index} is missing")
        return raw[index]
    raise ValueError(
        f"expected a structured observation (a dict or tuple with entry {key!r}), got "
        f"{type(raw).__name__}"
    )


def pack(entries: tuple[Entry, ...], raw: Any, width: int, dtype: np.dtype) -> np.ndarray:
    """A batch of structured observations -> rows (B, width) of ``dtype``: each entry
    checked against its space (shape; dtype for frames) and written to its columns."""
    batch = None
    out: np.ndarray | None = None
    offset = 0
    for entry in entries:
        value = np.asarray(pick(raw, entry["key"]))
        shape = tuple(entry["shape"])
        if value.shape[1:] != shape:
            raise ValueError(
                f"{_name(entry)}: expected a batch of shape (B, {', '.join(map(str, shape))}), "
                f"got shape {value.shape}"
            )
        if entry["kind"] == "image" and value.dtype.name != entry["dtype"]:
            raise ValueError(
                f"{_name(entry)}: expected frames of dtype {entry['dtype']}, got {value.dtype}"
            )
        if out is None:
            batch = len(value)
            out = np.zeros((batch, width), dtype)
        elif len(value) != batch:
            raise ValueError(f"{_name(entry)}: {len(value)} rows where other entries have {batch}")
        columns = out[:, offset : offset + entry["width"]]
        if entry["kind"] == "onehot":
            _one_hot(entry, value.reshape(len(value), -1), columns)
        else:
            columns[...] = value.reshape(len(value), -1)
        offset += entry["width"]
    assert out is not None
    return out


def _one_hot(entry: Entry, index: np.ndarray, out: np.ndarray) -> None:
    column = 0
    rows = np.arange(len(index))
    for component, (n, start) in enumerate(zip(entry["nvec"], entry["start"], strict=True)):
        choice = index[:, component].astype(np.int64) - start
        if choice.size and (choice.min() < 0 or choice.max() >= n):
            bad = int(index[:, component][(choice < 0) | (choice >= n)][0])
            raise ValueError(f"{_name(entry)}: value {bad} is outside [{start}, {start + n - 1}]")
        out[rows, column + choice] = 1
        column += n


def _name(entry: Entry) -> str:
    return f"observation entry {entry['key']!r}" if entry["key"] else "the observation"


def same(a: tuple[Entry, ...], b: tuple[Entry, ...]) -> bool:
    """Whether two layouts read the same rows (a checkpoint's JSON lists and a fresh
    spec's compare equal)."""
    return [dict(e) for e in a] == [dict(e) for e in b]


def is_single(entries: tuple[Entry, ...], raw: Any) -> bool:
    """Whether ``raw`` is one structured observation (True) or a batch (False), judged by
    its first entry; a ValueError naming the shapes when it is neither."""
    entry = entries[0]
    shape = tuple(np.shape(pick(raw, entry["key"])))
    expected = tuple(entry["shape"])
    if shape == expected:
        return True
    if shape[1:] == expected and len(shape) == len(expected) + 1:
        return False
    raise ValueError(
        f"{_name(entry)}: this policy expects shape {expected} (or a batch (B, "
        f"{', '.join(map(str, expected))})), got shape {shape}"
    )
