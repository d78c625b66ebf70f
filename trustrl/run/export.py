"""Export a trained policy's actor as one self-contained ONNX or TorchScript file.

The exported model is the deterministic actor only (no critic, no training state) and
runs without trustrl installed: onnxruntime (or any ONNX runtime) for ``.onnx``,
``torch.jit.load`` for TorchScript. Everything ``Policy.act(obs, deterministic=True)``
does on the way from a raw observation to an env action is inside it:

inputs
    ``obs``          float32 (batch, *obs_shape): raw observations as the env returns them
                     (for dict observations, the ``"observation"`` entry), batched.
                     A structured observation (envs/layout.py: an image, a Dict or Tuple,
                     a Discrete, MultiDiscrete or MultiBinary) is taken as the env hands it
                     out instead: one input per entry, named ``obs`` for a whole
                     observation (uint8 frames (batch, 4, 84, 84), bool grids, an int64
                     (batch,) Discrete index, ...) and ``obs.<key>`` for a Dict's key or a
                     Tuple's index, each with the entry's own dtype and shape (MultiBinary:
                     int8; Discrete and MultiDiscrete: int64, one-hot encoded inside, an
                     index out of range giving an all-zero one-hot), in the order of the
                     layout (the float vectors first): the order TorchScript takes them in,
                     positionally, and the order of the metadata's ``inputs``. Frames are
                     scaled inside (uint8 by 1/255); bool grids are bool inputs.
    ``state``        float32 (batch, S), only for a policy with memory (``policy.memory``):
                     the actor's recurrent state (an LSTM's h then c, a GRU's h), zeros at
                     an episode's start, then each step's ``next_state``.
    ``action_mask``  bool (batch, n), only when the policy was trained with action masks;
                     True = allowed. TorchScript also accepts a float/int mask (nonzero =
                     allowed); ONNX declares the input as bool.
output
    ``action``       Discrete: int64 (batch,), the argmax of the masked log-probabilities;
                     MultiDiscrete: int64 (batch, k), one argmax per component;
                     Box: float32 (batch, *env_action_shape), the Gaussian mean clipped to
                     the action space's bounds.
    ``next_state``   float32 (batch, S), only with memory: the state for the next step.

The observation normalizer's statistics (and its clip) are baked in as float32
constants computed exactly as ``RunningMeanStd.forward`` computes them (for a structured
observation, on its float vectors only, as the policy does). The batch axis
is dynamic. ONNX files carry a ``trustrl`` JSON entry in their metadata, TorchScript
files a ``trustrl.json`` extra file, describing the spaces and the inputs.
"""

from __future__ import annotations

import copy
import json
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from trustrl.envs.layout import Entry
from trustrl.envs.spaces import SpaceSpec
from trustrl.learner.policy import Policy

FORMATS = {"onnx": ".onnx", "torchscript": ".pt"}
ONNX_OPSET = 17


class ExportError(ValueError):
    """An export that cannot be done as asked; the message says why."""


def _torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a numpy dtype name ("uint8", "bool", "float32", "int64", ...)."""
    return torch.from_numpy(np.zeros(0, dtype=np.dtype(name))).dtype


class Pack(nn.Module):
    """The exported model's twin of envs/layout.py's ``pack`` (``SpaceSpec.split``): a
    structured observation's entries, one batched tensor each as the env hands them out,
    in the layout's order -> rows (B, obs_dim) of the spec's row dtype (uint8 or float32),
    the same rows ``split`` gives. Discrete and MultiDiscrete indices are one-hot encoded
    here, by comparing each one-hot column's component with the index that column stands
    for (an index out of range gives an all-zero one-hot where ``pack`` raises); every
    other entry is flattened and cast. Nothing is checked: the runtime checks each input's
    dtype and rank against the file's declaration, and a wrong size fails the reshape."""

    def __init__(self, spec: SpaceSpec) -> None:
        super().__init__()
        self.dtype = _torch_dtype(spec.obs_dtype.name)
        # The columns each entry reads: its width, or for a one-hot its components.
        self.widths = [
            len(e["nvec"]) if e["kind"] == "onehot" else int(e["width"]) for e in spec.obs_entries
        ]
        self.onehot: list[bool] = []
        for index, entry in enumerate(spec.obs_entries):
            self.onehot.append(entry["kind"] == "onehot")
            if entry["kind"] == "onehot":
                component, value = _one_hot_columns(entry)
                # Buffers: traced as constants of the graph.
                self.register_buffer(f"component_{index}", component)
                self.register_buffer(f"value_{index}", value)

    def forward(self, values: list[Tensor]) -> Tensor:
        pieces = []
        for index, value in enumerate(values):
            flat = value.reshape(value.shape[0], self.widths[index])  # traced: a dynamic batch
            if self.onehot[index]:
                component = getattr(self, f"component_{index}")
                choices = getattr(self, f"value_{index}")
                pieces.append((flat.to(torch.int64)[:, component] == choices).to(self.dtype))
            else:
                pieces.append(flat.to(self.dtype))
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, 1)


