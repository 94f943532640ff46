"""The metrics loop: the only writer of ``metrics.jsonl`` and of every other metrics view.

Components expose ``gauges()``; this loop polls them on a fixed interval, independent of the
training path, and also writes the per-step and eval records the orchestrator hands it. Each
record goes to the loggers behind it (``metrics.jsonl`` always; TensorBoard, W&B, the console
progress when on). Ages are in policy versions, times in seconds.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Callable, Optional

from rlorch.lifecycle import cancel_and_wait

Gauges = Callable[[], dict]


class MetricsLoop:
    def __init__(self, *, loggers: Any, interval: float, gauges: dict[str, Gauges]):
        self.loggers = loggers
        """A fan-out with ``log(record)``, ``add(logger)``, ``flush()`` and ``close()``."""
        self.interval = interval
        self.gauges = gauges
        self.started = time.monotonic()
        self.failure: Optional[str] = None
        self._task: Optional[asyncio.Task] = None

    def add_logger(self, logger: Any) -> None:
        """One more view of the records (the console progress), from the next record on."""
        self.loggers.add(logger)

    def snapshot(self) -> dict:
        merged: dict = {}
        for read in self.gauges.values():
            merged.update(read())
        return merged

    def write(self, record: dict) -> None:
        """Hand one record to the loggers. Metrics are observations: a failed write of
        ``metrics.jsonl`` (a full disk) does not raise into the loop; it is kept in ``failure``,
        which the orchestrator turns into its stop reason, and later records are dropped."""
        if self.failure is not None:
            return
        try:
            self.loggers.log({"time": round(time.monotonic() - self.started, 4), **record})
        except OSError as err:
            self.failure = str(err)

    async def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="metrics")

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            self.write({"kind": "periodic", **self.snapshot()})

    async def stop(self, timeout: Optional[float] = None) -> None:
        await cancel_and_wait(self._task, timeout=timeout)
        self._task = None
        if self.failure is None:
            self.loggers.flush()

    def close(self) -> None:
        try:
            self.loggers.close()
        except OSError:
            pass
