"""Why a run stops: typed reasons, and the exceptions that carry them out of the loop."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional


class StopKind(str, enum.Enum):
    """Why the loop stopped before (or at) its step target."""

    signal = "signal"
    trainer = "trainer"
    watcher = "watcher"
    generation = "generation"
    resume_alarm = "resume_alarm"
    empty_batches = "empty_batches"
    converged = "converged"
    bookkeeping = "bookkeeping"


@dataclass(frozen=True)
class StopReason:
    kind: StopKind
    detail: str

    def __str__(self) -> str:
        return self.detail

    @staticmethod
    def fields(reason: Optional["StopReason"]) -> dict:
        """The summary's ``reason`` (for people) and ``stop`` (the kind) of a run."""
        return {"reason": reason.detail if reason else None, "stop": reason.kind.value if reason else None}


class RunFailed(RuntimeError):
    """The run stopped on one of its own invariants; ``reason`` says which and why."""

    def __init__(self, reason: StopReason):
        super().__init__(reason.detail)
        self.reason = reason


class Converged(Exception):
    """Nearly every recent group earned the maximum reward: the task is solved, the run ends well."""


class Outcome(str, enum.Enum):
    """What the run does when the empty-batch guard finds the task solved."""

    converged = "converged"
    """held-out accuracy agrees (or there is no evaluation): the run ends converged."""
    evaluate = "evaluate"
    """the latest evaluation is of older weights: evaluate these, train on meanwhile."""
    train_on = "train_on"
    """held-out accuracy disagrees, or train.stop_on_converged is false: train on."""
    stalled = "stalled"
    """held-out accuracy disagrees and nothing is left to train: the guard tripped twice at the
    same version with the trainer idle and no group kept; the run fails rather than generate on."""


PUSHED_SHARE = 0.95
"""Held-out accuracy a run must reach to end converged while the guard's window holds flat wrong
groups that trainer.flat_advantage=unlikelihood pushes (``pushing``). Below it the run trains on:
a run at 90% with some prompts memorised wrongly is a stuck one, and the push is what moves them
(measured: a run the guard had ended converged at 90.7%, resumed under the push, reached 100% in
161 steps). At or above it the run ends: a solved run that trains on under the push risks its
accuracy for prompts it does not need."""


class Convergence:
    """The guard sees only training groups; a run ends converged only when the held-out
    evaluation of the same weights agrees (accuracy >= ``share``, or PUSHED_SHARE while
    ``pushing``), wherever there is one."""

    def __init__(self, *, stop_on_converged: bool, evaluating: bool, share: float,
                 stop_at: Optional[float] = None, stop_after: int = 3):
        self.stop_on_converged, self.evaluating, self.share = stop_on_converged, evaluating, share
        self.stop_at, self.stop_after = stop_at, stop_after
        """eval.stop_at / eval.stop_after: held-out accuracy that ends the run on its own."""
        self.idle_trip: Optional[int] = None
        """The version at which the guard last tripped with nothing left to train."""
        self.asked: Optional[int] = None
        """The version the guard's last trip asked to evaluate, until the next trip reads it."""

    def _current(self, version: int, last_eval: Optional[dict]) -> bool:
        """Whether the latest evaluation is of these weights, or of those the previous trip asked
        about: trained on since only while the guard counted no reward spread again (flat groups
        that trainer.flat_advantage trains, kept solved ones), they are the same policy, and
        asking again would evaluate forever behind a version that keeps moving."""
        wanted = version if self.asked is None else min(version, self.asked)
        self.asked = None
        return last_eval is not None and last_eval["step"] >= wanted

    def _evaluate(self, version: int) -> Outcome:
        self.asked = version
        return Outcome.evaluate

    def _agrees(self, last_eval: Optional[dict], pushing: bool) -> bool:
        share = max(self.share, PUSHED_SHARE) if pushing else self.share
        return not self.evaluating or (last_eval["accuracy"] or 0.0) >= share

    def outcome(self, version: int, last_eval: Optional[dict], idle: bool, pushing: bool = False) -> Outcome:
        """``idle``: the trainer has trained every shipped batch and no kept group waits;
        ``pushing``: the guard's window held flat wrong groups under the unlikelihood push."""
        if self.evaluating and not self._current(version, last_eval):
            return self._evaluate(version)
        agrees = self._agrees(last_eval, pushing)
        if self.stop_on_converged and agrees:
            return Outcome.converged
        stuck, self.idle_trip = idle and self.idle_trip == version, version if idle else None
        if stuck:
            return Outcome.converged if agrees else Outcome.stalled
        return Outcome.train_on

    def after_collapse(self, version: int, last_eval: Optional[dict], pushing: bool = False) -> Optional[Outcome]:
        """A collapsed policy (some training prompts answered wrongly on every sample) whose
        held-out evaluation of the same weights reaches ``share`` (PUSHED_SHARE while
        ``pushing``) ends ``converged``: the evaluation, not the prompts it memorised wrongly, is
        what the run is for. ``evaluate`` while the latest evaluation is of older weights. Else
        the run fails (None): there is no evaluation to agree, it disagrees, or
        train.stop_on_converged is false; but while ``pushing`` it trains on, as the push is
        still moving the collapsed prompts."""
        otherwise = Outcome.train_on if pushing else None
        if not (self.evaluating and self.stop_on_converged):
            return otherwise
        if not self._current(version, last_eval):
            return self._evaluate(version)
        return Outcome.converged if self._agrees(last_eval, pushing) else otherwise

    def held_out_solved(self, evaluations: list[dict]) -> Optional[str]:
        """Why the run ends converged on held-out accuracy alone: the last ``stop_after``
        evaluations (by step) each reached ``stop_at``. None while they do not, or where
        stop_at is unset, there is no evaluation, or train.stop_on_converged is false."""
        if self.stop_at is None or not (self.evaluating and self.stop_on_converged):
            return None
        recent = sorted(evaluations, key=lambda record: record["step"])[-self.stop_after:]
        if len(recent) < self.stop_after or any((r["accuracy"] or 0.0) < self.stop_at for r in recent):
            return None
        reached = ", ".join(f"{r['accuracy']:.1%} at step {r['step']}" for r in recent)
        return (f"held-out accuracy {reached}: {self.stop_after} evaluations in a row at or above "
                f"eval.stop_at={self.stop_at:g}")

    def explain(self, outcome: Outcome, last_eval: Optional[dict]) -> str:
        if last_eval is None:
            return ""
        said = f"held-out accuracy {last_eval['accuracy']:.1%} at step {last_eval['step']}"
        if outcome is Outcome.stalled:
            return f"; but {said} says it is not, and nothing is left to train"
        return f"; {said}"
