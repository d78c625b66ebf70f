"""Per-agent credentials for the gateway (``trustrl agents add / list / revoke``).

A learner's run folder holds ``agents.json``, readable and writable by its owner alone
(mode 0600): the run id, and for each agent its name, the SHA-256 of its token, when it
was added and whether it was revoked. The token itself is printed once, by ``trustrl
agents add``, and stored nowhere: ``trustrl.<run id>.<secret>``, the secret 32 random
bytes (``secrets.token_urlsafe``). The run id in the token binds it to this learner: a
token of another run folder is refused with a reason of its own.

The gateway (gateway.py) holds a ``Credentials`` over the file and looks at the file's
identity (inode, size, modification time) at every call: ``trustrl agents revoke`` takes
effect at the next call, with no restart, and an ``agents add`` while the learner runs
lets the new agent in. No Ray, no grpcio, no torch: the standard library only.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import secrets
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FILE = "agents.json"
FORMAT = "trustrl-agents/1"
PREFIX = "trustrl"
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
"""Agent names: what a log line, a metric name and a shell can carry as they are."""

REFUSALS = ("no_token", "bad_token", "other_learner", "revoked")
"""Why a call's token was refused (``Credentials.check``), as the gateway counts them."""


class CredentialsError(ValueError):
    """An ``agents`` command that cannot be done as asked; the message says why."""


@dataclass(frozen=True)
class Entry:
    name: str
    sha256: str
    added: str
    revoked: str | None = None


@dataclass(frozen=True)
class Verdict:
    """The answer to a token: ``name`` when it is let in, else ``reason`` (REFUSALS)
    and a message for the caller."""

    name: str | None
    reason: str = ""
    message: str = ""


def path_of(run_dir: str | Path) -> Path:
    return Path(run_dir) / FILE


def digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def run_id_of(token: str) -> str | None:
    """The run id a token names (None: not a trustrl token)."""
    parts = token.split(".")
    if len(parts) != 3 or parts[0] != PREFIX or not parts[1] or not parts[2]:
        return None
    return parts[1]


def read(run_dir: str | Path) -> tuple[str | None, list[Entry]]:
    """(run id, entries) of the run folder's file; (None, []) where there is none."""
    path = path_of(run_dir)
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None, []
    return _parse(text, path)


def _parse(text: str, path: Path) -> tuple[str, list[Entry]]:
    try:
        data = json.loads(text)
        if data.get("format") != FORMAT:
            raise ValueError(f"format {data.get('format')!r}, expected {FORMAT!r}")
        return str(data["run_id"]), [Entry(**entry) for entry in data["agents"]]
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CredentialsError(f"{path} is not a trustrl agents file ({exc})") from None


@contextlib.contextmanager
def _locked(run_dir: Path) -> Iterator[None]:
    """One ``agents`` command at a time on a run folder (two adds must not lose one)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(run_dir / f".{FILE}.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _write(run_dir: Path, run_id: str, entries: list[Entry]) -> None:
    """Atomically, created with mode 0600 (never readable by others, not even for an
    instant), synced: a revocation must survive a crash."""
    path = path_of(run_dir)
    data = {
        "format": FORMAT,
        "run_id": run_id,
        "agents": [entry.__dict__ for entry in entries],
    }
    temporary = path.with_name(f".{FILE}.tmp-{os.getpid()}")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)  # an older temporary file keeps its mode through O_CREAT
        os.write(fd, (json.dumps(data, indent=1) + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(temporary, path)


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def add(run_dir: str | Path, name: str) -> str:
    """A new agent ``name`` of the learner in ``run_dir``: its token (shown once). A
    revoked name may be added again, with a new token (the old one stays revoked)."""
    if not NAME.fullmatch(name):
        raise CredentialsError(
            f"agent name {name!r}: 1 to 64 letters, digits, '_', '.' or '-', starting with "
            "a letter or digit"
        )
    folder = Path(run_dir)
    with _locked(folder):
        run_id, entries = read(folder)
        if any(e.name == name and e.revoked is None for e in entries):
            raise CredentialsError(
                f"agent {name!r} already has a token in {folder}; revoke it first "
                f"(trustrl agents revoke {folder} {name}) to issue a new one"
            )
        run_id = run_id or secrets.token_hex(8)
        token = f"{PREFIX}.{run_id}.{secrets.token_urlsafe(32)}"
        entries.append(Entry(name, digest(token), _now()))
        _write(folder, run_id, entries)
    return token


def revoke(run_dir: str | Path, name: str) -> None:
    folder = Path(run_dir)
    with _locked(folder):
        run_id, entries = read(folder)
        mine = [e for e in entries if e.name == name]
        if run_id is None or not mine:
            raise CredentialsError(f"no agent {name!r} in {path_of(folder)}")
        if all(e.revoked is not None for e in mine):
            raise CredentialsError(f"agent {name!r} was revoked already, at {mine[-1].revoked}")
        entries = [
            Entry(e.name, e.sha256, e.added, _now()) if e.name == name and not e.revoked else e
            for e in entries
        ]
        _write(folder, run_id, entries)


class Credentials:
    """The gateway's view of a run folder's ``agents.json``, read again whenever the file
    changes; thread-safe. A missing file lets nobody in."""

    def __init__(self, run_dir: str | Path) -> None:
        self.path = path_of(run_dir)
        self.lock = threading.Lock()
        self.identity: tuple[int, int, int] | None = None
        self.run_id: str | None = None
        self.by_digest: dict[str, Entry] = {}

    def _refresh(self) -> None:
        """Read the file again if it is not the one read last (under the lock)."""
        try:
            stat = os.stat(self.path)
            identity = (stat.st_ino, stat.st_size, stat.st_mtime_ns)
        except FileNotFoundError:
            identity = None
        if identity == self.identity:
            return
        run_id: str | None = None
        entries: list[Entry] = []
        if identity is not None:
            try:
                run_id, entries = _parse(self.path.read_text(), self.path)
            except (OSError, CredentialsError):
                return  # mid-write by another tool: keep what was read, look again next call
        self.identity, self.run_id = identity, run_id
        self.by_digest = {e.sha256: e for e in entries}

    def check(self, token: str | None) -> Verdict:
        if not token:
            return Verdict(None, "no_token", "no token: send 'authorization: Bearer <token>'")
        with self.lock:
            self._refresh()
            entry = self.by_digest.get(digest(token))
            run_id = self.run_id
        if entry is not None and run_id_of(token) == run_id:
            if entry.revoked is not None:
                return Verdict(None, "revoked", f"the token of {entry.name!r} was revoked")
            return Verdict(entry.name)
        named = run_id_of(token)
        if named is not None and run_id is not None and named != run_id:
            return Verdict(
                None,
                "other_learner",
                f"this token is for another learner (run {named}); this one is run {run_id}",
            )
        return Verdict(None, "bad_token", "unknown token")

    def entries(self) -> list[dict[str, Any]]:
        with self.lock:
            self._refresh()
            return [e.__dict__ for e in self.by_digest.values()]
