"""Idle clocks: how much of the loop's wall time the trainer and the engines spent waiting.

Two figures, per step record and over the whole loop in the summary, both fractions of wall time:

- ``trainer_idle``: the trainer waited for a batch. The trainer counts as busy from the moment a
  batch ships until the version it trains is live in the engines, and idle whenever every shipped
  batch is live (nothing handed to it is unfinished). Measured from the orchestrator, so the
  reload of a version counts as trainer time.
- ``engine_idle``: the engines were paused or idle: reloading weights (generation is paused for a
  reload), or holding no training rollout in flight (the gate, the drain budget or backpressure
  admitted nothing; evaluation requests are not counted as work). The two causes may overlap in
  time and count once.

A step's figure covers the interval since the previous step record was written; the summary's
covers the loop from its start.
"""

from __future__ import annotations

import time
from typing import Callable


class IdleClock:
    """Accumulates the seconds during which at least one idle cause is active.

    ``set(cause, active)`` switches a cause on or off; the clock is idle while any cause is on.
    """

    def __init__(self, *, now: Callable[[], float] = time.monotonic):
        self.now = now
        self.causes: set[str] = set()
        self.idle_s = 0.0
        self._since = now()

    def set(self, cause: str, active: bool) -> None:
        self._advance()
        if active:
            self.causes.add(cause)
        else:
            self.causes.discard(cause)

    def total(self) -> float:
        """Idle seconds so far, including the current idle stretch."""
        self._advance()
        return self.idle_s

    def _advance(self) -> None:
        now = self.now()
        if self.causes:
            self.idle_s += now - self._since
        self._since = now


class IdleShares:
    """The trainer's and the engines' idle fractions over successive intervals."""

    def __init__(self, *, trainer: IdleClock, engines: IdleClock, now: Callable[[], float] = time.monotonic):
        self.trainer, self.engines, self.now = trainer, engines, now
        self.started = self._last_at = now()
        self._start = self._last = (trainer.total(), engines.total())

    def interval(self) -> dict:
        """``trainer_idle`` and ``engine_idle`` since the previous call (or the start)."""
        now, totals = self.now(), (self.trainer.total(), self.engines.total())
        span = now - self._last_at
        shares = [_share(t - last, span) for t, last in zip(totals, self._last)]
        self._last_at, self._last = now, totals
        return {"trainer_idle": shares[0], "engine_idle": shares[1]}

    def overall(self) -> dict:
        """The same fractions over the whole loop."""
        span = self.now() - self.started
        return {"trainer_idle": _share(self.trainer.total() - self._start[0], span),
                "engine_idle": _share(self.engines.total() - self._start[1], span)}


def _share(idle: float, span: float) -> float:
    return round(min(1.0, idle / span), 4) if span > 0 else 0.0


class LoopIdle:
    """The loop's two idle clocks as it starts them: the trainer waiting for its first batch, the
    engines with no work yet. Shares are measured from :meth:`start` (the loop's start)."""

    def __init__(self) -> None:
        self.trainer, self.engines = IdleClock(), IdleClock()
        self.trainer.set("waiting", True)
        self.engines.set("no_work", True)
        self.shares: IdleShares | None = None

    def start(self) -> None:
        self.shares = IdleShares(trainer=self.trainer, engines=self.engines)

    def interval(self) -> dict:
        return self.shares.interval() if self.shares is not None else {}

    def overall(self) -> dict:
        return self.shares.overall() if self.shares is not None else {}
