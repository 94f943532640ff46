"""The swap step of ``run.colocate=swap``, the orchestrator's side: the engines give the device to
the trainer before it is handed a batch, and take it back only for a version the trainer published
after moving its own state off the device (``trainer/offloaded``)."""

from __future__ import annotations

import time
from typing import Any, Callable, Iterable, Optional


class SwapStep:
    def __init__(self, *, release: Callable[[], Any], published: Callable[[], Iterable[tuple[int, Any]]],
                 offloaded: Callable[[], int]):
        self.release, self.published, self.offloaded = release, published, offloaded
        self.release_s: Optional[float] = None
        """Seconds the last release took (pause, flush, release on every server)."""

    def swappable(self) -> list:
        """The published versions the engines may take their memory back for."""
        offloaded = self.offloaded()
        return [(version, path) for version, path in self.published() if version <= offloaded]

    async def release_engines(self) -> Optional[str]:
        """None, or why the release failed (a refused release, a lost server: the pool names it)."""
        started = time.monotonic()
        try:
            await self.release()
        except Exception as err:
            return f"run.colocate=swap: {err}"
        self.release_s = time.monotonic() - started
        return None

    def step_fields(self) -> dict:
        return {"release_s": self.release_s}
