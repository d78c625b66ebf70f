"""Shared test setup: one torch thread (the tiny networks here run fastest on one, and
results are reproducible for a given thread count), and the ``time_limit`` marker."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from typing import Any

import pytest
import torch

torch.set_num_threads(1)


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
