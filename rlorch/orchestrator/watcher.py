"""The weight watcher: finds newly published trainer checkpoints, reloads every engine, then
bumps the shared policy version.

Only checkpoints with a PUBLISHED marker are seen, so a half-written one is never loaded. The
version is bumped after the engines report the reload, so a token is never stamped with a
version its engine does not hold yet.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from pathlib import Path
from typing import Callable, Iterable, Optional

from rlorch.config.schema import WatcherConfig
from rlorch.lifecycle import cancel_and_wait
from rlorch.types import Engine, PolicyVersion

log = logging.getLogger("rlorch.watcher")

class WatcherStalled(RuntimeError):
    pass


class WeightWatcher:
    def __init__(self, config: WatcherConfig, *, policy: PolicyVersion, engines: Engine,
                 published: Callable[[], Iterable[tuple[int, Path]]],
                 offers: Callable[[], Iterable[tuple[int, Path]]] = lambda: (),
                 offer_mark: Optional[Callable[[int, str], Path]] = None,
                 distributed: bool = False,
                 expecting: Callable[[], bool] = lambda: False,
                 on_version: Callable[[int], None] = lambda version: None,
                 on_error: Callable[[BaseException], None] = lambda error: None,
                 on_idle: Callable[[str, bool], None] = lambda cause, active: None):
        self.config = config
        self.on_idle = on_idle
        """Told ``("reload", True)`` while the engines load new weights (generation is paused)."""
        self.policy = policy
        self.engines = engines
        self.published = published
        self.offers = offers
        """Versions the trainer offers over the weight group (``inference.weight_transfer=distributed``)."""
        self.failed_offers: set[int] = set()
        """Offered versions the engines did not receive: they come from disk instead."""
        self.offer_mark = offer_mark
        """Where to answer an offered version: ``receiving`` (the trainer broadcasts only then) or
        ``refused`` (it publishes the version to disk at once)."""
        self.distributed = distributed
        self.transfer_fallbacks = 0
        """With weight transfer over the group asked for: versions that came from disk instead."""
        self.expecting = expecting
        self.on_version = on_version
        self.on_error = on_error
        self.reload_s: Optional[float] = None
        self.publish_to_reload_s: Optional[float] = None
        self.reloads = 0
        self.superseded = 0
        """Reloads abandoned because the trainer pruned the version meanwhile (a newer one was loaded)."""
        self.error: Optional[BaseException] = None
        self._last_advance = time.monotonic()
        self._task: Optional[asyncio.Task] = None

    async def start(self) -> None:
        self._last_advance = time.monotonic()
        self._task = asyncio.create_task(self._poll_loop(), name="weight-watcher")

    async def stop(self, timeout: Optional[float] = None) -> None:
        await cancel_and_wait(self._task, timeout=timeout)
        self._task = None

    async def last_poll(self, timeout: float) -> None:
        """One more poll at shutdown, given up after ``timeout`` seconds or on a failed load: the
        run ends on whatever version is live then."""
        try:
            await asyncio.wait_for(self.poll_once(), timeout)
        except (asyncio.TimeoutError, OSError, RuntimeError):
            pass

    async def poll_once(self) -> bool:
        """Load the newest version ahead of the live one: received over the weight group when it
        is offered there (and newer than anything on disk), else the newest published checkpoint."""
        newest = max(self.published(), default=None)
        offered = max(self.offers(), default=None)
        if (offered is not None and offered[0] > self.policy.value and offered[0] not in self.failed_offers
                and (newest is None or offered[0] >= newest[0])):
            return await self._receive(*offered)
        if newest is None or newest[0] <= self.policy.value:
            return False
        version, path = newest
        detected = time.monotonic()
        self.on_idle("reload", True)
        try:
            await self.engines.reload(str(path), version)
        except Exception:
            # The trainer prunes old versions (trainer.keep); when it runs that far ahead of a
            # reload, the version is gone and a newer one replaces it on the next poll.
            if not path.exists() and any(v > version for v, _ in self.published()):
                self.superseded += 1
                return False
            raise
        finally:
            self.on_idle("reload", False)
        self.transfer_fallbacks += self.distributed
        self._advance(version, detected, path / "PUBLISHED")
        return True

    async def _receive(self, version: int, offer_path: Path) -> bool:
        """Have the engines receive an offered version; when that fails the trainer publishes the
        version to disk instead, and the next polls load it from there."""
        try:
            offer = json.loads(offer_path.read_text())
        except FileNotFoundError:
            return False
        detected = time.monotonic()
        self.on_idle("reload", True)
        try:
            await self.engines.update_weights_from_distributed(offer, version,
                                                               receiving=lambda: self._answer(version, "receiving"))
        except Exception as err:  # the disk is the fallback: a failed transfer must not end the run
            self._answer(version, "refused")
            self.failed_offers.add(version)
            log.warning("version %d did not arrive over the weight group (%s); loading it from disk "
                        "once the trainer publishes it there", version, err)
            return False
        finally:
            self.on_idle("reload", False)
        self._advance(version, detected, offer_path)
        return True

    def _answer(self, version: int, answer: str) -> None:
        if self.offer_mark is not None:
            self.offer_mark(version, answer).touch()

    def _advance(self, version: int, detected: float, marker: Path) -> None:
        self.policy.bump(version)
        now = time.monotonic()
        self.reload_s = now - detected
        try:
            self.publish_to_reload_s = time.time() - os.path.getmtime(marker)
        except OSError:
            self.publish_to_reload_s = None
        self.reloads += 1
        self._last_advance = now
        self.on_version(version)

    async def _poll_loop(self) -> None:
        try:
            while True:
                if not await self.poll_once():
                    idle = time.monotonic() - self._last_advance
                    if idle > self.config.stall_timeout and self.expecting():
                        raise WatcherStalled(
                            f"policy version stuck at {self.policy.value} for {idle:.0f}s while "
                            f"batches wait for the trainer (watcher.stall_timeout="
                            f"{self.config.stall_timeout:g}); see logs/trainer.log")
                    await asyncio.sleep(self.config.poll_interval)
        except asyncio.CancelledError:
            raise
        except BaseException as err:
            self.error = err
            self.on_error(err)

    def stalled_for(self) -> float:
        return time.monotonic() - self._last_advance

    def step_fields(self) -> dict:
        """What each step record carries of the watcher."""
        return {"reload_s": self.reload_s, "transfer_fallbacks": self.transfer_fallbacks}

    def summary(self) -> dict:
        """What the run's summary carries of the watcher: versions loaded, and of those how many
        went by disk although the weight group was asked for."""
        return {"reloads": self.reloads, "transfer_fallbacks": self.transfer_fallbacks}

    def gauges(self) -> dict:
        return {"version": self.policy.value, "reloads": self.reloads, "reload_s": self.reload_s,
                "publish_to_reload_s": self.publish_to_reload_s, "version_idle_s": round(self.stalled_for(), 3),
                "reloads_superseded": self.superseded, "transfer_fallbacks": self.transfer_fallbacks}
