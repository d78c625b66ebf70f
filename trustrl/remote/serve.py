"""``trustrl serve``: a learner that external agents in other processes reach through Ray.

The learner is the ordinary Trainer over an ``ExternalRunner`` (external.py), in the
serving process; its ``Inbox`` is a named Ray actor (namespace ``trustrl``), pinned to
the learner's node so that its spool is in the run folder. Agents find it by name
(``trustrl.Agent.connect(NAME, address)``) and call it with bytes only (chunks and
snapshots are safetensors payloads). The actor belongs to the serving process: when the
learner stops, the name is free, agents queue, and a resumed learner
(``trustrl serve --resume RUN_DIR``) takes the name again and drains them.
"""

from __future__ import annotations

import shutil
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trustrl.config import Config, ConfigError
from trustrl.remote.cluster import RayCluster, create_actor, import_ray
from trustrl.remote.external import (
    ExternalRunner,
    external_groups,
    learner_config,
    learner_info,
    max_chunk,
    queue_capacity,
)
from trustrl.remote.inbox import Inbox
from trustrl.remote.wire import LinkError

if TYPE_CHECKING:
    from trustrl.remote.gateway import GatewaySettings

NAMESPACE = "trustrl"
LINGER_SECONDS = 2.0
"""How long a finished learner stays up so that its agents hear that it finished."""
CALL_SECONDS = 10.0
WATCHERS = "watchers"
"""The inbox actor's concurrency group for agents' long polls (``Inbox.latest``): each
waits on a thread of its own, and the agents' deliveries and the learner's calls never
wait behind them."""
MAX_WATCHERS = 256
"""Agents that can wait for a new policy at once (a thread each, mostly asleep); past
that, a long poll waits for a free thread, which the agent sees as a slow answer."""


class RemoteInbox:
    """The learner's side of the inbox actor, with the Inbox's learner-side methods, and
    the agents' ``submit_many`` and ``status`` for the gateway (gateway.py) in the serving
    process."""

    def __init__(self, handle: Any) -> None:
        self.ray = import_ray()
        self.handle = handle

    def publish(self, version: int, data: bytes) -> None:
        self.ray.get(self.handle.publish.remote(version, data))

    def take(
        self, timeout: float, needs: Sequence[int], version: int, max_lag: int
    ) -> dict[str, Any]:
        return dict(self.ray.get(self.handle.take.remote(timeout, needs, version, max_lag)))

    def release(self, upto: int) -> None:
        self.ray.get(self.handle.release.remote(upto))

    def finish(self) -> None:
        self.ray.get(self.handle.finish.remote())

    def submit_many(self, chunks: list[bytes]) -> list[dict[str, Any]]:
        return list(self._agents_call("submit_many", chunks))

    def status(self) -> dict[str, Any]:
        return dict(self._agents_call("status"))

    def _agents_call(self, method: str, *args: Any) -> Any:
        """An agent's call, made by the gateway: a failure is a LinkError (the gateway
        answers UNAVAILABLE, and the agent retries)."""
        try:
            return self.ray.get(getattr(self.handle, method).remote(*args), timeout=CALL_SECONDS)
        except self.ray.exceptions.RayError as exc:
            raise LinkError(f"the inbox actor: {type(exc).__name__}") from None


