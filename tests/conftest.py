"""Shared test setup: one torch thread (the tiny networks here run fastest on one, and
results are reproducible for a given thread count), the ``time_limit`` marker, and
``benchmark_script`` (a script of benchmarks/ loaded as a module)."""

from __future__ import annotations

import importlib.util
import signal
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

torch.set_num_threads(1)

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def _load_benchmark(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"benchmarks_{name}", BENCHMARKS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while being built
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def benchmark_script() -> Callable[[str], ModuleType]:
    """``benchmark_script("quality")``: benchmarks/quality.py, loaded as a module (the
    scripts are not a package), to test it without running it."""
    return _load_benchmark


@pytest.fixture(autouse=True)
def time_limit(request: pytest.FixtureRequest) -> Iterator[None]:
    """A test marked ``time_limit(seconds)`` raises TimeoutError past that many seconds,
    its fixtures' setup and teardown included (SIGALRM, so on the main thread): a hang
    inside Ray fails the test rather than the whole run."""
    marker = request.node.get_closest_marker("time_limit")
    if marker is None:
        yield
        return
    seconds = int(marker.args[0])

    def expire(signum: int, frame: Any) -> None:
        raise TimeoutError(f"{request.node.nodeid} ran past its time limit of {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
