"""Rollout runners on Ray: the local path's collector, hosted in Ray actors.

``RayRunners`` is a ``Runner`` (contract.py) like ``Collector`` itself, so the trainer
has one loop wherever the envs run. Per iteration the learner's snapshot is put in the
object store once; each runner collects its share of the envs with it and sends back a
``RolloutBatch`` of numpy arrays tagged with the policy version and its name; the
batches are joined row-wise in runner order (contract.join), so a run with the same seed
and the same number of runners gives the same progress file.

A lost runner (its process died, or it did not answer within ``runners.timeout``) is
killed and replaced by a fresh actor, seeded apart from every earlier one, and the
replacement collects that runner's share again with the same snapshot: an iteration is
always made of complete rollouts of one policy version, never a partial or mixed batch,
and the lost batch never reaches the learner. ``restarts`` counts replacements (logged
as ``runner_restarts``); ``runners.failures`` failures in a row stop the run.

Reward scaling is per runner: each keeps its own discounted-return statistics, as the
single-process collector does for its envs (a replacement starts its own afresh).
Observation statistics are merged on the learner, so every runner acts on the same.
"""

from __future__ import annotations

import os
import time
from typing import Any

from threadpoolctl import threadpool_limits

from trustrl.acting.collector import make_collector
from trustrl.config import Config
from trustrl.contract import PolicySnapshot, RolloutBatch, Runner, join
from trustrl.envs.rows import AgentGroup
from trustrl.remote.cluster import RayCluster, create_actor, import_ray

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


