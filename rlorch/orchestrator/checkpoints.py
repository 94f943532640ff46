"""The orchestrator's half of a checkpoint: ``orchestrator.json`` beside the trainer's state.

The loop decides when; this module decides what. A snapshot of step N saves the data position
and the replay queue of stuck prompts,
every finished rollout not trained at N (batches shipped after N, a parked batch, the sink's
groups, the dispatcher's finished groups) and every prompt not finished (in flight or abandoned,
failed, queued), so a resume neither skips nor repeats data.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from typing import Any, Callable, Optional

from rlorch.rundir.layout import CheckpointDir, RunDir, write_json_atomic
from rlorch.rundir.state import ResumeState, regroup
from rlorch.types import Batch, DispatcherState, Prompt, Rollout


@dataclass
class Unfinished:
    """Everything admitted and not yet trained or filtered, as the components hold it now."""

    dispatcher: DispatcherState
    sink_groups: list[list[Rollout]]
    parked: Optional[Batch]

    def groups(self, shipped_after: list[list[Rollout]]) -> list[list[Rollout]]:
        """Finished rollouts that a checkpoint has not trained, oldest first, given the groups
        shipped after it."""
        groups = list(shipped_after)
        if self.parked is not None:
            groups.extend(regroup(self.parked.rollouts))
        return groups + self.sink_groups + self.dispatcher.finished


class Snapshots:
    """Which checkpoints have their orchestrator state, and writing it.

    ``unfinished()`` reads the components' state at the moment of a snapshot; ``empty_batches()``
    is the train sink's count of this life; ``ledger`` is the run's ledger (shipped batches and
    the accounting). After each snapshot the resumable checkpoints beyond
    the newest ``keep`` are deleted, except every ``keep_every``-th step (0: none kept that way).
    """

    def __init__(self, run_dir: RunDir, *, ledger: Any, group_size: int, unfinished: Callable[[], Unfinished],
                 prompt_position: Callable[[], int], empty_batches: Callable[[], int], keep: int = 0,
                 keep_every: int = 0, replay: Callable[[], dict] = dict):
        self.run_dir, self.ledger, self.group_size = run_dir, ledger, group_size
        self.keep, self.keep_every = keep, keep_every
        self.unfinished, self.prompt_position, self.empty_batches = unfinished, prompt_position, empty_batches
        self.replay = replay
        self.done: set[int] = set()
        self.first_step = 1
        self.final: Optional[int] = None
        """The checkpoint the run ended on (None: nothing was checkpointed)."""

    def resumed_at(self, step: int) -> None:
        self.first_step = step + 1
        self.ledger.snapshotted(step)
        self.done.update(s for s, _ in self.run_dir.complete_checkpoints() if s <= step)

    def catch_up(self, version: int) -> None:
        """Snapshot every complete trainer checkpoint of this life up to ``version`` not yet done."""
        for step, _ in self.run_dir.complete_checkpoints():
            if step not in self.done and self.first_step <= step <= version:
                self.write(step)

    def finish(self, version: int, abandoned: list[Prompt]) -> None:
        """At the end: the newest complete checkpoint gets the state the run ends with."""
        complete = [step for step, _ in self.run_dir.complete_checkpoints() if self.first_step - 1 <= step <= version]
        if complete:
            self.write(complete[-1], abandoned=abandoned)
            self.final = complete[-1]

    def write(self, step: int, abandoned: Optional[list[Prompt]] = None) -> ResumeState:
        """``orchestrator.json`` for checkpoint ``step``. ``abandoned``: prompts cancelled in flight
        by a shutdown (already counted as requeued); without it, the prompts in flight now are
        the ones a resume runs again, counted as requeued here."""
        unfinished = self.unfinished()
        untrained = unfinished.groups(self.ledger.shipped_after(step))
        state = unfinished.dispatcher
        in_flight = state.in_flight if abandoned is None else abandoned
        totals = self.ledger.totals(step=step, untrained=sum(len(g) for g in untrained),
                                    failed_prompts=len(state.failed), empty_batches=self.empty_batches())
        if abandoned is None:
            totals["requeued"] += len(in_flight) * self.group_size
        resume = ResumeState(step=step, prompt_position=self.prompt_position(), untrained=untrained,
                             pending_prompts=in_flight + state.failed + state.queued, totals=totals,
                             replay=self.replay())
        write_json_atomic(CheckpointDir(self.run_dir.checkpoint(step)).state, resume.to_json())
        self.ledger.snapshotted(step)
        self.done.add(step)
        if self.keep:
            prune_checkpoints(self.run_dir, keep=self.keep, every=self.keep_every)
        return resume

    def account(self, version: int) -> dict:
        """The summary's accounting at the checkpoint the run ended on (``lost`` must be 0)."""
        step = self.final if self.final is not None else version
        unfinished = self.unfinished()
        untrained = self.ledger.shipped_count_after(step) + sum(len(g) for g in unfinished.groups([]))
        return {"steps": step, **self.ledger.account(
            step=step, untrained=untrained, failed_prompts=len(unfinished.dispatcher.failed),
            empty_batches=self.empty_batches(), saved=self.final is not None),
            "checkpoint": str(self.run_dir.checkpoint(self.final)) if self.final is not None else None}


def prune_checkpoints(run_dir: RunDir, *, keep: int, every: int = 0) -> list[int]:
    """Delete resumable checkpoints (complete, with ``orchestrator.json``) older than the newest
    ``keep``, sparing each step that is a multiple of ``every``; returns the steps deleted.

    Only resumable ones are counted and deleted: a checkpoint still being written (no
    ``COMPLETE`` or no ``orchestrator.json`` yet) is neither, so the newest usable resume point
    always survives.
    """
    resumable = [(step, path) for step, path in run_dir.resumable_checkpoints()]
    doomed = [(step, path) for step, path in resumable[:-keep] if not (every and step % every == 0)]
    for _, path in doomed:
        shutil.rmtree(path)
    return [step for step, _ in doomed]
