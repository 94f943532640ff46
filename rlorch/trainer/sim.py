"""The simulated trainer (``trainer=sim``): no model, ``step_time`` seconds per batch.

It keeps the real trainer's contract with the run directory: it trains batch N only after the
orchestrator shipped it, publishes weights/step_N with a PUBLISHED marker, appends a line to
trainer/metrics.jsonl, and writes full checkpoints (trainer/COMPLETE) every checkpoint_every
steps, at the last step and when asked to stop. Its markers are plain files (no fsync): there
are no weights to lose, and the loop benchmark measures the orchestrator, not the disk. With
real engines (``model_path`` set) each published checkpoint is the unchanged base model,
hard-linked, so engines load real HF weights at every version.
"""

from __future__ import annotations

import asyncio
import json
import random
import os
import shutil
import time
from pathlib import Path
from typing import NamedTuple, Optional

from rlorch.backends import trainer_backend
from rlorch.config.schema import Config, TrainerBackend
from rlorch.lifecycle import cancel_and_wait
from rlorch.rundir.layout import COMPLETE, PUBLISHED, CheckpointDir, RunDir, step_name
from rlorch.types import Batch


class Submitted(NamedTuple):
    """What the simulated trainer keeps of a batch until it trains it (like the real trainer,
    which reads the batch file, it holds none of the rollouts' arrays)."""

    step: int
    tokens: int
    reward_mean: float


class SimTrainer:
    def __init__(self, config: Config, *, run_dir: RunDir, start_step: int = 0,
                 model_path: Optional[Path] = None):
        self.config = config
        self.model_path = model_path
        self.run_dir = run_dir
        self.step = start_step
        self.checkpointed = start_step
        self.rng = random.Random(config.run.seed)
        self._batches: asyncio.Queue[Submitted] = asyncio.Queue()
        self._task: Optional[asyncio.Task] = None
        self._error: Optional[str] = None

    async def start(self) -> None:
        self.run_dir.make()
        self.run_dir.trainer_ready.touch()
        self._task = asyncio.create_task(self._loop(), name="sim-trainer")

    async def submit(self, batch: Batch) -> None:
        rewards = [r.reward for r in batch.rollouts]
        await self._batches.put(Submitted(batch.step, sum(len(r.tokens) for r in batch.rollouts),
                                          sum(rewards) / len(rewards)))

    def error(self) -> Optional[str]:
        return self._error

    async def _loop(self) -> None:
        try:
            while self.step < self.config.train.steps:
                batch = await self._batches.get()
                if batch.step != self.step + 1:
                    raise RuntimeError(f"trainer expected batch {self.step + 1}, got {batch.step}")
                started = time.monotonic()
                await asyncio.sleep(self.config.trainer.sim.step_time)
                self.step = batch.step
                self._record(batch, time.monotonic() - started)
                if self.step % self.config.trainer.publish_every == 0 or self.step == self.config.train.steps:
                    self._publish(self.step)
                if self.step % self.config.trainer.checkpoint_every == 0 or self.step == self.config.train.steps:
                    self._checkpoint(self.step)
        except asyncio.CancelledError:
            raise
        except Exception as err:
            self._error = f"sim trainer failed at step {self.step + 1}: {err}"

    def _record(self, batch: Submitted, seconds: float) -> None:
        line = {"step": batch.step, "loss": round(self.rng.uniform(-0.1, 0.1), 6),
                "grad_norm": round(self.rng.uniform(0.1, 1.0), 6), "tokens": batch.tokens,
                "reward_mean": batch.reward_mean, "step_s": round(seconds, 4)}
        with open(self.run_dir.trainer_metrics, "a") as handle:
            handle.write(json.dumps(line) + "\n")

    def _publish(self, step: int) -> None:
        weights = self.run_dir.weights
        staging = weights / f".staging-{step_name(step)}"
        staging.mkdir(parents=True, exist_ok=True)
        (staging / "sim_weights.json").write_text(json.dumps({"version": step}))
        self._link_model(staging)
        target = self.run_dir.weights_for(step)
        staging.rename(target)
        (target / PUBLISHED).touch()
        published = [path for _, path in self.run_dir.published_weights()]
        for old in published[:-self.config.trainer.keep_weight_versions]:
            shutil.rmtree(old, ignore_errors=True)

    def _link_model(self, target: Path) -> None:
        if self.model_path is None:
            return
        target.mkdir(parents=True, exist_ok=True)
        for source in self.model_path.iterdir():
            if source.is_file() and not (target / source.name).exists():
                try:
                    os.link(source, target / source.name)
                except OSError:
                    shutil.copy2(source, target / source.name)

    def _checkpoint(self, step: int) -> None:
        parts = CheckpointDir(self.run_dir.checkpoint(step))
        trainer_dir = parts.trainer
        trainer_dir.mkdir(parents=True, exist_ok=True)
        self._link_model(parts.weights)
        (trainer_dir / "trainer_state.json").write_text(json.dumps({"step": step, "backend": "sim"}))
        (trainer_dir / COMPLETE).touch()
        self.checkpointed = step

    async def stop(self, timeout: float) -> None:
        await cancel_and_wait(self._task, timeout=timeout)
        self._task = None
        if self.step > self.checkpointed:
            self._checkpoint(self.step)


@trainer_backend(TrainerBackend.sim)
def make_sim_trainer(config: Config, run_dir: RunDir, resume: Optional[Path], start_step: int,
                     launcher: object) -> SimTrainer:
    """An in-process trainer: nothing for the launcher to start."""
    from rlorch.model import resolve_model_path

    # Behind real engines the marker checkpoints link the served model, so reloads work.
    real_engines = config.inference.backend.generates_model_tokens
    return SimTrainer(config, run_dir=run_dir, start_step=start_step,
                      model_path=resolve_model_path(config.model.path) if real_engines else None)
