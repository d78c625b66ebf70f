"""`trustrl export`: the exported actor acts exactly as ``Policy.act(deterministic=True)``.

Policies are built directly (weights made decisive, normalizer statistics made
non-trivial), written with ``write_checkpoint`` and exported through the CLI. Each
exported file is run with onnxruntime and with ``torch.jit.load`` on 1,000 random
observations (wide enough that the normalizer's clip and the Box bounds both bite), and
once in a fresh interpreter in which trustrl cannot be imported. Policies for structured
observations (frames, Dicts, Tuples, Discrete indices) are exported the same way and held
to ``Policy.act`` on observations of real envs (tests.envs:DotEnv, FrozenLake, MinAtar,
Atari), fed as the env hands them out.
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
from trustrl.run.export import FORMATS

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
        arrays = np.load(job["inputs"])  # the inputs by name: obs, obs.<key>, action_mask
        session = ort.InferenceSession(job["onnx"], providers=["CPUExecutionProvider"])
        names = [i.name for i in session.get_inputs()]
        onnx_actions = session.run(["action"], {name: arrays[name] for name in names})[0]
        module = torch.jit.load(job["torchscript"])
        args = [torch.from_numpy(arrays[name]) for name in names]  # positionally, in order
        with torch.no_grad():
            ts_actions = module(*args).numpy()
        np.savez(job["outputs"], onnx=onnx_actions, torchscript=ts_actions)

    loaded = sorted(m for m in sys.modules if m.partition(".")[0] in ("trustrl", "tests"))
    assert not loaded, loaded
    print("ran", len(json.loads(sys.argv[1])), "models without trustrl")
    """
)


