"""Per-agent tokens (remote/credentials.py, ``trustrl agents``): stored hashed in a file
only its owner reads, shown once, bound to one learner, revoked without a restart."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest

from trustrl import cli
from trustrl.remote import credentials
from trustrl.remote.credentials import Credentials, CredentialsError


def test_add_prints_the_token_once_and_stores_only_its_hash(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["agents", "add", str(tmp_path), "robot-1"]) == 0
    token = capsys.readouterr().out.strip()
    run_id = credentials.run_id_of(token)
    assert token.startswith("trustrl.") and run_id is not None
    assert len(token.rsplit(".", 1)[1]) >= 43  # 32 random bytes, url-safe base64
    path = tmp_path / "agents.json"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    text = path.read_text()
    assert token not in text and token.rsplit(".", 1)[1] not in text
    data = json.loads(text)
    assert data["run_id"] == run_id
    assert data["agents"][0]["sha256"] == credentials.digest(token)
    assert cli.main(["agents", "list", str(tmp_path)]) == 0
    listed = capsys.readouterr().out
    assert "robot-1" in listed and "active" in listed and token not in listed


def test_the_file_is_never_readable_by_others_even_with_a_loose_umask(tmp_path: Path) -> None:
    import os

    previous = os.umask(0)
    try:
        credentials.add(tmp_path, "a")
        credentials.add(tmp_path, "b")
        credentials.revoke(tmp_path, "a")
    finally:
        os.umask(previous)
    for path in tmp_path.iterdir():
        assert stat.S_IMODE(path.stat().st_mode) & 0o077 == 0, path


def test_a_token_is_let_in_refused_and_revoked_without_a_restart(tmp_path: Path) -> None:
    gate = Credentials(tmp_path)
    assert gate.check("anything").reason == "bad_token"  # no file yet: nobody is let in
    first = credentials.add(tmp_path, "first")
    second = credentials.add(tmp_path, "second")
    assert gate.check(first).name == "first" and gate.check(second).name == "second"
    assert gate.check(None).reason == "no_token"
    assert gate.check("").reason == "no_token"
    assert gate.check(first[:-1] + ("A" if first[-1] != "A" else "B")).reason == "bad_token"
    assert gate.check("Bearer nonsense").reason == "bad_token"
    assert cli.main(["agents", "revoke", str(tmp_path), "first"]) == 0
    verdict = gate.check(first)  # the same Credentials object: it read the file again
    assert verdict.name is None and verdict.reason == "revoked" and "first" in verdict.message
    assert gate.check(second).name == "second"
    again = credentials.add(tmp_path, "first")  # a revoked name may be issued anew
    assert gate.check(again).name == "first" and gate.check(first).reason == "revoked"


def test_a_token_for_one_learner_is_refused_by_another(tmp_path: Path) -> None:
    one, other = tmp_path / "one", tmp_path / "other"
    token = credentials.add(one, "robot")
    credentials.add(other, "robot")
    verdict = Credentials(other).check(token)
    assert verdict.name is None and verdict.reason == "other_learner"
    assert credentials.run_id_of(token) in verdict.message


@pytest.mark.parametrize("name", ["", "../x", "a/b", "-x", "x" * 65, "sp ace", "é"])
def test_agent_names_are_plain(tmp_path: Path, name: str) -> None:
    with pytest.raises(CredentialsError, match="agent name"):
        credentials.add(tmp_path, name)


def test_mistakes_are_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    credentials.add(tmp_path, "robot")
    assert cli.main(["agents", "add", str(tmp_path), "robot"]) == 2
    assert "already has a token" in capsys.readouterr().err
    assert cli.main(["agents", "revoke", str(tmp_path), "nobody"]) == 2
    assert "no agent 'nobody'" in capsys.readouterr().err
    credentials.revoke(tmp_path, "robot")
    assert cli.main(["agents", "revoke", str(tmp_path), "robot"]) == 2
    assert "revoked already" in capsys.readouterr().err
    (tmp_path / "agents.json").write_text("{}")
    assert cli.main(["agents", "list", str(tmp_path)]) == 2
    assert "not a trustrl agents file" in capsys.readouterr().err


def test_a_run_folder_may_hold_its_agents_before_the_run_starts(tmp_path: Path) -> None:
    from trustrl.run.trainer import check_new_run_folder

    credentials.add(tmp_path, "robot")
    check_new_run_folder(tmp_path, overwrite=False)  # no "not empty" refusal
