"""Publishing weights: an HF checkpoint per version, made visible only when whole.

Invariant: a directory ``weights/step_N`` exists only once every file in it is on disk (written
in ``weights/.staging-step_N``, fsynced, renamed), and it counts as published only once its
PUBLISHED marker exists, so a reader never loads half a checkpoint.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from rlorch.rundir import PUBLISHED, RunDir, fsync_dir, mark, step_name

STAGING_PREFIX = ".staging-"


def fsync_tree(path: Path) -> None:
    for root, _, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(root))


def write_hf(target: Path, model, state_dict: dict, tokenizer) -> None:
    """An HF directory (config, safetensors weights, tokenizer) from a full state dict."""
    target.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(target, state_dict=state_dict)
    if tokenizer is not None:
        tokenizer.save_pretrained(target)


def publish(run: RunDir, step: int, model, state_dict: dict, tokenizer) -> Path:
    """Rank 0: write version ``step`` into ``weights/step_N`` and mark it PUBLISHED.

    A version directory left by an earlier life of the run (a resume re-trains steps after its
    checkpoint) is replaced: it belongs to a trajectory that no longer exists.
    """
    final = run.weights_for(step)
    staging = run.weights / f"{STAGING_PREFIX}{step_name(step)}"
    shutil.rmtree(staging, ignore_errors=True)
    write_hf(staging, model, state_dict, tokenizer)
    fsync_tree(staging)
    if final.exists():
        stale = run.weights / f"{STAGING_PREFIX}stale-{step_name(step)}"
        shutil.rmtree(stale, ignore_errors=True)
        os.rename(final, stale)
        shutil.rmtree(stale, ignore_errors=True)
    os.rename(staging, final)
    fsync_dir(run.weights)
    mark(final, PUBLISHED)
    return final


def prune(run: RunDir, keep: int) -> list[Path]:
    """Delete published versions beyond the newest ``keep`` (never the newest); the marker goes
    first, so a reader never sees a PUBLISHED directory that is being deleted."""
    published = [path for _, path in run.published_weights()]
    doomed = published[:-max(keep, 1)]
    for path in doomed:
        (path / PUBLISHED).unlink(missing_ok=True)
        shutil.rmtree(path, ignore_errors=True)
    return doomed


def discard_newer(run: RunDir, step: int) -> list[Path]:
    """Remove published versions after ``step`` (rank 0, at start). After a resume from step N
    they belong to an abandoned trajectory; serving them would break "version M is the weights
    after batches 1..M"."""
    doomed = [path for version, path in run.published_weights() if version > step]
    for path in doomed:
        (path / PUBLISHED).unlink(missing_ok=True)
        shutil.rmtree(path, ignore_errors=True)
    return doomed


def clear_staging(run: RunDir) -> None:
    """Remove staging directories a crashed trainer left behind (rank 0, at start)."""
    for entry in run.weights.glob(f"{STAGING_PREFIX}*"):
        shutil.rmtree(entry, ignore_errors=True)
