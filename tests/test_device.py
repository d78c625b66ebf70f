"""``device``: the update on a twin of the policy (learner/updates/device.py).

On a CPU-only machine the twin runs on the CPU, where it must train as the plain update
does (bit for bit on the CI's CPUs): that holds the twin's plumbing (weights copied back,
normalizers shared, optimizer state saved and loaded, agents grown) without a GPU. The
CUDA tests skip here and run where torch sees a GPU: the same runs there agree with the
CPU's first update to float tolerance and go on training, and a checkpoint crosses
between the devices.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gymnasium import spaces

import trustrl
from tests.test_multiagent import _fake_rollout
from trustrl.config import ConfigError, PolicyConfig, PPOConfig, config_from_dict
from trustrl.envs.spaces import SpaceSpec
from trustrl.learner.optim import torch_step
from trustrl.learner.policy import Policy
from trustrl.learner.updates.device import OnDevice, learner_device
from trustrl.learner.updates.ppo import PPOUpdate
from trustrl.learner.updates.registry import make_update
from trustrl.run.logging import read_progress
from trustrl.run.trainer import Trainer

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# Each a run of a few iterations: the MLP's numpy gradients, TRPO, memory, a Dict of an
# image, a vector and a Discrete (the CNN, the normalizer on the vector columns), and a
# multi-agent group with per-agent actors, a global critic and value normalization.
RUNS: dict[str, tuple[str, dict[str, Any]]] = {
    "ppo": ("CartPole-v1", {}),
    "trpo": ("CartPole-v1", {"algo": "trpo", "trpo": {"minibatches": 2}}),
    "gru": (
        "CartPole-v1",
        {"policy": {"memory": "gru", "memory_size": 16}, "rollout": {"sequence_length": 8}},
    ),
    "image": (
        "tests.envs:DotEnv",
        {"env": {"num_envs": 4, "kwargs": {"kind": "dict"}, "normalize_obs": True}},
    ),
    "multiagent": (
        "mpe2:simple_spread_v3",
        {
            "env": {"num_envs": 2, "normalize_obs": True},
            "multiagent": {"actor": "per_agent", "value_norm": True},
            "ppo": {"pi_lr": 1e-3, "vf_lr": 1e-3, "update_epochs": 2, "num_minibatches": 2},
        },
    ),
}


def run_config(name: str, run_dir: Path, iterations: int = 3, **extra: Any) -> trustrl.Config:
    env_id, overrides = RUNS[name]
    table: dict[str, Any] = {
        "env_id": env_id,
        "seed": 3,
        "quiet": True,
        "eval_episodes": 0,
        "checkpoint_every": 1000,
        "run_dir": str(run_dir),
        "env": {"num_envs": 2},
        "rollout": {"num_steps": 32},
        "policy": {"hidden_sizes": [16, 16]},
        "ppo": {"update_epochs": 2, "num_minibatches": 2},
    }
    for source in (overrides, extra):
        for key, value in source.items():
            if isinstance(value, dict):
                table[key] = {**table.get(key, {}), **value}
            else:
                table[key] = value
    num_envs = table["env"]["num_envs"]
    table["total_steps"] = iterations * num_envs * table["rollout"]["num_steps"]
    return config_from_dict(table)


def on_twins(trainer: Trainer, device: str) -> None:
    """Replace the trainer's updates with ``OnDevice`` ones on ``device``."""
    for update in trainer.updates:
        update.close()
    trainer.updates = [
        OnDevice(lambda p: make_update(trainer.config, p), policy, torch.device(device))
        for policy in trainer.policies
    ]


def weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.policy.state_dict().items()}


def test_device_names_are_checked() -> None:
    with pytest.raises(
        ConfigError, match=r'device must be one of auto, cpu, cuda, got the string "gpu"'
    ):
        config_from_dict({"device": "gpu"})


