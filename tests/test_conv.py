"""The image encoder: the numpy twin (trustrl/acting/conv.py) computes what the torch
module (trustrl/learner/cnn.py) computes on raw frames, its layers come from settings, a
stack too large for the image is refused, the scale follows the observation dtype, and
the twin's module loads no torch."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import numpy as np
import pytest
import torch
from numpy.lib.stride_tricks import sliding_window_view

from trustrl.acting import conv
from trustrl.acting.conv import NumpyConvEncoder, default_layers, image_scale
from trustrl.learner.cnn import ConvEncoder

# float32 convolutions summed in another order (im2col matmuls against torch's kernels):
# the twin's features may differ from torch's by 1e-4 of the largest feature.
RELATIVE_TOLERANCE = 1e-4


def twin_of(module: ConvEncoder, prefix: str = "actor.") -> NumpyConvEncoder:
    weights = {f"{prefix}{k}": v.detach().numpy().copy() for k, v in module.state_dict().items()}
    return NumpyConvEncoder(module.describe(), weights, prefix)


def assert_twin_equal(module: ConvEncoder, frames: np.ndarray) -> None:
    with torch.no_grad():
        expected = module(torch.from_numpy(frames)).numpy()
    scale = np.abs(expected).max()
    assert scale > 0.1, "the features are all (nearly) zero: the check would be vacuous"
    actual = twin_of(module)(frames)
    assert actual.dtype == np.float32 and actual.shape == expected.shape
    np.testing.assert_allclose(actual, expected, rtol=0, atol=RELATIVE_TOLERANCE * scale)


def random_frames(shape: tuple[int, ...], dtype: Any, batch: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if dtype == np.uint8:
        return rng.integers(0, 256, (batch, *shape), dtype=np.uint8)
    if dtype == np.bool_:
        return rng.random((batch, *shape)) < 0.2
    return rng.standard_normal((batch, *shape)).astype(dtype)


@pytest.mark.parametrize(
    ("shape", "channels_last", "dtype"),
    [
        ((4, 84, 84), False, np.uint8),  # Atari after FrameStackObservation: stack first
        ((84, 84, 4), True, np.uint8),
        ((10, 10, 7), True, np.bool_),  # MinAtar
        ((3, 40, 48), False, np.float32),  # a float image the user marks as one
    ],
    ids=["atari-channels-first", "atari-channels-last", "minatar-bool", "float"],
)
def test_the_twin_computes_what_the_module_computes(
    shape: tuple[int, ...], channels_last: bool, dtype: Any
) -> None:
    torch.manual_seed(0)
    layers = default_layers(shape, channels_last)
    module = ConvEncoder(shape, channels_last, **layers, scale=image_scale(dtype))
    assert_twin_equal(module, random_frames(shape, dtype, batch=5))


def test_a_batch_larger_than_a_chunk_gives_what_one_pass_gives(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    torch.manual_seed(0)
    module = ConvEncoder((36, 36, 2), True)
    frames = random_frames((36, 36, 2), np.uint8, batch=7)
    whole = twin_of(module)(frames)
    # The first layer's patch rows of two frames: 8x8 positions of 8x8x2 pixels.
    monkeypatch.setattr(conv, "PATCH_BUDGET", 2 * (8 * 8) * (8 * 8 * 2))
    chunked = twin_of(module)
    assert chunked.chunk == 2
    np.testing.assert_allclose(chunked(frames), whole, rtol=1e-6, atol=1e-6)


def test_layers_come_from_settings() -> None:
    torch.manual_seed(0)
    module = ConvEncoder(
        (30, 41, 3), True, channels=(8, 16), kernels=(5, 3), strides=(2, 2), linear=24
    )
    convs = list(module.convs)
    assert [(c.out_channels, c.kernel_size, c.stride) for c in convs] == [
        (8, (5, 5), (2, 2)),
        (16, (3, 3), (2, 2)),
    ]
    # 30x41 -> 13x19 -> 6x9, 16 channels
    assert module.linear.in_features == 16 * 6 * 9 and module.out_features == 24
    rebuilt = ConvEncoder(**module.describe())
    assert {k: v.shape for k, v in rebuilt.state_dict().items()} == {
        k: v.shape for k, v in module.state_dict().items()
    }
    assert_twin_equal(module, random_frames((30, 41, 3), np.uint8, batch=3))


def test_the_nature_default_and_its_initialization() -> None:
    # 84x84 Atari frames: 20x20, 9x9, then 7x7 of 64 channels into the 512 linear layer.
    assert conv.conv_sizes((84, 84, 4), True, (32, 64, 64), (8, 4, 3), (4, 2, 1)) == [
        (20, 20),
        (9, 9),
        (7, 7),
    ]
    torch.manual_seed(0)
    module = ConvEncoder((36, 36, 4), True)  # the Nature layers, at their smallest image
    assert module.describe()["channels"] == [32, 64, 64] and module.out_features == 512
    # CleanRL's layer_init: orthogonal rows of norm sqrt(2), zero biases.
    for layer in [*module.convs, module.linear]:
        weight = layer.weight.detach().reshape(len(layer.weight), -1)
        rows = min(weight.shape)
        gram = weight @ weight.T if rows == len(weight) else weight.T @ weight
        torch.testing.assert_close(gram, 2.0 * torch.eye(rows), atol=1e-4, rtol=0)
        assert not layer.bias.detach().any()


def test_default_layers_follow_the_image_size() -> None:
    nature, minatar = dict(conv.NATURE_LAYERS), dict(conv.MINATAR_LAYERS)
    assert default_layers((84, 84, 4), True) == nature
    assert default_layers((4, 84, 84), False) == nature
    assert default_layers((36, 36, 1), True) == nature  # the smallest the Nature stack fits
    assert default_layers((35, 84, 1), True) == minatar
    assert default_layers((10, 10, 7), True) == minatar
    assert default_layers((4, 10, 10), False) == minatar
    for shape in [(36, 36, 1), (10, 10, 7), (3, 3, 2)]:
        ConvEncoder(shape, True, **default_layers(shape, True))  # never refused


def test_a_stack_that_leaves_nothing_is_refused_with_the_sizes() -> None:
    with pytest.raises(ValueError, match=r"leave nothing of a 10x10x4 .*10x10 -> 1x1 -> 0x0"):
        ConvEncoder((10, 10, 4), True)  # the Nature stack on a MinAtar grid
    with pytest.raises(ValueError, match=r"one entry per conv layer"):
        ConvEncoder((84, 84, 4), True, channels=(32, 64), kernels=(8, 4, 3))
    with pytest.raises(ValueError, match=r"width must be positive"):
        ConvEncoder((84, 84, 4), True, linear=0)


def test_the_twin_refuses_frames_of_another_shape() -> None:
    torch.manual_seed(0)
    twin = twin_of(ConvEncoder((10, 10, 4), True, **conv.MINATAR_LAYERS, scale=1.0))
    with pytest.raises(ValueError, match=r"expected frames of shape \(B, \*\(10, 10, 4\)\)"):
        twin(np.zeros((2, 4, 10, 10), dtype=bool))


def test_the_scale_follows_the_dtype_and_is_inside_the_model() -> None:
    assert image_scale(np.uint8) == 1 / 255
    assert image_scale(np.bool_) == image_scale(np.float32) == image_scale("float64") == 1.0
    with pytest.raises(ValueError, match=r"uint8, bool or float, got dtype int32"):
        image_scale(np.int32)
    torch.manual_seed(0)
    raw = ConvEncoder((36, 36, 3), True, scale=image_scale(np.uint8))
    unit = ConvEncoder((36, 36, 3), True, scale=1.0)
    unit.load_state_dict(raw.state_dict())
    frames = random_frames((36, 36, 3), np.uint8, batch=2)
    with torch.no_grad():
        expected = unit(torch.from_numpy(frames.astype(np.float32) / 255))
        torch.testing.assert_close(raw(torch.from_numpy(frames)), expected)


def test_windows_are_sliding_window_view_s() -> None:
    x = np.arange(2 * 11 * 9 * 3).reshape(2, 11, 9, 3)
    for kernel, stride in [(3, 1), (4, 2), (8, 4)]:
        reference = sliding_window_view(x, (kernel, kernel), axis=(1, 2))[:, ::stride, ::stride]
        patches = conv.windows(x, kernel, stride)
        np.testing.assert_array_equal(patches, reference.transpose(0, 1, 2, 4, 5, 3))
        assert not patches.flags.writeable


def test_the_twin_loads_no_torch() -> None:
    code = "import sys, trustrl.acting.conv; assert 'torch' not in sys.modules, 'torch loaded'"
    subprocess.run([sys.executable, "-c", code], check=True)