class RayLink:
    """An agent's way to the inbox actor ``name`` on the cluster at ``address``: every
    failure (no such actor yet, the actor died, a call timed out) is a LinkError, and the
    name is looked up again at the next call, so a restarted learner is found."""

    def __init__(self, name: str, address: str, timeout: float = 60.0) -> None:
        self.name = name
        self.timeout = timeout
        self.cluster = RayCluster(address)
        self.cluster.start()
        self.ray = import_ray()
        self.handle: Any = None

    def _call(self, method: str, *args: Any, wait: float = 0.0, group: str | None = None) -> Any:
        """``method(*args)`` on the inbox actor, which may take ``wait`` seconds besides
        the call's own; ``group``: the actor's concurrency group to run it in."""
        ray = self.ray
        try:
            if self.handle is None:
                self.handle = ray.get_actor(self.name, namespace=NAMESPACE)
            call = getattr(self.handle, method)
            if group is not None:
                call = call.options(concurrency_group=group)
            return ray.get(call.remote(*args), timeout=CALL_SECONDS + wait)
        except (ValueError, ray.exceptions.RayError) as exc:
            self.handle = None
            raise LinkError(f"learner {self.name!r} unreachable ({type(exc).__name__})") from None

    def info(self) -> dict[str, Any]:
        """The learner's settings, waiting up to ``timeout`` for it to come up."""
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                return dict(self._call("info"))
            except LinkError:
                if time.monotonic() > deadline:
                    raise LinkError(
                        f"no learner named {self.name!r} on the Ray cluster at "
                        f"{self.cluster.address} within {self.timeout:g} s (is `trustrl serve "
                        f"--name {self.name}` running there?)"
                    ) from None
                time.sleep(0.5)

    def submit_many(self, chunks: list[bytes]) -> list[dict[str, Any]]:
        return list(self._call("submit_many", chunks))

    def latest(self, have: int, timeout: float = 0.0, watcher: str = "") -> dict[str, Any]:
        """``Inbox.latest``: a long poll of up to ``timeout`` seconds, on a thread of the
        actor's own for watchers."""
        return dict(self._call("latest", have, timeout, watcher, wait=timeout, group=WATCHERS))

    def wake(self, watcher: str) -> None:
        """``Inbox.wake``: end ``watcher``'s long poll."""
        self._call("wake", watcher)

    def close(self) -> None:
        self.cluster.shutdown()


def serve(
    config: Config,
    name: str,
    run_dir: str | Path | None = None,
    *,
    resume: bool = False,
    overwrite: bool = False,
    ray_address: str | None = None,
    announce: Any = print,
    gateway: GatewaySettings | None = None,
) -> Any:
    """Run the learner ``name`` until ``total_steps`` (or Ctrl-C); returns the Trainer.
    ``announce`` gets the lines that tell agents where to connect; ``gateway``: also
    serve agents over gRPC (gateway.py), in this process."""
    from trustrl.run.trainer import Trainer, check_new_run_folder, default_run_dir

    config, notes = learner_config(config)
    groups = external_groups(config)
    folder = Path(run_dir or config.run_dir or default_run_dir(config)).resolve()
    spool = folder / "inbox"
    if not resume:
        check_new_run_folder(folder, overwrite)
        if overwrite and spool.is_dir():
            shutil.rmtree(spool)  # an earlier run's chunks are not this run's
    cluster = RayCluster(ray_address or config.runners.ray_address)
    cluster.start()  # first: it chooses the mode Ray is imported in (cluster.py)
    server = None
    try:
        ray = import_ray()
        try:
            handle = create_actor(
                Inbox,
                (
                    groups,
                    learner_info(config, groups),
                    str(spool),
                    max_chunk(config),
                    queue_capacity(config, groups),
                ),
                num_cpus=0,
                node_id=ray.get_runtime_context().get_node_id(),  # the spool is in the run folder
                name=name,
                namespace=NAMESPACE,
                max_concurrency=32,  # agents' calls while the learner waits in take()
                concurrency_groups={WATCHERS: MAX_WATCHERS},
            )
            ray.get(handle.status.remote())
        except ValueError as exc:  # the name is taken
            raise ConfigError(
                f"--name {name!r}: a learner of that name is already serving on this cluster "
                f"({exc})"
            ) from None
        inbox: Any = RemoteInbox(handle)
        if gateway is not None:
            from trustrl.remote.gateway import gateway_for, start_server

            info = learner_info(config, groups)
            front = gateway_for(config, groups, info, inbox, folder, gateway, max_chunk(config))
            inbox = front.watch(inbox)
            server, where = start_server(
                front, gateway, lambda line: print(line, file=sys.stderr, flush=True)
            )
            url = f"{'grpcs' if gateway.tls_cert else 'grpc'}://{where}"
            announce(
                f"gateway on {url}: agents connect with trustrl.Agent.connect({url!r}, "
                f"token=...), each with a token of `trustrl agents add {folder} NAME`"
            )
        runner = ExternalRunner(config, groups, inbox)
        trainer = Trainer(config, folder, resume=resume, overwrite=overwrite, runner=runner)
        trainer.notes += notes
        runner.publish(trainer.snapshot())
        announce(
            f"serving {name!r} on the Ray cluster at {cluster.address}: agents connect with "
            f"trustrl.Agent.connect({name!r}, address={cluster.address!r})"
        )
        try:
            trainer.train()
        finally:
            runner.inbox.finish()
            time.sleep(LINGER_SECONDS)
        return trainer
    finally:
        if server is not None:
            from trustrl.remote.gateway import stop_server

            stop_server(server)
        cluster.shutdown()
