"""Where the metrics loop's records go: one fan-out, JSONL always, TensorBoard and W&B optional.

Every logger takes the same records (``{"kind": "step" | "eval" | "periodic" | "start" |
"summary", "time": ..., ...}``) from the metrics loop, the only writer. ``metrics.jsonl`` is the
record of the run; the others are views of it, so one that fails is dropped (said once on
stderr) and the run goes on.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Optional, Protocol

SCALAR_KINDS = ("step", "eval")
"""Record kinds sent to TensorBoard and W&B; eval figures go under ``eval/``."""


class Logger(Protocol):
    def log(self, record: dict) -> None: ...

    def close(self) -> None: ...


class JsonlLogger:
    """``metrics.jsonl``: one JSON object per line, flushed per line."""

    def __init__(self, path: Path):
        self.path = path
        self._file = open(path, "a", buffering=1)

    def log(self, record: dict) -> None:
        try:
            self._file.write(json.dumps(record) + "\n")
        except OSError as err:
            raise OSError(err.errno, f"writing {self.path} failed: {err.strerror or err}") from err

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def scalars(record: dict) -> tuple[Optional[int], dict[str, float]]:
    """(step, {name: value}) of a step or eval record's numeric fields; (None, {}) otherwise."""
    kind = record.get("kind")
    if kind not in SCALAR_KINDS:
        return None, {}
    prefix = "eval/" if kind == "eval" else ""
    values = {f"{prefix}{key}": float(value) for key, value in record.items()
              if isinstance(value, (int, float)) and not isinstance(value, bool) and key not in ("step", "time")}
    return int(record["step"]), values


class TensorBoardLogger:
    """TensorBoard scalars in ``tensorboard/`` of the run directory, indexed by training step."""

    def __init__(self, log_dir: Path):
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(str(log_dir))

    def log(self, record: dict) -> None:
        step, values = scalars(record)
        for key, value in values.items():
            self._writer.add_scalar(key, value, step)

    def close(self) -> None:
        self._writer.close()


class WandbLogger:
    """A W&B run (``metrics.wandb_project`` / ``metrics.wandb_name``) with the resolved config;
    its local files go in ``wandb/`` of the run directory. ``WANDB_MODE=offline`` keeps it local.
    W&B does not capture the console (the run's own output stays as it is)."""

    def __init__(self, *, project: str, name: str, run_dir: Path, config: dict[str, Any]):
        import wandb

        self._run = wandb.init(project=project, name=name, dir=str(run_dir), config=config,
                               reinit="create_new", settings=wandb.Settings(console="off"))

    def log(self, record: dict) -> None:
        step, values = scalars(record)
        if values:
            self._run.log(values, step=step)
        if record.get("kind") == "summary":
            self._run.summary.update({k: v for k, v in record.items() if isinstance(v, (int, float, str))})

    def close(self) -> None:
        self._run.finish()


class FanOut:
    """The loggers behind the metrics loop; the first (``metrics.jsonl``) is never dropped."""

    def __init__(self, loggers: list[Logger]):
        self.loggers = list(loggers)

    def add(self, logger: Logger) -> None:
        self.loggers.append(logger)

    def log(self, record: dict) -> None:
        self.loggers[0].log(record)
        for logger in list(self.loggers[1:]):
            try:
                logger.log(record)
            except Exception as err:
                self._drop(logger, err)

    def _drop(self, logger: Logger, err: Exception) -> None:
        self.loggers.remove(logger)
        print(f"metrics: {type(logger).__name__} failed and is off for the rest of the run: {err!r}",
              file=sys.stderr)

    def flush(self) -> None:
        flush = getattr(self.loggers[0], "flush", None)
        if flush is not None:
            flush()

    def close(self) -> None:
        for logger in self.loggers:
            logger.close()


def make_loggers(config: Any, run_dir: Any) -> FanOut:
    """JSONL into ``metrics.jsonl``, plus TensorBoard and W&B when ``metrics.*`` turns them on."""
    from rlorch.config.schema import to_plain

    metrics = config.metrics
    loggers: list[Logger] = [JsonlLogger(run_dir.metrics)]
    if metrics.tensorboard:
        loggers.append(TensorBoardLogger(run_dir.tensorboard))
    if metrics.wandb:
        loggers.append(WandbLogger(project=metrics.wandb_project, name=metrics.wandb_name or run_dir.root.name,
                                   run_dir=run_dir.root, config=to_plain(config)))
    return FanOut(loggers)
