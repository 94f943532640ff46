"""Shipping: full batches into the trainer's hands, each on disk first.

A batch is *parked* from the moment it is emitted until it is shipped: a checkpoint taken
meanwhile lists it as untrained. Under ship-side gating (``rollout.enforce=ship``) it stays
parked until the trainer is within S versions of it; staleness is then counted against batches
shipped (:attr:`shipped_handle`) rather than versions trained, so at most (S+1)*B rollouts wait
unshipped, generation never waits on the trainer at admission, and age stays bounded by 2S+2.
"""

from __future__ import annotations

import asyncio
import time
from typing import Awaitable, Callable, Optional

from rlorch.types import Batch, PolicyVersion


class Shipping:
    def __init__(self, *, policy: PolicyVersion, max_staleness: int, park: bool, poll_interval: float,
                 persist: Callable[[Batch], Awaitable[None]], on_shipped: Callable[[Batch, float], None],
                 check: Callable[[], None]):
        self.policy, self.max_staleness, self.park, self.poll_interval = policy, max_staleness, park, poll_interval
        self.persist, self.on_shipped, self.check = persist, on_shipped, check
        self.shipped = 0
        """The step of the newest batch handed to the trainer."""
        self.shipped_handle = PolicyVersion(0)
        self.parked: Optional[Batch] = None
        self.parked_s = 0.0
        """Seconds batches waited, parked, for the trainer (ship-side gating)."""

    def gauges(self) -> dict:
        return {"step": self.shipped, "parked_s_total": round(self.parked_s, 4)}

    def restore(self, step: int) -> None:
        self.shipped = step
        self.shipped_handle.bump(step)

    @property
    def parked_rollouts(self) -> int:
        return len(self.parked.rollouts) if self.parked is not None else 0

    async def ship(self, batch: Batch) -> None:
        self.parked = batch
        waited = 0.0
        if self.park:
            started = time.monotonic()
            await self.wait_version(batch.step - 1 - self.max_staleness)
            waited = time.monotonic() - started
            self.parked_s += waited
        await self.persist(batch)
        self.parked = None
        self.shipped = batch.step
        self.shipped_handle.bump(batch.step)
        self.on_shipped(batch, waited)

    async def wait_version(self, version: int) -> None:
        """Until the live policy reaches ``version``; ``check`` raises to give up."""
        while self.policy.value < version:
            self.check()
            await asyncio.sleep(self.poll_interval)