def test_exported_files_run_without_trustrl(
    exported: dict[str, Exported], structured: dict[str, StructuredExport], tmp_path: Path
) -> None:
    jobs, expected = [], {}
    rng = np.random.default_rng(3)
    for name in ("masked-dict", "multidiscrete", "image-box-2x3"):
        item = exported[name]
        obs = observations(item.policy, rng, N_OBS)
        arrays = {"obs": obs}
        mask = None
        if item.policy.spec.masked:
            mask = masks(item.policy.spec, rng)
            arrays["action_mask"] = mask
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
    # Structured observations: frames, a Dict of a grid, a vector and an index.
    for name in ("dot-uint8", "dot-dict"):
        structured_item = structured[name]
        np.savez(
            tmp_path / f"{name}-in.npz", **feed(structured_item.policy.spec, structured_item.batch)
        )
        jobs.append(
            {
                "inputs": str(tmp_path / f"{name}-in.npz"),
                "outputs": str(tmp_path / f"{name}-out.npz"),
                "onnx": str(structured_item.onnx),
                "torchscript": str(structured_item.torchscript),
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
    assert "ran 5 models without trustrl" in result.stdout
    for name in expected:
        outputs: Any = np.load(tmp_path / f"{name}-out.npz")
        for runtime in ("onnx", "torchscript"):
            assert_same_actions(exported[name].policy, outputs[runtime], expected[name])
    for name in ("dot-uint8", "dot-dict"):
        policy, batch = structured[name].policy, structured[name].batch
        outputs = np.load(tmp_path / f"{name}-out.npz")
        for runtime in ("onnx", "torchscript"):
            assert_acts_alike(outputs[runtime], policy.act(batch), logit_gaps(policy, batch))


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


# Structured observations (envs/layout.py): images, Dicts, Tuples, Discrete indices. The
# exported model takes them as the env hands them out: ``obs`` with the env's own dtype and
# shape for a whole observation, ``obs.<key>`` per entry of a Dict or Tuple (the float
# vectors first). Actions are compared with ``Policy.act`` on real observations; the
# convolutions of ONNX Runtime round differently from torch's, so a row whose two best
# log-probabilities are within LOGIT_TOL may go either way and is not counted.

LOGIT_TOL = 1e-4
N_REAL = 300


def dot_spec(kind: str) -> SpaceSpec:
    env = test_envs.DotEnv(kind)
    return SpaceSpec.from_spaces(env.observation_space, env.action_space)


MASKED_IMAGE = gym.spaces.Dict(
    {
        "observation": gym.spaces.Box(0, 255, (8, 8, 3), np.uint8),
        "action_mask": gym.spaces.Box(0, 1, (4,), np.int8),
    }
)

# name -> (env id for the checkpoint's config, a zero-argument env or None, the spec)
STRUCTURED: dict[str, Callable[[], tuple[str, gym.Env | None, SpaceSpec]]] = {
    **{
        f"dot-{kind}": (
            lambda kind=kind: ("tests.envs:DotEnv", test_envs.DotEnv(kind), dot_spec(kind))
        )
        for kind in ("uint8", "bool", "first", "dict", "tuple")
    },
    "frozenlake": lambda: (
        "FrozenLake-v1",
        gym.make("FrozenLake-v1", is_slippery=False),
        _spec(gym.make("FrozenLake-v1")),
    ),
    # The action-mask convention around a frame: observations sampled from the space.
    "masked-image": lambda: (
        "custom:MaskedImage",
        None,
        SpaceSpec.from_spaces(MASKED_IMAGE, gym.spaces.Discrete(4)),
    ),
}

# The inputs each exported model declares: name -> (ONNX type, shape).
STRUCTURED_INPUTS: dict[str, dict[str, tuple[str, list[Any]]]] = {
    "dot-uint8": {"obs": ("tensor(uint8)", ["batch", 6, 6, 1])},
    "dot-bool": {"obs": ("tensor(bool)", ["batch", 6, 6, 2])},
    "dot-first": {"obs": ("tensor(uint8)", ["batch", 2, 6, 6])},
    "dot-dict": {
        "obs.vec": ("tensor(float)", ["batch", 2]),
        "obs.count": ("tensor(int64)", ["batch"]),
        "obs.grid": ("tensor(bool)", ["batch", 6, 6, 2]),
    },
    "dot-tuple": {
        "obs.0": ("tensor(int64)", ["batch"]),
        "obs.1": ("tensor(int8)", ["batch", 3]),
    },
    "frozenlake": {"obs": ("tensor(int64)", ["batch"])},
    "masked-image": {
        "obs": ("tensor(uint8)", ["batch", 8, 8, 3]),
        "action_mask": ("tensor(bool)", ["batch", 4]),
    },
}


def decisive_policy(
    spec: SpaceSpec, seed: int, config: PolicyConfig | None = None, normalize: bool = True
) -> Policy:
    """A policy whose actions vary from observation to observation (the initial head is
    near-uniform), with normalizer statistics that matter: vectors in [-1, 1] reach past
    the clip."""
    torch.manual_seed(seed)
    policy = Policy(
        spec,
        config or PolicyConfig(hidden_sizes=(32,)),
        normalize_obs=normalize,
        obs_clip=OBS_CLIP,
    )
    with torch.no_grad():
        torch.nn.init.normal_(policy.head.linear.weight, std=3.0)  # type: ignore[attr-defined]
        if policy.obs_normalizer is not None:
            gen = torch.Generator().manual_seed(seed)
            dim = spec.vector_dim
            mean = torch.randn(dim, generator=gen, dtype=torch.float64) * 0.3
            policy.obs_normalizer.mean.copy_(mean)
            policy.obs_normalizer.var.copy_(
                torch.rand(dim, generator=gen, dtype=torch.float64) * 0.05 + 0.01
            )
            policy.obs_normalizer.count.fill_(12345.0)
    return policy.eval()


def env_observations(env: gym.Env, n: int, seed: int = 0) -> list[Any]:
    """``n`` observations of ``env`` as it hands them out, acting at random."""
    env.action_space.seed(seed)
    obs, _ = env.reset(seed=seed)
    seen = [obs]
    while len(seen) < n:
        obs, _, terminated, truncated, _ = env.step(env.action_space.sample())
        if terminated or truncated:
            obs, _ = env.reset()
        seen.append(obs)
    return seen


def stack(observations: list[Any]) -> Any:
    """Single observations -> the batch a vector env would hand out."""
    first = observations[0]
    if isinstance(first, dict):
        return {key: stack([o[key] for o in observations]) for key in first}
    if isinstance(first, tuple):
        return tuple(stack([o[i] for o in observations]) for i in range(len(first)))
    return np.stack([np.asarray(o) for o in observations])


def rows_of(batch: Any, rows: slice) -> Any:
    if isinstance(batch, dict):
        return {key: rows_of(value, rows) for key, value in batch.items()}
    if isinstance(batch, tuple):
        return tuple(rows_of(value, rows) for value in batch)
    return batch[rows]


def feed(spec: SpaceSpec, batch: Any) -> dict[str, np.ndarray]:
    """The exported model's inputs for a batch of raw observations, by name."""
    inputs: dict[str, np.ndarray] = {}
    if spec.dict_obs:
        inputs_mask = np.asarray(batch["action_mask"]).astype(bool)
        batch = batch["observation"]
    for entry in spec.obs_entries:
        key = entry["key"]
        if not key:
            inputs["obs"] = np.asarray(batch)
        else:
            inputs[f"obs.{key}"] = np.asarray(
                batch[key] if isinstance(batch, dict) else batch[int(key)]
            )
    if spec.dict_obs:
        inputs["action_mask"] = inputs_mask
    return inputs


def logit_gaps(policy: Policy, batch: Any) -> np.ndarray:
    """The gap between each row's two best log-probabilities, as ``act`` computes them."""
    rows, mask = policy.spec.split(batch)
    with torch.no_grad():
        x = policy.normalize(torch.as_tensor(rows))
        mask_t = torch.as_tensor(mask) if mask is not None else None
        params = policy.dist_params(x, mask_t).numpy()
    best = np.sort(params, axis=1)
    return best[:, -1] - best[:, -2]


def assert_acts_alike(got: np.ndarray, expected: np.ndarray, gaps: np.ndarray) -> None:
    """Equal actions, except where the two best log-probabilities are within LOGIT_TOL."""
    assert got.shape == expected.shape and got.dtype == np.int64
    decided = gaps > LOGIT_TOL
    assert decided.mean() > 0.95, "too many near-ties for the comparison to mean much"
    mismatched = np.flatnonzero((got != expected) & decided).tolist()
    assert mismatched == [], f"{len(mismatched)} of {int(decided.sum())} actions differ"


def run_structured(path: Path, inputs: dict[str, np.ndarray], names: list[str]) -> np.ndarray:
    """The exported file's actions: ONNX by input name, TorchScript positionally, in the
    order of the metadata's ``inputs``."""
    if path.suffix == ".onnx":
        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        return session.run(["action"], inputs)[0]
    module = torch.jit.load(str(path))
    with torch.no_grad():
        return module(*(torch.from_numpy(inputs[name]) for name in names)).numpy()


@dataclass
class StructuredExport:
    policy: Policy
    batch: Any
    onnx: Path
    torchscript: Path
    stdout: str


@pytest.fixture(scope="module")
def structured(tmp_path_factory: pytest.TempPathFactory) -> dict[str, StructuredExport]:
    root = tmp_path_factory.mktemp("structured")
    result = {}
    for seed, (name, make) in enumerate(STRUCTURED.items()):
        env_id, env, spec = make()
        policy = decisive_policy(spec, seed)
        if env is not None:
            batch = stack(env_observations(env, N_REAL, seed))
        else:
            space = MASKED_IMAGE
            space.seed(seed)
            batch = stack([space.sample() for _ in range(N_REAL)])
            batch["action_mask"][:, 0] = 1  # at least one action allowed
        run_dir = root / name
        meta = {"config": config_to_dict(Config(env_id=env_id)), "iteration": 1}
        write_checkpoint(run_dir / "checkpoints" / "iter_00000001", policy, meta, {})
        set_latest(run_dir / "checkpoints", "iter_00000001")
        stdout = io.StringIO()
        for fmt in ("onnx", "torchscript"):
            with contextlib.redirect_stdout(stdout):
                assert cli.main(["export", str(run_dir), "--format", fmt]) == 0, name
        result[name] = StructuredExport(
            policy, batch, run_dir / "policy.onnx", run_dir / "policy.pt", stdout.getvalue()
        )
    return result


@pytest.mark.parametrize("name", list(STRUCTURED))
def test_structured_export_acts_like_policy_act(
    structured: dict[str, StructuredExport], name: str
) -> None:
    item = structured[name]
    policy, spec, batch = item.policy, item.policy.spec, item.batch
    expected = policy.act(batch)
    gaps = logit_gaps(policy, batch)
    assert len(np.unique(expected)) > 1, "every observation gets the same action"
    if policy.obs_normalizer is not None:  # the baked-in statistics matter
        bare = Policy.from_description(policy.describe())
        bare.load_state_dict(policy.state_dict())
        assert bare.obs_normalizer is not None
        bare.obs_normalizer.mean.zero_()
        bare.obs_normalizer.var.fill_(1.0)
        assert not np.array_equal(bare.act(batch), expected)
    inputs = feed(spec, batch)
    names = list(STRUCTURED_INPUTS[name])
    for path in (item.onnx, item.torchscript):
        assert_acts_alike(run_structured(path, inputs, names), expected, gaps)
        # Dynamic batch axis: one row, and an odd batch size.
        for rows in (slice(0, 1), slice(10, 17)):
            part = {k: v[rows] for k, v in inputs.items()}
            got = run_structured(path, part, names)
            assert_acts_alike(got, policy.act(rows_of(batch, rows)), gaps[rows])


@pytest.mark.parametrize("name", list(STRUCTURED))
def test_structured_onnx_interface(structured: dict[str, StructuredExport], name: str) -> None:
    item = structured[name]
    session = ort.InferenceSession(str(item.onnx), providers=["CPUExecutionProvider"])
    declared = {i.name: (i.type, i.shape) for i in session.get_inputs()}
    assert declared == STRUCTURED_INPUTS[name]
    assert [i.name for i in session.get_inputs()] == list(STRUCTURED_INPUTS[name])
    (output,) = session.get_outputs()
    assert (output.name, output.type, output.shape) == ("action", "tensor(int64)", ["batch"])
    info = json.loads(session.get_modelmeta().custom_metadata_map["trustrl"])
    assert SpaceSpec.from_json(info["spec"]) == item.policy.spec
    assert list(info["inputs"]) == list(STRUCTURED_INPUTS[name])
    for input_name, (kind, shape) in STRUCTURED_INPUTS[name].items():
        dtype = {"tensor(float)": "float32"}.get(kind, kind[len("tensor(") : -1])
        dims = ", ".join(str(d) for d in shape)
        assert info["inputs"][input_name] == f"{dtype} ({dims})"
        assert f"{input_name} {dtype} ({dims})" in item.stdout
    extra = {"trustrl.json": ""}
    torch.jit.load(str(item.torchscript), _extra_files=extra)
    assert json.loads(extra["trustrl.json"])["inputs"] == info["inputs"]


def test_structured_gateway_model_gives_the_policys_log_probabilities(
    structured: dict[str, StructuredExport],
) -> None:
    """The gateway's ONNX model (``onnx_model``: a second output, ``params``) of a structured
    policy takes the same inputs; its log-probabilities are the policy's."""
    from trustrl.run.export import onnx_model

    for name in ("dot-dict", "dot-first", "masked-image"):
        item = structured[name]
        policy, batch = item.policy, item.batch
        session = ort.InferenceSession(
            onnx_model(policy, {"exported_by": "test"}), providers=["CPUExecutionProvider"]
        )
        action, params = session.run(["action", "params"], feed(policy.spec, batch))
        rows, mask = policy.spec.split(batch)
        with torch.no_grad():
            x = policy.normalize(torch.as_tensor(rows))
            expected = policy.dist_params(x, torch.as_tensor(mask) if mask is not None else None)
        finite = np.isfinite(expected.numpy())
        assert np.array_equal(np.isfinite(params), finite), name
        np.testing.assert_allclose(params[finite], expected.numpy()[finite], atol=1e-4)
        assert_acts_alike(action, policy.act(batch), logit_gaps(policy, batch))


PACK_SPACES: dict[str, tuple[gym.Space, dict[str, tuple[str, ...]]]] = {
    "uint8-frame": (gym.spaces.Box(0, 255, (4, 9, 9), np.uint8), {}),
    "bool-grid": (gym.spaces.Box(0, 1, (5, 5, 3), bool), {}),
    "discrete-start": (gym.spaces.Discrete(5, start=-2), {}),
    "multidiscrete": (gym.spaces.MultiDiscrete([3, 2, 4], start=[1, 0, -1]), {}),
    "multibinary": (gym.spaces.MultiBinary([2, 3]), {}),
    "tuple-of-bytes": (
        gym.spaces.Tuple((gym.spaces.Discrete(3), gym.spaces.Box(0, 1, (4, 4), bool))),
        {},
    ),
    # A bool grid taken flat (env.flat_keys) beside a one-hot: MinAtar for an MLP.
    "tuple-flat-grid": (
        gym.spaces.Tuple((gym.spaces.Discrete(3), gym.spaces.Box(0, 1, (4, 4, 2), bool))),
        {"flat_keys": ("1",)},
    ),
    # A float row: float64 and int32 vectors, a float image (env.image_keys), one-hots.
    "everything": (
        gym.spaces.Dict(
            {
                "pos": gym.spaces.Box(-5.0, 5.0, (3,), np.float64),
                "ints": gym.spaces.Box(-9, 9, (2,), np.int32),
                "depth": gym.spaces.Box(0.0, 1.0, (6, 6, 1), np.float32),
                "frame": gym.spaces.Box(0, 255, (2, 6, 6), np.uint8),
                "goal": gym.spaces.MultiDiscrete([4, 2]),
                "door": gym.spaces.Discrete(3, start=1),
                "flags": gym.spaces.MultiBinary(2),
            }
        ),
        {"image_keys": ("depth",)},
    ),
}


@pytest.mark.parametrize("name", list(PACK_SPACES))
def test_the_exported_packing_equals_split(name: str) -> None:
    """One packing: the exported model's (``Pack``, torch) gives the rows of
    ``SpaceSpec.split`` (envs/layout.py's ``pack``), dtype included."""
    from trustrl.run.export import Pack

    space, keys = PACK_SPACES[name]
    spec = SpaceSpec.from_spaces(space, gym.spaces.Discrete(2), **keys)
    space.seed(5)
    batch = stack([space.sample() for _ in range(64)])
    rows, _ = spec.split(batch)
    inputs = feed(spec, batch)
    packed = Pack(spec)([torch.from_numpy(np.ascontiguousarray(v)) for v in inputs.values()])
    assert packed.numpy().dtype == spec.obs_dtype == rows.dtype
    np.testing.assert_array_equal(packed.numpy(), rows)


def real_frames_check(env_id: str, n: int, tmp_path: Path) -> None:
    """Export a policy for ``env_id``'s frames (built by trustrl's env factory) and hold
    both files to ``Policy.act`` on ``n`` frames of play."""
    from trustrl.envs.gym import check_env_id, env_factory
    from trustrl.run.export import export_policy

    check_env_id(env_id)
    env = env_factory(env_id)()
    spec = _spec(env)
    policy = decisive_policy(spec, 0, PolicyConfig(), normalize=False)
    batch = stack(env_observations(env, n))
    env.close()
    assert batch.dtype == np.dtype(spec.obs_entries[0]["dtype"])
    # Frames of one game look alike to an untrained CNN: centre the head's logits on
    # these frames so that the best action changes from frame to frame.
    with torch.no_grad():
        linear = policy.head.linear  # type: ignore[attr-defined]
        logits = linear(policy.actor(torch.as_tensor(policy.spec.split(batch)[0])))
        linear.bias -= logits.median(0).values
    folder = tmp_path / "checkpoint"
    write_checkpoint(folder, policy, {}, {})
    expected, gaps = policy.act(batch), logit_gaps(policy, batch)
    assert len(np.unique(expected)) > 1, "every frame gets the same action"
    for fmt in ("onnx", "torchscript"):
        result = export_policy(folder, fmt, tmp_path / f"policy{FORMATS[fmt]}")
        assert list(result.inputs) == ["obs"]
        assert result.inputs["obs"].startswith(f"{batch.dtype} (batch, ")
        assert_acts_alike(run_structured(result.path, {"obs": batch}, ["obs"]), expected, gaps)


def test_minatar_frames(tmp_path: Path) -> None:
    """MinAtar's bool (10, 10, 4) grids go into the exported model as they are."""
    pytest.importorskip("minatar")
    real_frames_check("MinAtar/Breakout-v1", 200, tmp_path)


def test_atari_frames(tmp_path: Path) -> None:
    """ALE's preprocessed uint8 (4, 84, 84) frame stacks through the Nature CNN."""
    pytest.importorskip("ale_py")
    real_frames_check("ALE/Breakout-v5", 64, tmp_path)
