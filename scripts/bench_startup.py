"""Benchmark the start of the CPU default run: time to the first training step, and its parts.

Runs ``rlorch train`` (the default preset, with ``train.steps`` cut short and no progress
display) ``--runs`` times as a user would, each in a fresh run directory, and prints the median
of every part of ``summary.json``'s ``startup`` (see ``rlorch/startup.py``) plus the wall time
of the whole command, the time until the first step record appeared in ``metrics.jsonl``
as seen from outside (``seen_first_step``), and the machine it ran on. With ``--launchers
local,ray`` each launcher's runs are measured in turn and printed side by side (``ray`` starts a
private local Ray cluster per run: its start is part of the figure).

Usage: python scripts/bench_startup.py [--runs 3] [--steps 2] [--launchers local,ray] [key=value ...]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def one_run(root: Path, index: int, steps: int, overrides: list[str]) -> dict:
    run_dir = root / f"run-{index}"
    command = [sys.executable, "-m", "rlorch.cli", "train", f"train.steps={steps}", f"run.dir={run_dir}",
               "run.progress=false", "eval.every=1000", *overrides]
    started = time.monotonic()
    first_step = None
    with tempfile.TemporaryFile("w+") as errors:
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=errors, text=True)
        while process.poll() is None:
            if first_step is None and _has_step(run_dir / "metrics.jsonl"):
                first_step = time.monotonic() - started
            time.sleep(0.02)
        wall = time.monotonic() - started
        if process.returncode != 0:
            errors.seek(0)
            raise SystemExit(f"rlorch train failed ({process.returncode}):\n{errors.read()[-3000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    return {**(summary.get("startup") or {}), "seen_first_step": round(first_step or wall, 3),
            "command_wall": round(wall, 3)}


def _has_step(metrics: Path) -> bool:
    """Whether the run has written its first step record (seen from outside, so any version of
    rlorch can be measured the same way)."""
    try:
        return '"kind": "step"' in metrics.read_text()
    except OSError:
        return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--launchers", default="local", help="comma list of run.launcher values to compare")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    launchers = args.launchers.split(",")
    results = {}
    with tempfile.TemporaryDirectory(prefix="bench-startup-") as root:
        for launcher in launchers:
            overrides = [*args.overrides, f"run.launcher={launcher}"]
            results[launcher] = [one_run(Path(root) / launcher, i, args.steps, overrides) for i in range(args.runs)]
    print(f"machine: {platform.machine()} {os.cpu_count()} CPUs, {platform.platform()}, "
          f"python {platform.python_version()}, load average {os.getloadavg()[0]:.2f}")
    if os.environ.get("PYTHONDONTWRITEBYTECODE"):
        # Every process then compiles rlorch's sources again (a few tenths of a second here).
        print("PYTHONDONTWRITEBYTECODE is set: no bytecode caches, unlike a default Python")
    for launcher, runs in results.items():
        print(f"run.launcher={launcher}")
        keys = [key for key in runs[0] if all(isinstance(r.get(key), (int, float)) for r in runs)]
        for key in keys:
            values = [r[key] for r in runs]
            print(f"{key:>16}: median {statistics.median(values):6.2f}s   runs {', '.join(f'{v:.2f}' for v in values)}")


if __name__ == "__main__":
    main()
