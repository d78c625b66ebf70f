"""The Ray instance a run uses: a private one on loopback that the run starts and stops,
or an existing cluster that it joins.

A local instance is started with ``address="local"``, so a stale
``/tmp/ray/ray_current_cluster`` left by a killed run never makes it attach to a dead
cluster; with the dashboard off; sized to this machine's CPUs; with Ray's token
authentication on; and with every listener on 127.0.0.1. Both of the last two are
checked after start, not assumed (ray#7418: for years Ray bound to all interfaces
whatever node IP it was given).

How the loopback binding is obtained in Ray 2.60 (read from its source, measured by
``tests/test_ray_cluster.py``):

* Ray's C++ servers (gcs_server, raylet, every core worker including the driver) listen
  on 127.0.0.1 when, and only when, the node IP they are given is 127.0.0.1; any other
  node IP makes them listen on all interfaces. The runtime-env agent listens on the node
  IP itself.
* On Linux, Ray's Python side rewrites a loopback node IP (``ray start
  --node-ip-address 127.0.0.1`` or ``ray.init(_node_ip_address="127.0.0.1")``) to the
  machine's outward address, so neither keeps Ray on loopback. The rewrite is skipped
  when ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` at the time Ray is imported: the
  single-machine mode Ray uses by default on Windows and macOS, where the node IP is
  127.0.0.1. That switch is read once, at ``import ray``; ``import_ray(loopback=True)``
  sets it for that import only. Its price: in that process Ray can no longer join a
  cluster on other machines (the driver would advertise 127.0.0.1), which
  :class:`RayCluster` checks for.
"""

from __future__ import annotations

import os
import sys
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import ModuleType, TracebackType
from typing import Any

INSTALL_HINT = "pip install 'trustrl[ray]'"
LOOPBACK = "127.0.0.1"

# Read by Ray at import: "0" turns off multi-machine mode, in which Ray replaces a
# loopback node IP with the machine's outward address (see the module docstring).
_SINGLE_MACHINE_SWITCH = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
_AUTH_MODE = "RAY_AUTH_MODE"


class RayUnavailableError(ImportError):
    """Ray is not installed: the message carries the command that installs it."""


def import_ray(*, loopback: bool = False) -> ModuleType:
    """Import Ray, or raise :class:`RayUnavailableError` with the install command.

    With ``loopback=True``, a first import in this process is made in Ray's
    single-machine mode (module docstring), so that a local instance started afterwards
    binds to 127.0.0.1. Where Ray was already imported, its mode is whatever that import
    chose; :class:`RayCluster` checks it before starting anything.
    """
    if "ray" in sys.modules or not loopback:
        return _import_ray()
    saved = SavedEnviron()
    saved.set({_SINGLE_MACHINE_SWITCH: "0"})
    try:
        return _import_ray()
    finally:
        saved.restore()


def _import_ray() -> ModuleType:
    try:
        import ray
    except ImportError as error:
        raise RayUnavailableError(
            f"runners > 0 need Ray, which is not installed; install it with: {INSTALL_HINT}"
        ) from error
    return ray


class SavedEnviron:
    """Environment variables changed now and put back later as they were (unset ones
    unset again): one record per variable, of its value before the first change."""

    def __init__(self) -> None:
        self.before: dict[str, str | None] = {}

    def keep(self, name: str) -> None:
        """Put ``name`` back as it is now at ``restore``, whoever changes it meanwhile."""
        self.before.setdefault(name, os.environ.get(name))

    def set(self, changes: Mapping[str, str]) -> None:
        for name, value in changes.items():
            self.keep(name)
            os.environ[name] = value

    def restore(self) -> None:
        for name, value in self.before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        self.before = {}


