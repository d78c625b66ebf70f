"""SIGKILL real training processes at random moments: the newest complete checkpoint
always loads.

Each kill ends one ``trustrl train`` process (``trustrl.cli.main``) with SIGKILL. Iterations
are tiny (one env, four steps, one epoch) and a checkpoint is written after every one, so
checkpoint writing is most of the wall time and random kills land inside it; the test
counts those from what the killed process left behind (its ``.tmp-*-PID`` or
``.old-*-PID`` folder). A run folder that already has a checkpoint is usually continued
with ``--resume``, so kills also hit resumed runs; now and then a new run folder is
started, so kills also hit first checkpoints. After each kill:

* the newest checkpoint folder (highest ``iter_*`` that was renamed into place) loads
  with ``load_checkpoint`` and ``trustrl.load_policy``;
* the run folder itself resolves (through ``latest``) to that checkpoint or, when the kill
  fell between the rename and the pointer update, the one before, and loads too.

Kills before any checkpoint exists are counted separately.

Start-up (importing torch, gymnasium, tyro, tensorboard) costs seconds of CPU per
process, which would leave room for only a handful of kills in a minute. So the first
process is a plain ``python -m trustrl.cli train`` and the others are forked from a
helper process that imported trustrl once and then, per request, forks a child that runs
``trustrl.cli.main([...])`` with its output in a log file: a separate process running the
same code, killed the same way.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
import traceback
from collections import Counter
from pathlib import Path

import pytest

import trustrl
from trustrl.run.checkpoint import load_checkpoint

KILLS = 30
WORKERS = 3
DEADLINE_S = 45.0
REPO = Path(__file__).resolve().parents[1]

TRAIN_FLAGS = [
    "--quiet",
    "--seed", "1",
    "--checkpoint-every", "1",
    "--total-steps", "1000000000",
    "--eval-episodes", "0",
    "--target-return", "None",
    "--env.num-envs", "1",
    "--env.backend", "sync",
    "--rollout.num-steps", "4",
    "--ppo.update-epochs", "1",
    "--ppo.num-minibatches", "1",
    "--policy.hidden-sizes", "8",
]  # fmt: skip

FORK_SERVER = textwrap.dedent(
    """
    import json, os, signal, sys, traceback
    # Everything a training run imports, once (tyro and tensorboard are imported lazily).
    import torch.utils.tensorboard, tyro
    import trustrl.cli, trustrl.run.trainer

    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children are reaped automatically
    print("ready", flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            fd = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            code = 1
            try:
                code = trustrl.cli.main(request["argv"])
            except BaseException:
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        print(pid, flush=True)
    """
)


class ForkServer:
    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", FORK_SERVER],
            cwd=REPO,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.lock = threading.Lock()
        self.ready = threading.Event()

    def wait_ready(self) -> None:
        with self.lock:
            if not self.ready.is_set():
                assert self.proc.stdout is not None
                assert self.proc.stdout.readline().strip() == "ready"
                self.ready.set()

    def spawn(self, argv: list[str], log: Path) -> int:
        self.wait_ready()
        with self.lock:
            assert self.proc.stdin is not None and self.proc.stdout is not None
            self.proc.stdin.write(json.dumps({"argv": argv, "log": str(log)}) + "\n")
            self.proc.stdin.flush()
            return int(self.proc.stdout.readline())

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


SPAWNED: list[Training] = []  # every process started, killed at the end whatever happens


class Training:
    """One training process: spawned with ``python -m trustrl.cli`` or forked."""

    def __init__(self, argv: list[str], log: Path, server: ForkServer | None) -> None:
        self.popen: subprocess.Popen[bytes] | None = None
        if server is None:
            with log.open("a") as handle:
                self.popen = subprocess.Popen(
                    [sys.executable, "-m", "trustrl.cli", *argv],
                    cwd=REPO,
                    stdout=handle,
                    stderr=subprocess.STDOUT,
                )
            self.pid = self.popen.pid
        else:
            self.pid = server.spawn(argv, log)
        SPAWNED.append(self)

    def alive(self) -> bool:
        if self.popen is not None:
            return self.popen.poll() is None
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        return True

    def kill(self) -> None:
        os.kill(self.pid, signal.SIGKILL)
        if self.popen is not None:
            self.popen.wait()
            return
        while self.alive():  # the fork server reaps it
            time.sleep(0.002)


def train_argv(run_dir: Path) -> list[str]:
    # A complete checkpoint resumes, with or without the pointer (a kill between the first
    # checkpoint's rename and the pointer's write: resume loads the newest iter_*).
    if (run_dir / "checkpoints" / "latest").is_file() or complete_checkpoints(run_dir):
        return ["train", "--resume", str(run_dir), "--quiet"]
    # Killed before any checkpoint was complete: a new run over what that one left, as a
    # user would start it (a folder holding a run is refused without --overwrite).
    return ["train", "CartPole-v1", "--run-dir", str(run_dir), "--overwrite", *TRAIN_FLAGS]


def pointer(run_dir: Path) -> str | None:
    try:
        return (run_dir / "checkpoints" / "latest").read_text()
    except OSError:
        return None


def complete_checkpoints(run_dir: Path) -> list[Path]:
    """Checkpoint folders renamed into place (hidden temporary folders excluded)."""
    folder = run_dir / "checkpoints"
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.glob("iter_*") if (p / "meta.json").is_file())


def killed_mid_write(run_dir: Path, pid: int) -> bool:
    folder = run_dir / "checkpoints"
    return any(folder.glob(f".tmp-*-{pid}")) or any(folder.glob(f".old-*-{pid}"))


class Tally:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.counts: Counter[str] = Counter()
        self.failures: list[str] = []
        self.started = 0

    def claim(self) -> bool:
        with self.lock:
            if self.started >= KILLS:
                return False
            self.started += 1
            return True

    def add(self, *keys: str) -> None:
        with self.lock:
            self.counts.update(keys)

    def fail(self, message: str) -> None:
        with self.lock:
            self.failures.append(message)


def check_after_kill(run_dir: Path, pid: int, tally: Tally) -> None:
    complete = complete_checkpoints(run_dir)
    if not complete:
        tally.add("no checkpoint yet")
        return
    newest = complete[-1]
    try:
        load_checkpoint(newest)
        trustrl.load_policy(newest)
    except Exception as exc:
        tally.fail(f"{newest} (newest complete) does not load: {exc!r}")
        return
    tally.add("newest checkpoint loads")
    if killed_mid_write(run_dir, pid):
        tally.add("killed while writing a checkpoint")
    if pointer(run_dir) is None:
        # Killed between the first checkpoint's rename and the first pointer write: the run
        # folder has no `latest` yet (the checkpoint folder itself loads, checked above).
        tally.add("first pointer not yet written")
        return
    try:
        folder, _, _, _ = load_checkpoint(run_dir)
        trustrl.load_policy(run_dir)
    except Exception as exc:
        tally.fail(f"{run_dir} does not load after a kill: {exc!r}")
        return
    if folder not in complete[-2:]:
        tally.fail(f"{run_dir} resolved to {folder.name}; newest complete is {newest.name}")
        return
    tally.add("run folder loads")


def worker(
    root: Path, index: int, rng: random.Random, tally: Tally, server: ForkServer, stop_at: float
) -> None:
    try:
        kill_repeatedly(root, index, rng, tally, server, stop_at)
    except Exception:  # a worker's error must fail the test, not just end the thread
        tally.fail(f"worker {index}: {traceback.format_exc()}")


def kill_repeatedly(
    root: Path, index: int, rng: random.Random, tally: Tally, server: ForkServer, stop_at: float
) -> None:
    runs = 0
    first = True
    while time.monotonic() < stop_at and tally.claim():
        if runs == 0 or rng.random() < 0.3:
            # A new run folder now and then, so kills also hit a run's first checkpoint.
            runs += 1
            run_dir = root / f"worker{index}-run{runs}"
            log = root / f"worker{index}-run{runs}.log"
        before = pointer(run_dir)
        # Worker 0's first run goes through the real entry point, start-up and all.
        proc = Training(train_argv(run_dir), log, None if first and index == 0 else server)
        first = False
        if rng.random() < 0.2:
            # Any moment from the start: often before this process wrote anything.
            time.sleep(rng.uniform(0.0, 0.6))
        else:
            # Once this process is checkpointing, at a random moment.
            wait_until = time.monotonic() + 30.0
            while pointer(run_dir) == before and time.monotonic() < wait_until:
                if not proc.alive():
                    break
                time.sleep(0.005)
            time.sleep(rng.uniform(0.0, 0.5))
        if not proc.alive():
            tally.fail(f"training exited by itself; see {log}:\n{log.read_text()[-3000:]}")
            return
        proc.kill()
        tally.add("kills")
        check_after_kill(run_dir, proc.pid, tally)


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork and SIGKILL (POSIX)")
def test_sigkill_at_random_moments_leaves_a_loadable_checkpoint(tmp_path: Path) -> None:
    seed = int(os.environ.get("TRUSTRL_KILL_SEED", time.time_ns() % 1_000_000))
    print(f"\nkill test seed {seed} (TRUSTRL_KILL_SEED={seed} repeats the kill schedule)")
    tally = Tally()
    start = time.monotonic()
    server = ForkServer()
    try:
        threads = [
            threading.Thread(
                target=worker,
                args=(
                    tmp_path,
                    i,
                    random.Random(seed * 100 + i),
                    tally,
                    server,
                    start + DEADLINE_S,
                ),
            )
            for i in range(WORKERS)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        for proc in SPAWNED:
            if proc.alive():
                proc.kill()
        SPAWNED.clear()
        server.close()
    counts = tally.counts
    print(
        f"kills: {counts['kills']} in {time.monotonic() - start:.1f} s; no checkpoint yet: "
        f"{counts['no checkpoint yet']}; newest checkpoint loadable: "
        f"{counts['newest checkpoint loads']} (killed while writing a checkpoint: "
        f"{counts['killed while writing a checkpoint']}); run folder loadable: "
        f"{counts['run folder loads']}; first pointer not yet written: "
        f"{counts['first pointer not yet written']}; failures: {len(tally.failures)}"
    )
    assert not tally.failures, "\n".join(tally.failures)
    with_checkpoint = counts["kills"] - counts["no checkpoint yet"]
    assert counts["newest checkpoint loads"] == with_checkpoint
    assert counts["run folder loads"] + counts["first pointer not yet written"] == with_checkpoint
    assert counts["kills"] >= KILLS // 2, "too few kills in the time allowed"
    assert with_checkpoint >= KILLS // 4, "too few kills after a checkpoint was written"
    # The schedule does hit checkpoint writes (they are most of each iteration's time).
    assert counts["killed while writing a checkpoint"] >= 1
