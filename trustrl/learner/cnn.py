"""The image encoder: a stack of conv layers, then a linear layer, ReLU after each; by
default the Nature DQN network (Mnih et al. 2015) that CleanRL's ``ppo_atari`` and SB3's
``NatureCNN`` use.

It takes the frames as the env gives them, uint8, bool or float, channels last or first,
and does the scaling to [0, 1] and the permutation to NCHW inside the model, so that an
exported policy takes raw frames too and the rollout keeps them as bytes. Its numpy twin,
which the acting side runs, is ``acting/conv.py``'s ``NumpyConvEncoder``; the shape
arithmetic both sides need (``image_scale``, ``default_layers``, ``conv_sizes``) lives
there, beside the twin, since the acting side imports no torch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from trustrl.acting.conv import NATURE_MIN_SIDE, conv_sizes, default_layers, image_hwc, image_scale

__all__ = ["ConvEncoder", "default_layers", "image_scale"]


class ConvEncoder(nn.Module):
    """Frames (B, *image_shape) -> (B, linear) features.

    ``image_shape`` is the observation's (H, W, C) when ``channels_last``, else (C, H, W).
    ``channels``, ``kernels`` and ``strides`` have one entry per conv layer (square
    kernels, no padding); ``scale`` multiplies the input (``image_scale`` of the
    observation dtype). A stack that leaves nothing of the image is refused with the
    sizes it would give.
    """

    def __init__(
        self,
        image_shape: Sequence[int],
        channels_last: bool,
        channels: Sequence[int] = (32, 64, 64),
        kernels: Sequence[int] = (8, 4, 3),
        strides: Sequence[int] = (4, 2, 1),
        linear: int = 512,
        scale: float = 1.0 / 255.0,
    ) -> None:
        super().__init__()
        sizes = conv_sizes(image_shape, channels_last, channels, kernels, strides)
        if linear < 1:
            raise ValueError(f"the linear layer's width must be positive, got {linear}")
        self.image_shape = tuple(int(v) for v in image_shape)
        self.channels_last = bool(channels_last)
        self.scale = float(scale)
        self.layer_settings = {
            "channels": [int(c) for c in channels],
            "kernels": [int(k) for k in kernels],
            "strides": [int(s) for s in strides],
            "linear": int(linear),
        }
        frame_height, frame_width, in_channels = image_hwc(image_shape, channels_last)
        # The memory the convolutions run in, picked by measurement (one thread, forward and
        # backward over a 256-frame minibatch, benchmarks/conv_update.py): oneDNN's
        # channels-last (NHWC) kernels take the Nature CNN on Atari's 84 x 84 frames about
        # 1.4x faster than NCHW (240 against 340 ms), and MinAtar's one 3 x 3 layer on its
        # 10 x 10 grids about 1.25x slower (4.8 against 3.9 ms): channels-last for frames
        # the Nature network fits, NCHW for the small grids.
        self.nhwc = min(frame_height, frame_width) >= NATURE_MIN_SIDE
        self.convs = nn.ModuleList()
        for out, kernel, stride in zip(channels, kernels, strides, strict=True):
            self.convs.append(nn.Conv2d(in_channels, int(out), int(kernel), int(stride)))
            in_channels = int(out)
        height, width = sizes[-1]
        self.linear = nn.Linear(in_channels * height * width, int(linear))
        self.out_features = int(linear)
        # CleanRL's layer_init: orthogonal weights with gain sqrt(2), zero biases.
        # (policy.orthogonal_init reaches only linear layers, so the convs are done here.)
        for layer in [*self.convs, self.linear]:
            nn.init.orthogonal_(layer.weight, gain=math.sqrt(2))
            nn.init.zeros_(layer.bias)

    def forward(self, x: Tensor, agent: Tensor | None = None) -> Tensor:
        x = x.to(torch.float32)
        if self.scale != 1.0:
            x = x * self.scale
        if self.channels_last:
            x = x.permute(0, 3, 1, 2)
        # In channels-last memory (self.nhwc) the weights are converted per call too (a copy
        # of 78k floats for the Nature CNN, which the gradient passes through): the
        # optimizer keeps every parameter a view of its flat buffer.
        layout = torch.channels_last if self.nhwc else torch.contiguous_format
        x = x.contiguous(memory_format=layout)
        for conv in cast("list[nn.Conv2d]", self.convs):
            weight = conv.weight.contiguous(memory_format=layout)
            x = torch.relu(F.conv2d(x, weight, conv.bias, conv.stride))
        return torch.relu(self.linear(x.flatten(1)))

    def describe(self) -> dict[str, Any]:
        """The settings that rebuild this module (JSON-able), which are also what the numpy
        twin takes: ``NumpyConvEncoder(encoder.describe(), weights, prefix)``."""
        return {
            "image_shape": list(self.image_shape),
            "channels_last": self.channels_last,
            **self.layer_settings,
            "scale": self.scale,
        }