def _one_hot_columns(entry: Entry) -> tuple[Tensor, Tensor]:
    """For each one-hot column of a Discrete or MultiDiscrete entry: the component it
    belongs to and the index it stands for (``start`` + its place among the choices)."""
    component: list[int] = []
    value: list[int] = []
    for c, (n, start) in enumerate(zip(entry["nvec"], entry["start"], strict=True)):
        component += [c] * int(n)
        value += range(int(start), int(start) + int(n))
    return torch.tensor(component, dtype=torch.int64), torch.tensor(value, dtype=torch.int64)


def input_names(spec: SpaceSpec, recurrent: bool = False) -> list[str]:
    """The exported model's inputs: ``obs`` (a flat Box's vector, or a whole structured
    observation), or ``obs.<key>`` per entry of a Dict or Tuple, in the layout's order;
    ``state`` for a ``recurrent`` policy (memory); then ``action_mask`` for a masked
    policy."""
    entries = spec.obs_entries
    names = (
        ["obs"] if not entries or not entries[0]["key"] else [f"obs.{e['key']}" for e in entries]
    )
    if recurrent:
        names.append("state")
    return [*names, "action_mask"] if spec.masked else names


class DeployedActor(nn.Module):
    """Raw observation batch (and mask) -> deterministic env actions, for tracing. A
    structured observation comes as a list of its entries (``EntryInputs`` gives them
    as inputs of their own)."""

    obs_mean: Tensor
    obs_scale: Tensor
    low: Tensor
    high: Tensor

    def __init__(self, policy: Policy) -> None:
        super().__init__()
        spec = policy.spec
        self.obs_dim = spec.obs_dim
        self.vector_dim = spec.vector_dim
        self.pack = Pack(spec) if spec.obs_entries else None
        self.kind = spec.action_kind
        self.masked = spec.masked
        self.env_action_shape = tuple(spec.env_action_shape)
        norm = policy.obs_normalizer
        self.normalize = norm is not None
        if norm is not None:
            # The same float32 values RunningMeanStd.forward derives at every call.
            mean = norm.mean.to(torch.float32)
            scale = torch.rsqrt(norm.var.to(torch.float32) + norm.epsilon)
            self.obs_clip = float(norm.clip)
        else:
            mean = torch.zeros(spec.vector_dim)
            scale = torch.ones(spec.vector_dim)
            self.obs_clip = 0.0
        self.register_buffer("obs_mean", mean.clone())
        self.register_buffer("obs_scale", scale.clone())
        self.register_buffer("low", torch.tensor(spec.low, dtype=torch.float32))
        self.register_buffer("high", torch.tensor(spec.high, dtype=torch.float32))
        self.actor = copy.deepcopy(policy.actor)
        self.memory = copy.deepcopy(policy.actor_memory)
        self.head = copy.deepcopy(policy.head)
        self.requires_grad_(False)  # inference only: outputs carry no autograd graph

    def forward(self, obs: Tensor | list[Tensor], action_mask: Tensor | None = None) -> Tensor:
        return self.mode(self.params(obs, action_mask))

    def params(self, obs: Tensor | list[Tensor], action_mask: Tensor | None) -> Tensor:
        """The action head's distribution parameters for raw observations."""
        mask = action_mask.to(torch.bool) if action_mask is not None else None
        params: Tensor = self.head.forward(self.actor(self.rows(obs)), mask)
        return params

    def rows(self, obs: Tensor | list[Tensor]) -> Tensor:
        """Raw observations as the policy's normalized rows. A structured observation's
        entries are packed into the row ``SpaceSpec.split`` gives, and its float vectors
        normalized as ``RunningMeanStd`` does a structured row."""
        if isinstance(obs, list):  # a structured observation's entries
            assert self.pack is not None
            x = self.pack(obs)
            if self.normalize:
                width = self.vector_dim
                vectors = (x[:, :width] - self.obs_mean) * self.obs_scale
                vectors = vectors.clamp(-self.obs_clip, self.obs_clip)
                x = torch.cat([vectors, x[:, width:]], 1)
            return x
        x = obs.to(torch.float32).reshape(-1, self.obs_dim)
        if self.normalize:
            x = ((x - self.obs_mean) * self.obs_scale).clamp(-self.obs_clip, self.obs_clip)
        return x

    def mode(self, params: Tensor) -> Tensor:
        """The deterministic env action of the parameters."""
        actions: Tensor = self.head.mode(params)
        if self.kind == "box":
            # np.clip(a, low, high) in SpaceSpec.to_env is min(max(a, low), high).
            actions = torch.minimum(torch.maximum(actions, self.low), self.high)
            actions = actions.reshape((-1, *self.env_action_shape))
        return actions


