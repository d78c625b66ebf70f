"""The update on an accelerator (``device = "cuda"``): a twin of the policy trains there.

The policy the trainer holds stays on the CPU: runners act from its snapshots, checkpoints,
evaluation, video and export read it, and its normalizers take in the runners'
statistics, all as on a CPU-only machine. ``OnDevice`` keeps a twin of it on the device,
with the update (and its optimizers' state) built on the twin; each call moves the
rollout's training rows there (frames as uint8: the model scales them), trains the twin,
and copies its weights back into the policy: once per update, the only traffic besides the
rows. The twin's normalizers are the policy's own modules (CPU statistics that numpy
updates; ``RunningMeanStd.forward`` reads them onto the device), so the value normalizer
the update moves and the observation statistics the runners merge are one state, not two
kept in step.

Checkpoints hold the optimizers' state on the CPU: a run saved on a GPU resumes on a
CPU-only machine and the other way round.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from trustrl.config import ConfigError
from trustrl.learner.policy import Policy
from trustrl.learner.rollout import Rollout

# The policy's normalizer modules, shared by the twin (statistics stay on the CPU).
NORMALIZERS = ("obs_normalizer", "critic_normalizer", "value_normalizer")


def learner_device(name: str, policies: list[Policy]) -> torch.device:
    """The device ``device`` names for these policies' updates. "auto" takes CUDA where
    torch sees it and a policy reads images or has memory, and the CPU otherwise: on an
    H200 a CNN's update ran 8-45x and a GRU's 2.8x its speed on a CPU core, an MLP's 0.19x
    (its minibatches are too small to cover the kernel launches; docs/pixels.md)."""
    if name == "cpu":
        return torch.device("cpu")
    available = torch.cuda.is_available()
    if name == "cuda":
        if not available:
            raise ConfigError(
                'device = "cuda", but torch sees no CUDA device (torch.cuda.is_available() is '
                f'False; torch {torch.__version__}); use "auto" or "cpu"'
            )
        return torch.device("cuda")
    pays = any(
        p.state_size or any(e["kind"] == "image" for e in p.spec.obs_entries) for p in policies
    )
    return torch.device("cuda" if available and pays else "cpu")


@torch.no_grad()
def copy_weights(source: nn.Module, target: nn.Module) -> None:
    """Every parameter and buffer of ``source`` into ``target``'s, in place (across
    devices; the shared normalizers are the same tensors and are skipped)."""
    theirs = target.state_dict()
    for name, mine in source.state_dict().items():
        if not name.startswith(NORMALIZERS):
            theirs[name].copy_(mine)


def make_twin(policy: Policy, device: torch.device) -> Policy:
    """A copy of ``policy`` on ``device`` sharing its normalizers. Built from its
    description under a forked generator: making it draws no number from torch's."""
    with torch.random.fork_rng(devices=[]):
        twin = Policy.from_description(policy.describe())
    twin.load_state_dict(policy.state_dict())
    twin.to(device)
    for name in NORMALIZERS:
        setattr(twin, name, getattr(policy, name))
    return twin


class OnDevice:
    """An update (PPO's, TRPO's) run on a twin of the policy on ``device``; called by the
    trainer as the update itself is (``registry.Update``)."""

    def __init__(self, make: Callable[[Policy], Any], policy: Policy, device: torch.device) -> None:
        """``make`` builds the update on a policy (registry.make_update's, which imports
        this module: the update's type, ``registry.Update``, is not named here)."""
        self.policy = policy
        self.device = device
        self.twin = make_twin(policy, device)
        if self.twin.state_size:
            # cuDNN's LSTM/GRU want their weights in a buffer of their own layout and copy
            # them into one per call (a few hundred kB here) where they are not: Adam keeps
            # every weight a view of its own flat buffer. Measured with that copy
            # (docs/pixels.md), so its warning, once per process, says nothing to act on.
            warnings.filterwarnings("ignore", "RNN module weights are not part of single")
        self.update = make(self.twin)

    def __call__(self, policy: Policy, rollout: Rollout, progress: float) -> dict[str, float]:
        metrics = self.update(self.twin, rollout, progress)
        copy_weights(self.twin, policy)
        return metrics

    def state_dict(self) -> dict[str, Any]:
        return _to_cpu(self.update.state_dict())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The update's state, after the twin takes the policy's weights (the trainer loads
        the policy first): the optimizers copy their moments onto the device."""
        copy_weights(self.policy, self.twin)
        self.update.load_state_dict(state)

    def register_agent(self, grown: list[tuple[nn.Parameter, nn.Parameter, int]]) -> None:
        """The policy grew an agent (``grown`` is its list): the twin grows the same way,
        takes the policy's weights (the new agent's fresh ones included), and the update's
        optimizers grow over the twin's new parameters."""
        with torch.random.fork_rng(devices=[]):
            twin_grown = self.twin.register_agent()
        copy_weights(self.policy, self.twin)
        self.update.register_agent(twin_grown)

    def close(self) -> None:
        self.update.close()


def _to_cpu(value: Any) -> Any:
    """A state with every tensor on the CPU (checkpoints are written from there)."""
    if isinstance(value, torch.Tensor):
        return value.cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_to_cpu(v) for v in value)
    return value