class RayRunners(Runner):
    """``config.runners.count`` runner actors with ``config.runner_envs`` envs each."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.cluster = RayCluster(config.runners.ray_address)
        self.cluster.start()
        try:
            ray = import_ray()
            self.ray = ray
            # Runner i on node i mod n (of the nodes with CPUs, in a fixed order), softly:
            # a node that went away leaves the choice to Ray. Ray's SPREAD strategy is a
            # preference that left both runners of a two-node test on one node.
            self.nodes = sorted(
                node["NodeID"]
                for node in ray.nodes()
                if node["Alive"] and node["Resources"].get("CPU", 0) > 0
            )
            self.restarts = 0
            self.failures_in_a_row = 0
            self.dropped = 0  # asynchronous batches too stale to train on
            self.lags: list[int] = []  # of the asynchronous batches last joined
            # Asynchronous rollouts that came in but wait for the next update.
            self.held: list[tuple[int, RolloutBatch]] = []
            self.inflight: dict[int, tuple[Any, float]] = {}  # runner -> (task, started)
            self.snapshot_ref: Any = None  # the newest snapshot in the object store
            self.snapshot_version = -1
            self.busy_seconds = 0.0
            self.metrics_since = time.monotonic()
            self.replaced = [0] * config.runners.count  # replacements of each runner
            self.actors = [self._start(i) for i in range(config.runners.count)]
            self.groups: list[AgentGroup] = ray.get(self.actors[0].groups.remote())
            self.num_envs = config.num_envs
        except BaseException:
            self.cluster.shutdown()
            raise

    def _seed(self, index: int) -> int:
        return self.config.seed + SEED_STRIDE * index + REPLACEMENT_STRIDE * self.replaced[index]

    def _start(self, index: int) -> Any:
        """Runner ``index``'s actor. No restarts by Ray itself (create_actor): a
        replacement gets a new seed and the current snapshot from here."""
        args = (self.config, self._seed(index), self.config.runner_envs, f"runner-{index}")
        node = self.nodes[index % len(self.nodes)]
        return create_actor(RunnerActor, args, node_id=node, soft=True)

    def _replace(self, index: int, why: str) -> None:
        self.restarts += 1
        self.failures_in_a_row += 1
        if self.failures_in_a_row >= self.config.runners.failures:
            raise RunnerFailedError(
                f"runner-{index} failed ({why}); {self.failures_in_a_row} runner failures "
                f"in a row (runners.failures = {self.config.runners.failures}): stopping"
            )
        self.ray.kill(self.actors[index], no_restart=True)
        self.replaced[index] += 1
        self.actors[index] = self._start(index)

    def collect(self, snapshot: PolicySnapshot, train: bool = True) -> RolloutBatch:
        """Synchronous: every runner's rollout of this snapshot, joined. Asynchronous
        (``runners.async_collection``): the next ``runners.rollouts_per_update`` batches any
        runners finish, each of a version no more than ``runners.max_version_lag`` behind this
        snapshot's, joined; a runner starts its next rollout on the newest snapshot as
        soon as it delivers one, so collection goes on while the learner updates."""
        if self.config.runners.async_collection:
            return self._next_batch(snapshot, train)
        ref = self.ray.put(snapshot)  # once per iteration, read by every runner
        for i in range(len(self.actors)):
            self._submit(i, ref, train)
        batches: dict[int, RolloutBatch] = {}
        while self.inflight:
            for i, batch in self._wait(ref, train, every=True):
                batches[i] = batch
        self.failures_in_a_row = 0
        self._account(batches.values())
        return join([batches[i] for i in range(len(self.actors))])

    def _next_batch(self, snapshot: PolicySnapshot, train: bool) -> RolloutBatch:
        if self.snapshot_ref is None or self.snapshot_version != snapshot.version:
            self.snapshot_ref = self.ray.put(snapshot)
            self.snapshot_version = snapshot.version
        ref = self.snapshot_ref
        for i in range(len(self.actors)):
            if i not in self.inflight:  # idle: start it on the newest snapshot
                self._submit(i, ref, train)
        wanted = self.config.runners.rollouts_per_update
        # One rollout per runner while there are as many runners as rollouts wanted: a
        # runner that delivers twice before another delivers once keeps its second for
        # the next update (taking it now would leave the slower runners' rollouts to go
        # stale, and halve the throughput with them).
        distinct = wanted <= len(self.actors)
        batches: list[tuple[int, RolloutBatch]] = []
        arrivals, self.held = self.held, []
        while len(batches) < wanted:
            if not arrivals:
                for i, batch in self._wait(ref, train, every=False):
                    self._submit(i, ref, train)  # at once: it collects while we update
                    self.failures_in_a_row = 0
                    self._account([batch])
                    arrivals.append((i, batch))
            while arrivals and len(batches) < wanted:
                i, batch = arrivals.pop(0)
                if snapshot.version - batch.version > self.config.runners.max_version_lag:
                    self.dropped += 1  # too stale to train on (RelayRL's max_version_lag)
                elif distinct and any(i == j for j, _ in batches):
                    self.held.append((i, batch))
                else:
                    batches.append((i, batch))
        self.held += arrivals
        self.lags = [snapshot.version - b.version for _, b in batches]
        return join([b for _, b in batches], mixed=True)

    def _submit(self, index: int, ref: Any, train: bool) -> None:
        self.inflight[index] = (self.actors[index].collect.remote(ref, train), time.monotonic())

    def _wait(self, ref: Any, train: bool, every: bool) -> list[tuple[int, RolloutBatch]]:
        """Wait for the runners in flight (all of them, or the first one); the batches that
        came, by runner. Lost runners are replaced and restarted on ``ref``."""
        from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

        ray, timeout = self.ray, self.config.runners.timeout
        index_of = {task: i for i, (task, _) in self.inflight.items()}
        oldest = min(started for _, started in self.inflight.values())
        wait_for = max(0.0, oldest + timeout - time.monotonic())
        ready, _ = ray.wait(
            list(index_of), num_returns=len(index_of) if every else 1, timeout=wait_for
        )
        came = []
        for task in ready:
            i = index_of[task]
            del self.inflight[i]
            try:
                came.append((i, ray.get(task)))
            except RayTaskError as error:  # the env or collector raised: not a lost runner
                raise error.as_instanceof_cause() from None
            except (RayActorError, GetTimeoutError) as error:
                self._replace(i, f"its process exited ({type(error).__name__})")
                self._submit(i, ref, train)
        now = time.monotonic()
        for i, (_, started) in list(self.inflight.items()):
            if now - started >= timeout:
                self._replace(i, f"no rollout within runners.timeout = {timeout} s")
                self._submit(i, ref, train)
        return came

    def _account(self, batches: Any) -> None:
        self.busy_seconds += sum(b.seconds for b in batches)

    def metrics(self) -> dict[str, float]:
        """Restarts and dropped batches so far; the runners' idle fraction since the last
        call (1 - time spent collecting / (runners x wall time))."""
        now = time.monotonic()
        span = max(now - self.metrics_since, 1e-9) * len(self.actors)
        idle = max(0.0, 1.0 - self.busy_seconds / span)
        self.metrics_since, self.busy_seconds = now, 0.0
        lags = {}
        if self.lags:  # asynchronous: the joined rollouts' own lags (each the same rows)
            lags = {"version_lag_mean": float(sum(self.lags)) / len(self.lags)}
            lags["version_lag_max"] = float(max(self.lags))
        return {
            "runner_restarts": float(self.restarts),
            "dropped_rollouts": float(self.dropped),
            "runner_idle": idle,
            **lags,
        }

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
