"""The end-of-run figures: how the run went (first → last), how old the trained data was, how
fast it ran, and where the time went. Fed the step records as they are written; read once into
``summary.json``. A resumed run's figures cover its own life (the loop since the resume); the
accounting beside them (admitted, trained, ...) covers the whole run.
"""

from __future__ import annotations

from typing import Optional

import numpy as np


class RunStats:
    def __init__(self) -> None:
        self.age_counts: list[int] = []
        self.rollouts = 0
        self.tokens = 0
        self.reward_first: Optional[float] = None
        self.reward_last: Optional[float] = None

    def add(self, record: dict) -> None:
        """One step record (``kind == "step"``)."""
        for age, count in enumerate(record.get("age_counts") or []):
            if age >= len(self.age_counts):
                self.age_counts.extend([0] * (age + 1 - len(self.age_counts)))
            self.age_counts[age] += count
        self.rollouts += record.get("rollouts") or 0
        self.tokens += record.get("tokens") or 0
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

    def summary(self, *, loop_s: float, startup_s: float, idle: dict) -> dict:
        """The report's figures; rates are over the loop (start-up excluded), trained data only."""
        span = max(loop_s, 1e-9)
        return {"reward_mean_first": self.reward_first, "reward_mean_last": self.reward_last, **self.ages(),
                "rollouts_per_s": round(self.rollouts / span, 3), "tokens_per_s": round(self.tokens / span, 2),
                "startup_s": round(startup_s, 3), **idle}
