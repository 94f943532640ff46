"""Filing: where each finished group goes.

The train sink keeps a group with signal. A group with none is *filtered*; in strict mode a group
whose oldest token is older than S is *stale*, dropped and regenerated up to
``rollout.max_regenerations`` times. Either way its rollouts leave the gate's accounting (so
admission can replace them), the ledger records their fate, and the empty-batch guard looks at
the run: ``on_guard`` is handed its verdict and message when it trips.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from rlorch.types import Fate, Rollout


class Filing:
    def __init__(self, *, sink: Any, ledger: Any, gate: Any, dispatcher: Any, prompts: Any,
                 max_regenerations: int, max_empty_batches: int, on_guard: Callable[[Any, str], None],
                 kept: Any, stale: Any, failure_window: int = 0,
                 observe: Optional[Callable[[list[Rollout]], None]] = None):
        """``kept`` and ``stale`` are the sink's verdicts for a kept and a too-old group;
        ``observe`` sees every group that is kept or filtered (the prompt source's replay queue)."""
        self.observe = observe
        self.sink, self.ledger, self.gate, self.dispatcher, self.prompts = sink, ledger, gate, dispatcher, prompts
        self.max_regenerations, self.max_empty_batches, self.on_guard = max_regenerations, max_empty_batches, on_guard
        self.kept, self.stale_verdict = kept, stale
        self.failure_window = failure_window
        """Batch-worths a flat reward or a collapse must last before it stops the run (>= max_empty_batches)."""

    def file(self, group: list[Rollout], step: int) -> None:
        """Hand a finished group to the sink for batch ``step``."""
        verdict = self.sink.add(group, step)
        if self.observe is not None and verdict is not self.stale_verdict:
            self.observe(group)
        if verdict is self.kept:
            self._guard()    # a kept zero-variance group (rollout.filter_groups=false) counts toward it
            return
        if verdict is self.stale_verdict:
            self.stale(group)
        else:
            self.filtered(len(group))

    def filtered(self, rollouts: int) -> None:
        self.ledger.record(Fate.filtered, rollouts)
        self.gate.on_discarded(rollouts)
        self.dispatcher.notify()
        self._guard()

    def _guard(self) -> None:
        stop = self.sink.guard(self.max_empty_batches, self.failure_window)
        if stop is not None:
            self.on_guard(*stop)

    def stale(self, group: list[Rollout]) -> None:
        self.ledger.record(Fate.dropped_stale, len(group))
        self.ledger.note("stale_tokens", sum(r.generated_tokens for r in group))
        self.gate.on_discarded(len(group))
        attempt = max(r.attempt for r in group)
        if attempt < self.max_regenerations:
            prompt = self.prompts.make(group[0].group_id)
            prompt.attempt = attempt + 1
            self.ledger.note("regenerated")
            self.dispatcher.requeue(prompt)
