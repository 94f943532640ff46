"""The run directory: the source of truth for a run, and the contract between processes.

Layout (steps are 1-based; training step N reads batch N and publishes weights version N):

    config.yaml                     resolved config (written by the runner)
    metrics.jsonl, summary.json     orchestrator metrics and the end-of-run summary
    rollouts/step_000001.safetensors  batch N: the rollouts trained at step N (rlorch.rundir.batchfile:
                                    their arrays as tensors and one JSON record each, Rollout's
                                    fields plus "advantage", and "unlikelihood": true on a flat
                                    wrong group under trainer.flat_advantage=unlikelihood; .jsonl
                                    under run.batch_format=jsonl); written atomically before it is
                                    shipped, so it is both the persisted record and the trainer's
                                    input
    weights/step_000001/            HF safetensors checkpoint of version N; complete only once
                                    the PUBLISHED marker exists inside it
    checkpoints/step_000010/        full resumable state: trainer/ (complete when its COMPLETE
                                    marker exists), weights/ (HF, version N), orchestrator.json
    trainer/metrics.jsonl           one line per trainer step (loss, grad_norm, ...), written
                                    before that step's version is published
    trainer/ready                   written once the trainer has loaded its model
    trainer/workers/rank-R.json     the pid of each trainer rank (killed with its group on stop)
    servers.json                    the inference servers now (rewritten on a restart or a scale) and their versions
    tensorboard/                    TensorBoard scalars (metrics.tensorboard=true)
    logs/                           per-process logs
    STOP                            asks the trainer to checkpoint its last step and exit
    SCALE                           {"num_servers": N}: `rlorch scale` asks the running run for
                                    N launched servers (it adds or drains and stops servers)
    LOCK                            held (flock) by the one process running in this directory
    failed-start-*/                 a start-up that failed before any batch, set aside by a retry
    no-checkpoint-*/                a run that ended before its first complete checkpoint, set
                                    aside by a new run in the same directory
    rollouts/superseded-*/,         what a resume at an earlier checkpoint abandoned
    checkpoints/superseded-*/,
    metrics.superseded-*.jsonl,     (the logs' lines from past that checkpoint: the resume's own
    trainer/metrics.superseded-*.jsonl  take their steps' place)
    config.before-resume-*.yaml     the config a resume with overrides replaced
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional

from rlorch.rundir.batchfile import SUFFIXES

PUBLISHED = "PUBLISHED"
COMPLETE = "COMPLETE"
NONFINITE = "NONFINITE"
"""In a checkpoint's ``trainer/``: the trainer found non-finite values in it when it loaded it
(what, in the file); no resume picks it again (delete the marker to try it anyway)."""
_STEP = re.compile(r"^step_(\d+)$")


def step_name(step: int) -> str:
    return f"step_{step:06d}"


def parse_step(name: str) -> Optional[int]:
    match = _STEP.match(name)
    return int(match.group(1)) if match else None


@dataclass(frozen=True)
class RunDir:
    root: Path

    @property
    def config(self) -> Path:
        return self.root / "config.yaml"

    @property
    def is_run(self) -> bool:
        """rlorch writes config.yaml into a run directory before anything else: a directory
        without it is not a run, whatever else it holds."""
        return self.config.is_file()

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def summary(self) -> Path:
        return self.root / "summary.json"

    @property
    def rollouts(self) -> Path:
        return self.root / "rollouts"

    @property
    def weights(self) -> Path:
        return self.root / "weights"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def trainer(self) -> Path:
        return self.root / "trainer"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def stop_file(self) -> Path:
        return self.root / "STOP"

    @property
    def scale_file(self) -> Path:
        return self.root / "SCALE"

    @property
    def trainer_metrics(self) -> Path:
        return self.trainer / "metrics.jsonl"

    @property
    def trainer_ready(self) -> Path:
        return self.trainer / "ready"

    @property
    def trainer_offloaded(self) -> Path:
        """``run.colocate=swap``: the step after which the trainer last moved its state off the
        device (``{"step": N}``): engines may take their memory back for versions up to N."""
        return self.trainer / "offloaded"

    def offloaded_step(self) -> int:
        """The step in :attr:`trainer_offloaded` (-1 before the trainer first offloaded)."""
        try:
            return int(json.loads(self.trainer_offloaded.read_text())["step"])
        except (OSError, ValueError, KeyError, TypeError):
            return -1

    @property
    def trainer_workers(self) -> Path:
        return self.trainer / "workers"

    def worker_pid(self, rank: int) -> Path:
        return self.trainer_workers / f"rank-{rank}.json"

    @property
    def servers(self) -> Path:
        return self.root / "servers.json"

    @property
    def weight_group(self) -> Path:
        """Where the trainer's weight-transfer group meets (``inference.weight_transfer=distributed``)."""
        return self.trainer / "weight_group.json"

    @property
    def weight_group_members(self) -> Path:
        """The orchestrator's answer to ``weight_group.json``: ``{"world_size": N}``, written just
        before it asks the engines to join."""
        return self.trainer / "weight_group.members.json"

    def offer_mark(self, step: int, answer: str) -> Path:
        """The orchestrator's answer to offered version ``step``: ``receiving`` (every engine is in
        a weight-update session, waiting for the broadcast) or ``refused`` (send it by disk)."""
        return self.offers / f"{step_name(step)}.{answer}"

    @property
    def offers(self) -> Path:
        """Versions offered over the weight-transfer group: ``broadcast/step_N.json``."""
        return self.root / "broadcast"

    @property
    def publish_request(self) -> Path:
        """The orchestrator asks the trainer to write its current weights to disk
        (``{"version": N}``, N the version the engines must reach): no server holds the version
        that went over the weight group, so a restarted one can only catch up from there."""
        return self.offers / "publish.request"

    def offer_for(self, step: int) -> Path:
        return self.offers / f"{step_name(step)}.json"

    def broadcast_offers(self) -> Iterator[tuple[int, Path]]:
        """(version, offer file) of every version offered over the group, oldest first."""
        if not self.offers.is_dir():
            return iter(())
        found = [(parse_step(p.name.removesuffix(".json")), p) for p in self.offers.glob("step_*.json")]
        return iter(sorted((step, p) for step, p in found if step is not None))

    @property
    def tensorboard(self) -> Path:
        return self.root / "tensorboard"

    def superseded(self, parent: Path, stamp: str) -> Path:
        return parent / f"superseded-{stamp}"

    def superseded_lines(self, log: Path, stamp: str) -> Path:
        """Where a resume puts the lines of a JSON-lines log past its checkpoint."""
        return log.with_name(f"{log.stem}.superseded-{stamp}{log.suffix}")

    def config_before_resume(self, stamp: str) -> Path:
        return self.root / f"config.before-resume-{stamp}.yaml"

    def batch(self, step: int, fmt: str) -> Path:
        """Batch ``step``'s file in format ``fmt`` (``run.batch_format``)."""
        return self.rollouts / f"{step_name(step)}{SUFFIXES[fmt]}"

    def weights_for(self, step: int) -> Path:
        return self.weights / step_name(step)

    def checkpoint(self, step: int) -> Path:
        return self.checkpoints / step_name(step)

    @property
    def skeleton(self) -> tuple[Path, ...]:
        """The subdirectories :meth:`make` creates, before anything is written into them."""
        return (self.rollouts, self.weights, self.checkpoints, self.trainer, self.logs)

    def make(self) -> "RunDir":
        self.root.mkdir(parents=True, exist_ok=True)
        for path in self.skeleton:
            path.mkdir(exist_ok=True)
        return self

    def published_weights(self) -> Iterator[tuple[int, Path]]:
        """(version, path) of every published weight checkpoint, oldest first."""
        return _steps_with_marker(self.weights, PUBLISHED)

    def complete_checkpoints(self) -> Iterator[tuple[int, Path]]:
        """(step, path) of every checkpoint whose trainer state is complete, oldest first."""
        return ((step, path) for step, path in _steps_with_marker(self.checkpoints, "")
                if CheckpointDir(path).complete)

    def resumable_checkpoints(self) -> Iterator[tuple[int, Path]]:
        """Complete checkpoints that also carry the orchestrator's state, less those a trainer
        found non-finite values in."""
        return ((step, path) for step, path in self.complete_checkpoints()
                if CheckpointDir(path).state.exists() and not CheckpointDir(path).nonfinite.exists())


