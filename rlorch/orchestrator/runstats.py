"""The end-of-run figures: how the run went (first → last), how old the trained data was, how
fast it ran, and where the time went. Fed the step records as they are written; read once into
``summary.json``. A resumed run's figures cover its own life (the loop since the resume); the
accounting beside them (admitted, trained, ...) covers the whole run.
"""

from __future__ import annotations

import time
from typing import Any, Optional

import numpy as np

AGENT_GAUGES = ("agent_episodes", "agent_calls", "agent_failures", "agent_forks_total", "agent_errors")
"""An agent task's counts since the run's start (the step records carry them as gauges): the
summary keeps the last seen."""


class RunStats:
    """``idle`` is the loop's idle clocks (shares per interval and overall), ``startup`` the run's
    start-up clock (its origin is the run's start; it learns when the first step is recorded)."""

    def __init__(self, *, idle: Any, startup: Any) -> None:
        self.idle, self.startup = idle, startup
        self.age_counts: list[int] = []
        self.rollouts = 0
        self.tokens = 0
        self.truncated = 0.0
        self.reward_first: Optional[float] = None
        self.reward_last: Optional[float] = None
        self.agents: dict = {}

    def stamp(self, records: list[dict], *, loop_started: float) -> None:
        """The step records written now: each gets the idle shares of the interval since the last
        ones and the run's wall time, and is counted."""
        idle = self.idle.interval() if records else {}
        for record in records:
            record.update(idle, wall_s=round(time.monotonic() - self.startup.origin, 3))
            self.add(record)
            self.startup.first_step(loop_started)

    def add(self, record: dict) -> None:
        """One step record (``kind == "step"``)."""
        for age, count in enumerate(record.get("age_counts") or []):
            if age >= len(self.age_counts):
                self.age_counts.extend([0] * (age + 1 - len(self.age_counts)))
            self.age_counts[age] += count
        self.rollouts += record.get("rollouts") or 0
        self.truncated += (record.get("truncated_share") or 0.0) * (record.get("rollouts") or 0)
        self.tokens += record.get("tokens") or 0
        self.agents.update((key, record[key]) for key in AGENT_GAUGES if key in record)
        if record.get("reward_mean") is not None:
            if self.reward_first is None:
                self.reward_first = record["reward_mean"]
            self.reward_last = record["reward_mean"]

    def ages(self) -> dict:
        """Head age (policy versions behind, oldest token of each trained rollout) over the run."""
        total = sum(self.age_counts)
        if not total:
            return {"age_max": None, "age_p99": None, "age_mean": None}
        ages = np.repeat(np.arange(len(self.age_counts)), self.age_counts)
        return {"age_max": int(ages.max()), "age_p99": float(np.percentile(ages, 99)),
                "age_mean": round(float(ages.mean()), 4)}

    def summary(self, *, loop_started: float, gauges: Optional[dict] = None) -> dict:
        """The report's figures; rates are over the loop (start-up excluded), trained data only.
        ``gauges``: the work's counts now (an agent task's), kept where no step record carried
        them (a run that failed before its first step: every episode failed, say)."""
        if not self.agents:
            self.agents.update((key, value) for key, value in (gauges or {}).items() if key in AGENT_GAUGES)
        now, started, idle = time.monotonic(), self.startup.origin, self.idle.overall()
        loop_s = now - loop_started
        span = max(loop_s, 1e-9)
        return {"wall_s": round(now - started, 3), "loop_s": round(loop_s, 3),
                "reward_mean_first": self.reward_first, "reward_mean_last": self.reward_last, **self.ages(),
                "truncated_share": round(self.truncated / self.rollouts, 4) if self.rollouts else None,
                "rollouts_per_s": round(self.rollouts / span, 3), "tokens_per_s": round(self.tokens / span, 2),
                "startup_s": round(loop_started - started, 3), **idle, "startup": self.startup.summary(),
                **self.agents}
