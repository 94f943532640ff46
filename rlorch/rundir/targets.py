"""The forms ``rlorch resume checkpoint=...`` accepts, and when there is nothing to resume.

- ``checkpoint=RUN_DIR``: the newest resumable checkpoint of that run (complete trainer state
  and ``orchestrator.json``);
- ``checkpoint=RUN_DIR/checkpoints/step_83``: the same as ``step_000083`` (any zero padding);
- ``checkpoint=RUN_DIR/checkpoints/step_000083``: that checkpoint.

A run whose checkpoint already reached ``train.steps``, or that ended converged on it, is
finished: resuming says so and touches nothing (``train.steps=N`` goes further).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from rlorch.config.schema import Config, ConfigError
from rlorch.rundir.layout import RunDir, parse_step, step_name


def run_root(path: Path) -> Path:
    """The run directory ``path`` (one of the forms above) belongs to, read from names alone, so
    that the run's lock can be taken before anything in it is read."""
    step = parse_step(path.name)
    if not path.exists() and not (step is not None and path.with_name(step_name(step)).exists()):
        raise ConfigError("checkpoint", f"{path} does not exist")
    if RunDir(path).is_run:
        return path
    root = path.parent.parent
    if step is not None and path.parent.name == "checkpoints" and RunDir(root).is_run:
        return root
    raise ConfigError("checkpoint", f"{path} is not an rlorch run directory (no config.yaml) nor a "
                                    "checkpoint in one (RUN_DIR/checkpoints/step_N)")


def locate_checkpoint(path: Path) -> Path:
    """The checkpoint directory meant by ``path`` (one of the forms above)."""
    run_dir = RunDir(path)
    if run_dir.config.is_file() and run_dir.checkpoints.is_dir():
        newest = None
        for _, checkpoint in run_dir.resumable_checkpoints():
            newest = checkpoint
        if newest is None:
            raise ConfigError("checkpoint", f"{path} holds no complete checkpoint yet (checkpoints/step_N with "
                                            "trainer/COMPLETE and orchestrator.json); nothing to resume. Start it "
                                            f"again with `rlorch train run.dir={path}` (its files move into "
                                            "no-checkpoint-*/ there)")
        return newest
    step = parse_step(path.name)
    if step is not None and not path.exists():
        padded = path.with_name(step_name(step))
        if padded.exists():
            return padded
    return path


def finished_run(checkpoint: Path, config: Config, overrides: list[str]) -> Optional[str]:
    """Why resuming at ``checkpoint`` would train nothing, or None when there is work left."""
    step = parse_step(checkpoint.name)
    if step is None:
        return None
    root = checkpoint.parent.parent
    if step >= config.train.steps:
        return (f"{root} is finished: checkpoint {checkpoint.name} reached train.steps={config.train.steps}; "
                f"nothing to resume (to go further: rlorch resume {root} train.steps=N with N > {step})")
    summary = RunDir(root).summary
    ended = json.loads(summary.read_text()) if summary.is_file() else {}
    steps_set = _sets(overrides, "train.steps")
    if ended.get("status") == "converged" and ended.get("steps") == step and not steps_set:
        return (f"{root} is finished: it converged at step {step} ({ended.get('reason')}); nothing to resume "
                f"(to go further: rlorch resume {root} train.steps=N)")
    return None


def _sets(overrides: list[str], key: str) -> bool:
    return any(item.split("=", 1)[0].lstrip("+") == key for item in overrides)


def continues_converged(checkpoint: Path, overrides: list[str]) -> bool:
    """A resume of a run that ended converged, asked for more steps (``train.steps``) without a
    word on ``train.stop_on_converged``: the task is still solved, so stopping on it again would
    train nothing; the caller turns the stop off for this resume."""
    summary = RunDir(checkpoint.parent.parent).summary
    ended = json.loads(summary.read_text()) if summary.is_file() else {}
    return (ended.get("status") == "converged" and _sets(overrides, "train.steps")
            and not _sets(overrides, "train.stop_on_converged"))
