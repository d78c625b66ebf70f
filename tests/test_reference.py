"""Nothing lost: with a fixed seed, four explicit configs (``tests/reference/configs``:
PPO CartPole, PPO Hopper-v5 for 20k steps, TRPO Pendulum, MAPPO simple_spread) write the
same progress file (every column but ``sps`` and ``wall_time``) and the same final weights,
bit for bit, as at the commit named in ``tests/reference/REFERENCE.json``; and run folders
written at that commit (``tests/reference/fixtures``) still load, evaluate, export and
resume.

Floating-point results may differ between CPUs. Where the stored references do not hold
on a machine whose CPU differs from the one that made them, the test says so and compares
against the reference commit's own code run here instead (``git archive`` of it).
"""

from __future__ import annotations

import csv
import io
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

ROOT = Path(__file__).resolve().parent.parent
REFERENCE = ROOT / "tests" / "reference"
INFO = json.loads((REFERENCE / "REFERENCE.json").read_text())
NAMES = sorted(p.stem for p in (REFERENCE / "configs").glob("*.toml"))
# Progress columns added since the reference commit, by design; every other column holds.
ADDED_COLUMNS = {
    "trpo_pendulum": ("nonfinite_skips",),  # TRPO counts the steps it skipped, as PPO does
}


def _cpu() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def _make(out: Path, code: Path) -> None:
    """Run make.py in a fresh interpreter, importing trustrl from ``code``."""
    env = {"PYTHONPATH": str(code), "PATH": "/usr/bin:/bin"}
    subprocess.run(
        [sys.executable, str(REFERENCE / "make.py"), str(out), *NAMES],
        check=True,
        env=env,
        cwd=out,
        capture_output=True,
        timeout=600,
    )


def _progress(path: Path, added: tuple[str, ...]) -> tuple[str, bool]:
    """A progress file's text without the ``added`` columns, and whether it had them all
    (the stored references, made at the reference commit, have none)."""
    rows = list(csv.reader(io.StringIO(path.read_text())))
    keep = [i for i, column in enumerate(rows[0]) if column not in added]
    out = io.StringIO()
    csv.writer(out, lineterminator="\n").writerows([row[i] for i in keep] for row in rows)
    return out.getvalue(), len(keep) == len(rows[0]) - len(added)


def _differences(made: Path, expected: Path) -> list[str]:
    found = []
    for name in NAMES:
        added = ADDED_COLUMNS.get(name, ())
        progress, complete = _progress(made / name / "progress.csv", added)
        if not complete:
            found.append(f"{name}: progress.csv lacks a column of {added}")
        if progress != _progress(expected / name / "progress.csv", added)[0]:
            found.append(f"{name}: progress.csv")
        new = load_file(str(made / name / "weights.safetensors"))
        old = load_file(str(expected / name / "weights.safetensors"))
        if new.keys() != old.keys() or any(not np.array_equal(new[k], old[k]) for k in old):
            found.append(f"{name}: final weights")
    return found


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("reference-now")
    _make(out, ROOT)
    return out


def test_reference_commit_is_an_ancestor() -> None:
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    result = subprocess.run(
        ["git", "merge-base", "--is-ancestor", INFO["commit"], "HEAD"], cwd=ROOT, check=False
    )
    assert result.returncode == 0, f"reference commit {INFO['commit']} is not an ancestor of HEAD"


def test_numbers_unchanged(made: Path, tmp_path: Path) -> None:
    differs = _differences(made, REFERENCE / "expected")
    if not differs:
        return
    if _cpu() == INFO["cpu"]:
        pytest.fail(f"changed against {INFO['commit'][:8]} on its own CPU: {', '.join(differs)}")
    # Another CPU: the stored files may not hold here. Compare with the reference commit's
    # own code, run on this machine.
    print(f"stored references differ on this CPU ({_cpu()}, made on {INFO['cpu']}): {differs}")
    code = tmp_path / "code"
    code.mkdir()
    archive = subprocess.run(
        ["git", "archive", INFO["commit"], "trustrl"], cwd=ROOT, check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(code)], input=archive, check=True)
    expected = tmp_path / "expected"
    expected.mkdir()
    _make(expected, code)
    assert _differences(made, expected) == []


@pytest.mark.parametrize("name", NAMES)
def test_old_run_folders_load_evaluate_export_and_resume(name: str, tmp_path: Path) -> None:
    import trustrl
    from trustrl.config import config_from_dict, read_toml

    run = tmp_path / name
    shutil.copytree(REFERENCE / "fixtures" / name, run)
    policy = trustrl.load_policy(run)
    config = config_from_dict(read_toml(run / "config.toml"))
    result = trustrl.evaluate(policy, config.env_id, episodes=1, env_kwargs=config.env.kwargs)
    assert np.isfinite(result.mean_return)
    if not name.startswith("mappo"):  # multi-agent policies are not exported (README)
        from trustrl.run.export import export_policy

        out = export_policy(run, "onnx", tmp_path / f"{name}.onnx")
        assert out.path.stat().st_size > 0
    before = config.total_steps
    resumed = config_from_dict({**read_toml(run / "config.toml"), "total_steps": before + 1})
    trainer = trustrl.Trainer(resumed, run, resume=True)
    trainer.train()
    assert trainer.env_steps > before
