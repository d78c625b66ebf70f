"""The critic's share of PPO's minibatch steps, in a second process beside the actor's.

With the numpy gradients (grads.py) a minibatch step is the actor's forward pass, losses
and backward pass, then the critic's, then one gradient clip and one Adam step over
both. The two networks share nothing before the clip, so where a second core is free
the critic's share (``CriticShare``: a plain callable on numpy arrays) runs there: a
worker process reads the critic's weights and writes its gradient in shared memory,
while this process does the actor's. A step then takes about as long as the actor's
share alone (``docs/performance.md`` has the measurements). The results are the same bit
for bit: the same numpy calls on the same numbers, in another process.

* Why a process: a second thread was slower than one, as the GIL passes between the two
  threads at every numpy call; two processes share no lock.
* How it starts: a fresh interpreter (``python -m trustrl.learner.updates.critic_worker``, fork
  and exec by ``subprocess``), never a fork without exec, which is unsafe beside threads
  (notebooks, a progress bar's, Ray's). It imports numpy and ``kernels`` only, no torch,
  so it starts in a fraction of a second with little memory of its own. It is handed the
  shared memory as file descriptors (``pass_fds``) and a JSON description of where each
  array lies in it.
* The shared memory: ``shared_array`` allocates in a ``memfd`` (Linux), which a process
  given its descriptor maps; ``Adam(shared=True)`` and ``NumpyGradients(shared=True)``
  allocate the flat weights and gradients there from the start (moving a tensor there
  later would leave numpy views of it dangling).
* What crosses: per minibatch, the rows (observations, returns, old values) are copied
  into shared buffers and their count goes down a pipe; one byte comes back when the
  loss is in its shared slot and the gradient in the optimizer's flat buffer.
* Waiting: each side polls its end of the pipe for ``POLL_SECONDS`` before it blocks on
  it. A process blocked in ``read`` is woken through the scheduler, which on a VM's idle
  vCPU costs a sizeable share of a minibatch step; one that polls
  sees the message at once, and its writer makes no wake-up call. The
  messages still travel through the pipe, so the kernel orders the shared memory's
  writes before the reads on any CPU. At the end of an update the trainer sends
  ``rest`` and the child blocks at once: polling on into the collection would take the
  second core's share of the machine (two vCPUs here slow each other down) for nothing.
* Failure: if the child dies or stops answering, ``result`` returns None and the caller
  computes that minibatch, and the rest of the run, in its own process. The child exits
  when its pipe closes (the trainer's ``close``, or the trainer's death) and ignores
  SIGINT (Ctrl-C is the trainer's).
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import select
import signal
import subprocess
import sys
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from trustrl.acting import kernels

# A step's reply takes well under a millisecond; a child silent this long is taken for
# lost (its start included: a fresh interpreter importing numpy).
REPLY_TIMEOUT_SECONDS = 60.0

# How long a reader polls the pipe before it blocks: longer than the gap between two
# minibatch steps, or every message pays a wake-up (docs/performance.md).
POLL_SECONDS = 0.002

READY, DONE = b"\x01", b"\x00"


def available() -> bool:
    """Whether a worker can run beside this process: Linux (memfd shared memory) and at
    least two CPUs this process may use."""
    return sys.platform.startswith("linux") and len(os.sched_getaffinity(0)) >= 2


# Shared memory a worker maps: start address -> (descriptor, size), while it lives.
_SEGMENTS: dict[int, tuple[int, int]] = {}


def shared_array(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """Zeros in a memfd segment, which a worker handed its descriptor maps (OSError where
    the system refuses one). The segment lives while any view of it does."""
    size = max(1, int(np.prod(shape))) * dtype.itemsize
    fd = os.memfd_create("trustrl-critic", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, size)
        memory = mmap.mmap(fd, size)  # MAP_SHARED
    except OSError:
        os.close(fd)
        raise
    start = _address(np.frombuffer(memory, np.uint8))
    _SEGMENTS[start] = (fd, size)
    weakref.finalize(memory, _release, start, fd)
    return np.frombuffer(memory, dtype, int(np.prod(shape))).reshape(shape)


def _release(start: int, fd: int) -> None:
    _SEGMENTS.pop(start, None)
    os.close(fd)


def _address(array: np.ndarray) -> int:
    return int(array.__array_interface__["data"][0])


def locate(array: np.ndarray) -> dict[str, Any]:
    """Where a C-contiguous view of shared memory lies: its segment's descriptor, byte
    offset, shape and dtype (what the worker maps it back from)."""
    assert array.flags.c_contiguous, "shared views are C-contiguous"
    address = _address(array)
    for start, (fd, size) in _SEGMENTS.items():
        if start <= address < start + size:
            return {
                "fd": fd,
                "offset": address - start,
                "shape": list(array.shape),
                "dtype": array.dtype.str,
            }
    raise ValueError("the array is not in shared memory (critic_worker.shared_array)")


@dataclass
class CriticShare:
    """The critic's whole share of a minibatch: (observations, returns, old values) -> its
    value loss, returned, with its gradient written into ``grads`` (the flat buffer's
    views). The trainer's process and the worker run this same code."""

    layers: list[kernels.Dense]
    grads: list[tuple[np.ndarray, np.ndarray]]  # (weight, bias) gradients, per layer
    activation: str
    clip_coef: float | None  # value clipping
    value_scale: float  # vf_coef where one optimizer holds both networks, else 1

    def __call__(self, obs: np.ndarray, returns: np.ndarray, old_values: np.ndarray) -> float:
        hidden = kernels.forward(self.layers, self.activation, obs)
        named, d_values = kernels.value_terms_numpy(
            hidden[-1][:, 0], old_values, returns, self.clip_coef
        )
        d_out = (np.float32(self.value_scale) * d_values)[:, None]
        kernels.backward(self.layers, self.activation, hidden, d_out, self.grads)
        return named["loss_v"]


