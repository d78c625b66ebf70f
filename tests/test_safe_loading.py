"""Loading for evaluation, export and ``trustrl.load_policy`` never unpickles, and every damaged or
mismatched checkpoint is refused with a ``CheckpointError`` (exit code 2 from the CLI) that
names the problem.

The hostile payloads create a marker file when unpickled. They are planted where a
checkpoint file is expected (policy.safetensors, state.safetensors, meta.json) and given
directly as ``.pt``/``.pkl`` files; every loader is run on them and the marker must never
appear.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import pickle
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gymnasium as gym
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import trustrl
from trustrl import cli
from trustrl.config import (
    Config,
    EnvConfig,
    PolicyConfig,
    PPOConfig,
    RolloutConfig,
    config_to_dict,
)
from trustrl.envs.spaces import SpaceSpec
from trustrl.learner.policy import Policy
from trustrl.run.checkpoint import (
    CheckpointError,
    load_checkpoint,
    resolve_checkpoint,
    write_checkpoint,
)
from trustrl.run.trainer import Trainer

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


class MakesMarker:
    """Unpickling this creates ``marker``: what a malicious checkpoint would do."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (str(self.marker), "w"))


def payload(kind: str, marker: Path) -> bytes:
    if kind == "pickle":
        return pickle.dumps(MakesMarker(marker))  # binary protocol, not valid UTF-8
    if kind == "pickle-protocol-0":
        return pickle.dumps(MakesMarker(marker), protocol=0)  # plain ASCII
    buffer = io.BytesIO()
    torch.save(MakesMarker(marker), buffer)  # a zip archive holding a pickle
    return buffer.getvalue()


PAYLOADS = ("pickle", "pickle-protocol-0", "torch.save")


def test_the_payloads_really_run_code(tmp_path: Path) -> None:
    for kind in PAYLOADS:
        marker = tmp_path / f"{kind}.marker"
        data = payload(kind, marker)
        if kind == "torch.save":
            torch.load(io.BytesIO(data), weights_only=False)
        else:
            pickle.loads(data)
        assert marker.exists(), kind


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("trained")
    config = Config(
        env_id="CartPole-v1",
        seed=5,
        total_steps=2 * 32,
        quiet=True,
        eval_episodes=0,
        checkpoint_every=1,
        env=EnvConfig(num_envs=2, backend="sync", normalize_obs=True),
        rollout=RolloutConfig(num_steps=16),
        policy=PolicyConfig(hidden_sizes=(16,)),
        ppo=PPOConfig(update_epochs=1, num_minibatches=1),
    )
    Trainer(config, run_dir).train()
    return run_dir


@pytest.fixture
def run_copy(trained_run: Path, tmp_path: Path) -> tuple[Path, Path]:
    """(run folder, its newest checkpoint folder): a fresh copy for the test to damage."""
    run_dir = tmp_path / "run"
    shutil.copytree(trained_run, run_dir)
    folder = resolve_checkpoint(run_dir)
    trustrl.load_policy(run_dir)  # intact before the test damages it
    return run_dir, folder


# Every way trustrl reads a checkpoint: (name, call) where call returns normally, raises,
# or returns the CLI's exit code. ``outputs`` receives what the CLI printed.


def loaders(path: Path, out_dir: Path) -> dict[str, Callable[[], Any]]:
    return {
        "load_policy": lambda: trustrl.load_policy(path),
        "load_checkpoint": lambda: load_checkpoint(path),
        "eval": lambda: cli.main(["eval", str(path), "--episodes", "1"]),
        "export onnx": lambda: cli.main(["export", str(path), "--out", str(out_dir / "a.onnx")]),
        "export torchscript": lambda: cli.main(
            ["export", str(path), "--format", "torchscript", "--out", str(out_dir / "a.pt")]
        ),
    }


