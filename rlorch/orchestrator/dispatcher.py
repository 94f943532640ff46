"""The dispatcher: keeps as much work in flight as the gate allows.

Prompts wait in a bounded input queue; the submission loop admits whole groups through the gate
and runs them as tasks; the fetch path (task completion) moves finished groups to the output
queue. A watchdog cancels attempts older than ``request_timeout`` (one scan a second rather
than a timer per request, so admission cost does not grow with the number in flight). A failed
or timed-out attempt is retried (the engine pool routes the retry to a live
engine); after ``max_retries`` failures the run fails loudly. Invariant: every admitted group
ends accepted (in the output queue) or rejected with its error recorded, never silently lost.

Packing: the groups one admission pass lets through share a task and one engine call, up to
``pack_groups`` per pack. A pack holds only groups the gate admitted in that pass (it never
waits to fill), so packing adds no latency; it saves a task, a callback and an engine call per
group, which at one sample per prompt is most of the dispatcher's cost. A pack is one attempt:
it succeeds, fails, times out and is retried as a whole, while the gate, the output queue, the
in-flight list and the failed list still account for each of its groups.
"""

from __future__ import annotations

import asyncio
from collections import deque
from itertools import islice
from typing import Awaitable, Callable, Iterator, Optional

from rlorch.lifecycle import cancel_and_wait, gather_all
from rlorch.types import Admission, DispatcherState, Prompt, Rollout

Work = Callable[[Prompt], Awaitable[list[Rollout]]]
PackWork = Callable[[list[Prompt]], Awaitable[list[list[Rollout]]]]
"""Several prompts to their groups, in order, as one attempt (one engine call where it can)."""


class GenerationFailed(RuntimeError):
    pass


