"""The ledger: the fate of every admitted rollout, and the orchestrator state a checkpoint carries.

Every admitted rollout ends in exactly one of: trained (in a batch at or before the checkpoint),
filtered (a group or batch with no signal), dropped stale (strict mode), persisted untrained
(finished, saved in the checkpoint's state to train after a resume), or requeued (its prompt goes
back to the queue: abandoned in flight at shutdown, or its group failed every retry). Without any
checkpoint nothing is persisted and both of the last two count as unsaved. ``lost`` is what is
left and must be 0.

Counts persist across resumes: the checkpoint's ``totals`` are this life's starting point.
"""

from __future__ import annotations

from collections import deque
from typing import Callable, Optional

from rlorch.rundir.state import regroup
from rlorch.types import Batch, Fate, FiledBatch, Rollout


COUNTERS = ("admitted", "trained", "filtered", "dropped_stale", "requeued", "regenerated", "stale_tokens",
            "empty_batches")
"""What ``totals`` holds; ``regenerated``, ``stale_tokens`` and ``empty_batches`` are counts of
events, not of fates (the train sink counts this life's empty batches; the ledger adds them to
those of earlier lives)."""


class Ledger:
    """Counts every rollout's fate; keeps shipped batches until no checkpoint can need them, as
    :class:`FiledBatch` (their file on disk, no arrays in memory) once their file is written.

    ``admissions`` reads how many rollouts this life admitted (the gate's count); every other
    fate is reported by the loop as it happens.
    """

    def __init__(self, *, group_size: int, admissions: Callable[[], int], restored: dict | None = None):
        self.group_size = group_size
        self.admissions = admissions
        restored = restored or {}
        self.counts = {key: int(restored.get(key, 0)) for key in COUNTERS}
        self.base_admitted = self.counts.pop("admitted")
        self.shipped: deque[Batch | FiledBatch] = deque()
        self.last_snapshot = 0

    # events --------------------------------------------------------------------------------
    def record(self, fate: Fate, rollouts: int) -> None:
        self.counts[fate.value] += rollouts

    def note(self, event: str, count: int = 1) -> None:
        """Event counts: ``regenerated``, ``stale_tokens``."""
        self.counts[event] += count

    def ship(self, batch: Batch | FiledBatch) -> None:
        self.shipped.append(batch)

    def snapshotted(self, step: int) -> None:
        """Batches at or below the newest snapshot can no longer be untrained in any checkpoint
        this run writes; the rest stay so a snapshot of an older step still lists them."""
        self.last_snapshot = max(self.last_snapshot, step)
        while self.shipped and self.shipped[0].step <= self.last_snapshot:
            self.counts["trained"] += self.shipped.popleft().size

    # views ---------------------------------------------------------------------------------
    @property
    def admitted(self) -> int:
        return self.base_admitted + self.admissions()

    def trained_through(self, step: int) -> int:
        return self.counts["trained"] + sum(b.size for b in self.shipped if b.step <= step)

    def shipped_after(self, step: int) -> list[list[Rollout]]:
        """Groups of batches shipped after ``step``: untrained as far as checkpoint ``step`` knows
        (a filed batch's read back from its file)."""
        return [group for batch in self.shipped if batch.step > step for group in regroup(batch.load())]

    def shipped_count_after(self, step: int) -> int:
        """Rollouts of batches shipped after ``step`` (no file read)."""
        return sum(batch.size for batch in self.shipped if batch.step > step)

    def requeued(self, failed_prompts: int = 0) -> int:
        return self.counts["requeued"] + failed_prompts * self.group_size

    def totals(self, *, step: int, untrained: int, failed_prompts: int, empty_batches: int) -> dict:
        """The counts as checkpoint ``step`` records them (``empty_batches``: this life's)."""
        return {**self.counts, "admitted": self.admitted, "trained": self.trained_through(step),
                "untrained": untrained, "requeued": self.requeued(failed_prompts),
                "empty_batches": self.counts["empty_batches"] + empty_batches}

    def account(self, *, step: int, untrained: int, failed_prompts: int, empty_batches: int,
                saved: bool) -> dict:
        """The summary's accounting at checkpoint ``step``; ``lost`` must be 0."""
        trained = self.trained_through(step)
        requeued = self.requeued(failed_prompts)
        accounted = trained + self.counts["filtered"] + self.counts["dropped_stale"] + untrained + requeued
        unsaved = 0
        if not saved:
            # Nothing was checkpointed: a new run starts these prompts again.
            unsaved, untrained, requeued = untrained + requeued, 0, 0
        return {"admitted": self.admitted, "trained": trained, "filtered": self.counts["filtered"],
                "dropped_stale": self.counts["dropped_stale"], "regenerated": self.counts["regenerated"],
                "stale_tokens": self.counts["stale_tokens"], "persisted_untrained": untrained,
                "requeued": requeued, "unsaved": unsaved, "lost": self.admitted - accounted,
                "empty_batches": self.counts["empty_batches"] + empty_batches}


def unaccounted(lost: int) -> Optional[str]:
    """Why an accounting with this ``lost`` breaks the ledger's invariant (None when it is 0):
    positive, admitted rollouts that reached no fate; negative, rollouts whose fate was counted
    twice. Either way the counts the summary reports are wrong, and the run fails saying so."""
    if lost > 0:
        return (f"ledger: lost = {lost}: {lost} admitted rollout(s) were neither trained, filtered, dropped as "
                "stale, persisted untrained nor requeued")
    if lost < 0:
        return (f"ledger: lost = {lost}: {-lost} rollout fate(s) were counted twice (more trained, filtered, "
                "dropped, persisted or requeued than admitted)")
    return None