def outcome(call: Callable[[], Any]) -> tuple[str, str]:
    """('ok' | 'exit N' | 'CheckpointError' | other exception name, message)."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            result = call()
    except CheckpointError as exc:
        return "CheckpointError", str(exc)
    except Exception as exc:
        return type(exc).__name__, str(exc)
    if isinstance(result, int) and not isinstance(result, bool):
        return ("ok" if result == 0 else f"exit {result}"), err.getvalue()
    return "ok", ""


def check_refused(name: str, kind: str, message: str, expected: str) -> None:
    if name in ("load_policy", "load_checkpoint"):
        assert kind == "CheckpointError", (name, kind, message)
    else:
        assert kind == "exit 2", (name, kind, message)
        assert message.startswith("trustrl: error: "), (name, message)
        assert "Traceback" not in message
    assert expected in message, (name, message)


TARGETS = ("policy.safetensors", "state.safetensors", "meta.json")


def plant(folder: Path, target: str, kind: str, marker: Path) -> None:
    (folder / target).write_bytes(payload(kind, marker))


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("kind", PAYLOADS)
def test_planted_pickle_is_never_unpickled(
    run_copy: tuple[Path, Path], tmp_path: Path, target: str, kind: str
) -> None:
    run_dir, folder = run_copy
    marker = tmp_path / "unpickled.marker"
    plant(folder, target, kind, marker)
    for path in (run_dir, folder):
        for call in loaders(path, tmp_path).values():
            outcome(call)  # refused or not, it must not unpickle
    outcome(lambda: cli.main(["train", "--resume", str(run_dir), "--quiet"]))
    assert not marker.exists(), f"a pickle planted as {target} was unpickled"


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("kind", PAYLOADS)
def test_planted_pickle_is_refused_by_name(
    run_copy: tuple[Path, Path], tmp_path: Path, target: str, kind: str
) -> None:
    run_dir, folder = run_copy
    marker = tmp_path / "unpickled.marker"
    plant(folder, target, kind, marker)
    expected = {
        "policy.safetensors": "policy.safetensors is damaged or truncated",
        "state.safetensors": "state.safetensors is damaged or truncated",
        "meta.json": "meta.json is unreadable",
    }[target]
    for path in (run_dir, folder):
        for name, call in loaders(path, tmp_path).items():
            kind_, message = outcome(call)
            if target == "state.safetensors" and name != "load_checkpoint":
                # Acting and exporting never read the training state.
                assert kind_ == "ok", (name, kind_, message)
            else:
                check_refused(name, kind_, message, expected)
    kind_, message = outcome(lambda: cli.main(["train", "--resume", str(run_dir), "--quiet"]))
    check_refused("train --resume", kind_, message, expected)
    assert not marker.exists()


@pytest.mark.parametrize("kind", PAYLOADS)
def test_pickle_files_given_directly_are_refused(tmp_path: Path, kind: str) -> None:
    marker = tmp_path / "unpickled.marker"
    for suffix in (".pt", ".pkl", ".pth"):
        evil = tmp_path / f"model{suffix}"
        evil.write_bytes(payload(kind, marker))
        assert_every_loader_refuses(evil, tmp_path, f"{evil} is a file, not a trustrl checkpoint")
        kind_, message = outcome(lambda e=evil: cli.main(["train", "--resume", str(e)]))
        check_refused("train --resume", kind_, message, "no config.toml there")
    # A folder holding only a pickle is not a checkpoint either.
    folder = tmp_path / "pickles"
    folder.mkdir()
    (folder / "policy.pt").write_bytes(payload(kind, marker))
    assert_every_loader_refuses(folder, tmp_path, "no checkpoint found")
    assert not marker.exists()


def test_a_pt_beside_a_missing_safetensors_is_not_used(
    run_copy: tuple[Path, Path], tmp_path: Path
) -> None:
    _, folder = run_copy
    marker = tmp_path / "unpickled.marker"
    (folder / "policy.safetensors").unlink()
    (folder / "policy.pt").write_bytes(payload("torch.save", marker))
    assert_every_loader_refuses(folder, tmp_path, "policy.safetensors is missing")
    assert not marker.exists()


def test_environment_pickle_is_not_read_outside_resume(
    run_copy: tuple[Path, Path], tmp_path: Path
) -> None:
    """envs.pkl (exact resume) with a matching digest: acting, evaluating and exporting
    never read it. (train --resume does unpickle it: see the module docstring of
    checkpoint.py; a run folder from elsewhere must be trusted before resuming it.)"""
    run_dir, folder = run_copy
    marker = tmp_path / "unpickled.marker"
    data = payload("pickle", marker)
    (folder / "envs.pkl").write_bytes(data)
    meta = json.loads((folder / "meta.json").read_text())
    meta["env_state"] = {"file": "envs.pkl", "sha256": hashlib.sha256(data).hexdigest()}
    (folder / "meta.json").write_text(json.dumps(meta))
    for path in (run_dir, folder):
        for name, call in loaders(path, tmp_path).items():
            kind_, message = outcome(call)
            assert kind_ == "ok", (name, kind_, message)
    assert not marker.exists()


# Damage and mismatch: each refused by every loader, with a message naming the problem.


def edit_meta(folder: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    meta = json.loads((folder / "meta.json").read_text())
    edit(meta)
    (folder / "meta.json").write_text(json.dumps(meta))


def assert_every_loader_refuses(path: Path, out_dir: Path, *expected: str) -> None:
    for name, call in loaders(path, out_dir).items():
        kind_, message = outcome(call)
        for text in expected:
            check_refused(name, kind_, message, text)
    assert not (out_dir / "a.onnx").exists() and not (out_dir / "a.pt").exists()


def _spec(meta: dict[str, Any]) -> dict[str, Any]:
    return meta["policy"]["spec"]


OTHER_SPACES = {
    # CartPole weights (obs 4, Discrete(2), normalizer on, hidden (16,)) under a meta.json
    # describing something else. Weights written by this trustrl carry their description,
    # so the message names the differing fields; for weights without one (written before
    # descriptions were stored), the tensors that do not fit and both shapes.
    "obs-shape": (
        lambda m: _spec(m).update(obs_shape=[3]),
        ["spec.obs_shape ([4] vs [3])"],
        ["size mismatch for actor.0.weight", "torch.Size([16, 4]) from checkpoint", "[16, 3]"],
    ),
    "action-count": (
        lambda m: _spec(m).update(nvec=[3]),
        ["spec.nvec ([2] vs [3])"],
        ["size mismatch for head.linear.weight", "[2, 16]", "[3, 16]"],
    ),
    "box-actions": (
        lambda m: _spec(m).update(
            action_kind="box", action_shape=[2], nvec=[], low=[-1, -1], high=[1, 1],
            env_action_shape=[2],
        ),
        ["spec.action_kind ('discrete' vs 'box')", "spec.high ([] vs [1, 1])"],
        ['Missing key(s) in state_dict: "head.log_std"'],
    ),
    "no-normalizer": (
        lambda m: m["policy"].update(normalize_obs=False),
        ["normalize_obs (True vs False)"],
        ['Unexpected key(s) in state_dict: "obs_normalizer.count"'],
    ),
    "network-width": (
        lambda m: m["policy"]["policy"].update(hidden_sizes=[32]),
        ["policy.hidden_sizes ([16] vs [32])"],
        ["size mismatch for actor.0.weight", "[16, 4]", "[32, 4]"],
    ),
}  # fmt: skip


def strip_description(weights: Path) -> None:
    """Rewrite a policy.safetensors without the description in its header."""
    tensors = load_file(str(weights))
    save_file(tensors, str(weights))
    with safe_open(str(weights), framework="pt") as handle:
        assert not (handle.metadata() or {}).get("policy")


@pytest.mark.parametrize("legacy", [False, True], ids=["described", "legacy-weights"])
@pytest.mark.parametrize("case", list(OTHER_SPACES))
def test_checkpoint_for_other_spaces(
    run_copy: tuple[Path, Path], tmp_path: Path, case: str, legacy: bool
) -> None:
    _, folder = run_copy
    edit, described, undescribed = OTHER_SPACES[case]
    if legacy:
        strip_description(folder / "policy.safetensors")
        trustrl.load_policy(folder)  # still loads while meta.json is right
        expected = ["policy.safetensors does not fit the described policy", *undescribed]
    else:
        expected = ["policy.safetensors was saved for another policy than", *described]
    edit_meta(folder, edit)
    assert_every_loader_refuses(folder, tmp_path, *expected)


def test_weights_that_fit_other_spaces_are_still_refused(tmp_path: Path) -> None:
    """Same tensor shapes, other Box bounds: only the stored description can tell."""
    env = gym.make("Pendulum-v1")
    policy = Policy(SpaceSpec.from_spaces(env.observation_space, env.action_space))
    folder = tmp_path / "ckpt"
    write_checkpoint(folder, policy, {"config": config_to_dict(Config(env_id="Pendulum-v1"))}, {})
    trustrl.load_policy(folder)
    edit_meta(folder, lambda m: _spec(m).update(low=[-1.0], high=[1.0]))
    assert_every_loader_refuses(
        folder, tmp_path, "spec.high ([2.0] vs [1.0])", "spec.low ([-2.0] vs [-1.0])"
    )


def test_future_format_version(run_copy: tuple[Path, Path], tmp_path: Path) -> None:
    run_dir, folder = run_copy
    edit_meta(folder, lambda m: m.update(format_version=2))
    for path in (run_dir, folder):
        assert_every_loader_refuses(
            path, tmp_path, "checkpoint format version 2", "this trustrl reads version 1"
        )


def test_missing_policy_file(run_copy: tuple[Path, Path], tmp_path: Path) -> None:
    run_dir, folder = run_copy
    (folder / "policy.safetensors").unlink()
    for path in (run_dir, folder):
        assert_every_loader_refuses(
            path, tmp_path, f"checkpoint file {folder / 'policy.safetensors'} is missing"
        )


@pytest.mark.parametrize("keep", ["0", "4", "8", "40", "half", "all-but-1"])
def test_truncated_policy_file(run_copy: tuple[Path, Path], tmp_path: Path, keep: str) -> None:
    _, folder = run_copy
    path = folder / "policy.safetensors"
    data = path.read_bytes()
    size = {"half": len(data) // 2, "all-but-1": len(data) - 1}.get(keep) or int(keep)
    path.write_bytes(data[:size])
    assert_every_loader_refuses(folder, tmp_path, f"checkpoint file {path} is damaged or truncated")


def test_truncated_state_file_refuses_resume_only(
    run_copy: tuple[Path, Path], tmp_path: Path
) -> None:
    _, folder = run_copy
    path = folder / "state.safetensors"
    path.write_bytes(path.read_bytes()[:100])
    kind_, message = outcome(lambda: load_checkpoint(folder))
    check_refused("load_checkpoint", kind_, message, "state.safetensors is damaged or truncated")
    assert outcome(lambda: trustrl.load_policy(folder))[0] == "ok"


def _drop_tensor_reference(meta: dict[str, Any]) -> None:
    meta["training_state"] = {"missing": {"__tensor__": "state.not_in_the_file"}}


MALFORMED = {
    # meta.json that is valid JSON of the right version but not a checkpoint description.
    "meta-not-an-object": ("[1]", None, "meta.json"),
    "meta-without-policy": (None, lambda m: m.pop("policy"), "meta.json"),
    "unknown-spec-field": (None, lambda m: _spec(m).update(colour="red"), "meta.json"),
    "state-missing-a-tensor": (None, _drop_tensor_reference, "state.safetensors"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_checkpoint_is_a_checkpoint_error(
    run_copy: tuple[Path, Path], tmp_path: Path, case: str
) -> None:
    _, folder = run_copy
    text, edit, named = MALFORMED[case]
    if text is not None:
        (folder / "meta.json").write_text(text)
    else:
        assert edit is not None
        edit_meta(folder, edit)
    with pytest.raises(CheckpointError, match=named.replace(".", r"\.")):
        load_checkpoint(folder)
    if named == "meta.json":
        assert_every_loader_refuses(folder, tmp_path, named)


# Links and pointers: loading never leaves the run folder.


@pytest.mark.parametrize("target", ["policy.safetensors", "state.safetensors", "meta.json"])
def test_a_link_where_a_checkpoint_file_goes_is_refused_by_name(
    run_copy: tuple[Path, Path], tmp_path: Path, target: str
) -> None:
    run_dir, folder = run_copy
    # A link to a valid copy of the very file: refused for being a link, not for its content.
    outside = tmp_path / f"outside-{target}"
    shutil.copy(folder / target, outside)
    (folder / target).unlink()
    (folder / target).symlink_to(outside)
    expected = f"{folder / target} is a symbolic link"
    for path in (run_dir, folder):
        for name, call in loaders(path, tmp_path).items():
            kind_, message = outcome(call)
            if target == "state.safetensors" and name != "load_checkpoint":
                assert kind_ == "ok", (name, kind_, message)  # never read for acting
            else:
                check_refused(name, kind_, message, expected)
    kind_, message = outcome(lambda: cli.main(["train", "--resume", str(run_dir), "--quiet"]))
    check_refused("train --resume", kind_, message, expected)


@pytest.mark.parametrize("entry", ["final", "iter_00000002", "latest"])
def test_a_linked_checkpoint_folder_or_pointer_is_refused(
    run_copy: tuple[Path, Path], tmp_path: Path, entry: str
) -> None:
    run_dir, _ = run_copy
    checkpoints = run_dir / "checkpoints"
    elsewhere = tmp_path / f"elsewhere-{entry}"
    shutil.move(checkpoints / entry, elsewhere)
    (checkpoints / entry).symlink_to(elsewhere)
    if entry == "iter_00000002":  # reached only when latest and final are gone
        (checkpoints / "latest").unlink()
        shutil.rmtree(checkpoints / "final")
    assert_every_loader_refuses(run_dir, tmp_path, f"{checkpoints / entry} is a symbolic link")


@pytest.mark.parametrize("name", ["../../elsewhere", "/tmp/elsewhere", "iter_2", "", "final/x"])
def test_a_pointer_outside_the_run_folder_is_refused(
    run_copy: tuple[Path, Path], tmp_path: Path, name: str
) -> None:
    run_dir, _ = run_copy
    (run_dir / "checkpoints" / "latest").write_text(name + "\n")
    assert_every_loader_refuses(run_dir, tmp_path, f"names {name!r}, which is not a checkpoint")


def test_a_skipped_pointer_says_which_checkpoint_was_loaded(
    run_copy: tuple[Path, Path],
) -> None:
    run_dir, _ = run_copy
    checkpoints = run_dir / "checkpoints"
    (checkpoints / "latest").write_text("iter_00000099\n")  # a kill before its rename
    with pytest.warns(UserWarning, match=r"names iter_00000099, which is missing.*loaded .*final"):
        assert resolve_checkpoint(run_dir) == checkpoints / "final"
