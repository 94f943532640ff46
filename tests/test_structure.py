"""The import graph: no cycles anywhere in rlorch, orchestrator components never import each other
or the loop, launch's command builders never import each other, nothing the runner drives imports
the runner, and the top level stays small."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "rlorch"
COMPONENTS = {"dispatcher", "sinks", "gate", "watcher", "metrics", "ledger", "checkpoints", "evaluation", "steps",
              "stops", "filing", "shipping", "idle", "runstats", "loggers", "swap"}
"""Orchestrator components: none imports another or the loop; ``loop.py`` wires them."""
TOP_LEVEL_LIMIT = 10


def module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, root: Path = PACKAGE) -> set[str]:
    """Every module ``path`` imports, at module level or inside a function, absolute or relative,
    as dotted names (``from a import b`` yields ``a`` and ``a.b``)."""
    package = module_name(path, root)
    if path.name != "__init__.py":
        package = package.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    """Module -> the package's own modules it imports (importing ``a.b`` runs ``a`` first)."""
    modules = {module_name(path, root): path for path in root.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        edges = set()
        for target in imports_of(path, root):
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                edges.add(target)
        graph[name] = edges
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected set of two or more modules, each as one cycle through it."""
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            members = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                members.append(member)
                if member == node:
                    break
            if len(members) > 1:
                cycles.append(_one_cycle(graph, set(members)))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return cycles


def _one_cycle(graph: dict[str, set[str]], members: set[str]) -> list[str]:
    start = min(members)
    path, seen, node = [start], {start}, start
    while True:
        node = min(n for n in graph[node] if n in members)
        if node in seen:
            return path[path.index(node):] + [node]
        path.append(node)
        seen.add(node)


def test_no_import_cycles():
    cycles = find_cycles(import_graph())
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def component_violations(root: Path = PACKAGE, components: set[str] = COMPONENTS) -> list[str]:
    """Each orchestrator component of ``root`` that imports another component or the loop."""
    orchestrator = root / "orchestrator"
    found = []
    for name in sorted(components):
        forbidden = {f"rlorch.orchestrator.{other}" for other in (components - {name}) | {"loop"}}
        bad = imports_of(orchestrator / f"{name}.py", root) & forbidden
        if bad:
            found.append(f"orchestrator/{name}.py imports {sorted(bad)}")
    return found


def test_orchestrator_components_import_no_other_component_and_not_the_loop():
    assert component_violations() == []


def test_launch_command_builders_do_not_import_each_other_and_the_plan_imports_neither():
    launch = PACKAGE / "launch"
    builders = {"server_command", "trainer_command"}
    for name in builders:
        other = f"rlorch.launch.{(builders - {name}).pop()}"
        assert other not in imports_of(launch / f"{name}.py"), f"launch/{name}.py imports {other}"
    placement = imports_of(launch / "placement.py")
    assert not placement & {f"rlorch.launch.{b}" for b in builders}, "launch/placement.py imports a builder"


def test_nothing_below_the_runner_imports_it():
    for path in PACKAGE.rglob("*.py"):
        if path.name in ("runner.py", "cli.py"):
            continue
        assert "rlorch.runner" not in imports_of(path), f"{path.relative_to(PACKAGE)} imports rlorch.runner"


def test_every_orchestrator_module_is_a_component_or_the_loop():
    modules = {p.stem for p in (PACKAGE / "orchestrator").glob("*.py")} - {"__init__", "loop"}
    assert modules == COMPONENTS, f"not covered by the import rule: {sorted(modules - COMPONENTS)}"
    assert (PACKAGE / "orchestrator" / "loop.py").read_text().count("\n") <= 310


def test_top_level_is_small_and_every_package_says_what_it_owns():
    top = sorted(p.stem for p in PACKAGE.glob("*.py") if p.name != "__init__.py")
    assert len(top) <= TOP_LEVEL_LIMIT, f"{len(top)} top-level modules: {top}"
    for init in PACKAGE.rglob("__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc and len(doc) > 40, f"{init.relative_to(PACKAGE.parent)} has no docstring saying what it owns"


def _write_package(root: Path, modules: dict[str, str]) -> Path:
    package = root / "rlorch"
    for name, source in modules.items():
        path = package / (name.replace(".", "/") + ".py")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source)
    return package


def test_the_cycle_check_names_a_cycle_made_by_a_function_level_or_relative_import(tmp_path):
    package = _write_package(tmp_path, {
        "__init__": "",
        "launch/__init__": "",
        "launch/placement": "def plan():\n    from rlorch.launch.server_command import build\n",
        "launch/server_command": "from .placement import plan\n",
        "config": "X = 1\n",
    })
    assert find_cycles(import_graph(package)) == [
        ["rlorch.launch.placement", "rlorch.launch.server_command", "rlorch.launch.placement"]]


def test_the_component_rule_catches_a_component_importing_another(tmp_path):
    package = _write_package(tmp_path, {
        "__init__": "", "orchestrator/__init__": "",
        "orchestrator/checkpoints": "def f():\n    from rlorch.orchestrator.dispatcher import Dispatcher\n",
        "orchestrator/evaluation": "from . import sinks\n", "orchestrator/dispatcher": "import json\n",
        "orchestrator/sinks": "from .loop import Orchestrator\n"})
    assert component_violations(package, {"checkpoints", "evaluation", "dispatcher", "sinks"}) == [
        "orchestrator/checkpoints.py imports ['rlorch.orchestrator.dispatcher']",
        "orchestrator/evaluation.py imports ['rlorch.orchestrator.sinks']",
        "orchestrator/sinks.py imports ['rlorch.orchestrator.loop']"]


def test_every_script_answers_help_with_its_usage():
    """A benchmark a user cannot ask how to run is one they run wrong; --help must not start it."""
    for script in sorted((PACKAGE.parent / "scripts").glob("*.py")):
        done = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=120,
                              cwd=PACKAGE.parent.parent)
        assert done.returncode == 0 and done.stdout.startswith("usage:"), (script.name, done.stdout, done.stderr)


def test_every_package_in_the_source_tree_ships_in_the_wheel():
    """pyproject.toml lists the packages (conf/ ships as rlorch.conf); one left out installs
    editable and breaks only a wheel, at the first import of it."""
    import tomllib

    listed = set(tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    on_disk = {".".join(init.parent.relative_to(PACKAGE.parent).parts) for init in PACKAGE.rglob("__init__.py")}
    assert on_disk - listed == set(), "missing from [tool.setuptools] packages"
    assert listed - on_disk == {"rlorch.conf"}


@pytest.mark.slow
def test_a_wheel_installed_elsewhere_finds_its_presets_and_runs(tmp_path):
    """A non-editable install: the presets ship inside the package."""
    repo = PACKAGE.parent
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", str(repo), "--no-deps", "--no-build-isolation",
                            "-q", "-w", str(tmp_path / "wheel")], capture_output=True, text=True, cwd=tmp_path)
    assert built.returncode == 0, built.stderr
    (wheel,) = (tmp_path / "wheel").glob("rlorch-*.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    python, rlorch = venv / "bin" / "python", venv / "bin" / "rlorch"
    # Only the wheel: a source tree on PYTHONPATH (a test run of a checkout) would be found first,
    # and pip would take its metadata for rlorch already installed and install nothing.
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    installed = subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
                               capture_output=True, text=True, env=env)
    assert installed.returncode == 0, installed.stderr
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    where = subprocess.run([str(python), "-c", "import rlorch, rlorch.config.compose as c; print(rlorch.__file__); "
                            "print(c.conf_dir())"], capture_output=True, text=True, cwd=elsewhere, env=env)
    package, presets = where.stdout.split()
    assert package.startswith(str(venv)) and presets.startswith(str(venv)), where.stdout
    checked = subprocess.run([str(rlorch), "validate-config", "conf=sync"], capture_output=True, text=True,
                             cwd=elsewhere, env=env)
    assert checked.returncode == 0 and "rlorch config" in checked.stdout, checked.stderr
    run_dir = elsewhere / "run"
    trained = subprocess.run([str(rlorch), "train", "conf=sim", f"run.dir={run_dir}", "train.steps=3",
                              "run.progress=false"], capture_output=True, text=True, cwd=elsewhere, timeout=120,
                             env=env)
    assert trained.returncode == 0, trained.stderr
    assert json.loads((run_dir / "summary.json").read_text())["lost"] == 0
