"""The image encoder's numpy twin (``NumpyConvEncoder``), and the shape arithmetic both
sides share: the scale by observation dtype, the default layers, the sizes a conv stack
gives an image.

The torch module is ``learner/cnn.py``'s ``ConvEncoder``; ``tests/test_conv.py`` holds
the two equal on random frames. Like all of the acting side this module imports no torch:
a runner or an external agent acts on images from a snapshot's numpy arrays.

Each convolution is one matrix product (im2col): a strided view gives every output
position's patch (``windows``, what ``sliding_window_view`` gives), one reshape copies
them into rows, and the rows multiply a weight matrix laid out once at construction.
Activations stay channels last (N, H, W, C) between layers, which is what a matmul of
patches gives, so no layer transposes; the linear layer's columns are permuted once to
read that order. Channels-first frames (Gymnasium's ``FrameStackObservation`` stacks in
front) are made channels last once, on the way in.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from numpy.lib.stride_tricks import as_strided

from trustrl.config import ConfigError
from trustrl.envs import layout

_ZERO = np.float32(0.0)

# The Nature DQN network (Mnih et al. 2015), CleanRL's ppo_atari encoder: for 84x84 frames.
NATURE_LAYERS: dict[str, Any] = {
    "channels": (32, 64, 64),
    "kernels": (8, 4, 3),
    "strides": (4, 2, 1),
    "linear": 512,
}
# MinAtar's network (Young & Tian 2019, section 4): one conv of 16 3x3 filters, stride 1,
# then a 128-unit linear layer, for its 10x10 grids.
MINATAR_LAYERS: dict[str, Any] = {
    "channels": (16,),
    "kernels": (3,),
    "strides": (1,),
    "linear": 128,
}
# The smallest side the Nature stack leaves non-empty: 36 -> 8 -> 3 -> 1.
NATURE_MIN_SIDE = 36
# At most this many float32s in a layer's patch rows per pass (16 MiB): the twin takes a
# larger batch in chunks.
PATCH_BUDGET = 1 << 22


def image_scale(dtype: Any) -> float:
    """What an image's values are multiplied by inside the model: 1/255 for uint8 frames
    (to [0, 1]), 1.0 for bool grids and float images (already in the user's units)."""
    dtype = np.dtype(dtype)
    if dtype == np.uint8:
        return 1.0 / 255.0
    if dtype == np.bool_ or np.issubdtype(dtype, np.floating):
        return 1.0
    raise ValueError(f"an image must be uint8, bool or float, got dtype {dtype}")


def image_hwc(image_shape: Sequence[int], channels_last: bool) -> tuple[int, int, int]:
    """(height, width, channels) of an observation shape (H, W, C), or (C, H, W) when not
    ``channels_last``."""
    if len(image_shape) != 3:
        raise ValueError(f"an image has 3 dimensions, got shape {tuple(image_shape)}")
    height, width, channels = (
        image_shape if channels_last else (image_shape[1], image_shape[2], image_shape[0])
    )
    return int(height), int(width), int(channels)


def default_layers(image_shape: Sequence[int], channels_last: bool) -> dict[str, Any]:
    """The conv layers for an image shape: the Nature network's where it fits (both sides
    at least 36), MinAtar's for smaller grids."""
    height, width, _ = image_hwc(image_shape, channels_last)
    layers = NATURE_LAYERS if min(height, width) >= NATURE_MIN_SIDE else MINATAR_LAYERS
    return dict(layers)


def cnn_settings(entry: dict[str, Any], policy: dict[str, Any]) -> dict[str, Any]:
    """The image encoder's settings for an image entry of an observation layout
    (envs/layout.py) and the policy table (``policy.cnn_*``, empty: ``default_layers``):
    what ``ConvEncoder`` is built with and its twin reads, on both sides."""
    shape = layout.image_shape(entry)
    last = len(entry["shape"]) == 2 or layout.channels_last(shape)
    layers = default_layers(shape, last)
    if policy.get("cnn_channels"):
        layers.update(
            channels=tuple(policy["cnn_channels"]),
            kernels=tuple(policy["cnn_kernels"]),
            strides=tuple(policy["cnn_strides"]),
        )
    if policy.get("cnn_linear"):
        layers["linear"] = int(policy["cnn_linear"])
    try:
        conv_sizes(shape, last, layers["channels"], layers["kernels"], layers["strides"])
    except ValueError as exc:
        raise ConfigError(f"policy.cnn_*: {exc}") from None
    return {
        "image_shape": list(shape),
        "channels_last": last,
        **{k: [int(v) for v in layers[k]] for k in ("channels", "kernels", "strides")},
        "linear": int(layers["linear"]),
        "scale": image_scale(entry["dtype"]),
    }


def conv_sizes(
    image_shape: Sequence[int],
    channels_last: bool,
    channels: Sequence[int],
    kernels: Sequence[int],
    strides: Sequence[int],
) -> list[tuple[int, int]]:
    """(height, width) after each conv layer (no padding); a ValueError naming the sizes
    when the layers do not fit the image."""
    if not len(channels) == len(kernels) == len(strides) >= 1:
        raise ValueError(
            "channels, kernels and strides need one entry per conv layer, got "
            f"{list(channels)}, {list(kernels)} and {list(strides)}"
        )
    for name, values in (("channels", channels), ("kernels", kernels), ("strides", strides)):
        if any(int(v) < 1 for v in values):
            raise ValueError(f"conv {name} must be positive, got {list(values)}")
    height, width, _ = image_hwc(image_shape, channels_last)
    sizes = []
    for kernel, stride in zip(kernels, strides, strict=True):
        height, width = (height - kernel) // stride + 1, (width - kernel) // stride + 1
        sizes.append((height, width))
    if min(sizes[-1]) < 1:
        first = image_hwc(image_shape, channels_last)[:2]
        path = " -> ".join(f"{max(h, 0)}x{max(w, 0)}" for h, w in [first, *sizes])
        raise ValueError(
            f"conv layers with kernels {list(kernels)} and strides {list(strides)} leave "
            f"nothing of a {image_shape_text(image_shape, channels_last)} image ({path}); "
            "use smaller kernels or strides"
        )
    return sizes


def image_shape_text(image_shape: Sequence[int], channels_last: bool) -> str:
    height, width, channels = image_hwc(image_shape, channels_last)
    order = "channels last" if channels_last else "channels first"
    return f"{height}x{width}x{channels} ({order})"


def windows(x: np.ndarray, kernel: int, stride: int) -> np.ndarray:
    """The patches of a conv layer over (N, H, W, C) ``x`` (any strides), as a read-only
    view (N, H', W', kernel, kernel, C): ``sliding_window_view(x, (kernel, kernel),
    axis=(1, 2))[:, ::stride, ::stride]`` with the window's axes moved before C.

    Made with ``as_strided`` directly, which is what ``sliding_window_view`` calls: its
    argument handling costs three times the view itself at acting sizes, once per layer
    per step. Patch order (kh, kw, C) keeps a window row's pixels (kw, C) one contiguous
    run of a channels-last input, which the im2col copy then moves as one block."""
    n, height, width, channels = x.shape
    step_n, step_h, step_w, step_c = x.strides
    out_h, out_w = (height - kernel) // stride + 1, (width - kernel) // stride + 1
    return as_strided(
        x,
        (n, out_h, out_w, kernel, kernel, channels),
        (step_n, step_h * stride, step_w * stride, step_h, step_w, step_c),
        writeable=False,
    )


def to_channels_last(x: np.ndarray) -> np.ndarray:
    """(N, C, H, W) -> a C-contiguous (N, H, W, C) copy, one channel at a time: numpy's
    transposing copy walks C innermost, a stride of H * W between each element, and is
    several times slower than C copies that each walk a channel's rows."""
    out = np.empty((x.shape[0], *x.shape[2:], x.shape[1]), dtype=x.dtype)
    for channel in range(x.shape[1]):
        out[..., channel] = x[:, channel]
    return out


class NumpyConv:
    """One conv layer and its ReLU on (N, H, W, C) inputs: patches as rows, one matmul.

    ``matrix`` is the torch weight (out, C, k, k) as (k * k * C, out), rows in the patch
    order of ``windows``."""

    __slots__ = ("bias", "kernel", "matrix", "out", "stride")

    def __init__(self, weight: np.ndarray, bias: np.ndarray, stride: int, scale: float) -> None:
        self.out, _, self.kernel, _ = weight.shape
        self.stride = int(stride)
        # The input's scale folded into the weights: one multiply at construction instead of
        # one per pixel per call.
        matrix = weight.transpose(0, 2, 3, 1).reshape(self.out, -1).T * np.float32(scale)
        self.matrix = np.ascontiguousarray(matrix, dtype=np.float32)
        self.bias = np.asarray(bias, dtype=np.float32).copy()

    def __call__(self, x: np.ndarray) -> np.ndarray:
        """(N, H, W, C) of any real dtype -> (N, H', W', out) float32."""
        patches = windows(x, self.kernel, self.stride)
        n, height, width = patches.shape[:3]
        # The reshape copies the patches into rows (im2col); uint8 and bool frames are
        # copied as they are and converted afterwards.
        rows = patches.reshape(n * height * width, -1)
        if rows.dtype != np.float32:
            rows = rows.astype(np.float32)
        y = rows @ self.matrix
        y += self.bias
        np.maximum(y, _ZERO, out=y)
        return y.reshape(n, height, width, self.out)


class NumpyConvEncoder:
    """The numpy twin of ``ConvEncoder`` (learner/cnn.py): raw frames (B, *image_shape) of
    dtype uint8, bool or float -> (B, linear) features, float32.

    Built from the module's ``state_dict`` entries under ``prefix`` (``convs.<i>.weight``,
    ``convs.<i>.bias``, ``linear.weight``, ``linear.bias``) as numpy arrays, and
    ``settings`` with ``image_shape``, ``channels_last``, ``strides`` and ``scale``
    (``ConvEncoder.describe()``); the kernel sizes and channels are read off the weights.
    ``agent`` is accepted for the encoder contract and unused: the weights are shared.
    """

    def __init__(self, settings: dict[str, Any], weights: dict[str, np.ndarray], prefix: str):
        self.image_shape = tuple(int(v) for v in settings["image_shape"])
        self.channels_last = bool(settings["channels_last"])
        strides = [int(s) for s in settings["strides"]]
        scale = float(settings["scale"])
        self.convs = [
            NumpyConv(
                weights[f"{prefix}convs.{i}.weight"],
                weights[f"{prefix}convs.{i}.bias"],
                stride,
                scale if i == 0 else 1.0,
            )
            for i, stride in enumerate(strides)
        ]
        sizes = conv_sizes(
            self.image_shape,
            self.channels_last,
            [c.out for c in self.convs],
            [c.kernel for c in self.convs],
            strides,
        )
        height, width = sizes[-1]
        linear = weights[f"{prefix}linear.weight"]
        out, channels = len(linear), self.convs[-1].out
        if linear.shape[1] != channels * height * width:
            raise ValueError(
                f"the linear layer under {prefix!r} takes {linear.shape[1]} features; the conv "
                f"layers give {channels}x{height}x{width} = {channels * height * width}"
            )
        # torch flattens (C, H, W); the activations here are (H, W, C): permute the columns
        # once so the flat channels-last features multiply the same weights.
        hwc = linear.reshape(out, channels, height, width).transpose(0, 2, 3, 1)
        self.linear_matrix = np.ascontiguousarray(hwc.reshape(out, -1).T, dtype=np.float32)
        self.linear_bias = np.asarray(weights[f"{prefix}linear.bias"], dtype=np.float32).copy()
        self.out_features = out
        # Frames per pass: the patch rows of a large batch (the critic's values over a
        # whole rollout) would take gigabytes at once.
        patch_floats = max(
            h * w * layer.matrix.shape[0] for (h, w), layer in zip(sizes, self.convs, strict=True)
        )
        self.chunk = max(1, PATCH_BUDGET // patch_floats)

    def __call__(self, x: np.ndarray, agent: np.ndarray | None = None) -> np.ndarray:
        if x.shape[1:] != self.image_shape:
            raise ValueError(
                f"image encoder: expected frames of shape (B, *{self.image_shape}), got {x.shape}"
            )
        if len(x) <= self.chunk:
            return self.forward(x)
        out = np.empty((len(x), self.out_features), dtype=np.float32)
        for start in range(0, len(x), self.chunk):
            out[start : start + self.chunk] = self.forward(x[start : start + self.chunk])
        return out

    def forward(self, x: np.ndarray) -> np.ndarray:
        """One pass over (B, *image_shape) frames, B at most ``chunk``."""
        if not self.channels_last:
            x = to_channels_last(x)
        for conv in self.convs:
            x = conv(x)
        y = x.reshape(len(x), -1) @ self.linear_matrix
        y += self.linear_bias
        return np.maximum(y, _ZERO, out=y)
