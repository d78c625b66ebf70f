"""The parts a policy is made of, each registered once with its torch module and its numpy
twin.

::

    observation ─> encoder ─> (memory core) ─> heads (actor per action kind, critic)

A policy's description (``Policy.describe``, stored in every checkpoint and snapshot) names
its parts: ``{"encoder": {"kind": "mlp", "hidden_sizes": [64, 64], "activation": "tanh"},
...}``. The learner builds torch modules from it (``learner/policy.py``), the acting side
builds numpy twins from it and a snapshot's weights (``acting/inference.py``), export reads
the torch modules, a checkpoint stores the description. Neither the trainer nor the
collector knows a part's name: a new encoder is one ``register_encoder`` call naming both
sides, and ``tests/test_parts.py`` holds every registered twin equal to its module.

The torch side is named by its import path (``"package.module:attribute"``), or given as
the object itself, and resolved only by the learner: this module, like all of the acting
side, imports no torch.

An encoder's contract, both sides:

* torch: ``build(in_features, settings, num_agents)`` returns an ``nn.Module`` whose
  ``forward(x, agent=None)`` maps (B, in_features) float32 inputs, already normalized, to
  (B, out_features) features, and which has an ``out_features`` attribute. ``num_agents``
  set: one set of weights per agent (stacked), ``agent`` (B,) picks each row's.
* numpy: ``twin(settings, weights, prefix)`` returns a callable ``(x, agent=None) ->
  features`` computing the same from the module's ``state_dict`` entries under ``prefix``
  (numpy arrays, as a policy snapshot holds them).

A structured observation (an image, a Dict, Tuple or Discrete one; envs/layout.py) comes
as a packed row; the registered encoder then reads the entries' features: each image
entry through its own CNN (``front.<i>``: learner/cnn.py, its twin acting/conv.py), every
other entry's columns as floats, then any extra columns (the agent id), concatenated, into
the registered encoder (``body``): ``learner.policy.Structured`` and ``NumpyStructured``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from trustrl.acting import kernels
from trustrl.acting.conv import NumpyConvEncoder, cnn_settings
from trustrl.config import ConfigError
from trustrl.envs.layout import Entry


class EncoderTwin(Protocol):
    """An encoder's numpy twin, as the acting side calls it."""

    def __call__(self, x: np.ndarray, agent: np.ndarray | None = None) -> np.ndarray: ...


@dataclass(frozen=True)
class Part:
    """One registered part: its name, the torch builder (an object or its import path) and
    the numpy twin's constructor."""

    kind: str
    torch: str | Callable[..., Any]
    twin: Callable[[dict[str, Any], dict[str, np.ndarray], str], EncoderTwin]

    def build_torch(self, *args: Any) -> Any:
        """The torch module (the learner's side only: this may import torch)."""
        builder = self.torch
        if isinstance(builder, str):
            module_name, _, attribute = builder.partition(":")
            builder = getattr(importlib.import_module(module_name), attribute)
        return builder(*args)


ENCODERS: dict[str, Part] = {}


def register_encoder(
    kind: str,
    torch: str | Callable[..., Any],
    twin: Callable[[dict[str, Any], dict[str, np.ndarray], str], EncoderTwin],
) -> Part:
    """Register an encoder under ``kind`` (``policy.encoder = kind``) with both sides."""
    part = Part(kind, torch, twin)
    ENCODERS[kind] = part
    return part


def encoder(kind: str) -> Part:
    """The registered encoder ``kind``; a ConfigError naming the choices otherwise."""
    part = ENCODERS.get(kind)
    if part is None:
        raise ConfigError(
            f"policy.encoder must be one of {', '.join(sorted(ENCODERS))}, got {kind!r}"
        )
    return part


def layers(weights: dict[str, np.ndarray], prefix: str) -> list[kernels.Dense]:
    """The linear layers under ``prefix``, in the order the module holds them (a
    ``state_dict`` keeps registration order: input layer first)."""
    names = [
        k[: -len(".weight")] for k in weights if k.startswith(prefix) and k.endswith(".weight")
    ]
    return [kernels.Dense(weights[f"{n}.weight"], weights[f"{n}.bias"]) for n in names]


class NumpyMLP:
    """The MLP encoder's twin: every linear layer followed by the activation, plain or
    stacked per agent (``kernels.Dense`` takes both)."""

    def __init__(self, settings: dict[str, Any], weights: dict[str, np.ndarray], prefix: str):
        self.layers = layers(weights, prefix)
        self.activation = settings["activation"]

    def __call__(self, x: np.ndarray, agent: np.ndarray | None = None) -> np.ndarray:
        for layer in self.layers:
            x = kernels.activate(self.activation, layer(x, agent))
        return x


# The MLP on the flat observation vector: hidden layers of ``hidden_sizes``, each followed
# by the activation (the heads' linear layers come after it).
register_encoder("mlp", "trustrl.learner.policy:mlp_encoder", NumpyMLP)


class NumpyStructured:
    """The twin of ``learner.policy.Structured``: a packed row's entries -> each image
    through its CNN twin, the other columns as float32, concatenated -> the body's twin."""

    def __init__(
        self,
        entries: tuple[Entry, ...],
        settings: dict[str, Any],
        weights: dict[str, np.ndarray],
        prefix: str,
    ) -> None:
        self.columns: list[tuple[int, int, NumpyConvEncoder | None]] = []
        offset = 0
        for index, entry in enumerate(entries):
            cnn = None
            if entry["kind"] == "image":
                cnn = NumpyConvEncoder(
                    cnn_settings(entry, settings), weights, f"{prefix}front.{index}."
                )
            self.columns.append((offset, offset + entry["width"], cnn))
            offset += entry["width"]
        self.width = offset
        self.body = encoder(settings.get("encoder", "mlp")).twin(
            settings, weights, f"{prefix}body."
        )

    def features(self, x: np.ndarray) -> np.ndarray:
        """The body's input: (B, features) float32."""
        pieces = []
        for start, stop, cnn in self.columns:
            if cnn is not None:
                pieces.append(cnn(x[:, start:stop].reshape(len(x), *cnn.image_shape)))
            else:
                pieces.append(x[:, start:stop].astype(np.float32))
        if x.shape[1] > self.width:  # the agent id's columns
            pieces.append(x[:, self.width :].astype(np.float32))
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces, 1)

    def __call__(self, x: np.ndarray, agent: np.ndarray | None = None) -> np.ndarray:
        return self.body(self.features(x), agent)


def encoder_twin(
    entries: tuple[Entry, ...] | list[Entry],
    settings: dict[str, Any],
    weights: dict[str, np.ndarray],
    prefix: str,
) -> EncoderTwin:
    """The numpy twin of a policy's encoder under ``prefix``: the registered encoder's own
    on a flat Box's row, ``NumpyStructured`` on a structured observation's."""
    if entries:
        return NumpyStructured(tuple(entries), settings, weights, prefix)
    return encoder(settings.get("encoder", "mlp")).twin(settings, weights, prefix)