@dataclass(frozen=True)
class CheckpointDir:
    """``checkpoints/step_N/``: trainer state, HF weights of version N, orchestrator state."""

    path: Path

    @property
    def trainer(self) -> Path:
        return self.path / "trainer"

    @property
    def weights(self) -> Path:
        return self.path / "weights"

    @property
    def state(self) -> Path:
        """``orchestrator.json``: data position, untrained rollouts, pending prompts, totals."""
        return self.path / "orchestrator.json"

    @property
    def complete(self) -> bool:
        return (self.trainer / COMPLETE).exists()

    @property
    def nonfinite(self) -> Path:
        return self.trainer / NONFINITE


def _steps_with_marker(parent: Path, marker: str) -> Iterator[tuple[int, Path]]:
    if not parent.is_dir():
        return iter(())
    found = []
    for entry in os.scandir(parent):
        step = parse_step(entry.name)
        if step is not None and (not marker or os.path.exists(os.path.join(entry.path, marker))):
            found.append((step, Path(entry.path)))
    return iter(sorted(found))


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes | Iterable[bytes]) -> None:
    """Write, fsync, rename: readers see the old file or the whole new one, never a part.
    ``data``: the bytes, or pieces of them written as they come (a large file is never whole
    in memory)."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as handle:
        if isinstance(data, (bytes, bytearray)):
            handle.write(data)
        else:
            handle.writelines(data)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def write_json_atomic(path: Path, value: Any) -> None:
    write_atomic(path, json.dumps(value, separators=(",", ":")).encode())


def mark(path: Path, marker: str) -> None:
    """Create a marker file (durably) once everything beside it is on disk."""
    write_atomic(path / marker, b"")


def save_config(config: Any, path: Path) -> None:
    from omegaconf import OmegaConf

    write_atomic(path, OmegaConf.to_yaml(OmegaConf.structured(config)).encode())


def load_config(path: Path):
    """Load a resolved config written by :func:`save_config` back into a validated Config."""
    from omegaconf import DictConfig, OmegaConf

    from rlorch.config.schema import Config, ConfigError

    if not path.is_file():
        raise ConfigError("run.dir", f"no resolved config at {path}")
    try:
        loaded = OmegaConf.load(path)
    except Exception as err:   # yaml's errors, whose classes omegaconf does not re-export
        raise ConfigError("run.dir", f"{path} is not valid YAML ({_first_line(err)}); nothing was changed") from err
    if not isinstance(loaded, DictConfig) or not loaded:
        raise ConfigError("run.dir", f"{path} is empty or not a mapping, not a run's resolved config; nothing "
                                     "was changed")
    try:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Config), loaded))
    except ConfigError as err:
        raise ConfigError(err.key, f"{path}: {str(err).split(': ', 1)[-1]}; nothing was changed") from err
    except Exception as err:   # omegaconf's: an unknown key, a value of the wrong type
        key = getattr(err, "full_key", None) or "run.dir"
        raise ConfigError(key, f"{path}: {_first_line(err)}; nothing was changed") from err


def _first_line(err: Exception) -> str:
    mark = getattr(err, "problem_mark", None)    # yaml's: where the parse failed
    where = f", line {mark.line + 1}" if mark is not None else ""
    return (str(err).strip().splitlines() or [type(err).__name__])[0] + where
