"""The Ray instance trustrl starts: loopback only, token authentication on, nothing left behind.

Measured, not assumed: every process the instance started (the driver, gcs_server, raylet,
the runtime-env agent, every worker) is listed with psutil, and each listening socket
must be on loopback (127.0.0.0/8, ::1, or an IPv4-mapped 127.x). No component is excepted:
with the settings of ``trustrl.remote.cluster`` none listens elsewhere in Ray 2.60.
Token authentication is checked by being refused: the runtime-env agent's HTTP endpoint
without a token, and a driver with a wrong token at the GCS.

The socket tables are printed past pytest's capture; xdist workers' output is not shown,
so run ``pytest -p no:xdist tests/test_ray_cluster.py`` to see them. The tests share one
xdist group (``--dist loadgroup`` in scripts/test), so no two Ray instances run
at once and this worker's first ``import ray`` is trustrl's.
"""

from __future__ import annotations

import importlib.util
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="needs trustrl[ray]"),
    pytest.mark.xdist_group("ray"),
    # A hang inside Ray startup fails the test rather than the CI run.
    pytest.mark.time_limit(90),
]

psutil = pytest.importorskip("psutil")

from trustrl.remote.cluster import (  # noqa: E402
    RayCluster,
    create_actor,
    import_ray,
)


class Probe:
    """Says its process id and node, from inside a Ray worker."""

    def where(self) -> tuple[int, str]:
        import ray

        return os.getpid(), ray.get_runtime_context().get_node_id()

    def getenv(self, name: str) -> str | None:
        return os.environ.get(name)


def is_loopback(ip: str) -> bool:
    return ip.startswith("127.") or ip == "::1" or ip.startswith("::ffff:127.")


def component(process: psutil.Process) -> str:
    if process.pid == os.getpid():
        return "driver (this test)"
    name = process.name()
    if name.startswith("ray::"):
        title = name.removeprefix("ray::").strip()
        return title if title.endswith("Agent") else f"worker {title}"
    if name.startswith("python"):  # Ray's Python services (with ray[default]: dashboard.py)
        scripts = [Path(part).name for part in process.cmdline() if part.endswith(".py")]
        return scripts[0] if scripts else name
    return name


def ray_processes(session_dir: str) -> dict[int, psutil.Process]:
    """The driver, every process below it, and any process naming this session in its
    command line (one that detached from the tree would be caught by that)."""
    me = psutil.Process()
    found = {me.pid: me}
    found.update({child.pid: child for child in me.children(recursive=True)})
    session = Path(session_dir).name
    for process in psutil.process_iter(["cmdline"]):
        if any(session in part for part in process.info["cmdline"] or ()):
            found.setdefault(process.pid, process)
            found.update({child.pid: child for child in process.children(recursive=True)})
    return found


def listeners(processes: dict[int, psutil.Process]) -> list[tuple[str, int, str, str, int]]:
    """(component, pid, protocol, address, port) of every listening TCP socket and every
    unconnected bound UDP socket."""
    rows = []
    for pid, process in sorted(processes.items()):
        try:
            connections = process.net_connections(kind="inet")
            name = component(process)
        except psutil.NoSuchProcess:
            continue
        for conn in connections:
            tcp = conn.type == socket.SOCK_STREAM
            if (tcp and conn.status == psutil.CONN_LISTEN) or (not tcp and not conn.raddr):
                rows.append((name, pid, "tcp" if tcp else "udp", conn.laddr.ip, conn.laddr.port))
    return rows


@pytest.fixture
def show(request: pytest.FixtureRequest) -> Callable[[str], None]:
    """Print past pytest's capture, as ``capsys.disabled()`` does, without the capsys
    fixture: that one swaps sys.stderr for a stream closed after the test, which Ray's log
    handler (made at Ray's first log line) would keep writing to."""
    capture = request.config.pluginmanager.getplugin("capturemanager")

    def write(text: str) -> None:
        with capture.global_and_fixture_disabled():
            print(text, flush=True)

    return write


def table(title: str, rows: list[tuple[str, int, str, str, int]]) -> str:
    lines = [title, f"{'component':<24} {'pid':>7}  {'proto':<5} {'address':<18} port"]
    lines += [f"{c:<24} {pid:>7}  {proto:<5} {ip:<18} {port}" for c, pid, proto, ip, port in rows]
    return "\n" + "\n".join(lines)


def assert_all_loopback(rows: list[tuple[str, int, str, str, int]]) -> None:
    exposed = [row for row in rows if not is_loopback(row[3])]
    assert not exposed, f"Ray listens beyond loopback: {exposed}"


