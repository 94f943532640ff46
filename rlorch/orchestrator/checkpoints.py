"""The orchestrator's half of a checkpoint: ``orchestrator.json`` beside the trainer's state.

The loop decides when; this module decides what. A snapshot of step N saves the data position,
every finished rollout not trained at N (batches shipped after N, a parked batch, the sink's
groups, the dispatcher's finished groups) and every prompt not finished (in flight or abandoned,
failed, queued), so a resume neither skips nor repeats data.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from rlorch.orchestrator.dispatcher import DispatcherState
from rlorch.orchestrator.ledger import Ledger, ResumeState, regroup
from rlorch.rundir import CheckpointDir, RunDir, write_json_atomic
from rlorch.types import Batch, Prompt, Rollout


@dataclass
class Unfinished:
    """Everything admitted and not yet trained or filtered, as the components hold it now."""

    dispatcher: DispatcherState
    sink_groups: list[list[Rollout]]
    parked: Optional[Batch]

    def groups(self, ledger: Ledger, step: int) -> list[list[Rollout]]:
        """Finished rollouts that checkpoint ``step`` has not trained, oldest first."""
        groups = ledger.shipped_after(step)
        if self.parked is not None:
            groups.extend(regroup(self.parked.rollouts))
        return groups + self.sink_groups + self.dispatcher.finished


def snapshot(run_dir: RunDir, step: int, *, ledger: Ledger, unfinished: Unfinished, prompt_position: int,
             group_size: int, empty_batches: int, abandoned: Optional[list[Prompt]] = None) -> ResumeState:
    """Write ``orchestrator.json`` for checkpoint ``step``.

    ``abandoned``: prompts cancelled in flight by a shutdown (already counted as requeued). Without
    it, the prompts in flight now are the ones a resume runs again, counted as requeued here.
    """
    untrained = unfinished.groups(ledger, step)
    state = unfinished.dispatcher
    in_flight = state.in_flight if abandoned is None else abandoned
    totals = ledger.totals(step=step, untrained=sum(len(g) for g in untrained), failed_prompts=len(state.failed),
                           empty_batches=empty_batches)
    if abandoned is None:
        totals["requeued"] += len(in_flight) * group_size
    resume = ResumeState(step=step, prompt_position=prompt_position, untrained=untrained,
                         pending_prompts=in_flight + state.failed + state.queued, totals=totals)
    write_json_atomic(CheckpointDir(run_dir.checkpoint(step)).state, resume.to_json())
    ledger.snapshotted(step)
    return resume
