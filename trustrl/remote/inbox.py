"""The inbox: where external agents deliver chunks and find the newest policy, and where
the learner takes the chunks and publishes new policies. No Ray here: the inbox is a
plain thread-safe object that lives in the learner's process (``Agent.local``) or in a
named Ray actor (``trustrl serve``, serve.py).

::

    agent (any process)            Inbox                                  learner
      act(obs, reward) ...  ─chunk─>  checked, spooled, queued  ──take──>  ExternalRunner
      new snapshot      <──latest───  newest snapshot         <─publish──  .collect(snapshot)

Each chunk is parsed and checked once, on arrival (wire.py); the learner is handed the
parsed chunks. An agent asks for a newer policy with ``latest(have, timeout)``, a long
poll: the call returns as soon as a version newer than ``have`` is published, or when the
run finishes, or after ``timeout`` seconds, so an idle agent makes a call every few
seconds rather than a stream of them.

Nothing is lost while the learner is away. With a spool folder (the run folder's
``inbox/``) each accepted chunk is written there before it is acknowledged, and deleted
only once a checkpoint covers the update that used it (``release``); a new inbox over the
same folder (a resumed learner) queues what is left. A spool file that cannot be read
back as a chunk of this learner (a truncated write, spaces changed between runs) is not
deleted: it is moved into ``inbox/damaged/``, counted (``status()["damaged"]``) and named
in a warning.
"""

from __future__ import annotations

import os
import threading
import warnings
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from trustrl.envs.rows import AgentGroup
from trustrl.remote.wire import Chunk, ChunkError, decode_chunk

DAMAGED = "damaged"
"""The spool's subfolder for files that could not be read back (module docstring)."""