class Dispatcher:
    def __init__(self, *, gate: Admission, work: Work, prompts: Iterator[Prompt], group_size: int,
                 queue_size: int, max_buffered: int, request_timeout: float, max_retries: int,
                 on_idle: Callable[[str, bool], None] = lambda cause, active: None,
                 pack: Optional[PackWork] = None, pack_groups: int = 1):
        """``pack`` runs a pack of prompts (default: their ``work`` calls side by side);
        ``pack_groups`` is the most groups one pack holds (1 = a task per group)."""
        if pack_groups < 1:
            raise ValueError("pack_groups must be >= 1")
        self.gate = gate
        self.on_idle = on_idle
        """Told ``("no_work", True)`` when the last group in flight finishes and ``("no_work",
        False)`` when one is admitted into an empty engine: the engines' idle stretches."""
        self.work = work
        self.pack = pack if pack is not None else self._gather
        self.pack_groups = pack_groups
        self.prompts = prompts
        self.group_size = group_size
        self.queue_size = queue_size
        self.max_buffered = max_buffered
        self.request_timeout = request_timeout
        self.max_retries = max_retries
        self.in_queue: deque[Prompt] = deque()
        self.out_queue: deque[list[Rollout]] = deque()
        self.out_rollouts = 0
        self.admitted = 0
        self.retries = 0
        self.error: Optional[BaseException] = None
        self.failed: list[Prompt] = []
        self.admission_room: Callable[[], int] = lambda: 1 << 62
        """Rollouts the run still wants admitted (the drain budget); groups are admitted while
        it is positive, so the last group may reach past it by less than a group."""
        self._in_flight: dict[asyncio.Task, list] = {}
        """pack task -> [its prompts, when its current attempt started]"""
        self._groups_in_flight = 0
        self._timed_out: set[asyncio.Task] = set()
        self._paused = False
        self._wake = asyncio.Event()
        self._out_ready = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._loop_task: Optional[asyncio.Task] = None
        self._watchdog_task: Optional[asyncio.Task] = None

    # lifecycle -------------------------------------------------------------------------------
    async def start(self) -> None:
        self._loop_task = asyncio.create_task(self._submission_loop(), name="dispatcher")
        self._watchdog_task = asyncio.create_task(self._watchdog(), name="dispatcher-watchdog")

    async def stop_admitting(self) -> None:
        """Admit nothing more; in-flight groups keep running (and timing out) until
        :meth:`wait_idle` or :meth:`cancel_in_flight`."""
        await cancel_and_wait(self._loop_task)
        self._loop_task = None

    async def stop(self, timeout: Optional[float] = None) -> None:
        """Stop admitting and stop the watchdog (in-flight groups are left as they are)."""
        await cancel_and_wait(self._loop_task, self._watchdog_task, timeout=timeout)
        self._loop_task = self._watchdog_task = None

    def pause(self) -> None:
        self._paused = True

    def resume(self) -> None:
        self._paused = False
        self.notify()

    def notify(self) -> None:
        """Something that bounds admission changed (version, buffer, capacity)."""
        self._wake.set()

    # queues ----------------------------------------------------------------------------------
    def requeue(self, prompt: Prompt) -> None:
        """Put a prompt back at the front (regeneration, resume); it is admitted next."""
        self.in_queue.appendleft(prompt)
        self.notify()

    async def wait_ready(self) -> None:
        """Return once a finished group waits in the output queue (or a group failed)."""
        while not self.out_queue and not self.error:
            self._out_ready.clear()
            await self._out_ready.wait()

    def try_get(self) -> Optional[list[Rollout]]:
        """The oldest finished group without waiting, or None."""
        if self.error or not self.out_queue:
            return None
        group = self.out_queue.popleft()
        self.out_rollouts -= len(group)
        return group

    def in_flight_prompts(self) -> list[Prompt]:
        return [prompt for prompts, _ in self._in_flight.values() for prompt in prompts]

    @property
    def in_flight(self) -> int:
        return self._groups_in_flight * self.group_size

    async def wait_idle(self, timeout: Optional[float] = None) -> bool:
        """Wait for in-flight groups to finish; False when the timeout ran out first."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False

    def state(self) -> "DispatcherState":
        """What a checkpoint needs of the dispatcher: finished groups not yet taken, and the
        prompts not yet finished (in flight, failed, queued), in the order to run them again."""
        return DispatcherState(finished=list(self.out_queue), in_flight=self.in_flight_prompts(),
                               failed=list(self.failed), queued=list(self.in_queue))

    def restore(self, prompts: list[Prompt]) -> None:
        """Run ``prompts`` (a checkpoint's pending prompts) before any new one."""
        for prompt in reversed(prompts):
            self.requeue(prompt)

    async def cancel_in_flight(self) -> list[Prompt]:
        """Abandon in-flight groups (bounded shutdown); the prompts of those actually cancelled
        are returned for requeueing (a group that finished in the same tick is kept)."""
        await self.stop()
        entries = list(self._in_flight.items())
        await cancel_and_wait(*(task for task, _ in entries))
        return [prompt for task, (prompts, _) in entries if task.cancelled() for prompt in prompts]

    # submission and fetch --------------------------------------------------------------------
    def _refill(self) -> None:
        self.in_queue.extend(islice(self.prompts, max(0, self.queue_size - len(self.in_queue))))

    def _admit_all(self) -> None:
        """Admit as many whole groups as the drain budget, the queue and the gate allow (one
        gate call for all of them), then run them in packs of at most ``pack_groups``."""
        if self._paused or self.out_rollouts >= self.max_buffered:
            return
        room = self.admission_room()
        if room <= 0:
            return
        size = self.group_size
        wanted = -(-room // size)
        while wanted > 0:
            if not self.in_queue:
                self._refill()
                if not self.in_queue:
                    return
            offered = min(wanted, len(self.in_queue))
            admitted = self.gate.admit_groups(size, offered)
            if admitted:
                self._start(admitted)
            if admitted < offered:
                return
            wanted -= admitted

    def _start(self, groups: int) -> None:
        """Run the next ``groups`` queued prompts (already admitted) in packs."""
        queue, most = self.in_queue, self.pack_groups
        self._groups_in_flight += groups
        self.admitted += groups * self.group_size
        while groups > 0:
            take = min(most, groups)
            self._launch([queue.popleft() for _ in range(take)])
            groups -= take

    def _launch(self, pack: list[Prompt]) -> None:
        task = asyncio.create_task(self._run_pack(pack))
        was_idle = not self._in_flight
        self._in_flight[task] = [pack, asyncio.get_running_loop().time()]
        self._idle.clear()
        task.add_done_callback(self._finished)
        if was_idle:
            self.on_idle("no_work", False)

    async def _submission_loop(self) -> None:
        try:
            while True:
                self._wake.clear()
                self._admit_all()
                await self._wake.wait()
        except asyncio.CancelledError:
            raise
        except Exception as err:
            self.error = self.error or RuntimeError(f"admitting the next prompt failed: {err!r}")
            self._out_ready.set()

    async def _watchdog(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(min(1.0, self.request_timeout / 4))
            now = loop.time()
            for task, (_, started) in list(self._in_flight.items()):
                if now - started > self.request_timeout and task not in self._timed_out:
                    self._timed_out.add(task)
                    task.cancel()

    async def _gather(self, prompts: list[Prompt]) -> list[list[Rollout]]:
        if len(prompts) == 1:
            return [await self.work(prompts[0])]
        return await gather_all(*(self.work(prompt) for prompt in prompts))

    async def _run_pack(self, prompts: list[Prompt]) -> list[list[Rollout]]:
        last: Optional[BaseException] = None
        for _ in range(self.max_retries):
            try:
                groups = await self.pack(prompts)
                self._check_sizes(prompts, groups)
                return groups
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if task not in self._timed_out:
                    raise
                self._timed_out.discard(task)
                task.uncancel()
                last = TimeoutError(f"no answer within rollout.request_timeout={self.request_timeout:g}s")
            except (OSError, ConnectionError, RuntimeError) as err:
                last = err
            self.retries += 1
            self._in_flight[asyncio.current_task()][1] = asyncio.get_running_loop().time()
        which = (f"group {prompts[0].group_id}" if len(prompts) == 1 else
                 f"groups {', '.join(str(prompt.group_id) for prompt in prompts)} (one pack)")
        raise GenerationFailed(f"{which} failed {self.max_retries} times: {last!r}") from last

    def _check_sizes(self, prompts: list[Prompt], groups: list[list[Rollout]]) -> None:
        if len(groups) != len(prompts):
            raise GenerationFailed(f"a pack of {len(prompts)} prompts got {len(groups)} groups")
        for prompt, group in zip(prompts, groups):
            if len(group) != self.group_size:
                raise GenerationFailed(f"group {prompt.group_id}: got {len(group)} samples, "
                                       f"expected {self.group_size}")

    def _finished(self, task: asyncio.Task) -> None:
        prompts = self._in_flight.pop(task)[0]
        self._groups_in_flight -= len(prompts)
        self._timed_out.discard(task)
        if not self._in_flight:
            self._idle.set()
            self.on_idle("no_work", True)
        if task.cancelled():
            self.gate.on_rejected(self.group_size * len(prompts))
        elif task.exception() is not None:
            self.gate.on_rejected(self.group_size * len(prompts))
            self.failed.extend(prompts)
            self.error = self.error or task.exception()
        else:
            groups = task.result()
            count = self.group_size * len(groups)
            self.gate.on_accepted(count)
            self.out_queue.extend(groups)
            self.out_rollouts += count
        self._out_ready.set()
        self._wake.set()

    def gauges(self) -> dict:
        return {"in_queue": len(self.in_queue), "out_queue": self.out_rollouts,
                "in_flight": self.in_flight, "retries": self.retries}
