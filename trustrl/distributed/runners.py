"""Rollout runners on Ray: the local path's collector, hosted in Ray actors.

``RayRunners`` is a ``Runner`` (contract.py) like ``Collector`` itself, so the trainer
has one loop wherever the envs run. Per iteration the learner's snapshot is put in the
object store once; each runner collects its share of the envs with it and sends back a
``RolloutBatch`` of numpy arrays tagged with the policy version and its name; the
batches are joined row-wise in runner order (contract.join), so a run with the same seed
and the same number of runners gives the same progress file.

A lost runner (its process died, or it did not answer within ``runner_timeout``) is
killed and replaced by a fresh actor, seeded apart from every earlier one, and the
replacement collects that runner's share again with the same snapshot: an iteration is
always made of complete rollouts of one policy version, never a partial or mixed batch,
and the lost batch never reaches the learner. ``restarts`` counts replacements (logged
as ``runner_restarts``); ``runner_failures`` failures in a row stop the run.

Reward scaling is per runner: each keeps its own discounted-return statistics, as the
single-process collector does for its envs (a replacement starts its own afresh).
Observation statistics are merged on the learner, so every runner acts on the same.
"""

from __future__ import annotations

import os
from typing import Any

from threadpoolctl import threadpool_limits

from trustrl.collect import make_collector
from trustrl.config import Config
from trustrl.contract import PolicySnapshot, RolloutBatch, join
from trustrl.distributed.cluster import RayCluster, import_ray
from trustrl.envs import AgentGroup

# Seeds: runner i's envs start at seed + SEED_STRIDE * i (Gymnasium's vector envs seed
# env j with seed + j); its k-th replacement adds REPLACEMENT_STRIDE * k.
SEED_STRIDE = 1_000
REPLACEMENT_STRIDE = 1_000_003


class RunnerFailedError(RuntimeError):
    """Runners kept failing: the run stops rather than spinning."""


class RunnerActor:
    """One runner: a collector over ``num_envs`` envs of the run, in a Ray actor."""

    def __init__(self, config: Config, seed: int, num_envs: int, name: str) -> None:
        # One BLAS thread: several runners share a machine's cores.
        threadpool_limits(1, user_api="blas")
        self.collector = make_collector(config, seed, num_envs, name)

    def groups(self) -> list[AgentGroup]:
        return self.collector.groups

    def collect(self, snapshot: PolicySnapshot, train: bool = True) -> RolloutBatch:
        return self.collector.collect(snapshot, train)

    def state_dict(self) -> dict[str, Any]:
        return self.collector.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.collector.load_state_dict(state)

    def reset(self, seed: int) -> None:
        self.collector.reset(seed)

    def pid(self) -> int:
        return os.getpid()

    def node_id(self) -> str:
        ray = import_ray()
        return str(ray.get_runtime_context().get_node_id())

    def close(self) -> None:
        self.collector.close()


class RayRunners:
    """``config.runners`` runner actors with ``config.runner_envs`` envs each."""

    def __init__(self, config: Config, spread: bool = True) -> None:
        self.config = config
        self.cluster = RayCluster(config.ray_address)
        self.cluster.start()
        try:
            ray = import_ray()
            self.ray = ray
            # Spread over the nodes; no restarts by Ray itself: a replacement gets a
            # new seed and the current snapshot from here.
            options: dict[str, Any] = {"max_restarts": 0}
            if spread:
                options["scheduling_strategy"] = "SPREAD"
            self.actor_class = ray.remote(RunnerActor).options(**options)
            self.restarts = 0
            self.failures_in_a_row = 0
            self.replaced = [0] * config.runners  # replacements of each runner
            self.actors = [self._start(i) for i in range(config.runners)]
            self.groups: list[AgentGroup] = ray.get(self.actors[0].groups.remote())
            self.num_envs = config.num_envs
        except BaseException:
            self.cluster.shutdown()
            raise

    def _seed(self, index: int) -> int:
        return self.config.seed + SEED_STRIDE * index + REPLACEMENT_STRIDE * self.replaced[index]

    def _start(self, index: int) -> Any:
        name = f"runner-{index}"
        return self.actor_class.remote(
            self.config, self._seed(index), self.config.runner_envs, name
        )

    def _replace(self, index: int, why: str) -> None:
        self.restarts += 1
        self.failures_in_a_row += 1
        if self.failures_in_a_row >= self.config.runner_failures:
            raise RunnerFailedError(
                f"runner-{index} failed ({why}); {self.failures_in_a_row} runner failures "
                f"in a row (runner_failures = {self.config.runner_failures}): stopping"
            )
        self.ray.kill(self.actors[index], no_restart=True)
        self.replaced[index] += 1
        self.actors[index] = self._start(index)

    def collect(self, snapshot: PolicySnapshot, train: bool = True) -> RolloutBatch:
        ray = self.ray
        from ray.exceptions import RayActorError, RayTaskError

        ref = ray.put(snapshot)  # once per iteration, read by every runner
        pending = {i: actor.collect.remote(ref, train) for i, actor in enumerate(self.actors)}
        batches: dict[int, RolloutBatch] = {}
        while pending:
            index_of = {ref_: i for i, ref_ in pending.items()}
            ready, late = ray.wait(
                list(pending.values()),
                num_returns=len(pending),
                timeout=self.config.runner_timeout,
            )
            for done in ready:
                i = index_of[done]
                try:
                    batches[i] = ray.get(done)
                    del pending[i]
                except RayTaskError as error:  # the env or collector raised: not a lost runner
                    raise error.as_instanceof_cause() from None
                except RayActorError as error:
                    self._replace(i, f"its process exited: {type(error).__name__}")
                    pending[i] = self.actors[i].collect.remote(ref, train)
            for waited in late:
                i = index_of[waited]
                self._replace(
                    i, f"no rollout within runner_timeout = {self.config.runner_timeout} s"
                )
                pending[i] = self.actors[i].collect.remote(ref, train)
        self.failures_in_a_row = 0
        return join([batches[i] for i in range(len(self.actors))])

    def state_dict(self) -> dict[str, Any]:
        states = self.ray.get([actor.state_dict.remote() for actor in self.actors])
        return {"runners": states, "replaced": list(self.replaced), "restarts": self.restarts}

    def load_state_dict(self, state: dict[str, Any], env_state: Any = None) -> None:
        """The runners' acting state (sampling streams, reward scalers); their envs start
        fresh episodes (``reset``), as env state is not carried across runners."""
        self.replaced = list(state["replaced"])
        self.restarts = int(state["restarts"])
        self.ray.get(
            [
                a.load_state_dict.remote(s)
                for a, s in zip(self.actors, state["runners"], strict=True)
            ]
        )

    def capture(self) -> None:
        """Env state is not captured on runners: a resumed run starts fresh episodes."""
        return None

    def reset(self, seed: int) -> None:
        self.ray.get([a.reset.remote(seed + SEED_STRIDE * i) for i, a in enumerate(self.actors)])

    def pids(self) -> list[int]:
        return list(self.ray.get([actor.pid.remote() for actor in self.actors]))

    def node_ids(self) -> list[str]:
        return list(self.ray.get([actor.node_id.remote() for actor in self.actors]))

    def close(self) -> None:
        try:
            for actor in self.actors:
                self.ray.kill(actor, no_restart=True)
        finally:
            self.cluster.shutdown()
