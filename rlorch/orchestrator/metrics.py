"""The metrics loop: the only writer of ``metrics.jsonl``.

Components expose ``gauges()``; this loop polls them on a fixed interval, independent of the
training path, and also writes the per-step and eval records the orchestrator hands it. One
JSON object per line; ages are in policy versions, times in seconds.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Callable, Optional

from rlorch.lifecycle import cancel_and_wait

Gauges = Callable[[], dict]


class MetricsLoop:
    def __init__(self, *, path: Path, interval: float, gauges: dict[str, Gauges]):
        self.path = path
        self.interval = interval
        self.gauges = gauges
        self.started = time.monotonic()
        self.path = path
        self._file = open(path, "a", buffering=1)
        self.failure: Optional[str] = None
        self._task: Optional[asyncio.Task] = None
        self._tensorboard = None

    def enable_tensorboard(self, log_dir: Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as err:
            from rlorch.config import ConfigError

            raise ConfigError("metrics.tensorboard", "needs the tensorboard package "
                                                     "(pip install tensorboard)") from err
        self._tensorboard = SummaryWriter(str(log_dir))

    def snapshot(self) -> dict:
        merged: dict = {}
        for read in self.gauges.values():
            merged.update(read())
        return merged

    def write(self, record: dict) -> None:
        """Append one record. Metrics are observations: a failed write (a full disk) does not
        raise into the loop; it is kept in ``failure``, which the orchestrator turns into its
        stop reason, and later records are dropped."""
        if self.failure is not None:
            return
        record = {"time": round(time.monotonic() - self.started, 4), **record}
        try:
            self._file.write(json.dumps(record) + "\n")
        except OSError as err:
            self.failure = f"writing {self.path} failed: {err}"
            return
        if self._tensorboard is not None and record.get("kind") == "step":
            for key, value in record.items():
                if isinstance(value, (int, float)) and key not in ("step", "time"):
                    self._tensorboard.add_scalar(key, value, record["step"])

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
            self._file.flush()
        if self._tensorboard is not None:
            self._tensorboard.close()

    def close(self) -> None:
        try:
            self._file.close()
        except OSError:
            pass
