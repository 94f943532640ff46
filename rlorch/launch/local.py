"""The launcher for this machine: every process a child of the orchestrator, started through the
fork server.

A launched server gets a free local port; an SGLang server runs under :mod:`rlorch.launch.guard`,
which takes it down with the orchestrator (``rlorch serve`` and the trainer's ranks watch the
orchestrator's pid themselves). A one-node trainer of several ranks is started without torchrun's
agent: each rank is forked with the environment torchrun would give it (a :class:`RankGroup`),
so the ranks start warm. A stop signals each process's whole group (SGLang runs scheduler
subprocesses), and for a torchrun trainer also every rank it recorded: torchrun starts each rank
in a session of its own, so killing torchrun's group misses them, and a dead torchrun cannot stop
them.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

from rlorch.config.schema import InferenceBackend
from rlorch.launch import forkserver
from rlorch.launch.base import Launched
from rlorch.launch.server_command import API_KEY_ENV, server_command
from rlorch.launch.trainer_command import rank_env, standalone_ranks
from rlorch.lifecycle import ORCHESTRATOR_PID_ENV, kill_group, process_alive

WORKER_MODULE = b"rlorch.trainer.fsdp"
CHILD_ENV = {"PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1"}
"""What every launched process gets unless the caller says otherwise: its log written as it goes,
and a crash in native code (a segfault in a collective, say) leaving every thread's Python stack
there (a process the fork server starts enables the same itself)."""


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class LocalLauncher:
    name = "local"
    waiting: Optional[str] = None
    """Nothing to wait for: a local process starts at once."""

    def __init__(self, config=None) -> None:
        self.config = config

    def release(self, process: Launched) -> None:
        """Nothing held beyond the process, which :meth:`stop` ended."""

    def close(self) -> None:
        """Nothing to release: every process was stopped through :meth:`stop`."""

    def start_server(self, config, index: int, *, model_path: Path, api_key: str, log_dir: Path,
                     env: dict[str, str], port: Optional[int] = None) -> Launched:
        port = free_port() if port is None else port
        log = log_dir / f"server-{index}.log"
        command = server_command(config, model_path=model_path, port=port)
        env = {**os.environ, **CHILD_ENV, **env, API_KEY_ENV: api_key}
        shown = list(command)
        if config.inference.backend is InferenceBackend.sglang:
            # SGLang does not watch its orchestrator: the guard takes it down with it.
            env[ORCHESTRATOR_PID_ENV] = str(os.getpid())
            command = [sys.executable, "-m", "rlorch.launch.guard", *command, "--api-key", api_key]
            shown += ["--api-key", "***"]
        with open(log, "ab") as handle:
            handle.write(f"$ {' '.join(shown)}\n".encode())
        process = forkserver.spawn(command, log_path=str(log), env=env)
        return Launched("server", index, f"127.0.0.1:{port}", log, handle=process)

    def start_trainer(self, command: list[str], *, env: dict[str, str], log: Path, workers: Path) -> Launched:
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), **CHILD_ENV,
               ORCHESTRATOR_PID_ENV: str(os.getpid()), **env}
        ranks = standalone_ranks(command)
        if ranks is None:
            process = forkserver.spawn(command, log_path=str(log), env=env)
        else:
            nproc, worker = ranks
            port = free_port()
            process = RankGroup([forkserver.spawn(worker, log_path=str(log), env={**env, **rank_env(rank, nproc, port)})
                                 for rank in range(nproc)])
        return Launched("trainer", 0, None, log, handle=process, extra={"workers": workers})

    def returncode(self, process: Launched) -> Optional[int]:
        return None if process.handle is None else process.handle.poll()

    async def stop(self, processes: list[Launched], *, timeout: float) -> None:
        running = [member for p in processes if p.handle is not None for member in _members(p.handle)
                   if member.poll() is None]
        for handle in running:
            _signal(handle, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while any(h.poll() is None for h in running) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for handle in running:
            if handle.poll() is None:
                _signal(handle, signal.SIGKILL)
                await asyncio.to_thread(handle.wait)
        for process in processes:
            if "workers" in process.extra:
                await _kill_workers(process.extra["workers"])


class RankGroup:
    """The ranks of a one-node trainer started without torchrun, as the one process the trainer's
    owner watches (the part of ``Popen`` it uses). Like torchrun, it has failed as soon as one
    rank has (that rank's status, while the others may still run: a stop ends them), and
    succeeded once every rank exited with 0. Rank 0's pid stands for the group."""

    def __init__(self, ranks: list):
        self.ranks = ranks
        self.pid = ranks[0].pid

    @property
    def returncode(self) -> Optional[int]:
        return self.poll()

    def poll(self) -> Optional[int]:
        codes = [rank.poll() for rank in self.ranks]
        failed = [code for code in codes if code not in (None, 0)]
        if failed:
            return failed[0]
        return None if None in codes else 0

    def wait(self, timeout: Optional[float] = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(str(self.pid), timeout)
            time.sleep(0.01)
        return code

    def send_signal(self, sig: int) -> None:
        for rank in self.ranks:
            if rank.poll() is None:
                _signal(rank, sig)


def _members(handle) -> list:
    """The processes behind a handle: each rank of a :class:`RankGroup`, else the handle."""
    return list(handle.ranks) if isinstance(handle, RankGroup) else [handle]


def _signal(process: subprocess.Popen, sig: int) -> None:
    """Signal the process's whole group, or the process alone when it has none of its own."""
    try:
        os.killpg(process.pid, sig)
    except (ProcessLookupError, PermissionError):
        try:
            process.send_signal(sig)
        except ProcessLookupError:
            pass


async def _kill_workers(workers: Path) -> None:
    """Every recorded rank still running gets SIGTERM, then SIGKILL after 5 s."""
    pids = [pid for pid in worker_pids(workers) if kill_group(pid, signal.SIGTERM)]
    deadline = time.monotonic() + 5.0
    while any(process_alive(pid) for pid in pids) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    for pid in pids:
        kill_group(pid, signal.SIGKILL)


def worker_pids(workers: Path) -> list[int]:
    """The ranks recorded in ``workers`` that are still this run's trainer processes (a recycled
    pid running something else is left alone)."""
    run_dir = str(workers.parent.parent).encode()
    pids = []
    for path in sorted(workers.glob("rank-*.json")):
        try:
            pid = int(json.loads(path.read_text())["pid"])
            command = Path(f"/proc/{pid}/cmdline").read_bytes()
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if WORKER_MODULE in command and run_dir in command:
            pids.append(pid)
    return pids
