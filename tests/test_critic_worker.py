"""The critic's share of PPO's minibatch steps in a second process
(trustrl/learner/updates/critic_worker.py).

The worker runs the same numpy calls on the same numbers as the update's own process, so
whole updates with and without it must end at the same weights bit for bit; a worker
that dies must leave the run going, in one process, on the same trajectory.
"""

from __future__ import annotations

import copy
import os
import signal
import time

import numpy as np
import pytest
import torch

import trustrl.learner.updates.critic_worker as critic_worker
from tests.test_grads import make_policy, make_rollout
from trustrl.config import PPOConfig
from trustrl.learner.updates.ppo import PPOUpdate

pytestmark = pytest.mark.skipif(not critic_worker.available(), reason="needs Linux and two CPUs")

OPTIONS = [
    ("discrete", {"ent_coef": 0.01}),
    ("discrete", {"vf_clip_coef": 0.2, "target_kl": 0.02}),
    ("box", {"pi_lr": 3e-3, "vf_lr": 1e-2, "vf_epochs": 6, "target_kl": 0.02}),
    ("multidiscrete", {"vf_clip_coef": 0.2, "learning_rate": 3e-3}),
]


def run_pair(space: str, options: dict, between=None) -> tuple[PPOUpdate, PPOUpdate]:
    """Three updates with the worker and without it, from the same start; ``between``
    is called with the worker's update after the first."""
    policy = make_policy(space)
    twin = copy.deepcopy(policy)
    with_worker = PPOUpdate(
        policy, PPOConfig(update_epochs=4, num_minibatches=4, critic_process=True, **options), 5
    )
    alone = PPOUpdate(
        twin, PPOConfig(update_epochs=4, num_minibatches=4, critic_process=False, **options), 5
    )
    assert with_worker.critic_process and not alone.critic_process
    for i in range(3):
        rollout = make_rollout(policy, space)
        got = with_worker(policy, rollout, i / 3)
        want = alone(twin, copy.deepcopy(rollout), i / 3)
        assert got.keys() == want.keys()
        for name in got:
            assert got[name] == want[name] or (np.isnan(got[name]) and np.isnan(want[name])), name
        for (name, p), q in zip(policy.named_parameters(), twin.parameters(), strict=True):
            assert torch.equal(p, q), name
        if i == 0 and between is not None:
            between(with_worker)
    return with_worker, alone


@pytest.mark.parametrize(("space", "options"), OPTIONS)
def test_updates_with_the_worker_are_the_same_bit_for_bit(space: str, options: dict) -> None:
    with_worker, _ = run_pair(space, options)
    worker = with_worker.gradients.worker  # type: ignore[attr-defined]
    assert worker is not None and worker.pid != os.getpid()
    assert worker.steps >= 4  # the child computed the critic's shares
    with_worker.close()
    assert with_worker.gradients.worker is None  # type: ignore[attr-defined]
    with pytest.raises(ChildProcessError):
        os.waitpid(worker.pid, os.WNOHANG)  # reaped


@pytest.mark.parametrize("poll_seconds", [0.0, 60.0], ids=["select-only", "poll-only"])
def test_messages_arrive_whether_the_reader_polls_or_blocks(
    poll_seconds: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each side polls its pipe for POLL_SECONDS, then blocks in select: either way alone
    (the child is handed the patched value, so both sides see it) gives the same updates."""
    monkeypatch.setattr(critic_worker, "POLL_SECONDS", poll_seconds)
    with_worker, _ = run_pair("discrete", {"vf_clip_coef": 0.2})
    assert with_worker.gradients.worker is not None  # type: ignore[attr-defined]
    with_worker.close()


def test_the_worker_is_a_fresh_interpreter_without_torch() -> None:
    """Started by fork and exec (never a bare fork), it runs the worker module and maps
    no torch: its memory is its own, not a copy of the trainer's."""
    policy = make_policy("box")
    update = PPOUpdate(
        policy, PPOConfig(update_epochs=1, num_minibatches=2, critic_process=True), 0
    )
    update(policy, make_rollout(policy, "box"), 0.0)
    pid = update.gradients.worker.pid  # type: ignore[attr-defined]
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        assert b"trustrl.learner.updates.critic_worker" in f.read()
    with open(f"/proc/{pid}/maps") as f:
        assert "libtorch" not in f.read()
    update.close()


def test_the_worker_blocks_between_updates(monkeypatch: pytest.MonkeyPatch) -> None:
    """After an update's last minibatch the child waits in the kernel, not in its polling
    loop, even with a polling time far longer than the test."""
    monkeypatch.setattr(critic_worker, "POLL_SECONDS", 60.0)
    policy = make_policy("discrete")
    update = PPOUpdate(
        policy, PPOConfig(update_epochs=2, num_minibatches=2, critic_process=True), 0
    )
    update(policy, make_rollout(policy, "discrete"), 0.0)
    pid = update.gradients.worker.pid  # type: ignore[attr-defined]
    deadline = time.monotonic() + 5.0
    while _state(pid) != "S" and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _state(pid) == "S"  # sleeping: blocked in select
    update.close()


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(") ", 1)[1][0]


def test_a_lost_worker_leaves_the_update_in_this_process() -> None:
    def kill(update: PPOUpdate) -> None:
        worker = update.gradients.worker  # type: ignore[attr-defined]
        os.kill(worker.pid, signal.SIGKILL)
        os.waitpid(worker.pid, 0)

    with pytest.warns(RuntimeWarning, match="critic's worker process exited"):
        with_worker, _ = run_pair("discrete", {"ent_coef": 0.01}, between=kill)
    assert with_worker.gradients.worker is None  # type: ignore[attr-defined]
    assert with_worker.gradients.worker_lost  # type: ignore[attr-defined]


def test_the_worker_reads_the_weights_the_optimizer_steps() -> None:
    """The policy's parameters, the optimizer's flat buffer and the worker's views are
    one memory, shared with the child."""
    policy = make_policy("discrete")
    update = PPOUpdate(policy, PPOConfig(critic_process=True), 0)
    flat = update.optimizers["all"].flat
    critic_worker.locate(flat.numpy())  # raises where it is not in shared memory
    start, end = flat.data_ptr(), flat.data_ptr() + flat.numel() * flat.element_size()
    for p in policy.parameters():
        assert start <= p.data_ptr() < end


def test_without_shared_memory_the_update_runs_in_one_process(monkeypatch) -> None:
    def refuse(name: str, flags: int = 0) -> int:
        raise OSError(24, "Too many open files")

    monkeypatch.setattr(os, "memfd_create", refuse)
    policy = make_policy("discrete")
    with pytest.warns(RuntimeWarning, match="shared memory unavailable"):
        update = PPOUpdate(
            policy, PPOConfig(update_epochs=2, num_minibatches=2, critic_process=True), 0
        )
    assert not update.critic_process
    update(policy, make_rollout(policy, "discrete"), 0.0)
    assert update.gradients.worker is None  # type: ignore[attr-defined]
