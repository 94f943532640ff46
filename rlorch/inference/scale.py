"""``rlorch scale RUN_DIR inference.num_servers=N`` on the run's side: the launched fleet follows
the request written to ``RUN_DIR/SCALE``, and a request not yet met is visible.

- A request is read once (its file's mtime), and met one server at a time: new ones start, load
  the current weights and join; the newest go first when shrinking (their requests in flight
  finish or continue elsewhere, then they stop). With ``inference.weight_transfer=distributed``
  the pool rebuilds the weight group for the next version (new servers join it then).
- While a request is not met, :meth:`ScaleFollower.pending` says so: the size requested, the
  servers in the fleet, how long it has waited and what the start in progress waits for, as the
  launcher reports it (under Ray: the placement group and the cluster's free resources, renewed
  every 10 s). The pool puts it into the step records (``scale_pending``), the live line and the
  end report.
- A server that cannot start ends the request where it stands: under Ray, a placement group
  still pending after ``run.placement_timeout`` is removed and the request dropped with a
  warning naming it, and the run goes on with the servers it has (``scale_dropped`` counts the
  dropped requests). A request written meanwhile is read once this one is met or dropped.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path
from typing import Awaitable, Callable, Optional, Sized

from rlorch.launch.base import LaunchError

log = logging.getLogger("rlorch.servers")


class ScaleFollower:
    """Keeps as many launched servers as ``scale_file`` asks for (``{"num_servers": N}``, written
    by ``rlorch scale``), looking every ``interval`` seconds. ``servers`` is the fleet as it is
    now; ``add`` starts one more server and returns once it serves, ``remove`` takes the newest
    out; ``waiting`` says what a start in progress waits for (None: nothing)."""

    def __init__(self, scale_file: Path, servers: Sized, *, add: Callable[[], Awaitable[None]],
                 remove: Callable[[], Awaitable[None]], waiting: Callable[[], Optional[str]],
                 interval: float = 0.5):
        self.scale_file = scale_file
        self.servers = servers
        self.add, self.remove, self.waiting = add, remove, waiting
        self.interval = interval
        self.requested: Optional[int] = None
        """The size asked for by the request being met; None when none is."""
        self.since = 0.0
        self.dropped = 0
        """Requests dropped because a server could not start (not placed in time, under Ray)."""

    def pending(self) -> Optional[dict]:
        """``{"requested", "servers", "waiting_s", "waiting_for"}`` while a request is not met,
        else None."""
        if self.requested is None:
            return None
        return {"requested": self.requested, "servers": len(self.servers),
                "waiting_s": round(time.monotonic() - self.since, 1), "waiting_for": self.waiting()}

    def fields(self) -> dict:
        """What the step records, the live line and the end report show: ``scale_pending``
        (:meth:`pending`) and ``scale_dropped``."""
        return {"scale_pending": self.pending(), "scale_dropped": self.dropped}

    async def run(self) -> None:
        seen: Optional[float] = None
        while True:
            await asyncio.sleep(self.interval)
            try:
                stamp = self.scale_file.stat().st_mtime
                if stamp == seen:
                    continue
                seen = stamp
                want = int(json.loads(self.scale_file.read_text())["num_servers"])
            except FileNotFoundError:
                continue
            except (OSError, ValueError, KeyError, TypeError) as err:
                log.warning("%s: not a scale request (%s); ignored", self.scale_file, err)
                continue
            await self.meet(want)

    async def meet(self, want: int) -> None:
        """Grow or shrink the fleet to ``want`` servers (at least one), or drop the request with a
        warning naming it when a server cannot start."""
        have = len(self.servers)
        log.warning("rlorch scale: %d -> %d servers", have, want)
        self.requested, self.since = want, time.monotonic()
        try:
            while len(self.servers) < want:
                await self.add()
            while len(self.servers) > max(want, 1):
                await self.remove()
        except (LaunchError, OSError) as err:
            self.dropped += 1
            log.warning("rlorch scale: request inference.num_servers=%d dropped at %d servers, after %.0fs: %s",
                        want, len(self.servers), time.monotonic() - self.since, err)
        finally:
            self.requested = None
