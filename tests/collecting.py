"""Collecting in tests: a policy snapshot to a collector, its batch absorbed by the
learner's side (trainer.absorb), as the trainer does."""

from __future__ import annotations

from trustrl.acting.collector import Collector
from trustrl.contract import EpisodeStats, PolicySnapshot
from trustrl.learner.policy import Policy
from trustrl.learner.rollout import Rollout
from trustrl.run.trainer import absorb


def collect(
    collector: Collector, policies: Policy | list[Policy], num_steps: int, train: bool = True
) -> tuple[Rollout, EpisodeStats]:
    """``num_steps`` steps with ``policies`` (one per group): the first group's rollout
    and the episodes. With ``train``, the policies' normalizers take the batch's delta."""
    policies = [policies] if isinstance(policies, Policy) else policies
    collector.num_steps = num_steps
    batch = collector.collect(PolicySnapshot.of(policies, 0), train)
    return absorb(policies, batch, 0)[0], batch.episodes
