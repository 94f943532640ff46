"""Where the start of a run goes: ``summary.json``'s ``startup``.

Parts, in seconds: ``process`` (interpreter start to the runner: imports, config, run
directory), ``engines`` and ``trainer`` (each one's start; they run concurrently, so ``ready``,
the time until both are up, is about the larger), ``eval`` (the evaluation before step 1),
``first_step`` (loop start to the first step record) and ``total`` (interpreter start to the
first step record).
"""

from __future__ import annotations

import os
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Optional


def process_age() -> Optional[float]:
    """Seconds since this process started (Linux ``/proc``; None elsewhere)."""
    try:
        with open("/proc/self/stat") as handle:
            ticks = int(handle.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as handle:
            uptime = float(handle.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return max(0.0, uptime - ticks / os.sysconf("SC_CLK_TCK"))


@dataclass
class StartupClock:
    """Parts of the start-up, measured against the monotonic clock at the runner's start."""

    origin: float = field(default_factory=time.monotonic)
    before: Optional[float] = field(default_factory=process_age)
    parts: dict = field(default_factory=dict)
    first_step_at: Optional[float] = None
    """Monotonic time of step 1's record (None until it is written)."""

    @asynccontextmanager
    async def part(self, name: str):
        started = time.monotonic()
        try:
            yield
        finally:
            self.parts[name] = round(time.monotonic() - started, 3)

    def mark(self, name: str) -> None:
        """``name`` = seconds from the runner's start to now."""
        self.parts[name] = round(time.monotonic() - self.origin, 3)

    def first_step(self, loop_started: float) -> None:
        """The first step record is written now (later calls change nothing)."""
        if self.first_step_at is None:
            self.first_step_at = time.monotonic()
            self.parts["first_step"] = round(self.first_step_at - loop_started, 3)

    def summary(self) -> dict:
        """The ``startup`` record."""
        record = {"process": None if self.before is None else round(self.before, 3), **self.parts}
        if self.first_step_at is not None:
            since_runner = self.first_step_at - self.origin
            record["total"] = round(since_runner + (self.before or 0.0), 3)
        return record
