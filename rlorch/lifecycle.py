"""One lifecycle for long-lived components: ``start()`` runs background work until
``stop(timeout)``, and a stop is bounded. :func:`cancel_and_wait` is the one way a background
task is stopped."""

from __future__ import annotations

import asyncio
from typing import Optional


async def cancel_and_wait(*tasks: Optional[asyncio.Task], timeout: Optional[float] = None) -> None:
    """Cancel ``tasks`` and wait until they have finished, at most ``timeout`` seconds.

    Their exceptions are not re-raised: whoever owns a task reads its outcome before stopping it.
    ``None`` entries are skipped, so an optional task needs no check of its own.
    """
    live = [task for task in tasks if task is not None and not task.done()]
    for task in live:
        task.cancel()
    if live:
        await asyncio.wait(live, timeout=timeout)
