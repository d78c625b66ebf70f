"""A policy made of parts (trustrl/acting/parts.py): every registered encoder's numpy twin
computes what its torch module computes, and an encoder registered in one place (here, a
test-only one) trains, acts on the acting side, checkpoints and exports with no other edit.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import Tensor, nn

import trustrl
from trustrl.acting import kernels, parts
from trustrl.acting.inference import Inference
from trustrl.config import ConfigError, PolicyConfig
from trustrl.contract import GroupSnapshot
from trustrl.envs.spaces import SpaceSpec
from trustrl.learner.policy import Policy

TOLERANCE = 1e-5  # float32 matmuls in another order


@pytest.mark.parametrize("kind", sorted(parts.ENCODERS))
@pytest.mark.parametrize("num_agents", [None, 3])
def test_every_twin_is_its_torch_module(kind: str, num_agents: int | None) -> None:
    torch.manual_seed(0)
    settings = {**PolicyConfig().__dict__, "hidden_sizes": [32, 16], "activation": "relu"}
    part = parts.encoder(kind)
    module = part.build_torch(7, settings, num_agents)
    weights = {k: v.detach().numpy().copy() for k, v in module.state_dict().items()}
    twin = part.twin(settings, {f"enc.{k}": v for k, v in weights.items()}, "enc.")
    x = np.random.default_rng(0).standard_normal((11, 7)).astype(np.float32)
    agent = np.arange(11) % 3 if num_agents else None
    with torch.no_grad():
        expected = module(torch.from_numpy(x), torch.from_numpy(agent) if num_agents else None)
    assert module.out_features == expected.shape[1]
    np.testing.assert_allclose(twin(x, agent), expected.numpy(), atol=TOLERANCE)


def test_an_unknown_encoder_is_refused_naming_the_choices() -> None:
    spec = SpaceSpec((4,), "discrete", (), (2,))
    with pytest.raises(ConfigError, match=r"policy.encoder must be one of .*mlp.*got 'cnn9'"):
        Policy(spec, PolicyConfig(encoder="cnn9"))


# A test-only encoder: one linear layer to 24 features and a sine. Everything below uses
# it through its registration alone.


class SineEncoder(nn.Module):
    def __init__(self, in_features: int, settings: dict[str, Any], num_agents: int | None):
        super().__init__()
        assert num_agents is None
        self.linear = nn.Linear(in_features, 24)
        self.out_features = 24

    def forward(self, x: Tensor, agent: Tensor | None = None) -> Tensor:
        return torch.sin(self.linear(x))


class NumpySineEncoder:
    def __init__(self, settings: dict[str, Any], weights: dict[str, np.ndarray], prefix: str):
        self.linear = kernels.Dense(
            weights[f"{prefix}linear.weight"], weights[f"{prefix}linear.bias"]
        )

    def __call__(self, x: np.ndarray, agent: np.ndarray | None = None) -> np.ndarray:
        return np.sin(self.linear(x))


@pytest.fixture
def sine() -> Iterator[str]:
    parts.register_encoder("test_sine", SineEncoder, NumpySineEncoder)
    yield "test_sine"
    del parts.ENCODERS["test_sine"]


def _config(tmp_path: Path, env_id: str, encoder: str, **extra: Any) -> trustrl.Config:
    overrides = {
        "total_steps": 2048,
        "seed": 3,
        "run_dir": str(tmp_path / "run"),
        "quiet": True,
        "eval_episodes": 2,
        "policy": {"encoder": encoder},
        "env": {"num_envs": 2, "normalize_obs": True},
        "rollout": {"num_steps": 256},
        **extra,
    }
    return trustrl.resolve(env_id, overrides=overrides)


@pytest.mark.parametrize("env_id", ["CartPole-v1", "Pendulum-v1"])
def test_a_registered_encoder_trains_acts_checkpoints_and_exports(
    sine: str, tmp_path: Path, env_id: str
) -> None:
    config = _config(tmp_path, env_id, sine)
    trainer = trustrl.Trainer(config)
    policy = trainer.train()
    assert isinstance(policy, Policy)
    assert isinstance(policy.actor, SineEncoder) and isinstance(policy.critic[0], SineEncoder)
    assert trainer.env_steps == 2048 and trainer.eval_result is not None

    # The acting side (numpy, from a snapshot) is the torch module.
    spec = policy.spec
    inference = Inference(GroupSnapshot.of(policy))
    obs = np.random.default_rng(1).standard_normal((9, spec.obs_dim)).astype(np.float32)
    x = policy.normalize(torch.from_numpy(obs))
    with torch.no_grad():
        params = policy.dist_params(x)
        values = policy.critic_value(x)
    np.testing.assert_allclose(inference.value(x.numpy()), values.numpy(), atol=TOLERANCE)
    actions = inference.mode(x.numpy(), None)
    np.testing.assert_allclose(actions, policy.head.mode(params).numpy(), atol=TOLERANCE)

    # Checkpointed: the run folder loads into the same policy, and resumes.
    loaded = trustrl.load_policy(tmp_path / "run")
    for name, value in policy.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value), name
    resumed = trustrl.Trainer(
        _config(tmp_path, env_id, sine, total_steps=3072), tmp_path / "run", resume=True
    )
    resumed.train()
    assert resumed.env_steps == 3072

    # Exported: ONNX Runtime acts as the policy does.
    import onnxruntime

    from trustrl.run.export import export_policy

    out = export_policy(tmp_path / "run", "onnx", tmp_path / "policy.onnx")
    session = onnxruntime.InferenceSession(str(out.path))
    exported = session.run(None, {"obs": obs})[0]
    final = trustrl.load_policy(tmp_path / "run")
    np.testing.assert_allclose(exported, final.act(obs), atol=1e-4)
