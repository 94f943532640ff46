"""The real trainer as the orchestrator sees it: a torchrun process group a launcher starts, and
this module stops through the run directory (``STOP``) before the launcher kills it.

Batches reach it through the run directory (the orchestrator writes them before submitting), so
``submit`` has nothing to send; the process publishes weights the watcher picks up.
"""

from __future__ import annotations

import asyncio
import shutil
import time
from pathlib import Path
from typing import Optional

from rlorch.backends import trainer_backend
from rlorch.config.schema import Config, TrainerBackend
from rlorch.launch.base import Launched, Launcher
from rlorch.launch.placement import trainer_env
from rlorch.launch.trainer_command import trainer_command
from rlorch.lifecycle import off_loop
from rlorch.rundir.layout import RunDir
from rlorch.types import Batch


READY_POLL_S = 0.02
"""Seconds between looks for the trainer's ready file: the run waits for the first look that
finds it, and a look is one ``stat``."""


def log_tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


class TorchrunTrainer:
    def __init__(self, config: Config, *, run_dir: RunDir, launcher: Launcher, resume: Optional[Path] = None):
        self.config = config
        self.run_dir = run_dir
        self.launcher = launcher
        self.resume = resume
        self.log = run_dir.logs / "trainer.log"
        self.process: Optional[Launched] = None
        self.log_start = 0

    async def start(self) -> None:
        ready = self.run_dir.trainer_ready
        ready.unlink(missing_ok=True)
        self.run_dir.stop_file.unlink(missing_ok=True)
        shutil.rmtree(self.run_dir.trainer_workers, ignore_errors=True)
        command = trainer_command(self.config, self.run_dir.root, self.resume)
        self.log_start = self.log.stat().st_size if self.log.exists() else 0
        self.process = await off_loop(lambda: self.launcher.start_trainer(
            command, env=trainer_env(self.config), log=self.log, workers=self.run_dir.trainer_workers))
        deadline = time.monotonic() + self.config.trainer.start_timeout
        while not ready.exists():
            code = self.launcher.returncode(self.process)
            if code is not None:
                raise RuntimeError(f"trainer exited with code {code} before it was ready"
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
        code = None if self.process is None else self.launcher.returncode(self.process)
        if code is None:
            return None
        if code == 0:
            published = [version for version, _ in self.run_dir.published_weights()]
            if self.run_dir.stop_file.exists() or (published and published[-1] >= self.config.train.steps):
                return None
        return f"trainer exited with code {code}{_cause(self.log, self.log_start)}; {self.log}:\n{log_tail(self.log)}"

    async def stop(self, timeout: float) -> None:
        """Ask for a checkpoint of the last completed step and an exit; kill after ``timeout``."""
        if self.process is None:
            return
        if self.launcher.returncode(self.process) is None:
            self.run_dir.stop_file.touch()
        deadline = time.monotonic() + timeout
        while self.launcher.returncode(self.process) is None and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await self.launcher.stop([self.process], timeout=5.0)
        # STOP is a request to a running trainer; none is left to read it.
        self.run_dir.stop_file.unlink(missing_ok=True)


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
def make_fsdp_trainer(config: Config, run_dir: RunDir, resume: Optional[Path], start_step: int,
                      launcher: Launcher) -> TorchrunTrainer:
    return TorchrunTrainer(config, run_dir=run_dir, launcher=launcher, resume=resume)
