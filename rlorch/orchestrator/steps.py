"""Step records: one ``{"kind": "step"}`` line per trained batch, joined with the trainer's own.

A batch's record is started when it ships (admissions, ages, reward) and written once its version
is live and the trainer's line for that step (loss, grad_norm, kl, mismatch, ...) has been read,
joined by step number: lines read early wait in a backlog keyed by step, and a record whose line
is late waits for it (records still go out in step order). A line never comes only when the
trainer wrote a later step without it, or at the end of the run (``final``): then the record
goes out with null figures.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Optional

import numpy as np

from rlorch.types import Batch, head_ages

TRAINER_KEYS = ("loss", "grad_norm", "kl", "ratio_mean", "ratio_max", "clip_frac", "is_capped_frac", "step_s",
                "mismatch_kl", "mismatch_max", "mismatch_tokens", "entropy", "skipped_updates", "lr",
                "ref_kl")
"""Trainer figures joined into each step record (``loss`` and ``grad_norm`` always, null if missing)."""


def age_stats(ages: list[int]) -> dict:
    """Max, p99 and mean head age, and ``age_counts``: rollouts at each age 0, 1, ... max (a
    negative age counts as 0). Read off the counts of the few distinct ages a batch has: once
    per step on the event loop, where numpy's conversions and percentile cost several times more."""
    if not ages:
        return {"age_max": None, "age_p99": None, "age_mean": None, "age_counts": []}
    counts = Counter(ages)
    histogram = [0] * (max(max(counts), 0) + 1)
    for age, count in counts.items():
        histogram[max(age, 0)] += count
    return {"age_max": max(counts), "age_p99": percentile_99(ages, counts),
            "age_mean": round(sum(age * count for age, count in counts.items()) / len(ages), 4),
            "age_counts": histogram}


def percentile_99(values: list[int], counts: Counter) -> float:
    """``np.percentile(values, 99)``: linear interpolation between the order statistics around
    rank 0.99 (n - 1). Where every order statistic within one rank of those is the same value,
    that value is the result exactly and is read off ``counts``; numpy computes the rest."""
    rank = int(0.99 * (len(values) - 1))
    first, last = max(rank - 1, 0), min(rank + 2, len(values) - 1)
    seen, low = 0, None
    for value in sorted(counts):
        seen += counts[value]
        if low is None and seen > first:
            low = value
        if seen > last:
            if value == low:
                return float(value)
            break
    return float(np.percentile(np.asarray(values), 99))


def truncated_share(rollouts: list) -> float:
    """The share of rollouts whose (last) model turn ended by length (``finish_reason`` length)."""
    if not rollouts:
        return 0.0
    return round(sum(1 for r in rollouts if r.finish_reason == "length") / len(rollouts), 4)


class StepRecords:
    def __init__(self, trainer_metrics: Path):
        self.trainer_metrics = trainer_metrics
        # A resumed run reads only the trainer lines written from now on: older ones belong to
        # steps this run does not train (or to an abandoned trajectory).
        self.offset = trainer_metrics.stat().st_size if trainer_metrics.exists() else 0
        self.pending: dict[int, dict] = {}
        self.backlog: dict[int, dict] = {}
        self.last: dict = {}
        self.admitted_total = 0

    def shipped(self, batch: Batch, *, admitted_total: int, parked_s: float) -> None:
        """Batch ``batch.step`` is in the trainer's hands; ``admitted_total`` counts every rollout
        admitted so far (the record carries those admitted since the previous batch)."""
        admitted, self.admitted_total = admitted_total - self.admitted_total, admitted_total
        rollouts = batch.rollouts
        rewards = [r.reward for r in rollouts]
        self.pending[batch.step] = {
            "kind": "step", "step": batch.step, "admitted": admitted,
            **age_stats(head_ages(rollouts, batch.step - 1)),
            "trainable": sum(1 for a in batch.advantages if abs(a) > 1e-8), "filtered": batch.filtered,
            "reward_mean": round(sum(rewards) / len(rewards), 6), "parked_s": round(parked_s, 4),
            "tokens": sum([r.versions.count for r in rollouts]), "rollouts": len(rollouts),
            "truncated_share": truncated_share(rollouts),
            **({"agent_forks": forks} if (forks := sum(len(r.segments) - 1 for r in rollouts if r.segments)) else {})}

    def ready(self, trained: int, extra: Optional[dict] = None, *, final: bool = False) -> list[dict]:
        """The records of steps up to ``trained`` (the live version) whose trainer line has been
        read, oldest first; with ``final`` (the run ends) every one up to ``trained``."""
        self._read_trainer_lines()
        done = []
        newest_line = max(self.backlog, default=0)
        for step in sorted(self.pending):
            if step > trained or not (final or step in self.backlog or step < newest_line):
                break
            record = self.pending.pop(step)
            line = self.backlog.pop(step, {})
            record.update({"loss": line.get("loss"), "grad_norm": line.get("grad_norm"), **(extra or {})})
            record.update({key: line[key] for key in TRAINER_KEYS if key in line})
            self.last = record
            done.append(record)
        return done

    def _read_trainer_lines(self) -> None:
        try:
            with open(self.trainer_metrics, "rb") as handle:
                handle.seek(self.offset)
                data = handle.read()
        except OSError:
            return
        complete = data[: data.rfind(b"\n") + 1]
        self.offset += len(complete)
        for line in complete.splitlines():
            if line.strip():
                record = json.loads(line)
                self.backlog[record["step"]] = record
