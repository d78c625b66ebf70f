"""`trustrl export`: the exported actor acts exactly as ``Policy.act(deterministic=True)``.

Policies are built directly (weights made decisive, normalizer statistics made
non-trivial), written with ``write_checkpoint`` and exported through the CLI. Each
exported file is run with onnxruntime and with ``torch.jit.load`` on 1,000 random
observations (wide enough that the normalizer's clip and the Box bounds both bite), and
once in a fresh interpreter in which trustrl cannot be imported.
"""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from tests import envs as test_envs
from trustrl import cli
from trustrl.config import Config, PolicyConfig, config_to_dict
from trustrl.envs.spaces import SpaceSpec
from trustrl.learner.policy import Policy
from trustrl.run.checkpoint import set_latest, write_checkpoint

# torch.jit.load warns that TorchScript is deprecated; loading it is what deployers do.
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.load` is deprecated:DeprecationWarning")

N_OBS = 1000
OBS_CLIP = 5.0


@dataclass
class Case:
    env_id: str
    spec: SpaceSpec
    normalize_obs: bool
    hidden: tuple[int, ...] = (32, 32)


def _spec(env: gym.Env, info_mask: bool = False) -> SpaceSpec:
    return SpaceSpec.from_spaces(env.observation_space, env.action_space, info_mask=info_mask)


CASES: dict[str, Callable[[], Case]] = {
    "cartpole": lambda: Case("CartPole-v1", _spec(gym.make("CartPole-v1")), False),
    "masked-info": lambda: Case(
        "tests.envs:MaskedInfoEnv", _spec(test_envs.MaskedInfoEnv(n=5), info_mask=True), True
    ),
    "masked-dict": lambda: Case("tests.envs:MaskedDictEnv", _spec(test_envs.MaskedDictEnv()), True),
    "multidiscrete": lambda: Case(
        "tests.envs:MultiDiscreteEnv", _spec(test_envs.MultiDiscreteEnv()), True
    ),
    "pendulum": lambda: Case("Pendulum-v1", _spec(gym.make("Pendulum-v1")), True),
    # Image observations and a 2-D Box action with a different bound per element.
    "image-box-2x3": lambda: Case(
        "custom:ImageBox2x3",
        SpaceSpec.from_spaces(
            gym.spaces.Box(-100.0, 100.0, (3, 4, 4), np.float32),
            gym.spaces.Box(
                np.array([[-1, -2, -0.5], [0, -3, -1]], dtype=np.float32),
                np.array([[1, 2, 0.5], [4, 0, 1]], dtype=np.float32),
            ),
        ),
        True,
        (16,),
    ),
}


def build_policy(case: Case, seed: int) -> Policy:
    torch.manual_seed(seed)
    policy = Policy(
        case.spec,
        PolicyConfig(hidden_sizes=case.hidden),
        normalize_obs=case.normalize_obs,
        obs_clip=OBS_CLIP,
    )
    # The initial head is near-uniform (gain 0.01); make it decisive so that actions vary
    # and Box means reach past the bounds.
    with torch.no_grad():
        torch.nn.init.normal_(policy.head.linear.weight, std=1.5)  # type: ignore[attr-defined]
        torch.nn.init.normal_(policy.head.linear.bias, std=0.5)  # type: ignore[attr-defined]
        if policy.obs_normalizer is not None:
            gen = torch.Generator().manual_seed(seed)
            dim = case.spec.obs_dim
            policy.obs_normalizer.mean.copy_(torch.randn(dim, generator=gen, dtype=torch.float64))
            policy.obs_normalizer.var.copy_(
                torch.rand(dim, generator=gen, dtype=torch.float64) * 4 + 0.05
            )
            policy.obs_normalizer.count.fill_(12345.0)
    return policy.eval()


def observations(policy: Policy, rng: np.random.Generator, n: int = N_OBS) -> np.ndarray:
    """Raw (n, *obs_shape) float32 observations; normalized, about 10% land beyond the clip."""
    spec = policy.spec
    z = rng.normal(0.0, 3.0, (n, spec.obs_dim))
    norm = policy.obs_normalizer
    if norm is not None:
        z = norm.mean.numpy() + z * np.sqrt(norm.var.numpy())
    return z.astype(np.float32).reshape(n, *spec.obs_shape)


def masks(spec: SpaceSpec, rng: np.random.Generator, n: int = N_OBS) -> np.ndarray:
    """Random masks with at least one allowed action, plus a few rows with none allowed."""
    mask = rng.random((n, spec.mask_dim or 0)) < 0.5
    mask[np.arange(n), rng.integers(0, spec.mask_dim or 1, n)] = True
    mask[:5] = False
    return mask


def reference_actions(policy: Policy, obs: np.ndarray, mask: np.ndarray | None) -> np.ndarray:
    if policy.spec.dict_obs:
        assert mask is not None
        return policy.act({"observation": obs, "action_mask": mask.astype(np.int8)})
    return policy.act(obs, mask=mask)


@dataclass
class Exported:
    policy: Policy
    run_dir: Path
    onnx: Path
    torchscript: Path
    stdout: str


def write_run(root: Path, name: str, seed: int = 0) -> tuple[Policy, Path]:
    """A run folder with one checkpoint (and the ``latest`` pointer) for case ``name``."""
    case = CASES[name]()
    policy = build_policy(case, seed)
    run_dir = root / name
    meta = {"config": config_to_dict(Config(env_id=case.env_id)), "iteration": 1}
    write_checkpoint(run_dir / "checkpoints" / "iter_00000001", policy, meta, {})
    set_latest(run_dir / "checkpoints", "iter_00000001")
    return policy, run_dir


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Exported]:
    root = tmp_path_factory.mktemp("export")
    result = {}
    for seed, name in enumerate(CASES):
        policy, run_dir = write_run(root, name, seed)
        # ONNX to the default place (the run folder), TorchScript to an explicit --out.
        ts_out = root / "elsewhere" / f"{name}.pt"
        stdout = io.StringIO()
        for args in (["--format", "onnx"], ["--format", "torchscript", "--out", str(ts_out)]):
            with contextlib.redirect_stdout(stdout):
                assert cli.main(["export", str(run_dir), *args]) == 0, name
        result[name] = Exported(policy, run_dir, run_dir / "policy.onnx", ts_out, stdout.getvalue())
    return result


def run_onnx(path: Path, obs: np.ndarray, mask: np.ndarray | None) -> np.ndarray:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    feed = {"obs": obs}
    if mask is not None:
        feed["action_mask"] = mask.astype(bool)
    return session.run(["action"], feed)[0]


def run_torchscript(path: Path, obs: np.ndarray, mask: np.ndarray | None) -> np.ndarray:
    module = torch.jit.load(str(path))
    inputs = [torch.from_numpy(obs)]
    if mask is not None:
        inputs.append(torch.from_numpy(mask.astype(bool)))
    with torch.no_grad():
        return module(*inputs).numpy()


def assert_same_actions(policy: Policy, got: np.ndarray, expected: np.ndarray) -> None:
    assert got.shape == expected.shape
    if policy.spec.action_kind == "box":
        assert got.dtype == np.float32
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    else:
        assert got.dtype == np.int64
        mismatched = np.flatnonzero((got != expected).reshape(len(got), -1).any(axis=1)).tolist()
        assert mismatched == [], f"{len(mismatched)} of {len(got)} actions differ"


@pytest.mark.parametrize("name", list(CASES))
def test_exported_actor_acts_like_policy_act(exported: dict[str, Exported], name: str) -> None:
    item = exported[name]
    policy, spec = item.policy, item.policy.spec
    rng = np.random.default_rng(100)
    obs = observations(policy, rng)
    mask = masks(spec, rng) if spec.masked else None
    expected = reference_actions(policy, obs, mask)

    # The comparison has teeth: actions vary, masks and bounds bite, statistics matter.
    if spec.action_kind == "box":
        assert expected.shape == (N_OBS, *spec.env_action_shape)
        low = np.asarray(spec.low, np.float32).reshape(spec.env_action_shape)
        high = np.asarray(spec.high, np.float32).reshape(spec.env_action_shape)
        at_bound = (expected == low) | (expected == high)
        assert 0.05 < at_bound.mean() < 0.95
    else:
        assert expected.shape == (N_OBS, *spec.action_shape)
        for column in expected.reshape(N_OBS, -1).T:
            assert len(np.unique(column)) > 1
    if mask is not None:
        allowed = mask[np.arange(N_OBS), expected]
        assert allowed[5:].all() and not allowed[:5].any()
    if policy.obs_normalizer is not None:
        z = (obs.reshape(N_OBS, -1) - policy.obs_normalizer.mean.numpy()) / np.sqrt(
            policy.obs_normalizer.var.numpy()
        )
        assert (np.abs(z) > OBS_CLIP).any(), "no observation reaches the normalizer's clip"
        bare = Policy.from_description(policy.describe())
        bare.load_state_dict(policy.state_dict())
        assert bare.obs_normalizer is not None
        bare.obs_normalizer.mean.zero_()
        bare.obs_normalizer.var.fill_(1.0)
        assert not np.allclose(reference_actions(bare, obs, mask), expected)

    for run in (run_onnx, run_torchscript):
        path = item.onnx if run is run_onnx else item.torchscript
        assert_same_actions(policy, run(path, obs, mask), expected)
        # Dynamic batch axis: one row, and an odd batch size.
        for rows in (slice(0, 1), slice(10, 17)):
            part_mask = mask[rows] if mask is not None else None
            assert_same_actions(policy, run(path, obs[rows], part_mask), expected[rows])


def test_exported_onnx_interface(exported: dict[str, Exported]) -> None:
    expected_inputs = {
        "cartpole": {"obs": ["batch", 4]},
        "masked-info": {"obs": ["batch", 6], "action_mask": ["batch", 5]},
        "masked-dict": {"obs": ["batch", 2], "action_mask": ["batch", 4]},
        "multidiscrete": {"obs": ["batch", 7]},
        "pendulum": {"obs": ["batch", 3]},
        "image-box-2x3": {"obs": ["batch", 3, 4, 4]},
    }
    expected_outputs = {
        "cartpole": ("tensor(int64)", ["batch"]),
        "masked-info": ("tensor(int64)", ["batch"]),
        "masked-dict": ("tensor(int64)", ["batch"]),
        "multidiscrete": ("tensor(int64)", ["batch", 2]),
        "pendulum": ("tensor(float)", ["batch", 1]),
        "image-box-2x3": ("tensor(float)", ["batch", 2, 3]),
    }
    for name, item in exported.items():
        session = ort.InferenceSession(str(item.onnx), providers=["CPUExecutionProvider"])
        inputs = {i.name: i.shape for i in session.get_inputs()}
        assert inputs == expected_inputs[name], name
        types = {i.name: i.type for i in session.get_inputs()}
        assert types["obs"] == "tensor(float)"
        if "action_mask" in types:
            assert types["action_mask"] == "tensor(bool)"
        (output,) = session.get_outputs()
        assert (output.name, output.type, output.shape) == ("action", *expected_outputs[name])
        onnx.checker.check_model(onnx.load(str(item.onnx)))
        # The spaces travel with the file.
        info = json.loads(session.get_modelmeta().custom_metadata_map["trustrl"])
        assert SpaceSpec.from_json(info["spec"]) == item.policy.spec
        assert info["obs_normalizer_baked_in"] == (item.policy.obs_normalizer is not None)
        extra = {"trustrl.json": ""}
        torch.jit.load(str(item.torchscript), _extra_files=extra)
        assert json.loads(extra["trustrl.json"])["spec"] == info["spec"]


def test_export_says_where_the_file_went(exported: dict[str, Exported]) -> None:
    item = exported["pendulum"]
    assert f"-> {item.onnx} (onnx)" in item.stdout
    assert f"-> {item.torchscript} (torchscript)" in item.stdout
    assert "inputs: obs float32 (batch, 3)" in item.stdout
    assert "output: action float32 (batch, 1)" in item.stdout
    masked = exported["masked-info"].stdout
    assert "inputs: obs float32 (batch, 6), action_mask bool (batch, 5)" in masked
    assert "output: action int64 (batch)" in masked


def test_export_from_a_checkpoint_folder_and_to_a_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    policy, run_dir = write_run(tmp_path, "multidiscrete")
    checkpoint = run_dir / "checkpoints" / "iter_00000001"
    assert cli.main(["export", str(checkpoint), "--format", "torchscript"]) == 0
    assert (run_dir / "policy.pt").is_file()
    assert f"-> {run_dir / 'policy.pt'}" in capsys.readouterr().out
    # A checkpoint folder outside a run folder: the file goes beside it.
    loose = tmp_path / "loose"
    write_checkpoint(loose, policy, {}, {})
    assert cli.main(["export", str(loose)]) == 0
    assert (tmp_path / "loose.onnx").is_file()
    # --out naming an existing folder.
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    assert cli.main(["export", str(loose), "--out", str(out_dir), "--deterministic"]) == 0
    assert (out_dir / "policy.onnx").is_file()
    assert not list(out_dir.glob(".*")), "a temporary file was left behind"
    obs = observations(policy, np.random.default_rng(1), 50)
    expected = policy.act(obs)
    np.testing.assert_array_equal(run_onnx(out_dir / "policy.onnx", obs, None), expected)


def test_torchscript_mask_may_be_float(exported: dict[str, Exported]) -> None:
    item = exported["masked-info"]
    rng = np.random.default_rng(7)
    obs = observations(item.policy, rng, 200)
    mask = masks(item.policy.spec, rng, 200)
    module = torch.jit.load(str(item.torchscript))
    with torch.no_grad():
        got = module(torch.from_numpy(obs), torch.from_numpy(mask.astype(np.float32))).numpy()
    np.testing.assert_array_equal(got, reference_actions(item.policy, obs, mask))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--format", "tflite"], "unknown export format 'tflite'; choose from onnx, torchscript"),
        (["--no-deterministic"], "only deterministic actors can be exported"),
    ],
)
def test_export_refuses_bad_options(
    exported: dict[str, Exported], capsys: pytest.CaptureFixture[str], args, message: str
) -> None:
    run_dir = exported["cartpole"].run_dir
    assert cli.main(["export", str(run_dir), *args, "--out", str(run_dir / "x.onnx")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("trustrl: error: ") and message in err, err
    assert not (run_dir / "x.onnx").exists()


def test_export_missing_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["export", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("trustrl: error: ") and "does not exist" in err, err
    (tmp_path / "empty").mkdir()
    assert cli.main(["export", str(tmp_path / "empty"), "--format", "torchscript"]) == 2
    assert "no checkpoint found" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == [tmp_path / "empty"]


# The exported files in an interpreter that cannot import trustrl: -I drops the working
# directory and PYTHON* variables from the path; the editable install's finder is still in
# site-packages, so a meta-path hook refuses trustrl (and the tests package) outright.
FRESH_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import importlib.abc

    class Refuse(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.partition(".")[0] in ("trustrl", "tests"):
                raise ImportError(f"{name} is not importable here")
            return None

    sys.meta_path.insert(0, Refuse())
    try:
        import trustrl  # noqa: F401
    except ImportError:
        pass
    else:
        raise SystemExit("trustrl is importable")

    import numpy as np
    import onnxruntime as ort
    import torch

    for job in json.loads(sys.argv[1]):
        arrays = np.load(job["inputs"])
        obs = arrays["obs"]
        mask = arrays["mask"] if "mask" in arrays.files else None
        session = ort.InferenceSession(job["onnx"], providers=["CPUExecutionProvider"])
        feed = {"obs": obs} if mask is None else {"obs": obs, "action_mask": mask}
        onnx_actions = session.run(["action"], feed)[0]
        module = torch.jit.load(job["torchscript"])
        args = [torch.from_numpy(obs)] + ([] if mask is None else [torch.from_numpy(mask)])
        with torch.no_grad():
            ts_actions = module(*args).numpy()
        np.savez(job["outputs"], onnx=onnx_actions, torchscript=ts_actions)

    loaded = sorted(m for m in sys.modules if m.partition(".")[0] in ("trustrl", "tests"))
    assert not loaded, loaded
    print("ran", len(json.loads(sys.argv[1])), "models without trustrl")
    """
)


def test_exported_files_run_without_trustrl(exported: dict[str, Exported], tmp_path: Path) -> None:
    jobs, expected = [], {}
    rng = np.random.default_rng(3)
    for name in ("masked-dict", "multidiscrete", "image-box-2x3"):
        item = exported[name]
        obs = observations(item.policy, rng, N_OBS)
        arrays = {"obs": obs}
        mask = None
        if item.policy.spec.masked:
            mask = masks(item.policy.spec, rng)
            arrays["mask"] = mask
        np.savez(tmp_path / f"{name}-in.npz", **arrays)
        expected[name] = reference_actions(item.policy, obs, mask)
        jobs.append(
            {
                "inputs": str(tmp_path / f"{name}-in.npz"),
                "outputs": str(tmp_path / f"{name}-out.npz"),
                "onnx": str(item.onnx),
                "torchscript": str(item.torchscript),
            }
        )
    result = subprocess.run(
        [sys.executable, "-I", "-c", FRESH_SCRIPT, json.dumps(jobs)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "ran 3 models without trustrl" in result.stdout
    for name in expected:
        outputs: Any = np.load(tmp_path / f"{name}-out.npz")
        for runtime in ("onnx", "torchscript"):
            assert_same_actions(exported[name].policy, outputs[runtime], expected[name])


@pytest.mark.parametrize("mode", [{"per_agent": True}, {"agent_id": True}])
def test_export_refuses_multi_agent_actors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], mode: dict[str, bool]
) -> None:
    """Such actors read the agent's index, an input the exported model does not have."""
    case = CASES["cartpole"]()
    policy = Policy(case.spec, PolicyConfig(hidden_sizes=(8,)), num_agents=2, **mode)
    folder = tmp_path / "ckpt"
    write_checkpoint(folder, policy, {}, {})
    assert cli.main(["export", str(folder), "--out", str(tmp_path / "a.onnx")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("trustrl: error: ") and "multi-agent policy" in err, err
    assert not (tmp_path / "a.onnx").exists()
