"""The capacity gate: a pure state machine that bounds how many rollouts are in the system.

capacity = min(C - running, (S + version + 1) * B - (accepted + running))

Every admitted rollout is running until it is accepted (finished and kept) or rejected (finished
and thrown away, which frees its staleness slot). No tasks, no clients, no clock: the version is
read off the shared policy handle, and every counter change is under one lock so threads and
the event loop may share a gate.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Optional

from rlorch.types import PolicyVersion


@dataclass(frozen=True)
class GateCounts:
    submitted: int
    running: int
    accepted: int
    rejected: int
    version: int
    capacity: int


class CapacityGate:
    """Admission control for the staleness bound S, batch size B and concurrency cap C."""

    def __init__(self, *, max_staleness: int, batch_size: int, max_concurrent: int,
                 policy: PolicyVersion):
        if max_staleness < 0 or batch_size < 1 or max_concurrent < 1:
            raise ValueError("need max_staleness >= 0, batch_size >= 1, max_concurrent >= 1")
        self.max_staleness = max_staleness
        self.batch_size = batch_size
        self.max_concurrent = max_concurrent
        self.policy = policy
        self.submitted = 0
        self.running = 0
        self.accepted = 0
        self.rejected = 0
        self._resume_limit: Optional[int] = None
        self._lock = threading.Lock()

    @property
    def pending_limit(self) -> int:
        """Most rollouts in the system at steady state: (S + 1) * B."""
        return (self.max_staleness + 1) * self.batch_size

    def _capacity(self) -> int:
        concurrency = self.max_concurrent - self.running
        staleness = ((self.max_staleness + self.policy.value + 1) * self.batch_size
                     - (self.accepted + self.running))
        return min(concurrency, staleness)

    def capacity(self) -> int:
        """Rollouts that may be admitted now; negative when the system is over its bound."""
        with self._lock:
            return self._capacity()

    def try_admit(self, count: int = 1) -> bool:
        """Admit ``count`` rollouts together (a prompt group) if they all fit."""
        with self._lock:
            if self._capacity() < count:
                return False
            self.submitted += count
            self.running += count
            return True

    def admit_groups(self, size: int, most: int) -> int:
        """Admit as many whole groups of ``size`` as fit, at most ``most``; returns how many
        (the same as calling :meth:`try_admit` for each until one does not fit)."""
        with self._lock:
            groups = min(most, max(0, self._capacity()) // size)
            self.submitted += groups * size
            self.running += groups * size
            return groups

    def on_submitted(self, count: int = 1) -> None:
        """Record rollouts started without a capacity check (the simulator's tick admits one by one)."""
        with self._lock:
            self.submitted += count
            self.running += count

    def on_accepted(self, count: int = 1) -> None:
        """Finished rollouts that stay in the system until trained."""
        with self._lock:
            self._finish(count)
            self.accepted += count

    def on_rejected(self, count: int = 1) -> None:
        """Finished rollouts thrown away (failed, filtered); their slots are freed."""
        with self._lock:
            self._finish(count)
            self.rejected += count

    def on_discarded(self, count: int = 1) -> None:
        """Accepted rollouts removed before training (too stale in strict mode, filtered groups)."""
        with self._lock:
            if count > self.accepted:
                raise ValueError(f"discarding {count} rollouts but only {self.accepted} accepted")
            self.accepted -= count
            self.rejected += count

    def on_short_batch(self, missing: int) -> None:
        """A batch shipped ``missing`` rollouts short of B (the filter budget ran out). Each
        version must account for B accepted rollouts, or the staleness term would open
        ``missing`` extra slots per short batch; the shortfall counts as accepted."""
        with self._lock:
            self.accepted += missing

    def on_version_recovered(self, version: int, buffered: int = 0) -> None:
        """Re-establish the bound after a resume at ``version``.

        The live version jumps to V while the counters restart at zero, which would open
        (S + V + 1) * B slots at once and lose the bound for the rest of the run. Counting the
        V * B rollouts already trained (plus ``buffered`` finished-but-untrained ones restored
        from the checkpoint) as accepted closes that burst.
        """
        with self._lock:
            if self.running:
                raise ValueError(f"recover the gate before admitting ({self.running} running)")
            self.accepted = version * self.batch_size + buffered

    def _finish(self, count: int) -> None:
        if count > self.running:
            raise ValueError(f"finishing {count} rollouts but only {self.running} running")
        self.running -= count

    def arm_resume_check(self, limit: int) -> None:
        """After a resume: the admissions before the first version bump may not exceed
        ``limit`` ((S + 1) * B), or the recovery adjustment failed and the bound is lost."""
        self._resume_limit = limit

    def resume_overshoot(self) -> Optional[int]:
        """Once, at the first version bump after a resume: the admissions kept in the system
        (discarded ones freed their slots) when they exceed the armed limit, else None."""
        limit, self._resume_limit = self._resume_limit, None
        admitted = self.submitted - self.rejected
        return admitted if limit is not None and admitted > limit else None

    def resume_alarm(self) -> Optional[str]:
        """:meth:`resume_overshoot` as the message the run fails with, or None."""
        overshoot = self.resume_overshoot()
        if overshoot is None:
            return None
        return (f"resume alarm: {overshoot} rollouts admitted before the first step after resume, more than "
                f"(S+1)*B = {self.pending_limit}: the staleness bound is lost")

    def gauges(self) -> dict:
        counts = self.counts()
        return {"capacity": counts.capacity, "gate_running": counts.running, "gate_accepted": counts.accepted,
                "gate_rejected": counts.rejected}

    def counts(self) -> GateCounts:
        with self._lock:
            return GateCounts(self.submitted, self.running, self.accepted, self.rejected,
                              self.policy.value, self._capacity())
