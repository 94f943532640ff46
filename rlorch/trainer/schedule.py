"""The learning-rate schedule as a pure function of the optimizer step.

``position`` counts optimizer updates already taken (minibatches included: a batch with
``trainer.minibatches=M`` advances it by M), so the curve is the same whatever the batch/minibatch
split, and a resumed run that restores the position continues it exactly. The horizon is
``train.steps * trainer.minibatches`` updates.

Warm-up ramps linearly over the first ``warmup_steps`` updates, ``(position + 1) / warmup_steps``:
the first update already moves (a zero learning rate would waste a batch), the last warm-up
update reaches the full rate. After it ``constant`` holds, ``linear`` and ``cosine`` decay from the
full rate towards ``min_lr_ratio`` times it over the updates left; progress is measured as in
HF's schedulers, ``(position - warmup) / (total - warmup)``, so the last update is one step short
of the floor.
"""

from __future__ import annotations

import math


def lr_factor(position: int, *, schedule: str = "constant", warmup_steps: int = 0, total_steps: int = 1,
              min_lr_ratio: float = 0.0) -> float:
    """The multiplier of ``trainer.lr`` for the update at ``position`` (0-based)."""
    if position < warmup_steps:
        return (position + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (position - warmup_steps) / max(1, total_steps - warmup_steps))
    if schedule == "linear":
        shape = 1.0 - progress
    elif schedule == "cosine":
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        raise ValueError(f"trainer.lr_schedule: unknown schedule {schedule!r} (constant, linear or cosine)")
    return min_lr_ratio + (1.0 - min_lr_ratio) * shape
