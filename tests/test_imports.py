"""The package's import graph has no cycle, lazy (function-level) imports included."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import trustrl

ROOT = Path(trustrl.__file__).parent


def import_graph() -> dict[str, set[str]]:
    modules = {}
    for path in ROOT.rglob("*.py"):
        name = ".".join(path.relative_to(ROOT.parent).with_suffix("").parts)
        modules[name.removesuffix(".__init__")] = path
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                targets = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            graph[name].update(t for t in targets if t in modules and t != name)
    return graph


def test_no_import_cycles() -> None:
    graph = import_graph()
    assert "trustrl.envs.gym" in graph and "trustrl.learner.policy" in graph
    done: set[str] = set()

    def visit(name: str, path: list[str]) -> None:
        if name in path:
            cycle = " -> ".join([*path[path.index(name) :], name])
            raise AssertionError(f"import cycle: {cycle}")
        if name in done:
            return
        for target in sorted(graph[name]):
            visit(target, [*path, name])
        done.add(name)

    for name in sorted(graph):
        visit(name, [])


# The acting side (a Ray runner, an external agent) needs no torch: it acts on a policy
# snapshot's numpy arrays. A child process with torch made unimportable collects with a
# snapshot the learner made, and an agent acts on it and ships its episodes.
ACT_WITHOUT_TORCH = """
import sys
sys.modules["torch"] = None  # any import of torch now raises ImportError
from pathlib import Path
from trustrl.acting.collector import make_collector
from trustrl.config import resolve
from trustrl.remote.wire import decode_snapshot
import trustrl.client.agent, trustrl.remote.runners

env_id, folder = sys.argv[1], Path(sys.argv[2])
config = resolve(env_id, overrides={"env": {"num_envs": 2}, "rollout": {"num_steps": 64}})
collector = make_collector(config, seed=3, num_envs=2)
data = (folder / "snapshot").read_bytes()
snapshot = decode_snapshot(data)
for _ in range(2):
    batch = collector.collect(snapshot)
collector.state_dict()

# An agent acts on the snapshot and ships its episodes to an inbox, all without torch.
if ":" not in env_id:
    import gymnasium as gym
    from trustrl.client.agent import Agent, LocalLink
    from trustrl.remote.external import external_groups, learner_info
    from trustrl.remote.inbox import Inbox

    groups = external_groups(config)
    inbox = Inbox(groups, learner_info(config, groups))
    inbox.publish(snapshot.version, data)
    env = gym.make(env_id)
    with Agent(LocalLink(inbox), seed=0) as agent:
        for episode in range(2):
            obs, _ = env.reset(seed=episode)
            action, done = agent.act(obs), False
            while not done:
                obs, reward, terminated, truncated, _ = env.step(action)
                done = terminated or truncated
                if done:
                    agent.end_episode(float(reward), truncated=truncated and not terminated)
                else:
                    action = agent.act(obs, reward=float(reward))
        assert agent.flush(timeout=30)
    assert inbox.status()["received"] >= 2, inbox.status()
assert "torch" not in sys.modules or sys.modules["torch"] is None
print(batch.env_steps, batch.version)
"""


@pytest.mark.parametrize("env_id", ["CartPole-v1", "Pendulum-v1", "mpe2:simple_spread_v3"])
def test_the_acting_side_runs_without_torch(env_id: str, tmp_path: Path) -> None:
    from trustrl.config import resolve
    from trustrl.remote.wire import encode_snapshot
    from trustrl.run.trainer import Trainer

    config = resolve(env_id, overrides={"env": {"num_envs": 2}, "rollout": {"num_steps": 64}})
    trainer = Trainer(config, tmp_path / "run")
    (tmp_path / "snapshot").write_bytes(encode_snapshot(trainer.snapshot()))
    child = subprocess.run(
        [sys.executable, "-c", ACT_WITHOUT_TORCH, env_id, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert child.returncode == 0, child.stderr[-3000:]
    steps, version = child.stdout.split()
    assert int(steps) > 0 and int(version) == 0
