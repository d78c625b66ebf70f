"""Time the image encoder's update step: ConvEncoder's forward and backward over one
minibatch, as it runs, against the same layers in the other memory layout (contiguous NCHW
against channels-last NHWC), interleaved. ConvEncoder picks channels-last for frames the
Nature network fits (Atari) and NCHW for small grids (MinAtar) from these figures.

    .venv/bin/python benchmarks/conv_update.py                 # Atari: 256 frames (4, 84, 84)
    .venv/bin/python benchmarks/conv_update.py --minatar       # 256 grids (10, 10, 4)

With --minatar two more lines bound how fast that update could be: the conv layer as one
matrix product over patches cut beforehand (as a rollout's could be, once before its
epochs) and the linear layer alone.

One torch thread; blocks of calls alternate between the ways, and the table gives the
median of the blocks in milliseconds per step and each way's ratio to the one run.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from trustrl.learner.cnn import ConvEncoder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minatar", action="store_true")
    parser.add_argument("--blocks", type=int, default=5)
    parser.add_argument("--calls", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    if args.minatar:
        shape, last, layers = (10, 10, 4), True, {"channels": (16,), "kernels": (3,),
                                                   "strides": (1,), "linear": 128}  # fmt: skip
        frames = (torch.rand(256, *shape) < 0.1).to(torch.uint8)
    else:
        shape, last, layers = (4, 84, 84), False, {}
        frames = torch.randint(0, 256, (256, *shape), dtype=torch.uint8)
    encoder = ConvEncoder(shape, last, scale=1 / 255, **layers)

    other = torch.contiguous_format if encoder.nhwc else torch.channels_last
    other_name = "NCHW" if encoder.nhwc else "channels-last"

    def flipped(x: Tensor) -> Tensor:  # the same layers in the layout ConvEncoder does not use
        y = x.to(torch.float32) * encoder.scale
        y = (y.permute(0, 3, 1, 2) if last else y).contiguous(memory_format=other)
        for conv in encoder.convs:
            weight = conv.weight.contiguous(memory_format=other)
            y = torch.relu(F.conv2d(y, weight, conv.bias, conv.stride))
        return torch.relu(encoder.linear(y.flatten(1)))

    as_run = f"{'channels-last' if encoder.nhwc else 'NCHW'} (as run)"
    ways: dict[str, Callable[[Tensor], Tensor]] = {as_run: encoder, other_name: flipped}
    if args.minatar:
        # How low the update could go (docs/pixels.md, the speed beside SB3): MinAtar's one
        # conv layer as a matrix product over its patches, cut once beforehand as a
        # rollout's could be before its epochs, and the linear layer alone on fixed inputs.
        conv = cast("nn.Conv2d", encoder.convs[0])
        bias = cast(Tensor, conv.bias)
        grid = (frames.to(torch.float32) * encoder.scale).permute(0, 3, 1, 2).contiguous()
        patches = F.unfold(grid, tuple(conv.kernel_size)).transpose(1, 2)  # (B, positions, C*k*k)
        positions = patches.shape[1]
        patches = patches.reshape(len(frames) * positions, -1).contiguous()

        def cut_once(_: Tensor) -> Tensor:
            y = torch.relu(torch.addmm(bias, patches, conv.weight.flatten(1).t()))
            # Features in (position, channel) order, so the linear layer's columns are put
            # in that order (a copy of its weights, cheaper than one of the features).
            out = encoder.linear.weight
            weight = out.view(len(out), -1, positions).transpose(1, 2).reshape(len(out), -1)
            return torch.relu(F.linear(y.view(len(frames), -1), weight, encoder.linear.bias))

        with torch.no_grad():
            torch.testing.assert_close(cut_once(frames), encoder(frames))
            features = torch.relu(F.conv2d(grid, conv.weight, conv.bias)).flatten(1)
        ways["patches cut once"] = cut_once
        ways["linear layer alone"] = lambda _: torch.relu(encoder.linear(features))
    times: dict[str, list[float]] = {name: [] for name in ways}

    def step(way: Callable[[Tensor], Tensor]) -> None:
        for p in encoder.parameters():
            p.grad = None
        way(frames).sum().backward()

    for way in ways.values():
        step(way)
    for _ in range(args.blocks):
        for name, way in ways.items():
            start = time.perf_counter()
            for _ in range(args.calls):
                step(way)
            times[name].append((time.perf_counter() - start) / args.calls * 1e3)
    medians = {name: statistics.median(t) for name, t in times.items()}
    for name, value in medians.items():
        print(f"{name:36s} {value:8.1f} ms")
    for name in ways:
        if name != as_run:
            print(f"{name + ' / as run':36s} {medians[name] / medians[as_run]:8.2f}x")


if __name__ == "__main__":
    main()