class Inbox:
    """Accepted chunks, in arrival order, and the newest snapshot; thread-safe.

    ``groups`` are the learner's agent groups (chunks are checked against their spaces),
    ``info`` what ``info()`` tells an agent (external.learner_info), ``spool`` the folder
    chunks are written to before they are acknowledged (None: kept in memory only),
    ``max_length`` the longest chunk accepted, ``capacity`` the most steps queued before
    a delivery is answered ``full`` (None: no bound): past a few batches' worth, what an
    agent sends would be drained for version lag before the learner reached it, so it
    is better kept by the agent, which slows its shipping.
    """

    def __init__(
        self,
        groups: Sequence[AgentGroup],
        info: dict[str, Any],
        spool: str | Path | None = None,
        max_length: int = 1_000_000,
        capacity: int | None = None,
    ) -> None:
        self.groups = list(groups)
        self.capacity = capacity
        self.queued_steps = 0  # the steps of the chunks in the queue
        self._info = info
        self.max_length = max_length
        self.spool = Path(spool) if spool is not None else None
        self.condition = threading.Condition()
        # (inbox seq, group, chunk), in arrival order: parsed and checked once, here
        self.queue: deque[tuple[int, int, Chunk]] = deque()
        self.seen: set[tuple[str, int]] = set()  # (source, seq) of chunks accepted
        self.next_seq = 0
        self.snapshot: tuple[int, bytes] | None = None
        self.finished = False
        self.received = self.rejected = self.duplicates = self.damaged = 0
        self.taken_upto = 0  # chunks received when the learner last waited for more
        self.last_error = ""
        self.waiting: dict[str, bool] = {}  # watchers in a long poll -> woken by wake()
        if self.spool is not None and self.spool.is_dir():
            self._read_spool(self.spool)

    def _read_spool(self, spool: Path) -> None:
        """Queue the chunks a previous learner left in ``spool``; set aside, count and
        name the files that are not such chunks."""
        damaged: list[str] = []
        for path in sorted(spool.glob("*.chunk")):
            seq = _seq_of(path)
            try:
                if seq is None:
                    raise ChunkError("the name is not a spool number")
                where, chunk = decode_chunk(
                    path.read_bytes(), self.groups, self.max_length, self._info.get("memory")
                )
            except ChunkError as exc:
                kept = _set_aside(path, spool / DAMAGED)
                damaged.append(f"{path.name} ({exc}) -> {kept.relative_to(spool)}")
                continue
            self.queue.append((seq, where, chunk))
            self.queued_steps += len(chunk)
            self.seen.add((chunk.source, chunk.seq))
            self.next_seq = max(self.next_seq, seq + 1)
        self.damaged = len(damaged)
        if damaged:
            shown = "; ".join(damaged[:10])
            more = f"; and {len(damaged) - 10} more" if len(damaged) > 10 else ""
            warnings.warn(
                f"inbox {spool}: {len(damaged)} spool file(s) could not be read back as "
                f"chunks and were moved to {spool / DAMAGED}, not trained on: {shown}{more}",
                RuntimeWarning,
                stacklevel=3,
            )

    # The agents' side.

    def info(self) -> dict[str, Any]:
        return self._info

    def submit(self, data: bytes) -> dict[str, Any]:
        """Deliver one chunk. The reply: ``ok`` (accepted, or already had), ``retry`` (not
        taken now: the learner has not published a policy yet, or with ``full`` its
        queue holds ``capacity`` steps; send it again later), or ``error`` (refused for
        good, with why, and ``reason``, the check: wire.REASONS)."""
        with self.condition:
            if self.snapshot is None:
                return {"ok": False, "retry": True}
            # A finished learner takes no more batches, so its queue never drains: accept
            # (and spool) what agents finished before they heard, for a resumed run.
            if (
                self.capacity is not None
                and self.queued_steps >= self.capacity
                and not self.finished
            ):
                return {"ok": False, "retry": True, "full": True}
        try:
            where, chunk = decode_chunk(
                data, self.groups, self.max_length, self._info.get("memory")
            )
        except ChunkError as exc:
            with self.condition:
                self.rejected += 1
                self.last_error = str(exc)
            return {"ok": False, "error": str(exc), "reason": exc.reason}
        with self.condition:
            key = (chunk.source, chunk.seq)
            if key in self.seen:  # sent again after a lost acknowledgement
                self.duplicates += 1
                return {"ok": True, "finished": self.finished} if self.finished else {"ok": True}
            seq = self.next_seq
            self.next_seq += 1
            if self.spool is not None:
                _write_spool(self.spool, seq, data)
            self.seen.add(key)
            self.queue.append((seq, where, chunk))
            self.queued_steps += len(chunk)
            self.received += 1
            self.condition.notify_all()
            # The shipping agent hears at once that the run is over (its watcher may be
            # backing off, and a finished learner lingers only briefly).
            return {"ok": True, "finished": self.finished} if self.finished else {"ok": True}

    def submit_many(self, chunks: list[bytes]) -> list[dict[str, Any]]:
        """``submit`` for each, in order."""
        return [self.submit(data) for data in chunks]

    def latest(self, have: int, timeout: float = 0.0, watcher: str = "") -> dict[str, Any]:
        """The newest version, its snapshot's bytes if it is not version ``have`` (newer,
        or older: a learner resumed from a checkpoint before it, whose agents must act with
        its versions again or their chunks are drained for lag), and whether the run has
        finished.

        With a ``timeout`` this is a long poll: it waits up to ``timeout`` seconds for a
        version other than ``have`` to be published or for the run to finish, and returns
        at once when one is. ``watcher`` names the caller, so that ``wake(watcher)`` can
        end its wait early (an agent that closes)."""
        with self.condition:
            if timeout > 0:
                finished = self.finished
                if watcher:
                    self.waiting[watcher] = False
                try:
                    self.condition.wait_for(
                        lambda: (
                            self._version() != have
                            or self.finished != finished
                            or self.waiting.get(watcher, False)
                        ),
                        timeout,
                    )
                finally:
                    if watcher:
                        self.waiting.pop(watcher, None)
            version, data = self.snapshot if self.snapshot is not None else (-1, None)
            return {
                "version": version,
                "data": data if version != have else None,
                "finished": self.finished,
            }

    def wake(self, watcher: str) -> None:
        """End the long poll of ``watcher`` now, if it is in one."""
        with self.condition:
            if watcher in self.waiting:
                self.waiting[watcher] = True
                self.condition.notify_all()

    def status(self) -> dict[str, Any]:
        with self.condition:
            return {
                "version": self._version(),
                "finished": self.finished,
                "queued": len(self.queue),
                "queued_steps": self.queued_steps,
                "received": self.received,
                "rejected": self.rejected,
                "duplicates": self.duplicates,
                "damaged": self.damaged,
                "last_error": self.last_error,
            }

    def _version(self) -> int:
        return self.snapshot[0] if self.snapshot is not None else -1

    # The learner's side.

    def publish(self, version: int, data: bytes) -> None:
        with self.condition:
            self.snapshot = (version, data)
            self.condition.notify_all()

    def take(
        self, timeout: float, needs: Sequence[int], version: int, max_lag: int
    ) -> dict[str, Any]:
        """The oldest chunks, in order, until every group ``g`` has ``needs[g]`` more
        steps (or the queue is empty), waiting up to ``timeout`` seconds for one to
        arrive; the rest stay queued for the next batch. Chunks of a version more than
        ``max_lag`` from the learner's ``version`` are drained on the way, not sent (a
        backlog costs no transfer). Returns ``chunks`` ((group, chunk) each), ``drained``
        (how many were) and ``last`` (the highest seq taken or drained, -1 for none)."""
        with self.condition:
            if not self.queue:
                self.taken_upto = self.received  # everything delivered is in hand
                self.condition.notify_all()
                self.condition.wait(timeout)
            needs = list(needs)
            taken, drained, last = [], 0, -1
            while self.queue and any(n > 0 for n in needs):
                seq, where, chunk = self.queue.popleft()
                self.queued_steps -= len(chunk)
                last = max(last, seq)
                if abs(version - chunk.version) > max_lag:
                    drained += 1  # too stale, or of a version lost to a resume
                    continue
                needs[where] -= len(chunk)
                taken.append((where, chunk))
            return {"chunks": taken, "drained": drained, "last": last}

    def release(self, upto: int) -> None:
        """Forget the spooled chunks numbered ``upto`` or lower: a checkpoint covers them.
        Those numbers are spent: a chunk that arrives later gets a higher one, also in a
        resumed learner whose spool was empty (a lower one would be released unread)."""
        with self.condition:
            self.queue = deque(item for item in self.queue if item[0] > upto)
            self.queued_steps = sum(len(chunk) for _, _, chunk in self.queue)
            self.next_seq = max(self.next_seq, upto + 1)
            self.condition.notify_all()
        if self.spool is None or not self.spool.is_dir():
            return
        for path in self.spool.glob("*.chunk"):
            seq = _seq_of(path)
            if seq is not None and seq <= upto:
                path.unlink(missing_ok=True)

    def wait_until_taken(self) -> None:
        """Until the learner has taken every chunk delivered so far and waits for more
        (or the run is over): ``Agent.local`` keeps its loop in step with the learner."""
        with self.condition:
            received = self.received
            self.condition.wait_for(lambda: self.taken_upto >= received or self.finished)

    def finish(self) -> None:
        with self.condition:
            self.finished = True
            self.condition.notify_all()


def _seq_of(path: Path) -> int | None:
    """A spool file's number, from its name (None for a name the inbox did not write)."""
    return int(path.stem) if path.stem.isdigit() else None


def _write_spool(folder: Path, seq: int, data: bytes) -> None:
    """Atomically (a whole file or none), not synced: the file outlives the learner's
    process, which is the failure the spool is for; a sync per chunk (under the inbox's
    lock) would make the spool the learner's bottleneck. Machine crashes are the
    checkpoints' business (those are synced)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{seq:012d}.chunk"
    temporary = path.with_suffix(".tmp")
    temporary.write_bytes(data)
    os.replace(temporary, path)


def _set_aside(path: Path, folder: Path) -> Path:
    """Move ``path`` into ``folder`` under a name not taken there; returns the new path."""
    folder.mkdir(parents=True, exist_ok=True)
    target, copy = folder / path.name, 0
    while target.exists():
        copy += 1
        target = folder / f"{path.stem}.{copy}{path.suffix}"
    os.replace(path, target)
    return target
