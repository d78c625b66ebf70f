"""The critic's share of PPO's minibatch steps, in a second process beside the actor's.

With the numpy gradients (grads.py) a minibatch step is the actor's forward pass, losses
and backward pass, then the critic's, then one gradient clip and one Adam step over
both. The two networks share nothing before the clip, so where a second core is free
the critic's share runs there: a forked process reads the critic's weights and writes
its gradient in shared memory, while this process does the actor's. A step then takes
about as long as the actor's share alone (0.73x the time at 256 rows of 64 units, 0.62x
at 1,024 rows of 32: ``docs/performance.md``, round 8). The results are the same bit for
bit: the same numpy calls on the same numbers, in another process.

* Why a process: a second thread took 1.6x as long (round 7), as the GIL passes between
  the two threads at every numpy call; two processes share no lock.
* Why fork: the child needs the critic's code and its weights' memory as they are; a
  spawned interpreter would spend about 1.5 s importing torch.
* What crosses: per minibatch, the rows (observations, returns, old values) are copied
  into shared buffers and their count goes down a pipe; one byte comes back when the
  loss is in its shared slot and the gradient in the optimizer's flat buffer (which
  ``NumpyGradients(shared=True)`` and ``Adam(shared=True)`` allocate in shared memory).
* Waiting: each side polls its end of the pipe for ``POLL_SECONDS`` before it blocks on
  it. A process blocked in ``read`` is woken through the scheduler, which took 20-35 µs
  a message here (a VM's idle vCPU), about a tenth of a minibatch step; one that polls
  sees the message within a microsecond, and its writer makes no wake-up call. The
  messages still travel through the pipe, so the kernel orders the shared memory's
  writes before the reads on any CPU. At the end of an update the trainer sends
  ``rest`` and the child blocks at once: polling on into the collection would take the
  second core's share of the machine (two vCPUs here slow each other down) for nothing.
* Failure: if the child dies or stops answering, ``result`` returns None and the caller
  computes that minibatch, and the rest of the run, in its own process.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import select
import signal
import sys
import time
import warnings
import weakref
from collections.abc import Callable

import numpy as np
import torch
from threadpoolctl import threadpool_limits

# (observations, returns, old values) -> the value loss; writes the critic's gradient
# into memory the parent shares (``NumpyGradients.critic_share``).
CriticStep = Callable[[np.ndarray, np.ndarray, np.ndarray], float]

# A step's reply takes well under a millisecond; a child silent this long is taken for lost.
REPLY_TIMEOUT_SECONDS = 60.0

# How long a reader polls the pipe before it blocks: longer than the gap between two
# minibatch steps (tens to hundreds of µs). 0.5 ms took case 6's updates from 4.6 to
# 10.9 ms, interleaved in one process (docs/performance.md, round 9).
POLL_SECONDS = 0.002

# The parent's pipe ends of every live worker: a newly forked child closes the ones of
# its siblings, so that closing a pipe in the parent is seen (as end of file) by the
# child it was meant for.
_PARENT_FDS: set[int] = set()


def available() -> bool:
    """Whether a worker can run beside this process: Linux (fork with numpy is safe there)
    and at least two CPUs this process may use."""
    return sys.platform.startswith("linux") and len(os.sched_getaffinity(0)) >= 2


def _shared(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """An array in anonymous shared memory: a forked child sees the parent's writes."""
    count = int(np.prod(shape))
    memory = mmap.mmap(-1, max(1, count) * dtype.itemsize)  # MAP_SHARED | MAP_ANONYMOUS
    return np.frombuffer(memory, dtype=dtype, count=count).reshape(shape)


