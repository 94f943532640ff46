"""Helpers the test files share: running a sim run in-process and reading its run directory back,
waiting on state with a deadline, and a free port. Import with ``from helpers import ...`` (the
tests directory is on ``sys.path`` under pytest; ``tests/faults.py`` and ``scripts/`` put it there)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable, TypeVar

from rlorch.launch.local import free_port  # noqa: F401  (re-exported: the one free_port of the tests)

T = TypeVar("T")


def wait_until(predicate: Callable[[], T], timeout: float, what: str, interval: float = 0.05) -> T:
    """Poll ``predicate`` until it returns something true, and return that; past ``timeout``
    seconds fail naming ``what`` (a wait that falls through silently proves nothing)."""
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout:g}s for {what}")
        time.sleep(interval)
    return value


def read_run(run_dir: Path) -> tuple[dict, list[dict]]:
    """A run directory's summary and its step records."""
    summary = json.loads((run_dir / "summary.json").read_text())
    return summary, [r for r in read_metrics(run_dir) if r["kind"] == "step"]


def read_metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def step_count(run_dir: Path) -> int:
    """Step records written so far (0 before metrics.jsonl exists; a line being written is not
    parsed, only counted once complete)."""
    path = run_dir / "metrics.jsonl"
    return path.read_text().count('"kind": "step"') if path.exists() else 0


def train(run_dir: Path, *overrides: str, progress: bool = False) -> tuple[int, dict, list[dict]]:
    """A sim run (``conf=sim``) in this process: its exit code, summary and step records
    (``progress``: with the progress lines an operator sees)."""
    from rlorch.config.compose import compose
    from rlorch.runner import run_training

    config = compose(["conf=sim", f"run.dir={run_dir}", f"run.progress={str(progress).lower()}", *overrides])
    code = run_training(config, [])
    return code, *read_run(run_dir)


def start_local_ray(**options) -> None:
    """``ray.init(address="local", ...)``, once more if Ray's own start-up timed out: Ray gives its
    raylet a fixed 30 s to register (ray/_private/node.py, not configurable), which a loaded
    2-core machine can miss while nothing of rlorch has run yet."""
    import ray

    try:
        ray.init(address="local", **options)
    except Exception as err:
        if "timed out during startup" not in str(err):
            raise
        ray.shutdown()
        ray.init(address="local", **options)