def assert_gone(processes: dict[int, psutil.Process], session_dir: str) -> None:
    deadline = time.monotonic() + 15
    alive: list[psutil.Process] = []
    while time.monotonic() < deadline:
        alive = [p for pid, p in processes.items() if pid != os.getpid() and _alive(p)]
        alive += [p for p in ray_processes(session_dir).values() if p.pid != os.getpid()]
        if not alive:
            return
        time.sleep(0.2)
    raise AssertionError(f"Ray processes left after shutdown: {[(p.pid, p.name()) for p in alive]}")


def _alive(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def refused_by_gcs(gcs_address: str, env: dict[str, str]) -> bool:
    """Start a driver with ``env`` against the GCS; True when the GCS turns it away for its
    token. The driver retries forever, so it is stopped once the refusal shows."""
    code = f"import ray; ray.init(address={gcs_address!r}); print('CONNECTED', flush=True)"
    child = subprocess.Popen(
        [sys.executable, "-c", code],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    seen: list[str] = []

    def read() -> None:
        assert child.stdout is not None
        for line in child.stdout:
            seen.append(line)
            if "InvalidAuthToken" in line or "CONNECTED" in line:
                return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout=45)
    child.kill()
    child.wait()
    text = "".join(seen)
    assert "CONNECTED" not in text, f"a driver with {env.get('RAY_AUTH_MODE')} connected: {text}"
    assert "InvalidAuthToken" in text, f"no token refusal in the driver's output: {text[-3000:]}"
    return True


def unauthenticated_env(**extra: str) -> dict[str, str]:
    """This environment without Ray's token settings. Single-machine mode, as in the
    instance's own processes: otherwise Ray would rewrite 127.0.0.1 to the machine's
    outward address, where nothing of this instance listens."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    return {**env, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", **extra}


def test_local_instance_listens_on_loopback_only_and_requires_a_token(show):
    import urllib.error
    import urllib.request

    started = time.perf_counter()
    with RayCluster(num_cpus=2, env_vars={"TRUSTRL_RAY_PROBE": "reached"}) as cluster:
        startup_s = time.perf_counter() - started
        ray = import_ray()
        assert cluster.started_instance
        assert cluster.node_ip_address == "127.0.0.1"
        assert cluster.address is not None and cluster.address.startswith("127.0.0.1:")
        assert os.environ["RAY_AUTH_MODE"] == "token"
        # Two actors, so that worker processes (not only idle ones) are in the table.
        probes = [create_actor(Probe, num_cpus=0.5) for _ in range(2)]
        ray.get([probe.where.remote() for probe in probes], timeout=60)
        assert ray.get(probes[0].getenv.remote("TRUSTRL_RAY_PROBE"), timeout=60) == "reached"
        session_dir = _node_session_dir(ray)
        processes = ray_processes(session_dir)
        rows = listeners(processes)
        show(table(f"Ray 2.60 local instance (started in {startup_s:.1f} s)", rows))
        names = {row[0] for row in rows}
        assert {"driver (this test)", "gcs_server", "raylet", "RuntimeEnvAgent"} <= names
        assert any(name.startswith("worker ") for name in names)
        assert_all_loopback(rows)

        node = ray.nodes()[0]
        direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # no proxy
        agent = f"http://127.0.0.1:{node['RuntimeEnvAgentPort']}/get_runtime_envs_info"
        for headers, status in (({}, 401), ({"Authorization": "Bearer " + "0" * 32}, 403)):
            request = urllib.request.Request(agent, data=b"", method="POST", headers=headers)
            with pytest.raises(urllib.error.HTTPError) as refused:
                direct.open(request, timeout=10)
            assert refused.value.code == status
        wrong_token = secrets.token_hex(16)
        assert refused_by_gcs(
            cluster.address, unauthenticated_env(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=wrong_token)
        )
        assert refused_by_gcs(cluster.address, unauthenticated_env(RAY_AUTH_MODE="disabled"))
    assert not ray.is_initialized()
    assert not cluster.started_instance
    assert_gone(processes, session_dir)
    assert "RAY_AUTH_MODE" not in os.environ or os.environ["RAY_AUTH_MODE"] == "token"


def _node_session_dir(ray: Any) -> str:
    socket_path = ray.nodes()[0]["RayletSocketName"]  # <session>/sockets/raylet
    return str(Path(socket_path).parent.parent)


@pytest.fixture
def private_ray_tmpdir(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Ray's temp root (session folders, ``ray_current_cluster``) in a folder of this test
    alone, through ``RAY_TMPDIR``, so that what the test writes there cannot mislead another
    Ray user on the machine. Short (under /tmp), for Unix socket path limits."""
    folder = Path(tempfile.mkdtemp(prefix="trl", dir="/tmp"))
    monkeypatch.setenv("RAY_TMPDIR", str(folder))
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def test_stale_cluster_record_does_not_make_startup_attach(monkeypatch, private_ray_tmpdir):
    """A killed run leaves ``ray_current_cluster`` (and maybe ``RAY_ADDRESS``) pointing at a
    dead GCS; a new run must start its own instance, promptly."""
    record = private_ray_tmpdir / "ray" / "ray_current_cluster"  # where ray.init() looks
    record.parent.mkdir(parents=True)
    dead = "127.0.0.1:1"  # nothing listens on port 1
    record.write_text(dead)
    monkeypatch.setenv("RAY_ADDRESS", dead)
    started = time.perf_counter()
    with RayCluster(num_cpus=1) as cluster:
        assert cluster.started_instance
        assert cluster.address != dead
        ray = import_ray()
        assert ray.get(ray.put(7)) == 7
        session_dir = _node_session_dir(ray)
        assert Path(session_dir).is_relative_to(private_ray_tmpdir)
        processes = ray_processes(session_dir)
    assert time.perf_counter() - started < 60
    assert_gone(processes, session_dir)


def test_two_nodes_on_one_machine_host_one_actor_each(show, monkeypatch, private_ray_tmpdir):
    """``ray.cluster_utils.Cluster``: a head and a second node, both on loopback, an actor
    pinned to each by ``create_actor``'s node placement and one placed by a custom
    resource; everything stopped afterwards. (Cluster writes ``ray_current_cluster``: in
    the private temp root.)"""
    # Token authentication as RayCluster sets it: the mode before Ray's import (which
    # reads it), Ray's default token (one given by RAY_AUTH_TOKEN here would not reach this
    # process's token cache, filled by the tests before); `ray get-auth-token --generate`
    # creates the token where it is missing.
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    ray = import_ray(loopback=True)
    from ray.cluster_utils import Cluster

    assert not ray.is_initialized()
    ray_cli = Path(sys.executable).with_name("ray")
    subprocess.run([str(ray_cli), "get-auth-token", "--generate"], check=True, capture_output=True)
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "resources": {"node_a": 1}, "include_dashboard": False},
    )
    processes: dict[int, psutil.Process] = {}
    session_dir = ""
    try:
        cluster.add_node(num_cpus=1, resources={"node_b": 1})
        with RayCluster(ray_address=cluster.address) as joined:
            assert not joined.started_instance
            nodes = [node for node in ray.nodes() if node["Alive"]]
            assert len(nodes) == 2
            assert {node["NodeManagerAddress"] for node in nodes} == {"127.0.0.1"}
            node_ids = [node["NodeID"] for node in nodes]
            actors = [create_actor(Probe, num_cpus=0.5, node_id=node) for node in node_ids]
            placed = ray.get([actor.where.remote() for actor in actors], timeout=60)
            assert [node_id for _, node_id in placed] == node_ids
            (node_b,) = [node["NodeID"] for node in nodes if "node_b" in node["Resources"]]
            by_resource = create_actor(Probe, num_cpus=0, resources={"node_b": 1})
            assert ray.get(by_resource.where.remote(), timeout=60)[1] == node_b
            session_dir = _node_session_dir(ray)
            processes = ray_processes(session_dir)
            rows = listeners(processes)
            show(table("Ray 2.60 two-node cluster on one machine", rows))
            assert sum(row[0] == "raylet" for row in rows) >= 2
            assert_all_loopback(rows)
        assert not ray.is_initialized()
        # Joined, not started: leaving it disconnected this process and stopped nothing.
        services = {pid for name, pid, *_ in rows if name in ("gcs_server", "raylet")}
        assert len(services) == 3 and all(_alive(processes[pid]) for pid in services)
    finally:
        cluster.shutdown()
    if session_dir:
        assert_gone(processes, session_dir)


def test_ray_imported_in_multi_machine_mode_is_refused_before_anything_starts():
    """A program that imported ray itself, before trustrl, would get an instance listening
    on every interface: RayCluster says so and starts nothing."""
    code = (
        "import ray\n"
        "from trustrl.remote import RayCluster\n"
        "try:\n"
        "    RayCluster(num_cpus=1).start()\n"
        "except RuntimeError as error:\n"
        "    print('REFUSED', error)\n"
        "print('INITIALIZED', ray.is_initialized())\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert "REFUSED Ray was imported in multi-machine mode" in done.stdout, done.stderr[-2000:]
    assert "INITIALIZED False" in done.stdout
