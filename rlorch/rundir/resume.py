"""Resuming a run from a full checkpoint: which checkpoint, what a resume abandons, what it reads.

A resume at step N continues the trajectory that checkpoint N belongs to: batches shipped after
N and later checkpoints move aside (``superseded-*``) rather than being trained or resumed, the
metrics logs' lines from past step N move to ``*.superseded-*.jsonl`` beside them (so each step
has one line, the trajectory's), and published weights newer than N are removed.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Callable, Optional

from rlorch.rundir.validation import check_checkpoint
from rlorch.config.schema import Config, ConfigError
from rlorch.rundir.layout import CheckpointDir, RunDir, load_config, parse_step, save_config, write_atomic


def step_of(checkpoint: Path) -> int:
    step = parse_step(checkpoint.name)
    if step is None:
        raise ConfigError("checkpoint", f"{checkpoint} is not a checkpoints/step_N directory")
    return step


def resume_target(path: Path, overrides: list[str]) -> tuple[Config, RunDir]:
    """The run a checkpoint belongs to and its config with ``overrides`` applied; refuses a
    checkpoint that is not complete (naming the ones that are)."""
    from omegaconf import OmegaConf

    step = step_of(path)
    run_dir = RunDir(path.parent.parent)
    parts = CheckpointDir(path)
    config = load_config(run_dir.config)
    if not parts.complete or not parts.state.exists():
        raise ConfigError("checkpoint", f"{path} is not a complete checkpoint (needs trainer/COMPLETE and "
                                        f"{parts.state.name}); {_usable(run_dir, config)}")
    problem = check_checkpoint(path, run_dir, step, config)
    if problem is not None:
        raise ConfigError("checkpoint", f"{problem}; nothing was changed; {_usable(run_dir, config)}")
    if overrides:
        try:
            merged = OmegaConf.merge(OmegaConf.structured(config), OmegaConf.from_dotlist(overrides))
            resumed = OmegaConf.to_object(merged)
        except ConfigError:
            raise
        except Exception as err:
            raise ConfigError("overrides", str(err).splitlines()[0]) from err
        _keep_the_shapes(config, resumed)
        config = resumed
    return config, run_dir


SHAPING_KEYS = ("model.path", "model.lora.rank", "model.lora.target_modules", "model.lora.modules_to_save")
"""What a checkpoint's trainer state is shaped by: the model, and which tensors train."""


def _keep_the_shapes(saved: Config, resumed: Config) -> None:
    """Refuse an override of a key the trainer state's tensors depend on: the trainer would fail
    loading it after the engines started (and the changed config would stay, failing the next
    plain resume too)."""
    for key in SHAPING_KEYS:
        before, after = saved, resumed
        for part in key.split("."):
            before, after = getattr(before, part), getattr(after, part)
        if key == "model.path":   # empty is the built-in default's name
            before, after = before or "tiny", after or "tiny"
        if before != after:
            raise ConfigError(key, f"the checkpoint's trainer state is shaped by {key}={before!r}; a resume "
                                   f"keeps it (got {after!r}): nothing was changed; start a new run to change it")