def test_auto_takes_a_gpu_for_images_and_memory_only(monkeypatch: pytest.MonkeyPatch) -> None:
    frames = spaces.Box(0, 255, (8, 8, 1), np.uint8)
    image = Policy(SpaceSpec.from_spaces(frames, spaces.Discrete(2)))
    flat_spec = SpaceSpec.from_spaces(spaces.Box(-1, 1, (4,)), spaces.Discrete(2))
    flat = Policy(flat_spec)
    recurrent = Policy(flat_spec, PolicyConfig(memory="gru"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert learner_device("auto", [image]).type == "cpu"
    with pytest.raises(ConfigError, match=r'device = "cuda".*no CUDA device.*"auto" or "cpu"'):
        learner_device("cuda", [flat])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert learner_device("auto", [image]).type == "cuda"
    assert learner_device("auto", [recurrent]).type == "cuda"
    assert learner_device("auto", [flat]).type == "cpu"
    assert learner_device("cpu", [image]).type == "cpu"
    assert learner_device("cuda", [flat]).type == "cuda"


def test_adams_torch_step_is_torch_adams() -> None:
    """The arithmetic Adam steps weights on an accelerator with, against torch.optim.Adam."""
    g = torch.Generator().manual_seed(0)
    weights_ = torch.randn(50, generator=g, dtype=torch.float64)
    reference = torch.nn.Parameter(weights_.clone())
    optimizer = torch.optim.Adam([reference], lr=3e-3, betas=(0.9, 0.99), eps=1e-5)
    flat, moments = weights_.clone(), torch.zeros(2, 50, dtype=torch.float64)
    for step in range(1, 31):
        grad = torch.randn(50, generator=g, dtype=torch.float64) * step
        reference.grad = grad.clone()
        optimizer.step()
        torch_step(flat, moments, grad, 0.9, 0.99, 1e-5, 3e-3, step)
        torch.testing.assert_close(flat, reference.detach(), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", list(RUNS))
def test_a_twin_on_the_cpu_trains_bit_identically(tmp_path: Path, name: str) -> None:
    """The twin's update, its weights copied back each iteration, equals the plain update;
    a plain trainer resumes from its checkpoint with the same update state
    (optimizer moments, generator) and trains on."""
    plain = Trainer(run_config(name, tmp_path / "plain", iterations=4))
    plain.train()
    twin = Trainer(run_config(name, tmp_path / "twin", iterations=4))
    on_twins(twin, "cpu")
    twin.train()
    want, got = weights(plain), weights(twin)
    assert want.keys() == got.keys()
    for key in want:
        # Bit for bit on the CI's CPUs; some CPUs' convolution kernels round by the
        # weights' address (the twin's flat buffer is another allocation): to float32
        # rounding there.
        torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-7, msg=key)
    resumed = Trainer(run_config(name, tmp_path / "twin", iterations=5), resume=True)
    for mine, theirs in zip(resumed.updates, twin.updates, strict=True):
        assert_same_state(mine.state_dict(), theirs.state_dict())
    resumed.train()


def assert_same_state(a: Any, b: Any) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and b.device.type == "cpu" and torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            assert_same_state(a[key], b[key])
    elif isinstance(a, list | tuple):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same_state(x, y)
    else:
        assert a == b


def test_a_twin_grows_with_its_policy() -> None:
    """``register_agent`` through ``OnDevice``: the twin grows and takes the policy's new
    agent's weights; the next update trains them, as the plain update does."""
    spec = SpaceSpec.from_spaces(spaces.Box(-1, 1, (5,)), spaces.Discrete(3))
    config = PPOConfig(pi_lr=3e-3, vf_lr=3e-3, update_epochs=2, num_minibatches=2)
    small = PolicyConfig(hidden_sizes=(16,))
    made = []
    for _ in range(2):
        torch.manual_seed(0)
        made.append(Policy(spec, small, num_agents=2, per_agent=True, agent_id=True, critic_dim=6))
    plain_policy, twin_policy = made
    plain = PPOUpdate(plain_policy, config)
    twin = OnDevice(lambda p: PPOUpdate(p, config), twin_policy, torch.device("cpu"))
    torch.manual_seed(1)
    plain.register_agent(plain_policy.register_agent())
    torch.manual_seed(1)
    twin.register_agent(twin_policy.register_agent())
    assert twin.twin.num_agents == 3
    rollout = _fake_rollout(plain_policy, 3)
    plain(plain_policy, rollout, 0.0)
    twin(twin_policy, rollout, 0.0)
    for (key, a), b in zip(
        plain_policy.state_dict().items(), twin_policy.state_dict().values(), strict=True
    ):
        assert torch.equal(a, b), key


# Where torch sees a GPU.


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.reshape(1, -1), b.reshape(1, -1)))