class RecurrentActor(DeployedActor):
    """``DeployedActor`` of a policy with memory: the actor's recurrent state in and out
    (``state``, ``next_state``), one step per call."""

    def forward(  # type: ignore[override]
        self, obs: Tensor | list[Tensor], state: Tensor, action_mask: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        assert self.memory is not None
        features = self.actor(self.rows(obs))
        out, next_state = self.memory(features.unsqueeze(0), state)
        mask = action_mask.to(torch.bool) if action_mask is not None else None
        return self.mode(self.head.forward(out[0], mask)), next_state


class RecurrentSamplingActor(DeployedActor):
    """The gateway's model of a policy with memory (``SamplingActor``'s outputs, and the
    state): ``state`` in is the policy's whole state (the actor core's columns, then the
    critic core's), ``next_state`` out the same after one step; both cores advance, so
    that a thin agent that feeds ``next_state`` back holds the state the learner replays
    its chunk from (remote/thin.py)."""

    def __init__(self, policy: Policy) -> None:
        super().__init__(policy)
        assert policy.actor_memory is not None
        self.split = policy.actor_memory.state_size
        self.critic_encoder = copy.deepcopy(policy.critic[0])
        self.critic_memory = copy.deepcopy(policy.critic_memory)
        self.requires_grad_(False)

    def forward(  # type: ignore[override]
        self, obs: Tensor | list[Tensor], state: Tensor, action_mask: Tensor | None = None
    ) -> tuple[Tensor, Tensor, Tensor]:
        assert self.memory is not None
        x = self.rows(obs)
        out, actor_state = self.memory(self.actor(x).unsqueeze(0), state[:, : self.split])
        mask = action_mask.to(torch.bool) if action_mask is not None else None
        params = self.head.forward(out[0], mask)
        next_state = actor_state
        if self.critic_memory is not None:
            critic_in = self.critic_encoder(x).unsqueeze(0)
            _, critic_state = self.critic_memory(critic_in, state[:, self.split :])
            next_state = torch.cat([actor_state, critic_state], 1)
        return self.mode(params), params, next_state


class SamplingActor(DeployedActor):
    """``DeployedActor`` with a second output, ``params``, for an agent that samples its
    actions itself (the gateway's ONNX model, remote/gateway.py): Discrete and
    MultiDiscrete: the log-probabilities (masked), the components' blocks side by side;
    Box: the means, then the log standard deviations."""

    def forward(  # type: ignore[override]
        self, obs: Tensor | list[Tensor], action_mask: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        params = self.params(obs, action_mask)
        return self.mode(params), params


class EntryInputs(nn.Module):
    """A structured observation's entries as inputs of their own (``input_names``): the
    entries in the layout's order, then the mask where the policy takes one."""

    def __init__(self, actor: DeployedActor, entries: int, masked: bool) -> None:
        super().__init__()
        self.actor = actor
        self.entries = entries
        self.masked = masked
        self.recurrent = isinstance(actor, RecurrentActor)

    def forward(self, *inputs: Tensor) -> Any:
        mask = inputs[-1] if self.masked else None
        entries = list(inputs[: self.entries])
        if self.recurrent:  # the state comes after the entries
            return self.actor(entries, inputs[self.entries], mask)
        return self.actor(entries, mask)


def deployed(policy: Policy, sampling: bool = False) -> nn.Module:
    """The module to trace: ``DeployedActor`` (``SamplingActor`` when ``sampling``,
    ``RecurrentActor`` for a policy with memory), in an ``EntryInputs`` for a structured
    observation."""
    if policy.actor_memory is not None:
        recurrent = RecurrentSamplingActor if sampling else RecurrentActor
        actor: DeployedActor = recurrent(policy).eval()
    else:
        actor = (SamplingActor if sampling else DeployedActor)(policy).eval()
    spec = policy.spec
    if not spec.obs_entries:
        return actor
    return EntryInputs(actor, len(spec.obs_entries), spec.masked).eval()


def onnx_model(policy: Policy, info: dict[str, Any]) -> bytes:
    """``policy``'s ``SamplingActor`` as ONNX bytes (outputs ``action`` and ``params``;
    ``info`` goes into its ``trustrl`` metadata entry)."""
    import tempfile

    if policy.per_agent or policy.agent_id:
        raise ExportError("a multi-agent policy needs an agent input this export does not have")
    inputs, outputs = describe_io(policy, whole_state=True)
    info = {**info, "spec": policy.spec.to_json(), "inputs": inputs, "outputs": outputs}
    module = deployed(policy, sampling=True)
    recurrent = policy.actor_memory is not None
    with tempfile.TemporaryDirectory(prefix="trustrl-onnx-") as folder:
        path = Path(folder) / "policy.onnx"
        example = _example_inputs(policy, whole_state=True)
        names = input_names(policy.spec, recurrent)
        outputs_named = ("action", "params", "next_state") if recurrent else ("action", "params")
        _export_onnx(module, example, names, path, info, outputs_named)
        return path.read_bytes()


@dataclass(frozen=True)
class ExportResult:
    path: Path
    checkpoint: Path
    format: str
    inputs: dict[str, str]
    outputs: dict[str, str]


def default_output(checkpoint: Path, fmt: str) -> Path:
    """<run>/policy.<ext> for a checkpoint in a run folder, else <checkpoint>.<ext> beside it."""
    suffix = FORMATS[fmt]
    if checkpoint.parent.name == "checkpoints":
        return checkpoint.parent.parent / f"policy{suffix}"
    return checkpoint.parent / f"{checkpoint.name}{suffix}"


def describe_io(policy: Policy, whole_state: bool = False) -> tuple[dict[str, str], dict[str, str]]:
    """Names -> 'dtype (shape)' of the exported model's inputs and outputs; a recurrent
    policy's state is the actor's, or with ``whole_state`` (the gateway's model) the
    policy's whole state."""
    spec = policy.spec
    if spec.obs_entries:
        names = input_names(spec)
        inputs = {
            name: f"{entry['dtype']} {_shape(tuple(entry['shape']))}"
            for name, entry in zip(names, spec.obs_entries, strict=False)
        }
    else:
        inputs = {"obs": f"float32 {_shape(spec.obs_shape)}"}
    memory = policy.actor_memory
    size = 0
    if memory is not None:
        size = policy.state_size if whole_state else memory.state_size
        inputs["state"] = f"float32 {_shape((size,))}"
    if spec.masked:
        inputs["action_mask"] = f"bool {_shape((spec.mask_dim or 0,))}"
    if spec.action_kind == "box":
        output = f"float32 {_shape(spec.env_action_shape)}"
    else:
        output = f"int64 {_shape(spec.action_shape)}"
    outputs = {"action": output}
    if memory is not None:
        outputs["next_state"] = f"float32 {_shape((size,))}"
    return inputs, outputs


def _shape(dims: tuple[int, ...]) -> str:
    return "(" + ", ".join(["batch", *(str(d) for d in dims)]) + ")"


def export_policy(
    path: str | Path, fmt: str = "onnx", out: str | Path | None = None
) -> ExportResult:
    """Export the checkpoint at ``path`` (run or checkpoint folder) to ``out``."""
    if fmt not in FORMATS:
        raise ExportError(f"unknown export format {fmt!r}; choose from {', '.join(FORMATS)}")
    from trustrl.run.checkpoint import load_policy, read_meta, resolve_checkpoint

    folder = resolve_checkpoint(path)
    meta = read_meta(folder)
    policy = load_policy(folder)
    if not isinstance(policy, Policy) or policy.per_agent or policy.agent_id:
        # The actor of a multi-agent group reads the agent's index (or several groups'
        # policies act together): that needs an agent input this export does not have.
        raise ExportError(
            f"{folder} holds a multi-agent policy; export supports single-agent policies "
            "(one actor, no per-agent weights or agent ids)"
        )
    target = Path(out) if out is not None else default_output(folder, fmt)
    if target.is_dir():
        target = target / f"policy{FORMATS[fmt]}"
    inputs, outputs = describe_io(policy)
    config = meta.get("config")
    info = {
        "exported_by": "trustrl",
        "checkpoint": str(folder),
        "env_id": config.get("env_id") if isinstance(config, dict) else None,
        "iteration": meta.get("iteration"),
        "spec": policy.spec.to_json(),
        "inputs": inputs,
        "outputs": outputs,
        "obs_normalizer_baked_in": policy.obs_normalizer is not None,
        "deterministic": True,
    }
    module = deployed(policy)
    example = _example_inputs(policy)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
        try:
            if fmt == "onnx":
                names = input_names(policy.spec, policy.actor_memory is not None)
                _export_onnx(module, example, names, tmp, info, tuple(outputs))
            else:
                _export_torchscript(module, example, tmp, info)
            os.replace(tmp, target)
        finally:
            tmp.unlink(missing_ok=True)
    except OSError as exc:
        raise ExportError(f"could not write {target}: {exc.strerror or exc}") from None
    return ExportResult(target, folder, fmt, inputs, outputs)


def _example_inputs(policy: Policy, whole_state: bool = False) -> tuple[Tensor, ...]:
    spec = policy.spec
    mask = (torch.ones((2, spec.mask_dim or 0), dtype=torch.bool),) if spec.masked else ()
    memory = policy.actor_memory
    size = (policy.state_size if whole_state else memory.state_size) if memory else 0
    state = (torch.zeros((2, size)),) if memory is not None else ()
    if spec.obs_entries:
        entries = tuple(
            torch.zeros((2, *entry["shape"]), dtype=_torch_dtype(entry["dtype"]))
            for entry in spec.obs_entries
        )
        return (*entries, *state, *mask)
    return (torch.zeros((2, *spec.obs_shape), dtype=torch.float32), *state, *mask)


def _export_onnx(
    module: nn.Module,
    example: tuple[Tensor, ...],
    names: list[str],
    path: Path,
    info: dict[str, Any],
    outputs: tuple[str, ...] = ("action",),
) -> None:
    # torch >= 2.9 defaults to the torch.export-based ("dynamo") exporter, which needs
    # onnxscript; trustrl's export extra installs only onnx and onnxruntime. The
    # TorchScript-based exporter (dynamo=False) needs neither, handles this small static
    # graph fully, and takes dynamic_axes for the batch dimension. It warns that it is
    # deprecated; that warning is not the user's concern, so it is silenced here.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        # A recurrent policy's LSTM or GRU: the exporter warns that a batch size other
        # than the example's needs the initial states as inputs, which they are here.
        warnings.filterwarnings("ignore", "Exporting a model to ONNX with a batch_size")
        torch.onnx.export(
            module,
            example,
            str(path),
            input_names=names,
            output_names=list(outputs),
            dynamic_axes={name: {0: "batch"} for name in [*names, *outputs]},
            opset_version=ONNX_OPSET,
            dynamo=False,
        )
    try:
        import onnx
    except ImportError:  # the file is written; metadata and the check need onnx
        return
    model = onnx.load(str(path))
    entry = model.metadata_props.add()
    entry.key, entry.value = "trustrl", json.dumps(info)
    onnx.checker.check_model(model)
    onnx.save(model, str(path))


def _export_torchscript(
    module: nn.Module, example: tuple[Tensor, ...], path: Path, info: dict[str, Any]
) -> None:
    # torch.jit is deprecated in favour of torch.export, but a TorchScript file is still
    # what C++ (libtorch) and older runtimes load; the warnings are silenced like ONNX's.
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore", DeprecationWarning)
        traced = torch.jit.trace(module, example)
        torch.jit.save(traced, str(path), _extra_files={"trustrl.json": json.dumps(info)})
