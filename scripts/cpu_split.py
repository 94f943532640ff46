"""Where a training step's CPU goes: the trainer, the engines, the orchestrator (Linux).

Runs ``rlorch train`` (the default preset unless ``key=value`` overrides say otherwise) in a fresh
run directory and samples, every ``--interval`` seconds, the CPU time (user + system, from
``/proc/PID/stat``) of each process by its role: the orchestrator (the command itself), the
engines (pids in ``servers.json``), the trainer ranks (``trainer/workers/rank-R.json``) and any
other process below the command (the fork server that starts them), with the step the run had
reached (the last line of ``metrics.jsonl``) and the machine's idle time (``/proc/stat``).

It prints, between the sample where the run passed ``--skip`` steps (start-up is over) and the
last sample before its summary, each role's CPU milliseconds per step and its share of the
machine's cores, the step interval, and how much of the machine sat idle. On a machine whose
cores are all busy the roles slow one another: the figures say which role to make cheaper.

Usage: python scripts/cpu_split.py [--skip 20] [--interval 0.2] [key=value ...]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TICKS = os.sysconf("SC_CLK_TCK")
ROLES = ("trainer", "engines", "orchestrator", "other")


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of ``pid`` (all its threads), or None once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / TICKS


def parent_of(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def descendants(root: int) -> set[int]:
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            parent = parent_of(int(entry.name))
            if parent is not None:
                parents[int(entry.name)] = parent
    found, frontier = set(), {root}
    while frontier:
        frontier = {pid for pid, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def machine_idle_seconds() -> tuple[float, float]:
    """(idle, total) CPU seconds of the whole machine since boot, over all cores."""
    fields = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return (fields[3] + fields[4]) / TICKS, sum(fields[:8]) / TICKS


def read_pids(run_dir: Path) -> dict[int, str]:
    roles = {}
    try:
        for server in json.loads((run_dir / "servers.json").read_text()):
            if server.get("pid"):
                roles[int(server["pid"])] = "engines"
    except (OSError, ValueError):
        pass
    for path in (run_dir / "trainer" / "workers").glob("rank-*.json"):
        try:
            roles[int(json.loads(path.read_text())["pid"])] = "trainer"
        except (OSError, ValueError, KeyError):
            pass
    return roles


def last_step(metrics: Path) -> tuple[int, bool]:
    """The newest step in ``metrics.jsonl`` and whether the summary is written."""
    try:
        with open(metrics, "rb") as handle:
            handle.seek(max(0, handle.seek(0, os.SEEK_END) - 8192))
            lines = handle.read().splitlines()
    except OSError:
        return 0, False
    step, done = 0, False
    for line in lines[1:] if len(lines) > 1 else lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if record.get("kind") == "step":
            step = max(step, int(record["step"]))
        done = done or record.get("kind") == "summary"
    return step, done


def sample(command_pid: int, run_dir: Path, roles: dict[int, str], seconds: dict[int, float]) -> dict:
    roles.update(read_pids(run_dir))
    for pid in descendants(command_pid) | {command_pid}:
        used = cpu_seconds(pid)
        if used is not None:
            seconds[pid] = used
    by_role = dict.fromkeys(ROLES, 0.0)
    for pid, used in seconds.items():
        role = "orchestrator" if pid == command_pid else roles.get(pid, "other")
        by_role[role] += used
    idle, total = machine_idle_seconds()
    step, done = last_step(run_dir / "metrics.jsonl")
    return {"time": time.monotonic(), "step": step, "done": done, "idle": idle, "total": total, **by_role}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("--skip", type=int, default=20, help="steps of start-up left out")
    parser.add_argument("--interval", type=float, default=0.2, help="seconds between samples")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for rlorch train")
    args = parser.parse_args()
    if not Path("/proc/stat").is_file():
        raise SystemExit("cpu_split.py reads /proc: it runs on Linux only")
    root = Path(tempfile.mkdtemp(prefix="rlorch-cpu-split-"))
    run_dir = root / "run"
    command = [sys.executable, "-m", "rlorch.cli", "train", f"run.dir={run_dir}", *args.overrides]
    log = open(root / "train.log", "w")
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    roles: dict[int, str] = {}
    seconds: dict[int, float] = {}
    samples = []
    while process.poll() is None:
        samples.append(sample(process.pid, run_dir, roles, seconds))
        time.sleep(args.interval)
    log.close()
    if process.returncode:
        raise SystemExit(f"rlorch train exited with {process.returncode}: see {root / 'train.log'}")
    live = [s for s in samples if not s["done"]]
    start = next((s for s in live if s["step"] > args.skip), None)
    end = live[-1] if live else None
    if start is None or end is None or end["step"] <= start["step"]:
        raise SystemExit(f"the run did not pass {args.skip} steps while sampled: see {root / 'train.log'}")
    steps = end["step"] - start["step"]
    wall = end["time"] - start["time"]
    cores = os.cpu_count() or 1
    print(f"{' '.join(args.overrides) or 'default preset'}: steps {start['step']}-{end['step']} over {wall:.1f} s "
          f"on {cores} cores; run directory {run_dir}")
    print(f"step interval {1000 * wall / steps:7.1f} ms")
    busy = 0.0
    for role in ROLES:
        used = end[role] - start[role]
        busy += used
        print(f"  {role:<13}{1000 * used / steps:7.1f} CPU ms a step  {used / (wall * cores):6.1%} of the machine")
    idle = (end["idle"] - start["idle"]) / (end["total"] - start["total"])
    print(f"  {'all of rlorch':<13}{1000 * busy / steps:7.1f} CPU ms a step  {busy / (wall * cores):6.1%} of the machine; "
          f"the machine idle {idle:.1%}")


if __name__ == "__main__":
    main()
