"""Why a run stops: typed reasons, and the exceptions that carry them out of the loop."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class StopKind(str, enum.Enum):
    """Why the loop stopped before (or at) its step target."""

    signal = "signal"
    trainer = "trainer"
    watcher = "watcher"
    generation = "generation"
    resume_alarm = "resume_alarm"
    empty_batches = "empty_batches"
    converged = "converged"
    bookkeeping = "bookkeeping"


@dataclass(frozen=True)
class StopReason:
    kind: StopKind
    detail: str

    def __str__(self) -> str:
        return self.detail


class RunFailed(RuntimeError):
    """The run stopped on one of its own invariants; ``reason`` says which and why."""

    def __init__(self, reason: StopReason):
        super().__init__(reason.detail)
        self.reason = reason


class Converged(Exception):
    """Nearly every recent group earned the maximum reward: the task is solved, the run ends well."""
