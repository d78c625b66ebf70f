"""Time the image encoder on the acting side: the numpy twin (trustrl/acting/conv.py)
against ONNX Runtime running the encoder, exported by ``torch.onnx.export`` or built as an
ONNX graph from the numpy weights (no torch), with torch beside them for reference.

    .venv/bin/python benchmarks/conv_acting.py
    .venv/bin/python benchmarks/conv_acting.py --repeats 31 --calls 20

Cases: Atari (batch 8 of 84x84 frames, uint8, frame stack 4, channels first as
Gymnasium's FrameStackObservation gives them, and channels last; batch 128 for the
critic's values over a rollout), MinAtar (batch 16 and 64 of 10x10x7 bool grids,
channels last), each with its ``default_layers`` (the Nature CNN, MinAtar's network).
One thread each: ``threadpool_limits(1)`` for numpy's BLAS, ``intra_op_num_threads=1``
for ONNX Runtime, ``torch.set_num_threads(1)``. The backends run interleaved (a block of
``--calls`` calls each, fewer for the larger batches, in turn, ``--repeats`` times), so
that a drift in the machine's load reaches them all alike; the table gives the median and
the minimum of the blocks, in microseconds per call, and the largest difference of each
from torch's features.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import torch
from threadpoolctl import threadpool_limits

from trustrl.acting.conv import NumpyConvEncoder, default_layers, image_scale
from trustrl.learner.cnn import ConvEncoder

# (name, image shape, channels last, dtype, batch, share of --calls per block)
CASES = [
    ("Atari 8x(4,84,84) uint8", (4, 84, 84), False, np.uint8, 8, 1.0),
    ("Atari 8x(84,84,4) uint8", (84, 84, 4), True, np.uint8, 8, 1.0),
    ("Atari 128x(4,84,84) uint8", (4, 84, 84), False, np.uint8, 128, 0.1),
    ("MinAtar 16x(10,10,7) bool", (10, 10, 7), True, np.bool_, 16, 5.0),
    ("MinAtar 64x(10,10,7) bool", (10, 10, 7), True, np.bool_, 64, 2.0),
]


def frames(shape: tuple[int, ...], dtype: type, batch: int) -> np.ndarray:
    rng = np.random.default_rng(0)
    if dtype is np.bool_:
        return rng.random((batch, *shape)) < 0.1  # MinAtar grids are mostly empty
    return rng.integers(0, 256, (batch, *shape), dtype=np.uint8)


def onnx_session(module: ConvEncoder, example: np.ndarray, folder: Path) -> ort.InferenceSession:
    path = folder / "encoder.onnx"
    # The TorchScript-based exporter, as trustrl export uses (no onnxscript needed).
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            module,
            (torch.from_numpy(example),),
            str(path),
            input_names=["frames"],
            output_names=["features"],
            dynamic_axes={"frames": {0: "batch"}, "features": {0: "batch"}},
            opset_version=17,
            dynamo=False,
        )
    return ort.InferenceSession(str(path), session_options(), providers=["CPUExecutionProvider"])


def onnx_from_weights(
    settings: dict[str, Any], weights: dict[str, np.ndarray], prefix: str, dtype: type
) -> ort.InferenceSession:
    """The same encoder as an ONNX graph built from the snapshot's numpy weights with
    ``onnx.helper``: how the acting side could run ONNX Runtime without torch and without
    an export per update. The input's scale is folded into the first conv's weights, as
    the numpy twin does."""
    from onnx import TensorProto, helper, numpy_helper

    nodes = [helper.make_node("Cast", ["frames"], ["x"], to=TensorProto.FLOAT)]
    if settings["channels_last"]:
        nodes.append(helper.make_node("Transpose", ["x"], ["x_nchw"], perm=[0, 3, 1, 2]))
    current = nodes[-1].output[0]
    initializers = []
    for i, stride in enumerate(settings["strides"]):
        scale = np.float32(settings["scale"] if i == 0 else 1.0)
        weight = (weights[f"{prefix}convs.{i}.weight"] * scale).astype(np.float32)
        initializers += [
            numpy_helper.from_array(weight, f"w{i}"),
            numpy_helper.from_array(weights[f"{prefix}convs.{i}.bias"], f"b{i}"),
        ]
        nodes += [
            helper.make_node("Conv", [current, f"w{i}", f"b{i}"], [f"c{i}"], strides=[stride] * 2),
            helper.make_node("Relu", [f"c{i}"], [f"h{i}"]),
        ]
        current = f"h{i}"
    initializers += [
        numpy_helper.from_array(weights[f"{prefix}linear.weight"], "w_linear"),
        numpy_helper.from_array(weights[f"{prefix}linear.bias"], "b_linear"),
    ]
    nodes += [
        helper.make_node("Flatten", [current], ["flat"], axis=1),
        helper.make_node("Gemm", ["flat", "w_linear", "b_linear"], ["linear"], transB=1),
        helper.make_node("Relu", ["linear"], ["features"]),
    ]
    frames = helper.make_tensor_value_info(
        "frames",
        helper.np_dtype_to_tensor_dtype(np.dtype(dtype)),
        ["batch", *settings["image_shape"]],
    )
    features = helper.make_tensor_value_info(
        "features", TensorProto.FLOAT, ["batch", settings["linear"]]
    )
    graph = helper.make_graph(nodes, "conv_encoder", [frames], [features], initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    return ort.InferenceSession(
        model.SerializeToString(), session_options(), providers=["CPUExecutionProvider"]
    )


def session_options() -> ort.SessionOptions:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    return options


def measure(
    backends: dict[str, Callable[[], np.ndarray]], calls: int, repeats: int
) -> dict[str, list[float]]:
    """Microseconds per call of each backend, one entry per block, blocks interleaved."""
    times: dict[str, list[float]] = {name: [] for name in backends}
    for run in backends.values():
        for _ in range(5):
            run()
    for _ in range(repeats):
        for name, run in backends.items():
            start = time.perf_counter()
            for _ in range(calls):
                run()
            times[name].append((time.perf_counter() - start) / calls * 1e6)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=20, help="calls per timed block")
    parser.add_argument("--repeats", type=int, default=21, help="blocks per backend")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    rows = []
    with tempfile.TemporaryDirectory() as folder, threadpool_limits(1):
        for name, shape, last, dtype, batch, share in CASES:
            layers = default_layers(shape, last)
            module = ConvEncoder(shape, last, **layers, scale=image_scale(dtype)).eval()
            weights = {f"enc.{k}": v.numpy() for k, v in module.state_dict().items()}
            twin = NumpyConvEncoder(module.describe(), weights, "enc.")
            x = frames(shape, dtype, batch)
            start = time.perf_counter()
            session = onnx_session(module, x, Path(folder))
            exported = time.perf_counter() - start
            start = time.perf_counter()
            built = onnx_from_weights(module.describe(), weights, "enc.", dtype)
            from_weights = time.perf_counter() - start
            x_torch = torch.from_numpy(x)

            def run_torch(
                module: ConvEncoder = module, x_torch: torch.Tensor = x_torch
            ) -> np.ndarray:
                with torch.inference_mode():
                    return module(x_torch).numpy()

            backends: dict[str, Callable[[], np.ndarray]] = {
                "numpy": lambda twin=twin, x=x: twin(x),
                "onnxruntime": lambda session=session, x=x: session.run(None, {"frames": x})[0],
                "onnxruntime, graph from weights": (
                    lambda built=built, x=x: built.run(None, {"frames": x})[0]
                ),
                "torch": run_torch,
            }
            reference = run_torch()
            error = {k: float(np.abs(run() - reference).max()) for k, run in backends.items()}
            times = measure(backends, max(1, round(args.calls * share)), args.repeats)
            for backend, blocks in times.items():
                rows.append((name, backend, statistics.median(blocks), min(blocks), error[backend]))
            print(
                f"{name}: torch.onnx.export and session {exported * 1e3:.0f} ms, "
                f"graph from weights and session {from_weights * 1e3:.0f} ms",
                flush=True,
            )
    print()
    print("| case | backend | median us/call | min us/call | max abs diff vs torch |")
    print("| --- | --- | ---: | ---: | ---: |")
    for name, backend, median, best, err in rows:
        print(f"| {name} | {backend} | {median:.0f} | {best:.0f} | {err:.1e} |")


if __name__ == "__main__":
    main()