class CriticWorker:
    """A forked process that runs ``critic_step`` on minibatches of up to ``rows`` rows."""

    def __init__(self, critic_step: CriticStep, rows: int, obs_dim: int, dtype: np.dtype) -> None:
        self.rows = rows
        self.obs = _shared((rows, obs_dim), dtype)
        self.returns = _shared((rows,), dtype)
        self.values = _shared((rows,), dtype)
        self.loss = _shared((1,), np.dtype(np.float64))
        self.pending = False
        start_r, start_w = os.pipe()
        done_r, done_w = os.pipe()
        with warnings.catch_warnings():
            # Python 3.12+ warns when a process with threads (a progress bar's, a
            # checkpoint writer's) forks. The child runs numpy and os.read/os.write only
            # and takes none of those threads' locks.
            warnings.filterwarnings("ignore", ".*fork", DeprecationWarning)
            pid = os.fork()
        if pid == 0:  # the child: serve until the parent's end of the pipe closes
            code = 1
            try:
                signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's
                # One thread for torch's and BLAS's kernels here, whatever the trainer
                # uses: a thread pool inherited through fork is not safe to use.
                torch.set_num_threads(1)
                threadpool_limits(1, user_api="blas")
                for fd in (start_w, done_r, *_PARENT_FDS):
                    os.close(fd)
                os.set_blocking(start_r, False)
                self._serve(critic_step, start_r, done_w)
                code = 0
            finally:
                os._exit(code)  # never back into the parent's code, its atexit or buffers
        os.close(start_r)
        os.close(done_w)
        os.set_blocking(done_r, False)
        self.pid, self._start, self._done = pid, start_w, done_r
        _PARENT_FDS.update((start_w, done_r))
        self._finalizer = weakref.finalize(self, _stop, pid, start_w, done_r)

    def _serve(self, critic_step: CriticStep, start: int, done: int) -> None:
        poll = True
        while True:
            message = _read(start, 4, None, poll)
            if message is None or len(message) < 4:
                return  # the parent closed its end
            n = int.from_bytes(message, "little")
            poll = n > 0  # 0 (``rest``): the update is over, block until the next one
            if n:
                self.loss[0] = critic_step(self.obs[:n], self.returns[:n], self.values[:n])
                os.write(done, b"\x00")

    def submit(self, obs: np.ndarray, returns: np.ndarray, values: np.ndarray) -> bool:
        """Start the critic's share of a minibatch; False if the child is gone."""
        n = len(obs)
        self.obs[:n] = obs
        self.returns[:n] = returns
        self.values[:n] = values
        try:
            os.write(self._start, n.to_bytes(4, "little"))
        except OSError:  # BrokenPipeError: the child exited
            return False
        self.pending = True
        return True

    def rest(self) -> None:
        """The update is over: the child stops polling for the next minibatch (it would
        take the core from the collection) and blocks until one comes."""
        with contextlib.suppress(OSError):  # the child exited: the next submit finds out
            os.write(self._start, (0).to_bytes(4, "little"))

    def result(self) -> float | None:
        """Wait for the submitted minibatch: its value loss (the gradient is written), or
        None if the child died or did not answer within ``REPLY_TIMEOUT_SECONDS``."""
        self.pending = False
        if _read(self._done, 1, REPLY_TIMEOUT_SECONDS, True) != b"\x00":
            return None
        return float(self.loss[0])

    def close(self) -> None:
        """Stop the child (it finishes a submitted minibatch first) and reap it."""
        self._finalizer()


def _read(fd: int, size: int, timeout: float | None, poll: bool) -> bytes | None:
    """Up to ``size`` bytes from the non-blocking pipe end ``fd`` (b"" at end of file):
    with ``poll``, polled for ``POLL_SECONDS`` first; then waited for in select for up to
    ``timeout`` seconds (None: no limit). None if nothing came."""
    deadline = time.perf_counter() + POLL_SECONDS if poll else 0.0
    while True:
        try:
            return os.read(fd, size)
        except BlockingIOError:
            if time.perf_counter() > deadline:
                break
    ready, _, _ = select.select([fd], [], [], timeout)
    return os.read(fd, size) if ready else None


def _stop(pid: int, start: int, done: int) -> None:
    for fd in (start, done):
        _PARENT_FDS.discard(fd)
        os.close(fd)  # the child reads end of file and exits
    deadline = time.monotonic() + 5.0
    try:
        while os.waitpid(pid, os.WNOHANG) == (0, 0):
            if time.monotonic() > deadline:  # stuck: it holds nothing worth waiting for
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                return
            time.sleep(0.001)
    except ChildProcessError:  # already reaped
        pass
