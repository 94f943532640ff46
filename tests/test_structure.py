"""The import graph: orchestrator components never import each other or the loop, and nothing
the runner drives imports the runner."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "rlorch"
COMPONENTS = {"gate", "dispatcher", "sinks", "watcher", "metrics"}
"""Orchestrator components; the loop and its bookkeeping helpers (ledger, steps, checkpoints,
evaluation) wire them and may import them."""


def imports_of(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def test_components_import_no_other_component_and_not_the_loop():
    orchestrator = PACKAGE / "orchestrator"
    for name in COMPONENTS:
        forbidden = {f"rlorch.orchestrator.{other}" for other in (COMPONENTS - {name})}
        forbidden |= {f"rlorch.orchestrator.{helper}" for helper in
                      ("loop", "ledger", "steps", "checkpoints", "evaluation")}
        bad = imports_of(orchestrator / f"{name}.py") & forbidden
        assert not bad, f"orchestrator/{name}.py imports {sorted(bad)}"


def test_nothing_below_the_runner_imports_it():
    for path in PACKAGE.rglob("*.py"):
        if path.name in ("runner.py", "cli.py"):
            continue
        assert "rlorch.runner" not in imports_of(path), f"{path.relative_to(PACKAGE)} imports rlorch.runner"


def test_the_import_check_would_catch_a_component_importing_another(tmp_path):
    module = tmp_path / "sinks.py"
    module.write_text("from rlorch.orchestrator.gate import CapacityGate\nimport rlorch.orchestrator.loop\n")
    assert {"rlorch.orchestrator.gate", "rlorch.orchestrator.loop"} <= imports_of(module)


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
    installed = subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
                               capture_output=True, text=True)
    assert installed.returncode == 0, installed.stderr
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    where = subprocess.run([str(python), "-c", "import rlorch, rlorch.config.compose as c; print(rlorch.__file__); "
                            "print(c.conf_dir())"], capture_output=True, text=True, cwd=elsewhere)
    package, presets = where.stdout.split()
    assert package.startswith(str(venv)) and presets.startswith(str(venv)), where.stdout
    checked = subprocess.run([str(rlorch), "validate-config", "conf=sync"], capture_output=True, text=True,
                             cwd=elsewhere)
    assert checked.returncode == 0 and "rlorch config" in checked.stdout, checked.stderr
    run_dir = elsewhere / "run"
    trained = subprocess.run([str(rlorch), "train", "conf=sim", f"run.dir={run_dir}", "train.steps=3",
                              "run.progress=false"], capture_output=True, text=True, cwd=elsewhere, timeout=120)
    assert trained.returncode == 0, trained.stderr
    assert json.loads((run_dir / "summary.json").read_text())["lost"] == 0
