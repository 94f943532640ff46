"""Helpers the test files share: running a sim run in-process and reading its run directory back,
waiting on state with a deadline (in a thread or in a coroutine, or for a server to answer), a
stand-in call that never answers, and a free port. Import with ``from helpers import ...`` (the
tests directory is on ``sys.path`` under pytest; ``tests/faults.py`` and ``scripts/`` put it there)."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
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


async def wait_until_async(predicate: Callable[[], T], timeout: float, what: str, interval: float = 0.01) -> T:
    """:func:`wait_until` inside a coroutine: the event loop runs on while it polls."""
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout:g}s for {what}")
        await asyncio.sleep(interval)
    return value


def wait_answering(url: str, process, timeout: float = 120.0, *, what: str = "the server",
                   output: Callable[[], str] = lambda: "") -> None:
    """Poll ``url`` until it answers 200; fail at once if ``process`` (anything with ``poll()``)
    exits first, with ``output()`` (its log, say) in the message."""
    def answers() -> bool:
        if process.poll() is not None:
            raise AssertionError(f"{what} exited ({process.poll()}) before {url} answered\n{output()[-3000:]}")
        try:
            with urllib.request.urlopen(url, timeout=10) as response:
                return response.status == 200
        except OSError:
            return False

    wait_until(answers, timeout, f"{what} to answer {url}", interval=0.1)


async def hang() -> None:
    """A stand-in for a call that never answers: it waits until cancelled (by the timeout under
    test), with no fixed length to outlast."""
    await asyncio.Event().wait()


def read_run(run_dir: Path) -> tuple[dict, list[dict]]:
    """A run directory's summary and its step records."""
    summary = json.loads((run_dir / "summary.json").read_text())
    return summary, of_kind(read_metrics(run_dir), "step")


def read_metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def trained(run_dir: Path, step: int) -> list[dict]:
    """Batch ``step``'s rollouts as the run wrote them (either format), one dict each."""
    from rlorch.rundir.batchfile import read_records
    from rlorch.rundir.layout import RunDir

    (path,) = RunDir(run_dir).rollouts.glob(f"step_{step:06d}.*")
    return read_records(path)


def of_kind(records: list[dict], kind: str) -> list[dict]:
    """The records of one kind (``step``, ``periodic``, ``eval``, ...)."""
    return [r for r in records if r.get("kind") == kind]


def records_of(run_dir: Path, kind: str) -> list[dict]:
    """A run's records of one kind so far, read while it runs: [] before metrics.jsonl exists, and
    a last line still being written is left for the next read."""
    path = run_dir / "metrics.jsonl"
    lines = [line for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    if lines and not lines[-1].endswith("}"):
        lines.pop()
    return of_kind([json.loads(line) for line in lines], kind)


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


async def wait_generated(engine, at_least: int) -> None:
    """Wait until the server behind ``engine`` (an ``SGLangEngine`` on ``rlorch serve``) has
    generated ``at_least`` more tokens than when called."""
    start = (await engine.server_info())["internal_states"][0]["generated_tokens"]
    for _ in range(2000):
        if (await engine.server_info())["internal_states"][0]["generated_tokens"] >= start + at_least:
            return
        await asyncio.sleep(0.005)
    raise AssertionError("generation made no progress")
