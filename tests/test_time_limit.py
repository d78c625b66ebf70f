"""The ``time_limit`` marker of tests/conftest.py: a hang past the limit fails the test."""

from __future__ import annotations

import signal
import time

import pytest


@pytest.mark.time_limit(1)
def test_a_test_past_its_time_limit_is_interrupted() -> None:
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="ran past its time limit of 1 s"):
        time.sleep(30)
    assert time.monotonic() - start < 10


def test_an_unmarked_test_sets_no_alarm() -> None:
    assert signal.alarm(0) == 0  # no alarm was pending