@CUDA
@pytest.mark.parametrize("name", list(RUNS))
def test_the_update_on_cuda_agrees_with_the_cpus(tmp_path: Path, name: str) -> None:
    """One iteration on each device from the same start and rollout: the same metrics to
    float tolerance, the weights moved the same way (Adam's first steps are near-sign
    steps, so a gradient element near zero may flip: the whole move is compared), and the
    CUDA run trains on to finite weights."""
    torch.backends.cudnn.allow_tf32 = False  # compare float32 with float32
    cpu = Trainer(run_config(name, tmp_path / "cpu", iterations=1, device="cpu"))
    cuda = Trainer(run_config(name, tmp_path / "cuda", iterations=1, device="cuda"))
    assert cuda.device.type == "cuda" and isinstance(cuda.updates[0], OnDevice)
    assert cuda.updates[0].twin.device.type == "cuda"
    start = weights(cpu)
    cpu.train()
    cuda.train()
    a, b = weights(cpu), weights(cuda)
    for key in start:
        if "normalizer" in key:
            torch.testing.assert_close(a[key], b[key], rtol=1e-5, atol=1e-6)
            continue
        moved_cpu, moved_cuda = a[key] - start[key], b[key] - start[key]
        if moved_cpu.abs().max() > 0:
            assert _cosine(moved_cpu.double(), moved_cuda.double()) > 0.98, key
    cpu_rows = read_progress(tmp_path / "cpu" / "progress.csv")
    cuda_rows = read_progress(tmp_path / "cuda" / "progress.csv")
    for metric in ("loss_v", "explained_variance"):
        np.testing.assert_allclose(cuda_rows[0][metric], cpu_rows[0][metric], rtol=1e-3)
    longer = Trainer(run_config(name, tmp_path / "cuda", iterations=4, device="cuda"), resume=True)
    longer.train()
    assert all(torch.isfinite(v).all() for v in weights(longer).values())


def first_moment(trainer: Trainer) -> torch.Tensor:
    """The first parameter's Adam mean, as the update's state (a checkpoint's) has it."""
    return trainer.updates[0].state_dict()["optimizers"]["all"]["state"][0]["exp_avg"]


@CUDA
def test_a_checkpoint_crosses_between_devices(tmp_path: Path) -> None:
    """Saved on CUDA, resumed on the CPU, and the other way round: the optimizer's moments
    arrive as they were saved, and training goes on."""
    folder = tmp_path / "run"
    first = Trainer(run_config("image", folder, iterations=2, device="cuda"))
    first.train()
    moments = first_moment(first)
    assert moments.device.type == "cpu"
    on_cpu = Trainer(run_config("image", folder, iterations=3, device="cpu"), resume=True)
    assert torch.equal(
        on_cpu.updates[0].state_dict()["optimizers"]["all"]["state"][0]["exp_avg"], moments
    )
    on_cpu.train()
    again = Trainer(run_config("image", folder, iterations=4, device="cuda"), resume=True)
    want = on_cpu.updates[0].state_dict()["optimizers"]["all"]["state"][0]["exp_avg"]
    assert torch.equal(
        again.updates[0].state_dict()["optimizers"]["all"]["state"][0]["exp_avg"], want
    )
    again.train()


@CUDA
def test_the_numpy_gradients_refuse_a_gpu(tmp_path: Path) -> None:
    config = run_config("ppo", tmp_path / "run", device="cuda", ppo={"grad_backend": "numpy"})
    with pytest.raises(ConfigError, match=r'grad_backend = "numpy".*runs on cuda'):
        Trainer(config)