def carried_age_warning(checkpoint: Path, before: Config, after: Config) -> Optional[str]:
    """What a resume that shrinks ``rollout.batch_size`` or ``rollout.max_staleness`` does to the
    rollouts the checkpoint carries untrained: they were admitted under the old bound and are
    trained first, so their age passes the new one until they are (None when nothing shrank)."""
    old, new = before.rollout, after.rollout
    if new.batch_size * (new.max_staleness + 1) >= old.batch_size * (old.max_staleness + 1):
        return None
    state = json.loads(CheckpointDir(checkpoint).state.read_text())
    carried = sum(len(group) for group in state.get("untrained", []))
    steps = -(-carried // new.batch_size)
    if steps <= new.max_staleness + 1:
        return None
    return (f"the checkpoint carries {carried} untrained rollouts admitted at rollout.batch_size={old.batch_size}, "
            f"rollout.max_staleness={old.max_staleness}: at batch {new.batch_size} they fill the first {steps} "
            f"steps, their age passing rollout.max_staleness={new.max_staleness} there "
            f"(rollout.enforce=strict drops the ones too old instead)")


def _usable(run_dir: RunDir, config: Config) -> str:
    usable = [str(p) for step, p in run_dir.resumable_checkpoints()
              if check_checkpoint(p, run_dir, step, config) is None]
    return f"resumable checkpoints: {', '.join(usable) or 'none'}"


def prepare(run_dir: RunDir, step: int, config: Config, overrides: list[str]) -> None:
    """Move aside what came after ``step`` and save the overridden config (keeping the old one)."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    supersede(run_dir, step, stamp)
    if overrides:
        shutil.copy2(run_dir.config, run_dir.config_before_resume(stamp))
        save_config(config, run_dir.config)


def supersede(run_dir: RunDir, step: int, stamp: str) -> None:
    """Batches shipped after the checkpoint were not trained there (their rollouts are in its
    untrained set) and later checkpoints belong to the abandoned trajectory: both move aside.
    Later weight versions go, a version killed before its PUBLISHED marker too (its step is
    published again, and its directory would stand in the way)."""
    for parent, pattern in ((run_dir.rollouts, "step_*.*"), (run_dir.checkpoints, "step_*")):
        aside = run_dir.superseded(parent, stamp)
        for path in sorted(parent.glob(pattern)):
            later = parse_step(path.name.split(".")[0])
            if later is not None and later > step:
                aside.mkdir(exist_ok=True)
                shutil.move(str(path), aside / path.name)
    for path in sorted(run_dir.weights.glob("step_*")):
        version = parse_step(path.name)
        if version is not None and version > step:
            shutil.rmtree(path, ignore_errors=True)
    for log in (run_dir.metrics, run_dir.trainer_metrics):
        cut_log(log, step, run_dir.superseded_lines(log, stamp))


def cut_log(log: Path, step: int, aside: Path) -> None:
    """Move a JSON-lines log's lines of the abandoned trajectory to ``aside``: from the first
    record of a step past ``step`` on, every line but a record of a step up to ``step`` (an
    evaluation of such a step can finish after the next step's record), and a torn last line
    (a kill leaves it, and the next append would fuse it with a record). Lines are moved, never
    dropped; a line before the cut that does not parse stays."""
    if not log.is_file():
        return
    lines = log.read_text().splitlines(keepends=True)
    torn = bool(lines) and not lines[-1].endswith("\n")
    whole = lines[:-1] if torn else lines

    def step_of_line(line: str) -> Optional[int]:
        try:
            value = json.loads(line).get("step")
        except (ValueError, AttributeError):
            return None
        return value if isinstance(value, int) else None

    def within(line: str) -> bool:
        found = step_of_line(line)
        return found is not None and found <= step

    cut = next((i for i, line in enumerate(whole) if step_of_line(line) is not None and not within(line)),
               len(whole))
    kept = whole[:cut] + [line for line in whole[cut:] if within(line)]
    moved = [line for line in whole[cut:] if not within(line)] + lines[len(whole):]
    if not moved:
        return
    tail = "".join(moved)
    write_atomic(aside, (tail if tail.endswith("\n") else tail + "\n").encode())
    write_atomic(log, "".join(kept).encode())


def read_state(checkpoint: Path, make_prompt: Callable, restore_replay: Optional[Callable[[dict], None]] = None):
    """The orchestrator's state saved with ``checkpoint``; ``restore_replay`` is handed the saved
    replay queue's state before any pending prompt is made (a replay's id resolves through it)."""
    from rlorch.rundir.state import ResumeState

    data = json.loads(CheckpointDir(checkpoint).state.read_text())
    if restore_replay is not None:
        restore_replay(data.get("replay", {}))
    return ResumeState.from_json(data, make_prompt)


def weights_of(checkpoint: Path, run_dir: RunDir, step: int) -> Path:
    """The HF weights to load into the engines: the checkpoint's own, else the published ones."""
    weights = CheckpointDir(checkpoint).weights
    return weights if weights.is_dir() else run_dir.weights_for(step)
