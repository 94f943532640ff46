"""``EnginePool``: the Engine Protocol over several servers.

Invariants:
- Every request handed to :meth:`EnginePool.generate` completes or raises; none is dropped. A
  server that stops answering (connection error, timeout) is marked down and the request
  continues on another live server from its partial progress, up to ``max_retries`` attempts.
- A request resubmitted after a pause-abort stays on the server that started it (the client's
  interruptible generation loop never leaves its server).
- A server can be *suspect* (down): it stopped answering a request or a control call in time, or
  missed ``health_failures`` probes in a row. It takes no new work, its requests in flight are
  aborted here and continue elsewhere, and it rejoins only once it answers again and holds the
  current checkpoint. A *dead* one (its process exited, or was killed for hanging) never rejoins.
- :meth:`EnginePool.reload` returns only once every live server runs the new version; a server
  that was down during a reload is brought to the current checkpoint before it rejoins. Every
  response is stamped with the version of the weights that produced it, whatever happens.
- With weights over a process group (:meth:`EnginePool.update_weights_from_distributed`), the
  group's members are exactly the servers that receive: when that set changed (a server
  restarted, joined, left or went down) the group is rebuilt before the next version. A server
  that cannot catch up from disk (the current version never went there) waits out of rotation
  and joins the group, and rotation, with the next version; when no live server is left to
  receive one, the trainer is asked to write its weights to disk and it catches up from there.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Awaitable, Callable, Iterable, Optional, Sequence

from rlorch.inference.client import EngineError, EngineUnavailable
from rlorch.launch.weight_group import rank_offsets
from rlorch.lifecycle import cancel_and_wait, gather_all
from rlorch.types import Generation, GroupRequest, SamplingParams, Server

log = logging.getLogger("rlorch.pool")
SETTLE_FACTOR = 4.0
SETTLE_MIN_S = 2.0
"""A weight update's steps (pause, load, continue) wait for a server still busy once half the
servers have finished at most SETTLE_FACTOR times as long as that took, and at least
SETTLE_MIN_S: a straggler that loads twice as slowly keeps up, a hung server never holds the
update. Half, not the first: in a fleet of a thousand the calls themselves take the orchestrator
a while to issue and read, and the last server answered is not slow for being last."""


RELEASED_TAGS = ["kv_cache", "weights", "cuda_graph"]
"""What a swap step releases: SGLang 0.5.23's GPU_MEMORY_ALL_TYPES, named so that the resumes
name exactly these (SGLang's scheduler dies resuming a tag never released)."""
RESUMED_FIRST = ["weights"]
"""Resumed before new weights load into them; the rest after (SGLang's and its RL users' order)."""


class EnginePool:
    def __init__(self, engines: list[Server], *, request_timeout: float = 300.0, max_retries: int = 3,
                 probe_interval: float = 1.0, name: str = "pool",
                 on_close: Optional[Callable[[], Awaitable[None]]] = None,
                 diagnose: Optional[Callable[[str], Optional[str]]] = None,
                 health_interval: Optional[float] = None, health_timeout: float = 10.0, health_failures: int = 3):
        """``on_close`` runs last in :meth:`close` (the launcher stops its processes there);
        ``diagnose(name)`` says why a server that stopped answering is gone for good (its
        process exited), else None. With ``health_interval`` every server in rotation is probed
        that often (``/health_generate`` within ``health_timeout``)."""
        if not engines:
            raise ValueError("an EnginePool needs at least one engine")
        self.name = name
        self.engines = list(engines)
        self.request_timeout = request_timeout
        self.max_retries = max_retries
        self.probe_interval = probe_interval
        self._on_close = on_close
        self._diagnose = diagnose
        self._up = {e.name: True for e in self.engines}
        self._dead: dict[str, str] = {}
        self._down_reason: dict[str, str] = {}
        self._in_flight = {e.name: 0 for e in self.engines}
        self._running: dict[str, set[asyncio.Task]] = {e.name: set() for e in self.engines}
        """Each server's requests in flight, aborted here when it is marked down."""
        self._aborted: set[asyncio.Task] = set()
        self._down_since: dict[str, float] = {}
        self._suspect_s = 0.0
        """Seconds servers spent suspect before their current stretch (rejoined or dead since)."""
        self._misses = {e.name: 0 for e in self.engines}
        self._tokens = {e.name: 0 for e in self.engines}
        self._started = time.monotonic()
        self.health_interval, self.health_timeout, self.health_failures = health_interval, health_timeout, health_failures
        self._health: Optional[asyncio.Task] = None
        self.restarts = 0
        self._changed = asyncio.Event()
        self._reload_lock = asyncio.Lock()
        self._weight_group: Optional[str] = None
        self._group_members: tuple[str, ...] = ()
        """The servers in the weight group, in rank order (empty: it must be rebuilt)."""
        self._awaiting_group: set[str] = set()
        """Servers that answer but can only catch up over the weight group: out of rotation, they
        join it (and rotation) with the next version."""
        self._version: Optional[int] = None
        """The version every live server holds (None: the weights they started with)."""
        self.regroup: Optional[Callable[[int, int], Awaitable[dict]]] = None
        """``regroup(version, world_size)``: have the trainer open a new weight group of that size
        for ``version`` and return its spec (master_address, master_port, group_name, backend);
        without it the group is never rebuilt."""
        self.group_rebuilds = 0
        self.published: Callable[[], Iterable[tuple[int, Path]]] = lambda: ()
        """The versions the trainer published to disk, (version, HF directory)."""
        self._released: set[str] = set()
        """Servers whose memory is released (``run.colocate=swap``, while the trainer trains)."""
        self.request_publish: Callable[[int], None] = lambda version: None
        """Ask the trainer to write its current weights (at least ``version``) to disk."""
        self.scale_fields: Callable[[], dict] = lambda: {}
        """What the follower of ``rlorch scale`` requests adds to :meth:`health` (a request not yet
        met, requests dropped); nothing where the fleet cannot be scaled."""
        self._publish_requested: set[int] = set()
        self.restartable: Callable[[str], bool] = lambda name: False
        """Whether dead server ``name`` will be started again (the supervisor's restarts left):
        while one will, a request waits for it rather than failing at once."""
        self._retiring: set[str] = set()
        """Servers being taken out: no new work, never probed back."""
        self._checkpoint: Optional[tuple[str, int]] = None
        self._probe: Optional[asyncio.Task] = None
        self._turn = 0
        self.failovers = 0
        self.completed = 0

    # ---- routing --------------------------------------------------------------------------

    def _live(self) -> list[Server]:
        return [e for e in self.engines if self._up[e.name]]

    def _mark_down(self, engine: Server, reason: str) -> None:
        if self._up[engine.name]:
            log.warning("%s: server %s marked down: %s", self.name, engine.name, reason)
            self._down_since[engine.name] = time.monotonic()
            for task in self._running[engine.name]:
                self._aborted.add(task)
                task.cancel()
        self._up[engine.name] = False
        self._down_reason[engine.name] = reason
        gone = self._diagnose(engine.name) if self._diagnose is not None else None
        if gone is not None:
            self._dead.setdefault(engine.name, gone)
        if not self._live():
            # Nobody is left to take the next version over the group: those waiting for it
            # catch up from disk through the probe instead (:meth:`_catch_up_from_disk`).
            self._awaiting_group.clear()
        self._changed.set()
        self._ensure_probe()

    def mark_dead(self, name: str, reason: str) -> None:
        """Server ``name`` is gone for good (its process exited): out of rotation now, and once
        every server is dead (and none will be restarted: :attr:`restartable`) a request fails at
        once with ``reason`` instead of waiting."""
        self._dead[name] = reason
        self._awaiting_group.discard(name)
        self._forget_member(name)
        self._end_suspect(name)
        for engine in self.engines:
            if engine.name == name:
                self._mark_down(engine, reason)

    def _end_suspect(self, name: str) -> None:
        since = self._down_since.pop(name, None)
        if since is not None:
            self._suspect_s += time.monotonic() - since

    def _forget_member(self, name: str) -> None:
        """Server ``name``'s process is gone: a new one on its address holds no group, so the
        group must be rebuilt even if the names of its members come out the same."""
        if name in self._group_members:
            self._group_members = ()

    def down_for(self, name: str) -> Optional[float]:
        """Seconds server ``name`` has been suspect (down, not dead), or None."""
        if self._up[name] or name in self._dead:
            return None
        return time.monotonic() - self._down_since.get(name, time.monotonic())

    def restarted(self, name: str) -> None:
        """Server ``name`` was started anew (same address): suspect until it rejoins."""
        self._dead.pop(name, None)
        self._awaiting_group.discard(name)
        self._forget_member(name)
        self._down_reason[name] = "restarted; rejoins once it answers and loads the current weights"
        self._end_suspect(name)
        self._down_since[name] = time.monotonic()
        self.restarts += 1
        self._ensure_probe()

    def add(self, engine: Server) -> None:
        """A new server (``rlorch scale``): it takes work once the probe finds it answering and
        holding the current checkpoint (it loads it first), as a server that was down."""
        name = engine.name
        self.engines.append(engine)
        self._up[name] = False
        self._in_flight[name], self._misses[name], self._tokens[name] = 0, 0, 0
        self._running[name] = set()
        self._down_reason[name] = "joining; takes work once it answers and holds the current weights"
        self._down_since[name] = time.monotonic()
        self._ensure_probe()

    async def remove(self, name: str, timeout: float) -> None:
        """Take server ``name`` out (``rlorch scale``): no new work from now; its requests in
        flight finish there, or past ``timeout`` seconds are aborted and continue on the others
        from their partial progress (nothing is lost); then it leaves the pool."""
        engine = next(e for e in self.engines if e.name == name)
        self._retiring.add(name)
        self._up[name] = False
        self._changed.set()
        deadline = time.monotonic() + timeout
        while self._in_flight[name] and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for task in list(self._running[name]):
            self._aborted.add(task)
            task.cancel()
        while self._in_flight[name]:
            await asyncio.sleep(0.05)
        # A weight update under way may count it in the weight group: it leaves once that is over.
        async with self._reload_lock:
            self._end_suspect(name)
            self.engines.remove(engine)
            self._retiring.discard(name)
            self._awaiting_group.discard(name)
            self._dead.pop(name, None)
        await engine.close()

    def _no_live_server(self, waited: str) -> EngineUnavailable:
        """Names every server and why it is down (a dead one: its exit status and log tail)."""
        for engine in self.engines:
            gone = self._diagnose(engine.name) if self._diagnose is not None and not self._up[engine.name] else None
            if gone is not None:
                self._dead.setdefault(engine.name, gone)
        reasons = "; ".join(self._dead.get(e.name) or f"{e.name}: {self._down_reason.get(e.name, 'down')}"
                            for e in self.engines)
        return EngineUnavailable(f"{self.name}: no live server{waited}: {reasons}")

    async def _pick(self) -> Server:
        """The live server with the fewest requests in flight (ties rotate); waits for one to
        come back when none is up, at most ``request_timeout``."""
        live = await self._wait_live(time.monotonic() + self.request_timeout)
        self._turn += 1
        order = live[self._turn % len(live):] + live[:self._turn % len(live)]
        return min(order, key=lambda e: self._in_flight[e.name])

    async def _wait_live(self, deadline: float) -> list[Server]:
        """The live servers, once there is one; raises at once when every server is dead and none
        will be restarted, or at ``deadline`` (naming every server and why it is out)."""
        while True:
            live = self._live()
            if live:
                return live
            if all(e.name in self._dead and not self.restartable(e.name) for e in self.engines):
                raise self._no_live_server("")
            self._changed.clear()
            left = deadline - time.monotonic()
            if left <= 0:
                raise self._no_live_server(f" for {self.request_timeout:.0f}s")
            try:
                await asyncio.wait_for(self._changed.wait(), timeout=left)
            except asyncio.TimeoutError:
                pass

    async def generate(self, input_ids: list[int], params: SamplingParams, rid: str) -> Generation:
        return await self._generate(input_ids, params, rid)

    async def generate_group(self, input_ids: list[int], params: SamplingParams, n: int,
                             rid: str) -> list[Generation]:
        """``n`` samples (request ids ``f"{rid}-{i}"``), started together on one server so it
        batches them (and shares their prompt's cache); a sample whose server fails continues
        elsewhere like any request."""
        self._ensure_probe()
        server = await self._pick()
        return await gather_all(*(self._generate(input_ids, params, f"{rid}-{i}", prefer=server) for i in range(n)))

    async def generate_batch(self, requests: Sequence[GroupRequest]) -> list[list[Generation]]:
        """Every sample of ``requests`` in one call to one server (the least loaded), so it
        batches them. If that server fails the call, it is marked down and each sample starts
        again on the live servers like any request."""
        self._ensure_probe()
        server = await self._pick()
        count = sum(request.n for request in requests)
        self._in_flight[server.name] += count
        try:
            answers = await self._on(server, server.generate_batch(requests))
        except EngineUnavailable as err:
            self._mark_down(server, str(err))
            self.failovers += 1
            return await gather_all(*(self._group(r) for r in requests))
        finally:
            self._in_flight[server.name] -= count
        self.completed += count
        self._tokens[server.name] += sum(len(g.output_ids) for group in answers for g in group)
        return answers

    async def _on(self, server: Server, call: Awaitable):
        """``call`` on ``server``, aborted here (as :class:`EngineUnavailable`) when the server is
        marked down meanwhile; a cancellation from outside propagates as ever."""
        task = asyncio.ensure_future(call)
        self._running[server.name].add(task)
        try:
            return await task
        except asyncio.CancelledError:
            if task in self._aborted and not asyncio.current_task().cancelling():
                raise EngineUnavailable(f"{server.name}: aborted here, the server is suspect "
                                        f"({self._down_reason.get(server.name)})") from None
            raise
        finally:
            self._running[server.name].discard(task)
            self._aborted.discard(task)

    async def _group(self, request: GroupRequest) -> list[Generation]:
        return await gather_all(*(self._generate(request.input_ids, request.params, f"{request.rid}-{i}")
                                  for i in range(request.n)))

    async def _generate(self, input_ids: list[int], params: SamplingParams, rid: str, *,
                        prefer: Optional[Server] = None) -> Generation:
        self._ensure_probe()
        partial: Optional[Generation] = None
        for attempt in range(1, self.max_retries + 1):
            use_preferred = attempt == 1 and prefer is not None and self._up[prefer.name]
            engine = prefer if use_preferred else await self._pick()
            self._in_flight[engine.name] += 1
            try:
                result = await self._on(engine, engine.generate(input_ids, params, rid, prefix=partial))
            except EngineUnavailable as err:
                partial = err.partial if err.partial is not None else partial
                self._mark_down(engine, str(err))
                if attempt == self.max_retries:
                    raise EngineUnavailable(f"{self.name}: request {rid} failed {attempt} times; last: {err}",
                                            partial) from err
                self.failovers += 1
                continue
            finally:
                self._in_flight[engine.name] -= 1
            self.completed += 1
            self._tokens[engine.name] += len(result.output_ids)
            return result
        raise AssertionError("unreachable")

    # ---- control --------------------------------------------------------------------------

    async def _each(self, engines: list[Server], call: Callable[[Server], Awaitable], *, settle: bool = False) -> list:
        """Run ``call`` on every engine in parallel; mark unreachable ones down; return the
        (engine, EngineError) pairs of servers that answered with a failure. With ``settle`` a
        server still busy past the settle time (SETTLE_FACTOR) is marked down and its call
        abandoned."""
        tasks = [asyncio.ensure_future(call(e)) for e in engines]
        late = await _settle(tasks) if settle and len(tasks) > 1 else None
        results = await asyncio.gather(*tasks, return_exceptions=True)
        failed = []
        for engine, result in zip(engines, results):
            if isinstance(result, asyncio.CancelledError):
                self._mark_down(engine, f"still busy {late:.1f}s into a weight update the others had finished")
            elif isinstance(result, EngineUnavailable):
                self._mark_down(engine, str(result))
            elif isinstance(result, BaseException):
                failed.append((engine, result))
        return failed

    async def pause(self) -> None:
        failed = await self._each(self._live(), lambda e: e.pause())
        if failed:
            raise EngineError("; ".join(str(err) for _, err in failed))

    async def resume(self) -> None:
        failed = await self._each(self._live(), lambda e: e.resume())
        if failed:
            raise EngineError("; ".join(str(err) for _, err in failed))

    @property
    def released(self) -> bool:
        """Whether the servers' memory is released (between :meth:`release_memory` and the next
        :meth:`reload`): nothing may generate, probe or restart then."""
        return bool(self._released)

    async def release_memory(self, flush_timeout: float = 60.0) -> None:
        """The swap step's first half: every server pauses (its requests in flight come back as
        aborts and are sent again after the next reload), its cache flushes (``/flush_cache``
        polled until it answers 200, as SGLang needs the scheduler idle) and it releases
        :data:`RELEASED_TAGS`. Every server must be in rotation, or be back within the request
        timeout: a colocated run has no device memory to restart one into later. Raises
        :class:`EngineError` naming each server that failed and what it answered."""
        deadline = time.monotonic() + self.request_timeout
        while any(not self._up[e.name] and e.name not in self._dead for e in self.engines):
            if time.monotonic() > deadline:
                break
            await asyncio.sleep(self.probe_interval)
        async with self._reload_lock:
            missing = [f"{e.name} ({self._down_reason.get(e.name, 'down')})" for e in self.engines if not self._up[e.name]]
            if missing:
                raise EngineError(f"{self.name}: cannot release memory with servers out of rotation: "
                                  + "; ".join(missing))

            async def release(engine: Server) -> None:
                await engine.pause()
                flush_by = time.monotonic() + flush_timeout
                while not await engine.flush_cache():
                    if time.monotonic() > flush_by:
                        raise EngineError(f"{engine.name} /flush_cache still refused after {flush_timeout:g}s: "
                                          "requests run or wait")
                    await asyncio.sleep(0.02)
                await engine.release_memory_occupation(RELEASED_TAGS)
                self._released.add(engine.name)

            results = await asyncio.gather(*(release(e) for e in self.engines), return_exceptions=True)
            failed = [_named(e, r) for e, r in zip(self.engines, results) if isinstance(r, BaseException)]
            if failed:
                raise EngineError(f"{self.name}: releasing memory failed: " + "; ".join(failed))

    async def _swap_in(self, path: str, version: int) -> None:
        """The swap step's second half: every released server resumes its weights, loads
        ``path`` as ``version``, resumes the rest and continues. A server lost meanwhile fails
        it, named with why."""
        async with self._reload_lock:
            lost = [f"{name} ({self._dead.get(name) or self._down_reason.get(name, 'down')})"
                    for name in sorted(self._released) if not self._up[name]]
            if lost:
                raise EngineError(f"{self.name}: lost while its memory was released (run.colocate=swap): "
                                  + "; ".join(lost))

            async def swap_in(engine: Server) -> None:
                await engine.resume_memory_occupation(RESUMED_FIRST)
                await engine.reload(path, version)
                await engine.resume_memory_occupation([t for t in RELEASED_TAGS if t not in RESUMED_FIRST])
                self._released.discard(engine.name)
                await engine.resume()

            engines = [e for e in self.engines if e.name in self._released]
            results = await asyncio.gather(*(swap_in(e) for e in engines), return_exceptions=True)
            failed = [_named(e, r, "lost while its memory was released: " if isinstance(r, EngineUnavailable) else "")
                      for e, r in zip(engines, results) if isinstance(r, BaseException)]
            if failed:
                raise EngineError(f"{self.name}: version {version} not swapped in (run.colocate=swap): "
                                  + "; ".join(failed))
            self._version = version

    async def reload(self, path: str, version: int) -> None:
        """Pause every live server, load ``path`` as ``version`` on all of them in parallel,
        continue; return once every live server has it, else raise with the servers' messages.
        After :meth:`release_memory` the servers take their memory back around the load instead.

        A server that refuses the checkpoint keeps its previous weights and says so in its
        ``weight_version`` (loading is all-or-nothing), so it stays in rotation; one that stops
        answering is marked down and loads the current checkpoint before it rejoins.
        """
        if self._released:
            await self._swap_in(path, version)
            self._checkpoint = (str(path), version)
            return
        await self._update(version, lambda engines: self._each(engines, lambda e: e.reload(path, version), settle=True))
        self._checkpoint = (str(path), version)
        if self._awaiting_group:    # they can catch up from this checkpoint now
            self._awaiting_group.clear()
            self._ensure_probe()

    def weight_group_ranks(self) -> tuple[list[int], int]:
        """Each server's ``rank_offset`` in the weight group and the group's world size: rank 0
        is the trainer, a server takes one rank per TP rank (``tp_size`` from its ``/server_info``)."""
        return rank_offsets([getattr(e, "tp_size", 1) for e in self.engines])

    async def init_weights_update_group(self, spec: dict) -> None:
        """Every server joins the trainer's weight group at its rank offset (``spec`` carries the
        world size); the group's name is remembered so :meth:`close` can destroy it."""
        await self._join_group(list(self.engines), spec)

    async def _join_group(self, members: list[Server], spec: dict) -> None:
        """``members`` join the group ``spec`` names, in order (ranks 1.. after the trainer)."""
        offsets, _ = rank_offsets([getattr(e, "tp_size", 1) for e in members])
        rank = {e.name: offset for e, offset in zip(members, offsets)}
        self._group_members = ()
        joined: set[str] = set()

        async def join(engine: Server) -> None:
            await engine.init_weights_update_group({**spec, "rank_offset": rank[engine.name]})
            joined.add(engine.name)

        failed = await self._each(members, join)
        self._weight_group = spec["group_name"]
        if len(joined) < len(members):
            raise EngineError(f"{self.name}: not every server joined the weight group: "
                              + "; ".join(str(err) for _, err in failed))
        self._group_members = tuple(e.name for e in members)

    async def _rebuild(self, members: list[Server], version: int) -> str:
        """A new weight group of exactly ``members``: the survivors of the old one leave it
        (SGLang's ``/destroy_weights_update_group``, best effort), the trainer opens a new one
        (``regroup``) and every member joins; its name. Raises :class:`EngineError` when it did
        not form (that version then goes by disk)."""
        old = self._weight_group
        self._group_members = ()
        if old is not None:    # a restarted or new server holds no such group: its refusal is no matter
            self._weight_group = None
            for engine, err in await self._each(members, lambda e: e.destroy_weights_update_group(old)):
                log.info("%s did not leave weight group %s: %s", engine.name, old, err)
        _, world_size = rank_offsets([getattr(e, "tp_size", 1) for e in members])
        log.warning("%s: rebuilding the weight group for version %d: %d server(s), world size %d", self.name,
                    version, len(members), world_size)
        try:
            spec = await self.regroup(version, world_size)
        except (OSError, ValueError, KeyError, asyncio.TimeoutError) as err:
            raise EngineError(f"{self.name}: the trainer did not open a new weight group: {err}") from err
        await self._join_group(members, {**spec, "world_size": world_size})
        self.group_rebuilds += 1
        return spec["group_name"]

    async def destroy_weights_update_group(self) -> None:
        """Best effort: every live server leaves the group (long-lived servers can then join a
        later run's group); a server that cannot is only logged."""
        name, self._weight_group = self._weight_group, None
        if name is None:
            return
        for engine, err in await self._each(self._live(), lambda e: e.destroy_weights_update_group(name)):
            log.warning("%s did not leave weight group %s: %s", engine.name, name, err)

    async def update_weights_from_distributed(self, offer: dict, version: int,
                                              receiving: Callable[[], None] = lambda: None) -> None:
        """Like :meth:`reload`, with every live server receiving ``offer`` over the weight group.

        Each server opens a weight-update session first; ``receiving`` (which lets the trainer
        broadcast) is called only once every one has, so the trainer never sends to a group in
        which a member will not take part; every session opened is closed whatever happens.

        The group's members are the live servers plus those waiting for it (restarted or added
        while the current version went over the group only: they join rotation once they hold
        this one). When they are not the group's members, or ``offer`` names no group or another
        one (the trainer lost it), the group is rebuilt first (:meth:`_rebuild`).

        With no live server it raises at once rather than wait for one: the trainer then puts
        this version on disk, which is where a restarted server must catch up from (nobody in
        the group holds it), and the next version rebuilds the group."""
        if not self._live():
            raise EngineError(f"{self.name}: no live server to receive version {version} over the weight group")

        async def receive(engines: list[Server]) -> list:
            joining = [e for e in self.engines if e.name in self._awaiting_group
                       and e.name not in self._dead and e.name not in self._retiring]
            members = engines + joining
            if not engines:    # every live server failed to pause: nobody to rebuild the group for
                raise EngineError(f"{self.name}: no live server to receive version {version} over the weight group")
            group = offer.get("group_name")
            if group is None or group != self._weight_group or tuple(e.name for e in members) != self._group_members:
                if self.regroup is None:
                    raise EngineError(f"{self.name}: the weight group no longer matches the servers "
                                      "and cannot be rebuilt here")
                group = await self._rebuild(members, version)
            received: set[str] = set()
            sent = False

            async def update(engine: Server) -> None:
                await engine.update_weights_from_distributed({**offer, "group_name": group}, version)
                received.add(engine.name)

            failed = await self._each(members, lambda e: e.begin_weight_update())
            refused = {e.name for e, _ in failed}
            opened = [e for e in members if e.name not in refused]
            try:
                if not failed:
                    receiving()
                    sent = True
                    failed += await self._each(opened, update)
            finally:
                failed += await self._each(opened, lambda e: e.end_weight_update())
            if sent and len(received) < len(members):
                self._group_members = ()    # a member missed tensors: the next version rebuilds the group
            for engine in joining:
                if not failed and engine.name in received:
                    self._awaiting_group.discard(engine.name)
                    self._rejoined(engine)
            return failed

        await self._update(version, receive)

    async def _update(self, version: int, load: Callable[[list[Server]], Awaitable[list]]) -> None:
        """Pause every live server, ``load`` the paused ones (it returns their failures), continue.

        The version goes live on the servers that loaded it; one that did not answer in time is
        suspect and catches up before it rejoins. When none is left live, this waits (without the
        reload lock, so a server can rejoin) for one to come back and loads again, at most
        ``request_timeout``; it raises at once when every server is dead and none will be
        restarted."""
        deadline = time.monotonic() + self.request_timeout
        while True:
            await self._wait_live(deadline)
            async with self._reload_lock:
                live = self._live()
                if not live:
                    continue
                failed = await self._each(live, lambda e: e.pause(), settle=True)
                try:
                    refused = {e.name for e, _ in failed}
                    paused = [e for e in self._live() if e.name not in refused]
                    failed += await load(paused)
                finally:
                    failed += await self._each(self._live(), lambda e: e.resume(), settle=True)
                if failed:
                    raise EngineError(f"{self.name}: version {version} not loaded everywhere: "
                                      + "; ".join(str(err) for _, err in failed))
                if self._live():
                    self._version = version
                    return

    async def healthy(self, timeout: Optional[float] = None) -> bool:
        live = self._live()
        if not live:
            return False
        return any(await asyncio.gather(*(e.healthy(timeout) for e in live)))

    def health(self) -> dict:
        """The fleet's size (``rlorch scale`` changes it; a request not yet met is
        ``scale_pending``), servers up, suspect and dead, restarts, and generated tokens/s per
        server (p10, p50, p90 over servers since the start) with the count of slow ones (under
        half the median): a straggler shows here, and is not a hang."""
        rates = sorted(self._tokens[e.name] / max(time.monotonic() - self._started, 1e-9) for e in self.engines)
        median = rates[len(rates) // 2]
        pick = (lambda q: round(rates[min(len(rates) - 1, int(q * len(rates)))], 1))
        return {"servers": len(self.engines), "servers_up": len(self._live()), "servers_suspect": len(self.engines) - len(self._live()) - len(self._dead),
                "servers_dead": len(self._dead), "server_restarts": self.restarts,
                "servers_suspect_s": round(self._suspect_s + sum(time.monotonic() - since for name, since
                                                                 in self._down_since.items() if name not in self._dead), 1),
                "server_tokens_per_s_p10": pick(0.1), "server_tokens_per_s_p50": pick(0.5),
                "server_tokens_per_s_p90": pick(0.9), "servers_slow": sum(r < median / 2 for r in rates),
                "weight_group_rebuilds": self.group_rebuilds,
                "server_slowest": min(self.engines, key=lambda e: self._tokens[e.name]).name, **self.scale_fields()}

    def gauges(self) -> dict:
        return {**self.health(),
                "in_flight": dict(self._in_flight), "in_flight_total": sum(self._in_flight.values()),
                "failovers": self.failovers, "completed": self.completed,
                "version": self._checkpoint[1] if self._checkpoint else None}

    # ---- health probe ---------------------------------------------------------------------

    def _ensure_probe(self) -> None:
        if self._probe is None or self._probe.done():
            self._probe = asyncio.get_running_loop().create_task(self._probe_loop(), name=f"{self.name}-probe")
        if self.health_interval is not None and (self._health is None or self._health.done()):
            self._health = asyncio.get_running_loop().create_task(self._health_loop(), name=f"{self.name}-health")

    async def _health_loop(self) -> None:
        """Probe every server in rotation each ``health_interval``; ``health_failures`` misses in a
        row make it suspect. No probe runs while weights load (the servers are paused then)."""
        while True:
            await asyncio.sleep(self.health_interval)
            live = [] if self._reload_lock.locked() or self._released else self._live()
            answers = await asyncio.gather(*(e.healthy(self.health_timeout) for e in live))
            for engine, ok in zip(live, answers):
                self._misses[engine.name] = 0 if ok else self._misses[engine.name] + 1
                if self._misses[engine.name] >= self.health_failures and self._up[engine.name]:
                    self._misses[engine.name] = 0
                    self._mark_down(engine, f"missed {self.health_failures} health probes in a row "
                                            f"(inference.health_interval={self.health_interval:g}s, "
                                            f"inference.health_timeout={self.health_timeout:g}s)")

    async def _probe_loop(self) -> None:
        """Bring down servers back once they continue, ``/health_generate`` answers and they
        hold the current checkpoint; exits when every server is up."""
        def waiting(e: Server) -> bool:
            return (not self._up[e.name] and e.name not in self._dead and e.name not in self._retiring
                    and e.name not in self._awaiting_group)

        while any(waiting(e) for e in self.engines):
            await asyncio.sleep(self.probe_interval)
            if self._released:    # a server lost in a swap step fails it; none is brought back into it
                continue
            for engine in [e for e in self.engines if waiting(e)]:
                if await self._resumed(engine) and await engine.healthy():
                    await self._rejoin(engine)

    @staticmethod
    async def _resumed(engine: Server) -> bool:
        """Continue a server before probing it: one left paused (by a reload that timed out)
        would hold the probe behind its pause and never come back."""
        try:
            await engine.resume()
        except EngineError:
            return False
        return True

    async def _rejoin(self, engine: Server) -> None:
        async with self._reload_lock:
            try:
                current = self._version if self._version is not None else (self._checkpoint or (None, None))[1]
                held = await engine.weight_version() if current is not None else None
                if held != current:
                    if self._checkpoint is not None and self._checkpoint[1] == current:
                        await engine.reload(*self._checkpoint)
                    elif self._live():
                        # The current version went over the weight group only: it arrives with the next.
                        self._awaiting_group.add(engine.name)
                        log.info("%s: server %s answers; it joins the weight group with the next version",
                                 self.name, engine.name)
                        return
                    elif not await self._catch_up_from_disk(engine, current):
                        return
                await engine.resume()
            except EngineError as err:
                log.warning("%s: server %s answers but cannot rejoin: %s", self.name, engine.name, err)
                return
            self._rejoined(engine)

    async def _catch_up_from_disk(self, engine: Server, current: int) -> bool:
        """Bring ``engine`` to the newest version at least ``current`` on disk; False while there
        is none. The current version went over the weight group only and no live server is left
        to receive the next (with none in rotation no batch fills, so no next version comes): the
        trainer is asked (``request_publish``) to write its weights to disk, and the probe
        retries until they are there. A newer version than ``current`` serves as well: its
        responses carry the version it holds, and the watcher brings the pool to it."""
        newest = max((entry for entry in self.published() if entry[0] >= current), default=None)
        if newest is None:
            if current not in self._publish_requested:
                self._publish_requested.add(current)
                log.warning("%s: server %s answers, but version %s went over the weight group only and no live "
                            "server is left to receive the next; asking the trainer to write it to disk",
                            self.name, engine.name, current)
            self.request_publish(current)
            return False
        version, path = newest
        await engine.reload(str(path), version)
        self._checkpoint, self._version = (str(path), version), version
        return True

    def _rejoined(self, engine: Server) -> None:
        self._up[engine.name] = True
        self._misses[engine.name] = 0
        self._end_suspect(engine.name)
        self._changed.set()
        log.info("%s: server %s is back", self.name, engine.name)

    async def start(self) -> None:
        """Nothing runs until a server goes down: the rejoin probe starts then."""

    async def stop(self, timeout: Optional[float] = None) -> None:
        """Stop the probe, close every client and stop what the launcher started."""
        await cancel_and_wait(self._probe, self._health, timeout=timeout)
        try:
            await asyncio.wait_for(self.destroy_weights_update_group(), 10.0)
        except (asyncio.TimeoutError, EngineError, OSError):
            log.warning("%s: the weight group was not destroyed on every server", self.name)
        await asyncio.gather(*(e.close() for e in self.engines), return_exceptions=True)
        if self._on_close is not None:
            await self._on_close()

    async def close(self) -> None:
        await self.stop()


def _named(engine: Server, error: BaseException, what: str = "") -> str:
    """``error`` led by the server's name (once: the client's errors often start with it)."""
    text = str(error).removeprefix(f"{engine.name} ").removeprefix(f"{engine.name}: ")
    return f"{engine.name}: {what}{text}"


async def _settle(tasks: list[asyncio.Task]) -> float:
    """Wait for ``tasks`` until half of them (at least one) have finished, then at most until
    SETTLE_FACTOR times that time (at least SETTLE_MIN_S) from the start; cancel those still
    running. Returns the seconds waited."""
    started = time.monotonic()
    pending = set(tasks)
    try:
        while pending and len(tasks) - len(pending) < max(1, len(tasks) // 2):
            _, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        if pending:
            half = time.monotonic() - started
            limit = max(SETTLE_MIN_S, SETTLE_FACTOR * half) - half
            _, pending = await asyncio.wait(pending, timeout=max(0.0, limit))
    except asyncio.CancelledError:
        pending = set(tasks)
        raise
    finally:
        for task in pending:
            task.cancel()
    return time.monotonic() - started
