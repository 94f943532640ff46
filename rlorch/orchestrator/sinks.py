"""Sinks turn finished rollouts into training batches (train sink) or eval records (eval sink).

The train sink accumulates B rollouts, applies the filters group by group, computes group
advantages and emits what is left as the batch for the next step. In strict mode it first checks
every group's head age against the step the batch will train at: a group older than S is handed
back (to regenerate or drop) and never trained.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional, Sequence

from rlorch.types import Batch, Origin, Rollout

GroupFilter = Callable[[Sequence[Rollout]], Optional[str]]
"""A filter looks at one group and returns a reason to drop it, or None to keep it."""


def zero_variance_filter(group: Sequence[Rollout]) -> Optional[str]:
    """Groups whose samples all scored the same carry no GRPO signal."""
    if len(group) > 1 and all(r.reward == group[0].reward for r in group):
        return "zero_variance"
    return None


def group_advantages(rewards: Sequence[float], eps: float = 1e-6) -> list[float]:
    """(r - mean) / (std + eps) within one group (GRPO)."""
    mean = sum(rewards) / len(rewards)
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards))
    return [(r - mean) / (std + eps) for r in rewards]


def head_ages(rollouts: Iterable[Rollout], train_version: int) -> list[int]:
    """Head off-policy age of each live rollout trained at ``train_version``.

    Replayed or external rollouts carry no meaningful version and are excluded.
    """
    return [train_version - r.versions.head for r in rollouts
            if r.origin is Origin.live and r.versions.runs]


@dataclass
class SinkTotals:
    batches: int = 0
    trained: int = 0
    filtered: int = 0
    filtered_by: dict = field(default_factory=dict)
    empty_batches: int = 0
    consecutive_empty: int = 0
    stale_groups: int = 0
    stale_rollouts: int = 0
    stale_tokens: int = 0


class TrainSink:
    """Filters groups as they arrive and emits batches of exactly B kept rollouts.

    Filtering on arrival (rather than inside an assembled batch) keeps every batch full and the
    gate's accounting exact: a filtered or stale group is discarded from the gate, which frees
    its slots for a replacement, and each shipped batch consumes exactly B accepted rollouts.
    Invariant: every rollout handed to :meth:`add` is in an emitted batch, rejected (filtered or
    stale, counted) or still in :meth:`pending_groups`.
    """

    def __init__(self, *, batch_size: int, max_staleness: int, strict: bool,
                 filters: Sequence[GroupFilter] = (zero_variance_filter,)):
        self.batch_size = batch_size
        self.max_staleness = max_staleness
        self.strict = strict
        self.filters = list(filters)
        self.totals = SinkTotals()
        self._groups: list[list[Rollout]] = []
        self._count = 0
        self._filtered_run = 0
        self._filtered_at_emit = 0

    def pending_groups(self) -> list[list[Rollout]]:
        """Kept groups not yet in a batch, oldest first."""
        return list(self._groups)

    @property
    def buffered(self) -> int:
        return self._count

    def is_stale(self, group: Sequence[Rollout], train_version: int) -> bool:
        ages = head_ages(group, train_version)
        return bool(ages) and max(ages) > self.max_staleness

    def _count_stale(self, group: Sequence[Rollout]) -> None:
        self.totals.stale_groups += 1
        self.totals.stale_rollouts += len(group)
        self.totals.stale_tokens += sum(r.generated_tokens for r in group)

    def add(self, group: list[Rollout], step: int) -> Optional[str]:
        """Take a finished group for the batch of ``step`` (trained at version step - 1).

        Returns None when kept, ``"stale"`` (strict mode: too old to train; the caller
        regenerates or drops it) or the reason a filter gave. Every batch-worth of consecutive
        filtered rollouts counts as one empty batch.
        """
        if self.strict and self.is_stale(group, step - 1):
            self._count_stale(group)
            return "stale"
        reason = next((why for check in self.filters if (why := check(group))), None)
        if reason:
            self.totals.filtered += len(group)
            self.totals.filtered_by[reason] = self.totals.filtered_by.get(reason, 0) + len(group)
            self._filtered_run += len(group)
            if self._filtered_run >= self.batch_size:
                self._filtered_run = 0
                self.totals.empty_batches += 1
                self.totals.consecutive_empty += 1
            return reason
        self._filtered_run = 0
        if len(group) > 1:
            self.totals.consecutive_empty = 0
        self._groups.append(group)
        self._count += len(group)
        return None

    def restale(self, step: int) -> list[list[Rollout]]:
        """Strict mode: hand back buffered groups that became too stale for ``step``."""
        if not self.strict:
            return []
        keep, stale = [], []
        for group in self._groups:
            (stale if self.is_stale(group, step - 1) else keep).append(group)
        for group in stale:
            self._count -= len(group)
            self._count_stale(group)
        self._groups = keep
        return stale

    def ready(self) -> bool:
        return self._count >= self.batch_size

    def emit(self, step: int) -> Optional[Batch]:
        """Take B rollouts (whole groups, oldest first) as the batch for ``step``.

        Groups of one sample are normalised across the batch instead; a batch whose rewards
        are then all equal carries no signal: it is counted as empty and None is returned
        (its rollouts are the caller's to discard).
        """
        taken, count = [], 0
        while self._groups and count < self.batch_size:
            group = self._groups.pop(0)
            taken.append(group)
            count += len(group)
        self._count -= count
        rollouts = [r for group in taken for r in group]
        if all(len(group) == 1 for group in taken):
            advantages = group_advantages([r.reward for r in rollouts])
        else:
            advantages = [a for group in taken for a in group_advantages([r.reward for r in group])]
        if not any(abs(a) > 1e-8 for a in advantages):
            self.totals.empty_batches += 1
            self.totals.consecutive_empty += 1
            self.totals.filtered += len(rollouts)
            self.totals.filtered_by["no_signal"] = self.totals.filtered_by.get("no_signal", 0) + len(rollouts)
            return None
        self.totals.consecutive_empty = 0
        self.totals.batches += 1
        self.totals.trained += len(rollouts)
        filtered = self.totals.filtered - self._filtered_at_emit
        self._filtered_at_emit = self.totals.filtered
        return Batch(step=step, rollouts=rollouts, advantages=advantages, filtered=filtered)


@dataclass
class EvalSink:
    """Eval rollouts: no advantages, no filtering, exempt from the staleness bound."""

    results: list[dict] = field(default_factory=list)

    def add(self, step: int, rollouts: Sequence[Rollout]) -> dict:
        rewards = [r.reward for r in rollouts]
        record = {"kind": "eval", "step": step, "eval_prompts": len(rewards),
                  "eval_reward_mean": sum(rewards) / len(rewards) if rewards else 0.0}
        self.results.append(record)
        return record
