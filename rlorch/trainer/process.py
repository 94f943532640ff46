"""The real trainer as the orchestrator sees it: a torchrun process group it starts and stops.

Batches reach it through the run directory (the orchestrator writes them before submitting), so
``submit`` has nothing to send; the process publishes weights the watcher picks up.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

from rlorch.launch import forkserver
from rlorch.backends import trainer_backend
from rlorch.config.schema import Config, TrainerBackend
from rlorch.lifecycle import ORCHESTRATOR_PID_ENV, kill_group, process_alive
from rlorch.rundir.layout import RunDir
from rlorch.types import Batch


READY_POLL_S = 0.02
"""Seconds between looks for the trainer's ready file: the run waits for the first look that
finds it, and a look is one ``stat``."""

_MULTI_NODE_FLAGS = ("--nnodes", "--node-rank", "--rdzv-endpoint", "--rdzv-backend", "--rdzv-id",
                     "--rdzv-conf", "--master-addr", "--master-port")


def trainer_command(config, run_dir: Path, resume: Optional[Path] = None, *,
                    node_rank: Optional[int] = None) -> list[str]:
    """The command line the runner launches: the worker itself for one process on one node and
    no extra torchrun arguments (torchrun's agent would cost a second torch import at every
    start); else torchrun: ``--standalone`` on one node, a c10d rendezvous at
    ``trainer.fsdp.rdzv_endpoint`` across ``trainer.fsdp.nnodes`` (``node_rank`` defaults to
    ``trainer.fsdp.node_rank``), or whatever the extra torchrun arguments set up."""
    trainer = config.trainer.fsdp
    if trainer.nproc == 1 and trainer.nnodes == 1 and not trainer.torchrun_args:
        command = [sys.executable, "-m", "rlorch.trainer.fsdp", "--run-dir", str(run_dir)]
        return command + (["--resume", str(resume)] if resume is not None else [])
    flags = {arg.split("=", 1)[0].replace("_", "-") for arg in trainer.torchrun_args}
    command = [sys.executable, "-m", "torch.distributed.run"]
    if trainer.nnodes > 1:
        rank = trainer.node_rank if node_rank is None else node_rank
        command += ["--nnodes", str(trainer.nnodes), "--node-rank", str(rank), "--rdzv-backend", "c10d",
                    "--rdzv-endpoint", trainer.rdzv_endpoint, "--rdzv-id", config.run.name]
    elif not flags & set(_MULTI_NODE_FLAGS):
        command.append("--standalone")
    command += ["--nproc-per-node", str(trainer.nproc), *trainer.torchrun_args,
                "-m", "rlorch.trainer.fsdp", "--run-dir", str(run_dir)]
    if resume is not None:
        command += ["--resume", str(resume)]
    return command


def log_tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


class TorchrunTrainer:
    def __init__(self, config: Config, *, run_dir: RunDir, resume: Optional[Path] = None):
        self.config = config
        self.run_dir = run_dir
        self.resume = resume
        self.log = run_dir.logs / "trainer.log"
        self.process: Optional[subprocess.Popen] = None
        self.log_start = 0

    async def start(self) -> None:

        ready = self.run_dir.trainer_ready
        ready.unlink(missing_ok=True)
        self.run_dir.stop_file.unlink(missing_ok=True)
        shutil.rmtree(self.run_dir.trainer_workers, ignore_errors=True)
        command = trainer_command(self.config, self.run_dir.root, self.resume)
        from rlorch.launch.placement import trainer_env

        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
               "PYTHONUNBUFFERED": "1", ORCHESTRATOR_PID_ENV: str(os.getpid()), **trainer_env(self.config)}
        self.log_start = self.log.stat().st_size if self.log.exists() else 0
        self.process = forkserver.spawn(command, log_path=str(self.log), env=env)
        deadline = time.monotonic() + self.config.trainer.start_timeout
        while not ready.exists():
            if self.process.poll() is not None:
                raise RuntimeError(f"trainer exited with code {self.process.returncode} before it was ready"
                                   f"{_cause(self.log, self.log_start)}; {self.log}:\n{log_tail(self.log)}")
            if time.monotonic() > deadline:
                await self.stop(5.0)
                raise RuntimeError(f"trainer not ready after trainer.start_timeout="
                                   f"{self.config.trainer.start_timeout:g}s; {self.log}:\n{log_tail(self.log)}")
            await asyncio.sleep(READY_POLL_S)

    async def submit(self, batch: Batch) -> None:
        return None

    def error(self) -> Optional[str]:
        """Why the trainer can no longer make progress, if it cannot: it died, or it exited
        before training the last step (it only exits cleanly at train.steps or on STOP)."""
        if self.process is None or self.process.poll() is None:
            return None
        if self.process.returncode == 0:
            published = [version for version, _ in self.run_dir.published_weights()]
            if self.run_dir.stop_file.exists() or (published and published[-1] >= self.config.train.steps):
                return None
        return (f"trainer exited with code {self.process.returncode}{_cause(self.log, self.log_start)}; "
                f"{self.log}:\n{log_tail(self.log)}")

    async def stop(self, timeout: float) -> None:
        """Ask for a checkpoint of the last completed step and an exit; kill after ``timeout``."""
        if self.process is None:
            return
        if self.process.poll() is None:
            self.run_dir.stop_file.touch()
        deadline = time.monotonic() + timeout
        while self.process.poll() is None and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.process.poll() is None:
            kill_group(self.process.pid, signal.SIGTERM)
            try:
                await asyncio.to_thread(self.process.wait, 5)
            except subprocess.TimeoutExpired:
                kill_group(self.process.pid, signal.SIGKILL)
                await asyncio.to_thread(self.process.wait)
        await self._kill_workers()

    async def _kill_workers(self) -> None:
        """Torchrun starts each rank in a session of its own, so killing torchrun's group
        misses them, and a dead torchrun cannot stop them: every recorded rank still running
        gets SIGTERM, then SIGKILL after 5 s."""
        pids = [pid for pid in _worker_pids(self.run_dir) if kill_group(pid, signal.SIGTERM)]
        deadline = time.monotonic() + 5.0
        while any(process_alive(pid) for pid in pids) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for pid in pids:
            kill_group(pid, signal.SIGKILL)


def _worker_pids(run_dir: RunDir) -> list[int]:
    """The recorded trainer ranks that are still this run's trainer processes (a recycled
    pid running something else is left alone)."""
    pids = []
    for path in sorted(run_dir.trainer_workers.glob("rank-*.json")):
        try:
            pid = int(json.loads(path.read_text())["pid"])
            command = Path(f"/proc/{pid}/cmdline").read_bytes()
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if b"rlorch.trainer.fsdp" in command and str(run_dir.root).encode() in command:
            pids.append(pid)
    return pids


def _cause(log: Path, start: int) -> str:
    """The trainer's own one-line reason (``rlorch trainer: ...``), which torchrun's error
    report can push out of the log's tail."""
    try:
        with open(log, "rb") as handle:
            handle.seek(start)
            lines = handle.read().decode(errors="replace").splitlines()
    except OSError:
        return ""
    causes = [line for line in lines if line.startswith("rlorch trainer: ")]
    return f": {causes[-1].removeprefix('rlorch trainer: ')}" if causes else ""


@trainer_backend(TrainerBackend.fsdp)
def make_fsdp_trainer(config: Config, run_dir: RunDir, resume: Optional[Path], start_step: int) -> TorchrunTrainer:
    return TorchrunTrainer(config, run_dir=run_dir, resume=resume)