class CriticWorker:
    """A worker process that runs ``share`` on minibatches of up to ``rows`` rows. The
    share's weights and gradients must lie in ``shared_array`` memory."""

    def __init__(
        self,
        share: CriticShare,
        weights: Sequence[tuple[np.ndarray, np.ndarray]],
        rows: int,
        obs_dim: int,
        dtype: np.dtype,
    ) -> None:
        """``weights``: the (weight, bias) arrays in torch's layout, per layer, that
        ``share.layers`` were made from."""
        self.rows = rows
        self.obs = shared_array((rows, obs_dim), dtype)
        self.returns = shared_array((rows,), dtype)
        self.values = shared_array((rows,), dtype)
        self.loss = shared_array((1,), np.dtype(np.float64))
        self.pending = False
        self.steps = 0  # minibatches the child computed
        placed = [[locate(w), locate(b)] for w, b in [*weights, *share.grads]]
        rows_placed = [locate(a) for a in (self.obs, self.returns, self.values, self.loss)]
        fds = sorted({a["fd"] for pair in placed for a in pair} | {a["fd"] for a in rows_placed})
        description: dict[str, Any] = {
            "weights": placed[: len(weights)],
            "grads": placed[len(weights) :],
            "rows": rows_placed,
            "activation": share.activation,
            "clip_coef": share.clip_coef,
            "value_scale": share.value_scale,
            "poll_seconds": POLL_SECONDS,
        }
        start_r, start_w = os.pipe()
        done_r, done_w = os.pipe()
        description["pipes"] = [start_r, done_w]
        # One BLAS thread in the worker, whatever the trainer uses.
        env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
        env["MKL_NUM_THREADS"] = "1"
        # This trustrl, wherever it was imported from.
        package_root = os.path.dirname(os.path.dirname(os.path.dirname(kernels.__file__)))
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
        try:
            self.process = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "trustrl.learner.updates.critic_worker",
                    json.dumps(description),
                ],
                pass_fds=(*fds, start_r, done_w),
                stdin=subprocess.DEVNULL,
                env=env,
            )
        finally:
            os.close(start_r)
            os.close(done_w)
        os.set_blocking(done_r, False)
        self.pid, self._start, self._done = self.process.pid, start_w, done_r
        self._finalizer = weakref.finalize(self, _stop, self.process, start_w, done_r)
        self.started = _read(done_r, 1, REPLY_TIMEOUT_SECONDS, False) == READY

    def submit(self, obs: np.ndarray, returns: np.ndarray, values: np.ndarray) -> bool:
        """Start the critic's share of a minibatch; False if the child is gone."""
        if not self.started:
            return False
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
        if _read(self._done, 1, REPLY_TIMEOUT_SECONDS, True) != DONE:
            return None
        self.steps += 1
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


def _stop(process: subprocess.Popen[bytes], start: int, done: int) -> None:
    for fd in (start, done):
        os.close(fd)  # the child reads end of file and exits
    try:
        process.wait(5.0)
    except subprocess.TimeoutExpired:  # stuck: it holds nothing worth waiting for
        process.kill()
        process.wait()


# The worker process.


def _map(description: dict[str, Any], segments: dict[int, mmap.mmap]) -> np.ndarray:
    fd = description["fd"]
    if fd not in segments:
        segments[fd] = mmap.mmap(fd, os.fstat(fd).st_size)
    shape = tuple(description["shape"])
    dtype = np.dtype(description["dtype"])
    return np.ndarray(shape, dtype, buffer=segments[fd], offset=description["offset"])


def _serve(description: dict[str, Any]) -> None:
    global POLL_SECONDS
    POLL_SECONDS = description["poll_seconds"]  # the trainer's, should it have changed it
    segments: dict[int, mmap.mmap] = {}

    def pair(entry: list[dict[str, Any]]) -> tuple[np.ndarray, np.ndarray]:
        return _map(entry[0], segments), _map(entry[1], segments)

    layers = [kernels.Dense(*pair(e), copy=False) for e in description["weights"]]
    share = CriticShare(
        layers,
        [pair(e) for e in description["grads"]],
        description["activation"],
        description["clip_coef"],
        description["value_scale"],
    )
    obs, returns, values, loss = (_map(a, segments) for a in description["rows"])
    start, done = description["pipes"]
    os.set_blocking(start, False)
    os.write(done, READY)
    poll = True
    while True:
        message = _read(start, 4, None, poll)
        if message is None or len(message) < 4:
            return  # the parent closed its end
        n = int.from_bytes(message, "little")
        poll = n > 0  # 0 (``rest``): the update is over, block until the next one
        if n:
            loss[0] = share(obs[:n], returns[:n], values[:n])
            os.write(done, DONE)


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's
    _serve(json.loads(sys.argv[1]))
