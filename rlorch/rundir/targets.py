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


def locate_checkpoint(path: Path) -> Path:
    """The checkpoint directory meant by ``path`` (one of the forms above)."""
    run_dir = RunDir(path)
    if run_dir.config.is_file() and run_dir.checkpoints.is_dir():
        newest = None
        for _, checkpoint in run_dir.resumable_checkpoints():
            newest = checkpoint
        if newest is None:
            raise ConfigError("checkpoint", f"{path} holds no complete checkpoint yet (checkpoints/step_N with "
                                            "trainer/COMPLETE and orchestrator.json); nothing to resume")
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
                f"nothing to resume (to go further: rlorch resume checkpoint={root} train.steps=N with N > {step})")
    summary = RunDir(root).summary
    ended = json.loads(summary.read_text()) if summary.is_file() else {}
    steps_set = any(item.split("=", 1)[0].lstrip("+") == "train.steps" for item in overrides)
    if ended.get("status") == "converged" and ended.get("steps") == step and not steps_set:
        return (f"{root} is finished: it converged at step {step} ({ended.get('reason')}); nothing to resume "
                f"(to go further: rlorch resume checkpoint={root} train.steps=N)")
    return None
