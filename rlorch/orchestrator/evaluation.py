"""Scheduled evaluations: greedy decoding of the held-out prompts on a given policy version.

The eval sink turns the rollouts into a record; this helper owns when they run (before the first
step, every ``eval.every`` steps, at the end) and the tasks that run them.
"""

from __future__ import annotations

import asyncio
from itertools import accumulate
from typing import Any, Callable, Optional

from rlorch.config.schema import EvalConfig
from rlorch.lifecycle import cancel_and_wait
from rlorch.types import Prompt


class Evaluations:
    def __init__(self, config: EvalConfig, *, work: Callable, prompts: Any, sink: Any,
                 write: Callable[[dict], None], request_timeout: float, pack: Optional[Callable] = None,
                 pack_samples: int = 1):
        """``pack`` runs several prompts in one engine call (single-turn work's ``pack``), at most
        ``pack_samples`` held-out prompts (one greedy sample each) at a time; without it, or at
        1, each prompt goes on its own (``work``)."""
        self.config = config
        self.work = work
        self.pack = pack
        self.pack_samples = max(1, pack_samples)
        self.prompts = prompts
        self.write = write
        self.request_timeout = request_timeout
        self.sink = sink
        """The eval sink: rollouts of one evaluation to its record."""
        self.done: set[int] = set()
        self.tasks: set[asyncio.Task] = set()
        self._prompts: Optional[list[Prompt]] = None

    def due(self, step: int) -> bool:
        every = self.config.every
        return self.config.enabled and bool(every) and step % every == 0 and step not in self.done

    def start(self, step: int) -> None:
        """Evaluate version ``step`` in the background (once per step)."""
        if not self.config.enabled or step in self.done:
            return
        self.done.add(step)
        task = asyncio.get_running_loop().create_task(self.run(step))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def run(self, step: int) -> None:
        """Greedy decoding of the held-out prompts on the weights of version ``step``."""
        self.done.add(step)
        if self._prompts is None:
            self._prompts = self.prompts.eval_set(self.config.prompts)
        rollouts = [r for g in await self._generate(self._prompts) for r in g]
        self.write(self.sink.add(step, rollouts, asked=len(self._prompts)))

    async def _generate(self, prompts: list[Prompt]) -> list[list]:
        """The groups of ``prompts`` that came back within the request timeout. Where the work
        packs, as few packs as hold at most ``pack_samples`` prompts each, their sizes at most one
        apart, one engine call each; else one call per prompt. A pack that fails loses its
        prompts to this evaluation (its record counts them ``failed``), as a prompt sent alone does."""
        if self.pack is None or self.pack_samples == 1 or not prompts:
            calls = [self._alone(prompt) for prompt in prompts]
        else:
            packs = -(-len(prompts) // self.pack_samples)
            size, larger = divmod(len(prompts), packs)
            ends = list(accumulate(size + (index < larger) for index in range(packs)))
            calls = [self.pack(prompts[start:end]) for start, end in zip([0, *ends], ends)]
        results = await asyncio.gather(*(asyncio.wait_for(call, self.request_timeout) for call in calls),
                                       return_exceptions=True)
        return [group for groups in results if not isinstance(groups, BaseException) for group in groups]

    async def _alone(self, prompt: Prompt) -> list[list]:
        return [await self.work(prompt)]

    def summary(self) -> dict:
        first, last = self.sink.first, self.sink.last
        return {"eval_accuracy_first": first["accuracy"] if first else None,
                "eval_accuracy_last": last["accuracy"] if last else None,
                "eval_step_first": first["step"] if first else None,
                "eval_step_last": last["step"] if last else None}

    async def finish(self, step: int, alarm: asyncio.Task, check: Callable[[], None]) -> None:
        """Evaluate version ``step`` and wait for every evaluation still running; ``check`` runs
        whenever ``alarm`` fires first (it raises to give up)."""
        self.start(step)
        pending = set(self.tasks)
        while pending:
            _, pending = await asyncio.wait(pending | {alarm}, return_when=asyncio.FIRST_COMPLETED)
            pending.discard(alarm)
            check()

    async def stop(self, timeout: Optional[float] = None) -> None:
        await cancel_and_wait(*self.tasks, timeout=timeout)