def machine_cpus() -> int:
    """CPUs this process may run on (the affinity mask where the OS has one, so a
    container or ``taskset`` limit is respected)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _is_loopback(host: str) -> bool:
    return host == "localhost" or host.startswith("127.") or host in ("::1", "[::1]")


class RayCluster:
    """The Ray instance of one run; a context manager that shuts down what it started.

    ``ray_address=None`` starts a private local instance (module docstring) and stops it
    at the end; any other value joins that cluster (``"auto"``, ``"host:port"`` or
    ``"ray://host:port"``) and at the end only disconnects this process from it. If this
    process is already connected to Ray (a notebook that called ``ray.init``), pass
    ``ray_address`` to use that connection as it is; it is left connected.

    ``num_cpus`` defaults to this machine's CPUs for a local instance; it is ignored when
    joining (the cluster's nodes declare their own). ``env_vars`` reach every Ray worker
    process of the run (e.g. thread-count variables for the runners).
    """

    def __init__(
        self,
        ray_address: str | None = None,
        *,
        num_cpus: int | None = None,
        object_store_memory: int | None = None,
        env_vars: Mapping[str, str] | None = None,
    ):
        if num_cpus is not None and num_cpus < 1:
            raise ValueError(f"num_cpus must be at least 1, got {num_cpus}")
        self.ray_address = ray_address
        self.num_cpus = num_cpus
        self.object_store_memory = object_store_memory
        self.env_vars = dict(env_vars or {})
        self.address: str | None = None
        self.node_ip_address: str | None = None
        self.started_instance = False  # True while a local instance of ours runs.
        self._connected = False  # True while this object holds a ray.init connection.
        self._environ = SavedEnviron()  # what start changed, put back by shutdown

    def __enter__(self) -> RayCluster:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.shutdown()

    def start(self) -> RayCluster:
        """Start the local instance or join the cluster; returns self."""
        if self._connected or self.started_instance:
            raise RuntimeError("this RayCluster is already started")
        if self.ray_address is None:
            self._start_local()
        else:
            self._join(self.ray_address)
        return self

    def shutdown(self) -> None:
        """Stop the local instance, or disconnect from the joined cluster; idempotent.

        Only what this object started is stopped: a joined cluster keeps running, and a
        connection this process had before is left alone.
        """
        if self._connected:
            ray = _import_ray()
            ray.shutdown()
            self._connected = False
            self.started_instance = False
        self._environ.restore()

    def _start_local(self) -> None:
        mode = os.environ.get(_AUTH_MODE)
        if mode is not None and mode.lower() != "token":
            raise ValueError(
                f"{_AUTH_MODE}={mode} is set, but trustrl starts its local Ray instance only "
                f"with token authentication; unset {_AUTH_MODE} or set it to 'token'"
            )
        # Inherited by the gcs_server, raylet and agents that ray.init spawns; restored at
        # shutdown. Usage statistics off: a private instance reports nowhere.
        changes = {"RAY_USAGE_STATS_ENABLED": "0"}
        # Ray reads the mode at import. Set before Ray's import; where Ray was imported
        # already with the mode unset, it must stay unset, as a mode that appears after
        # import is not seen by this process's client: Ray 2.60 then turns token
        # authentication on by itself for a new local instance. Both ways are checked
        # after start.
        if "ray" not in sys.modules or mode is not None:
            changes[_AUTH_MODE] = "token"
        self._environ.set(changes)
        self._environ.keep(_AUTH_MODE)  # Ray may set it: undo at the end
        try:
            self._start_local_instance()
        except BaseException:
            self.shutdown()
            raise

    def _start_local_instance(self) -> None:
        ray = import_ray(loopback=True)
        if ray.is_initialized():
            raise RuntimeError(
                "Ray is already initialized in this process; set runners.ray_address = 'auto' to "
                "run on that instance, or call ray.shutdown() first"
            )
        # Before starting anything: where this process's Ray was imported without the
        # single-machine switch (by the user, before trustrl), the instance would
        # listen on every interface.
        planned_ip = ray.util.get_node_ip_address()
        if not _is_loopback(planned_ip):
            raise RuntimeError(
                f"Ray was imported in multi-machine mode (node IP {planned_ip}), in which a "
                "local instance listens on all interfaces; import trustrl's Ray support "
                f"first, or set {_SINGLE_MACHINE_SWITCH}=0 before importing ray, or start "
                "Ray yourself (docs/distributed.md) and set runners.ray_address"
            )
        context = ray.init(
            address="local",
            num_cpus=self.num_cpus or machine_cpus(),
            object_store_memory=self.object_store_memory,
            include_dashboard=False,
            runtime_env={"env_vars": self.env_vars} if self.env_vars else None,
        )
        self._connected = True
        self.started_instance = True
        restrict_token_file()
        self.address = context.address_info["gcs_address"]
        self.node_ip_address = context.address_info["node_ip_address"]
        self._verify_local(ray)

    def _verify_local(self, ray: ModuleType) -> None:
        """Check that the instance just started is on loopback and asks for a token."""
        nodes = [node for node in ray.nodes() if node["Alive"]]
        addresses = {node["NodeManagerAddress"] for node in nodes}
        if self.address is None or not _is_loopback(self.address.rsplit(":", 1)[0]):
            raise RuntimeError(f"the local Ray instance is not on loopback: {self.address}")
        if not addresses or not all(_is_loopback(address) for address in addresses):
            raise RuntimeError(f"the local Ray node is not on loopback: {sorted(addresses)}")
        for node in nodes:
            _check_token_required(node["NodeManagerAddress"], node["RuntimeEnvAgentPort"])

    def _join(self, ray_address: str) -> None:
        host = ray_address.removeprefix("ray://").rsplit(":", 1)[0]
        # Token authentication by default here too (a mode the user set is kept): Ray reads
        # the mode at import, and a driver without it is turned away by a cluster that
        # asks for a token. The token itself comes from ~/.ray/auth_token or RAY_AUTH_TOKEN.
        if "ray" not in sys.modules and _AUTH_MODE not in os.environ:
            self._environ.set({_AUTH_MODE: "token"})
        # A cluster on this machine's loopback is reached in single-machine mode, as it was
        # started (docs/distributed.md); in multi-machine mode Ray would look for it at the
        # machine's outward address, where it does not listen, and retry forever.
        ray = import_ray(loopback=_is_loopback(host))
        if ray.is_initialized():
            # The user's own connection: use it, leave it connected at the end.
            self.address = ray.get_runtime_context().gcs_address
            self.node_ip_address = ray.util.get_node_ip_address()
            return
        local_ip = ray.util.get_node_ip_address()
        if ray_address != "auto" and _is_loopback(local_ip) != _is_loopback(host):
            raise RuntimeError(
                f"cannot join the cluster at {ray_address} from this process: its Ray was "
                f"imported in {'single' if _is_loopback(local_ip) else 'multi'}-machine mode "
                f"(node IP {local_ip}), which reaches only "
                f"{'loopback' if _is_loopback(local_ip) else 'outward'} addresses; use a fresh "
                f"process ({_SINGLE_MACHINE_SWITCH}=0 is set for a loopback cluster, at import)"
            )
        try:
            context = ray.init(
                address=ray_address,
                runtime_env={"env_vars": self.env_vars} if self.env_vars else None,
            )
        except BaseException:
            self._environ.restore()
            raise
        self._connected = True
        self.address = context.address_info.get("gcs_address") or ray_address
        self.node_ip_address = context.address_info.get("node_ip_address")


def token_file() -> Path:
    """Where Ray 2.60 writes the token a new local instance generates when it finds
    none (``ray._private.authentication``): ``~/.ray/auth_token``."""
    return Path.home() / ".ray" / "auth_token"


def restrict_token_file() -> None:
    """Make the token file readable by its owner alone: Ray writes it with the process's
    umask (world-readable, usually), and whoever reads it can run any code on the
    instance. Only a file of this user's is touched."""
    path = token_file()
    try:
        stat = path.stat()
        if stat.st_uid == os.getuid() and stat.st_mode & 0o077:
            path.chmod(stat.st_mode & 0o700)
    except FileNotFoundError:
        pass


def _check_token_required(host: str, port: int) -> None:
    """Ask the node's runtime-env agent for something without a token: it must refuse.

    The agent is the one HTTP listener of a minimal Ray node; its token middleware and the
    gRPC servers' authentication follow the same ``RAY_AUTH_MODE``. The gRPC side is
    checked by the tests (an unauthenticated driver is turned away).
    """
    request = urllib.request.Request(
        f"http://{host}:{port}/get_runtime_envs_info", data=b"", method="POST"
    )
    try:
        with _direct_opener().open(request, timeout=10):
            pass
    except urllib.error.HTTPError as error:
        if error.code == 401:
            return
        raise RuntimeError(
            f"Ray's runtime-env agent at {host}:{port} answered {error.code} to a request "
            "without a token; expected 401 (token authentication)"
        ) from error
    raise RuntimeError(
        f"Ray's runtime-env agent at {host}:{port} accepted a request without a token: "
        "token authentication is off"
    )


def _direct_opener() -> urllib.request.OpenerDirector:
    """An opener that ignores http_proxy and friends: a loopback request must not be
    handed to a proxy."""
    return urllib.request.build_opener(urllib.request.ProxyHandler({}))


def create_actor(
    actor_class: type,
    args: Sequence[Any] = (),
    *,
    num_cpus: float | None = None,
    resources: Mapping[str, float] | None = None,
    node_id: str | None = None,
    soft: bool = False,
    env_vars: Mapping[str, str] | None = None,
    name: str | None = None,
    namespace: str | None = None,
    max_concurrency: int | None = None,
    concurrency_groups: Mapping[str, int] | None = None,
) -> Any:
    """One actor of ``actor_class``, built with ``args``; returns its handle. Every actor
    of trustrl is made here.

    Ray never restarts it (``max_restarts=0``) nor retries its calls: a lost actor is
    replaced by its owner, with a fresh seed of its choosing, which a restart by Ray (same
    constructor arguments, same seed) would not give. ``num_cpus`` None keeps Ray's
    default for actors (one CPU to be placed, none held while it runs). ``node_id`` (a
    hex id from ``ray.nodes()``) places it on that node: hard (it waits for that node
    rather than run elsewhere), or with ``soft`` a preference that lets Ray choose when
    the node is gone. ``resources`` are custom resources it needs (another way to place
    it); ``env_vars`` reach its process; ``name`` and ``namespace`` make it findable with
    ``ray.get_actor``; ``max_concurrency`` and ``concurrency_groups`` let calls run on
    several threads at once (groups: a method called with
    ``.options(concurrency_group=...)`` waits only for calls of its own group).
    """
    ray = _import_ray()
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    options: dict[str, Any] = {"max_restarts": 0, "max_task_retries": 0}
    if num_cpus is not None:
        options["num_cpus"] = num_cpus
    if resources:
        options["resources"] = dict(resources)
    if node_id is not None:
        options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node_id, soft=soft)
    if env_vars:
        options["runtime_env"] = {"env_vars": dict(env_vars)}
    if name is not None:
        options["name"] = name
    if namespace is not None:
        options["namespace"] = namespace
    if max_concurrency is not None:
        options["max_concurrency"] = max_concurrency
    # Concurrency groups are a class option in Ray (``.options`` does not take them).
    groups = dict(concurrency_groups or {})
    remote_class = (
        ray.remote(concurrency_groups=groups)(actor_class) if groups else ray.remote(actor_class)
    )
    return remote_class.options(**options).remote(*args)
