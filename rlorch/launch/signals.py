"""Signals for the whole life of a run, start-up included.

The handlers go in before any child process starts: a SIGINT or SIGTERM while the engines or the
trainer are still starting cancels the start-up (whose cleanup stops what did start) and the run
ends ``interrupted`` with a summary; once the orchestrator runs, a signal asks it for its bounded
shutdown. A repeated signal changes nothing: the first one's shutdown is already bounded.
"""

from __future__ import annotations

import asyncio
import signal
from typing import Callable, Optional

from rlorch.rundir.layout import RunDir, write_json_atomic

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class SignalRelay:
    """``say``: told of each signal as it comes (its name, and whether it is the first), so the
    operator sees the stop begin rather than a silent pause until the end report."""

    def __init__(self, say: Optional[Callable[[str, bool], None]] = None) -> None:
        self.received: Optional[str] = None
        self._say = say
        self._task = asyncio.current_task()
        self._forward: Optional[Callable[[str], None]] = None
        loop = asyncio.get_running_loop()
        for sig in SIGNALS:
            loop.add_signal_handler(sig, self._on_signal, sig.name)

    def forward_to(self, request_shutdown: Callable[[str], None]) -> None:
        """From now on a signal goes to the orchestrator (one that came before goes at once)."""
        self._forward = request_shutdown
        if self.received is not None:
            request_shutdown(self.received)

    def _on_signal(self, name: str) -> None:
        first = self.received is None
        self.received = self.received or name
        if self._say is not None:
            self._say(name, first)
        if self._forward is not None:
            self._forward(name)
        elif first and self._task is not None:
            self._task.cancel()

    def close(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in SIGNALS:
            loop.remove_signal_handler(sig)


def startup_summary(run_dir: RunDir, *, status: str, reason: Optional[str], error: Optional[str],
                    step: int, wall_s: float) -> dict:
    """The summary of a run that ended before its orchestrator ran: nothing was admitted, so
    nothing can be lost; ``step`` is where a resume stands (0 for a new run)."""
    summary = {"status": status, "error": error, "reason": reason,
               "stop": "signal" if status == "interrupted" else "startup", "version": step, "steps": step,
               "admitted": 0, "trained": 0, "filtered": 0, "dropped_stale": 0, "persisted_untrained": 0,
               "requeued": 0, "unsaved": 0, "lost": 0, "checkpoint": None, "wall_s": round(wall_s, 3)}
    write_json_atomic(run_dir.summary, summary)
    return summary
