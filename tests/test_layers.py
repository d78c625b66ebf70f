"""The layers are checked, not described (docs/design.md has the map).

* Direction: a module imports, at module level, only modules of its own layer or the
  layers below it (root, envs, acting, learner, run, remote, client, cli, bottom to top).
  Function-level imports are the documented lazy exceptions (``Agent.local`` runs a
  learner; the trainer starts Ray runners when asked for them).
* Heavy dependencies stay where they belong, checked in a fresh interpreter per package:
  importing every module of the root, envs and acting layers and of the agent client loads
  no torch; importing every module but the remote side and the CLI loads no Ray and no
  grpcio; the agent's gRPC link loads neither torch nor Ray; every module but plot, video
  and the CLI loads no matplotlib or moviepy.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import trustrl

PACKAGE = Path(trustrl.__file__).parent
LAYERS = ("root", "envs", "acting", "learner", "run", "remote", "client", "cli")


def modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        found[name.removesuffix(".__init__")] = path
    return found


def layer(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1 or parts[1] in ("config", "contract", "normalize"):
        return "root"
    if parts[1] == "cli":
        return "cli"
    assert parts[1] in LAYERS, f"{module} is in no layer: add its folder to LAYERS"
    return parts[1]


def module_level_imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import run when the module is imported: the top level and
    its plain ``if``/``try`` blocks, not functions, classes or ``if TYPE_CHECKING``."""
    found: list[tuple[int, str]] = []

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.Import):
                found.extend((node.lineno, alias.name) for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.extend((node.lineno, f"{node.module}.{a.name}") for a in node.names)
                found.append((node.lineno, node.module))
            elif isinstance(node, ast.If):
                if "TYPE_CHECKING" not in ast.unparse(node.test):
                    visit(node.body)
                    visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body)

    visit(ast.parse(path.read_text()).body)
    return found


def test_every_module_is_in_a_layer() -> None:
    for module in modules():
        layer(module)


def test_lower_layers_never_import_higher_ones() -> None:
    known = modules()
    wrong = []
    for module, path in known.items():
        here = LAYERS.index(layer(module))
        for line, target in module_level_imports(path):
            if target in known and LAYERS.index(layer(target)) > here:
                wrong.append(
                    f"{path.relative_to(PACKAGE.parent)}:{line} ({layer(module)}) "
                    f"imports {target} ({layer(target)})"
                )
    assert not wrong, "\n".join(wrong)


def test_the_checker_sees_a_wrong_import(tmp_path: Path) -> None:
    source = tmp_path / "m.py"
    source.write_text(
        "from typing import TYPE_CHECKING\nimport numpy\nif TYPE_CHECKING:\n"
        "    import trustrl.run.trainer\ndef f():\n    import trustrl.remote.cluster\n"
        "from trustrl.learner import policy\n"
    )
    imports = [target for _, target in module_level_imports(source)]
    assert imports == [
        "typing.TYPE_CHECKING",
        "typing",
        "numpy",
        "trustrl.learner.policy",
        "trustrl.learner",
    ]


def _loaded_after_importing(names: list[str], heavy: list[str]) -> list[str]:
    """Import ``names`` in a fresh interpreter; which of ``heavy`` got loaded."""
    code = (
        "import importlib, sys\n"
        f"for name in {names!r}:\n    importlib.import_module(name)\n"
        f"print(' '.join(h for h in {heavy!r} if h in sys.modules))\n"
    )
    child = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300
    )
    assert child.returncode == 0, child.stderr[-3000:]
    return child.stdout.split()


def _modules_of(*layers: str, but: tuple[str, ...] = ()) -> list[str]:
    return [m for m in modules() if layer(m) in layers and m not in but]


def test_root_envs_acting_and_the_agent_client_import_no_torch() -> None:
    names = _modules_of("root", "envs", "acting", "client")
    assert "trustrl.acting.collector" in names and "trustrl.client.agent" in names
    assert _loaded_after_importing(names, ["torch"]) == []


def test_only_the_remote_side_imports_ray() -> None:
    names = _modules_of(*LAYERS[:-1], but=tuple(m for m in modules() if layer(m) == "remote"))
    assert _loaded_after_importing(names, ["ray"]) == []


def test_only_the_remote_side_imports_grpc() -> None:
    names = _modules_of(*LAYERS[:-1], but=tuple(m for m in modules() if layer(m) == "remote"))
    assert _loaded_after_importing(names, ["grpc"]) == []


def test_the_agents_grpc_link_imports_neither_torch_nor_ray() -> None:
    # What an agent-only machine runs: Agent.connect("grpc://...") and its link.
    names = ["trustrl.client.agent", "trustrl.remote.grpc_link", "trustrl.remote.thin"]
    assert _loaded_after_importing(names, ["torch", "ray"]) == []


def test_only_plot_and_video_import_matplotlib_and_moviepy() -> None:
    names = _modules_of(*LAYERS[:-1], but=("trustrl.run.plot", "trustrl.run.video"))
    assert _loaded_after_importing(names, ["matplotlib", "moviepy"]) == []


@pytest.mark.parametrize("module", ["trustrl.run.plot", "trustrl.run.video"])
def test_plot_and_video_import_their_libraries_only_when_used(module: str) -> None:
    assert _loaded_after_importing([module], ["matplotlib", "moviepy"]) == []
