"""``RoutedServer``: a sglang-router in front of SGLang workers, driven as one Server.

sglang-router (0.3.x) forwards ``/generate``, ``/health_generate`` and ``/get_model_info`` to a
worker, but answers 404 to ``/pause_generation``, ``/continue_generation``,
``/update_weights_from_disk`` and ``/abort_request``, and its ``/get_server_info`` has no
``version``. So generation and health go through the router while pause, continue, weight
updates, aborts and version reads go to every worker.

Invariant: :meth:`RoutedServer.reload` succeeds only if every worker loaded the version, and
:meth:`RoutedServer.weight_version` is the lowest version a worker holds, so a version check never
passes while one worker lags behind.
"""

from __future__ import annotations

import asyncio
from typing import Optional, Sequence

from rlorch.inference.client import EngineError, SGLangEngine
from rlorch.types import Generation, GroupRequest, SamplingParams


class RoutedServer:
    def __init__(self, router: SGLangEngine, workers: list[SGLangEngine]):
        if not workers:
            raise ValueError("a routed server needs the worker addresses behind its router")
        self.router = router
        self.workers = list(workers)
        self.name = router.name

    async def generate(self, input_ids: list[int], params: SamplingParams, rid: str, *,
                       prefix: Optional[Generation] = None) -> Generation:
        return await self.router.generate(input_ids, params, rid, prefix=prefix)

    async def generate_group(self, input_ids: list[int], params: SamplingParams, n: int,
                             rid: str) -> list[Generation]:
        return await self.router.generate_group(input_ids, params, n, rid)

    async def generate_batch(self, requests: Sequence[GroupRequest]) -> list[list[Generation]]:
        return await self.router.generate_batch(requests)

    async def _all(self, call) -> list:
        results = await asyncio.gather(*(call(w) for w in self.workers), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise errors[0] if len(errors) == 1 else EngineError("; ".join(str(e) for e in errors))
        return results

    async def abort(self, rid: str) -> None:
        """Abort on every worker (only the one running it has it; the others ignore the id)."""
        self.router._cancelled.add(rid)
        sent = self.router.wire_rid(rid)
        if sent is not None:
            await self._all(lambda w: w._control("POST", "/abort_request", {"rid": sent, "abort_all": False},
                                                 expect_json=False))

    async def pause(self) -> None:
        await self._all(lambda w: w.pause())

    async def resume(self) -> None:
        await self._all(lambda w: w.resume())

    async def reload(self, path: str, version: int) -> None:
        await self._all(lambda w: w.reload(path, version))
        self.router.version = version

    async def weight_version(self) -> int:
        version = min(await self._all(lambda w: w.weight_version()))
        self.router.version = version
        return version

    async def healthy(self, timeout: Optional[float] = None) -> bool:
        return await self.router.healthy(timeout)

    async def server_info(self) -> dict:
        """The first worker's (the router's own has no ``version``)."""
        return await self.workers[0].server_info()

    def gauges(self) -> dict:
        return self.router.gauges()

    def health(self) -> dict:
        return self.router.health()

    async def close(self) -> None:
        await asyncio.gather(self.router.close(), *(w.close() for w in self.workers), return_exceptions=True)
