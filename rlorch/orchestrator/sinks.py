"""Sinks turn finished rollouts into training batches (train sink) or eval records (eval sink).

The train sink accumulates B rollouts, applies the filters group by group, computes group
advantages and emits what is left as the batch for the next step. With ``keep_flat`` a
zero-variance group is trained rather than dropped (its advantages are 0: only the entropy
bonus and the token count of the batch see it), and it still counts toward the empty-batch
guard, so a solved task ends the run the same way. In strict mode it first checks
every group's head age against the step the batch will train at: a group older than S is handed
back (to regenerate or drop) and never trained.
"""

from __future__ import annotations

import enum
import math
from bisect import bisect_left
from collections import Counter
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Callable, Optional, Sequence

import numpy

from rlorch.trainer.advantages import advantages as estimate, unlikelihood_marks
from rlorch.types import LONG, Batch, Rollout, head_ages


class Verdict(str, enum.Enum):
    """What the train sink did with a group (``kept``) or why it did not keep it."""

    kept = "kept"
    stale = "stale"
    """strict mode: its oldest token is older than S at the step it would train in."""
    solved = "solved"
    """every sample earned the environment's maximum reward: nothing left to learn."""
    collapsed = "collapsed"
    """every sample is the same completion (the same tokens after the prompt), short of the
    maximum reward: the policy stopped exploring."""
    constant = "constant"
    """different completions, one reward: a constant reward or a broken environment."""
    no_signal = "no_signal"
    """a batch of single-sample groups whose rewards are all equal."""
    no_tokens = "no_tokens"
    """no sample generated a token to train: every episode ended without a model turn (an agent
    that failed, or an environment that never called the model). Filtered whatever
    rollout.filter_groups says: nothing of it could train."""


KEPT = Verdict.kept
"""``Verdict.kept``, bound once: :meth:`TrainSink.add` returns it for nearly every group, and
attribute lookups on an Enum class cost several times a plain class's."""

FLAT_WRONG = (Verdict.collapsed, Verdict.constant)
"""The verdicts of zero-variance groups below the maximum reward: what trainer.flat_advantage trains."""
SOLVED_SHARE = 0.9
"""Share of recently filtered rollouts at the maximum reward for the empty-batch guard to call
the task solved; below it, some prompts are answered wrongly without variance to learn from.
Held-out accuracy must reach the same share for the run to end converged."""
FAILURE_WINDOW_CAP = 10
"""A data set scales the guard's failure window to one pass over its prompts, at most this many
times train.max_empty_batches: a long enough look at hard prompts, yet bounded for a large set."""


def failure_window(max_empty_batches: int, prompt_count: Optional[int], prompts_per_batch: int,
                   flat_signal: bool = False) -> int:
    """Batch-worths without a learning signal before a flat reward or a collapsed policy stops it:
    one pass over a finite prompt set of ``prompt_count`` prompts, at least ``max_empty_batches``
    and at most FAILURE_WINDOW_CAP times it. ``flat_signal`` (``trainer.flat_advantage`` other
    than zero: flat groups below the maximum train with an advantage of their own) waits the
    longest, FAILURE_WINDOW_CAP times ``max_empty_batches``, so a stuck prompt has time to move."""
    if flat_signal:
        return FAILURE_WINDOW_CAP * max_empty_batches
    if not prompt_count:
        return max_empty_batches
    one_pass = math.ceil(prompt_count / max(prompts_per_batch, 1))
    return max(max_empty_batches, min(one_pass, FAILURE_WINDOW_CAP * max_empty_batches))


GroupFilter = Callable[[Sequence[Rollout]], Optional[Verdict]]
"""A filter looks at one group and returns the reason to drop it, or None to keep it."""


def zero_variance_filter(max_reward: float = 1.0) -> GroupFilter:
    """Groups whose samples all scored the same carry no GRPO signal; the verdict says why."""

    def check(group: Sequence[Rollout]) -> Optional[Verdict]:
        if all(r.generated_tokens == 0 for r in group):
            return Verdict.no_tokens
        if len(group) < 2 or any(r.reward != group[0].reward for r in group):
            return None
        if group[0].reward >= max_reward:
            return Verdict.solved
        first = group[0].tokens[group[0].prompt_len:]
        if all(r.tokens[r.prompt_len:] == first for r in group):
            return Verdict.collapsed
        return Verdict.constant

    return check


@dataclass
class SinkTotals:
    batches: int = 0
    trained: int = 0
    filtered: int = 0
    filtered_by: dict = field(default_factory=dict)
    empty_batches: int = 0
    consecutive_empty: int = 0
    stale_groups: int = 0
    stale_rollouts: int = 0
    stale_tokens: int = 0
    short_batches: int = 0
    recent: Counter = field(default_factory=Counter)
    """Rollouts of zero-variance groups (filtered, or kept under ``keep_flat``), by verdict, since
    a group with a signal was last kept: what the empty-batch guard reads."""
    recent_surprisal: float = 0.0
    recent_tokens: int = 0
    """Summed -logprob and count of the sampled tokens of those rollouts (an entropy estimate)."""


class TrainSink:
    """Filters groups as they arrive and emits batches of exactly B kept rollouts.

    Filtering on arrival (rather than inside an assembled batch) keeps every batch full and the
    gate's accounting exact: a filtered or stale group is discarded from the gate, which frees
    its slots for a replacement, and each shipped batch consumes exactly B accepted rollouts.
    Invariant: every rollout handed to :meth:`add` is in an emitted batch, rejected (filtered or
    stale, counted) or still in :meth:`pending_groups`.
    """

    def __init__(self, *, batch_size: int, max_staleness: int, strict: bool, max_reward: float = 1.0,
                 filters: Optional[Sequence[GroupFilter]] = None, filter_budget: int = 0,
                 advantage: object = "grpo", scale_rewards: object = None, keep_flat: bool = False,
                 flat_advantage: object = "zero"):
        self.batch_size = batch_size
        self.max_reward = max_reward
        self.flat_advantage = getattr(flat_advantage, "value", flat_advantage)
        """What kept flat groups below the maximum train with (``trainer.flat_advantage``)."""
        self.keep_flat = keep_flat
        """Train zero-variance groups (``rollout.filter_groups=false``) instead of dropping them."""
        self.pushes_flat_wrong = keep_flat and self.flat_advantage == "unlikelihood"
        """A kept flat group below the maximum reward (one wrong completion sampled throughout,
        or different ones scoring one wrong reward) trains with a push of its own: the
        unlikelihood of its tokens, never zero. It still counts toward the guard's run (a solved
        run whose training set holds a few such prompts must be able to end), and
        :attr:`pushing` tells the run's convergence check that the window held some (see
        rlorch.orchestrator.stops.PUSHED_SHARE)."""
        # Config enums or their names: the estimator table is keyed by name.
        self.advantage = getattr(advantage, "value", advantage)
        self.scale_rewards = getattr(scale_rewards, "value", scale_rewards)
        self.filter_budget = filter_budget
        self.flat = zero_variance_filter(max_reward)
        self.max_staleness = max_staleness
        self.strict = strict
        self.filters = [self.flat] if filters is None else list(filters)
        self.totals = SinkTotals()
        self._groups: list[list[Rollout]] = []
        self._count = 0
        self._filtered_run = 0
        self._filtered_at_emit = 0
        self._filtered_since_emit = 0

    def pending_groups(self) -> list[list[Rollout]]:
        """Kept groups not yet in a batch, oldest first."""
        return list(self._groups)

    @property
    def buffered(self) -> int:
        return self._count

    @property
    def buffered_signal(self) -> int:
        """Buffered rollouts the trainer can learn from: kept zero-variance groups left out, but
        for flat wrong ones under the push (cold: read when the guard trips)."""
        pushed = FLAT_WRONG if self.pushes_flat_wrong else ()
        return sum(len(group) for group in self._groups if (verdict := self._verdict(group)) is None or verdict in pushed)

    @property
    def pushing(self) -> bool:
        """The guard's current window holds flat groups below the maximum reward (collapsed or
        constant) that train with the unlikelihood push: prompts the run is still moving."""
        return self.pushes_flat_wrong and any(self.totals.recent[verdict] for verdict in FLAT_WRONG)

    def gauges(self) -> dict:
        return {"buffered": self._count, "short_batches": self.totals.short_batches}

    def is_stale(self, group: Sequence[Rollout], train_version: int) -> bool:
        ages = head_ages(group, train_version)
        return bool(ages) and max(ages) > self.max_staleness

    def _count_stale(self, group: Sequence[Rollout]) -> None:
        self.totals.stale_groups += 1
        self.totals.stale_rollouts += len(group)
        self.totals.stale_tokens += sum(r.generated_tokens for r in group)

    def add(self, group: list[Rollout], step: int) -> Verdict:
        """Take a finished group for the batch of ``step`` (trained at version step - 1).

        Returns ``kept``, ``stale`` (strict mode: too old to train; the caller regenerates or
        drops it) or the verdict of the filter that dropped it. Every batch-worth of consecutive
        filtered rollouts counts as one empty batch. Under ``keep_flat`` a zero-variance group is
        kept, and its rollouts count toward the guard's run as if filtered (not as empty batches:
        they train).
        """
        if self.strict and self.is_stale(group, step - 1):
            self._count_stale(group)
            return Verdict.stale
        reason = self._verdict(group)
        if reason:
            self._note_flat(reason, group)
            self._filtered_run += len(group)
            kept = self.keep_flat and reason is not Verdict.no_tokens
            if self._filtered_run >= self.batch_size:
                self._filtered_run = 0
                self.totals.consecutive_empty += 1
                self.totals.empty_batches += not kept
            if not kept:
                self._count_filtered(reason, group)
                self._filtered_since_emit += len(group)
                return reason
        else:
            self._reset_guard(group)
        self._groups.append(group)
        self._count += len(group)
        return KEPT

    def _verdict(self, group: Sequence[Rollout]) -> Optional[Verdict]:
        """The first filter's reason to drop ``group``, or None (the group carries a signal)."""
        for check in self.filters:
            if reason := check(group):
                return reason
        return None

    def _reset_guard(self, group: Sequence[Rollout]) -> None:
        """A group with a signal was kept: the guard's run of groups without one starts again."""
        self._filtered_run = 0
        if len(group) > 1:
            self.totals.consecutive_empty = 0
            self.totals.recent.clear()
            self.totals.recent_surprisal, self.totals.recent_tokens = 0.0, 0

    def _count_filtered(self, reason: Verdict, rollouts: Sequence[Rollout]) -> None:
        totals = self.totals
        totals.filtered += len(rollouts)
        totals.filtered_by[reason.value] = totals.filtered_by.get(reason.value, 0) + len(rollouts)

    def _note_flat(self, reason: Verdict, rollouts: Sequence[Rollout]) -> None:
        """What the guard's diagnosis reads of a group without a signal: its verdict and the
        surprisal of its sampled tokens."""
        totals = self.totals
        totals.recent[reason] += len(rollouts)
        for rollout in rollouts:
            if len(rollout.logprobs) >= LONG:
                sampled = numpy.asarray(rollout.logprobs)[numpy.asarray(rollout.loss_mask) != 0]
                totals.recent_surprisal -= float(sampled.sum(dtype=numpy.float64))
            else:
                sampled = [p for p, m in zip(rollout.logprobs, rollout.loss_mask) if m]
                totals.recent_surprisal -= sum(sampled)
            totals.recent_tokens += len(sampled)

    def guard(self, max_empty_batches: int, failure_window: int = 0) -> Optional[tuple[Verdict, str]]:
        """The empty-batch guard: once ``max_empty_batches`` batch-worths of finished rollouts in
        a row had no reward spread to learn from (no group with a signal in between; batches may
        still have trained on groups kept earlier), the verdict and the message the run ends with;
        else None. A verdict other than ``solved`` waits for ``failure_window`` batch-worths when
        that is longer (one pass over a data set: hard prompts may all score 0 for a while)."""
        empty = self.totals.consecutive_empty
        if empty < max_empty_batches:
            return None
        verdict, why = self.diagnose()
        if verdict is not Verdict.solved and empty < failure_window:
            return None
        window = max_empty_batches if verdict is Verdict.solved else max(max_empty_batches, failure_window)
        scaled = "" if window == max_empty_batches else f", scaled to one pass over the data set: {window}"
        return verdict, (f"{empty * self.batch_size} rollouts in a row ({empty} batches' worth) finished with no "
                         f"reward spread to learn from (train.max_empty_batches={max_empty_batches}{scaled}); {why}.")

    def rearm(self) -> None:
        """Start the guard's count again (the run trains on after it tripped)."""
        self.totals.consecutive_empty = 0
        self._filtered_run = 0
        self.totals.recent.clear()
        self.totals.recent_surprisal, self.totals.recent_tokens = 0.0, 0

    def diagnose(self) -> tuple[Verdict, str]:
        """Why recent batches had no reward spread to learn from.

        ``solved`` when at least SOLVED_SHARE of the filtered rollouts earned the maximum reward;
        ``collapsed`` when most of the rest sampled one completion per group (a policy that
        stopped exploring, whether or not it solved some prompts); else ``constant``.
        """
        recent = self.totals.recent
        seen = sum(recent.values()) or 1
        counts = ", ".join(f"{n} {why.value}" for why, n in recent.most_common())
        if recent[Verdict.solved] >= SOLVED_SHARE * seen:
            return Verdict.solved, f"of the last {seen} rollouts {counts}: the task is solved"
        if recent[Verdict.no_tokens] * 2 > seen:
            return Verdict.no_tokens, (
                f"of the last {seen} rollouts {counts}: most episodes ended without a model turn, nothing "
                f"to train (an agent failing its episodes: summary.json's agent_errors holds its last errors; "
                f"or an environment that never calls the model)")
        entropy = self.totals.recent_surprisal / max(self.totals.recent_tokens, 1)
        if (recent[Verdict.collapsed] + recent[Verdict.solved]) * 2 > seen:
            return Verdict.collapsed, (
                f"of the last {seen} rollouts {counts}: the policy collapsed, its groups sample one "
                f"completion (sampled-token entropy estimate {entropy:.3g} nats) and the collapsed ones "
                f"fall short of the maximum reward. Raise trainer.entropy_coef or rollout.temperature, "
                f"or lower trainer.lr")
        # A policy whose entropy bonus outweighs its advantages (an unscaled estimator at a
        # grpo-sized trainer.entropy_coef) samples near-uniform answers that all score the same.
        return Verdict.constant, (f"of the last {seen} rollouts {counts}: different completions score "
                                  f"the same (sampled-token entropy estimate {entropy:.3g} nats); a constant "
                                  f"reward, a broken environment, or a policy sampling too randomly to score "
                                  f"(lower trainer.entropy_coef) does this")

    def over_budget(self) -> bool:
        """More rollouts were filtered while assembling this batch than the budget allows, and
        kept groups wait: the batch ships short rather than generating on."""
        return bool(self.filter_budget) and self._filtered_since_emit > self.filter_budget and self._count > 0

    def restale(self, step: int) -> list[list[Rollout]]:
        """Strict mode: hand back buffered groups that became too stale for ``step``."""
        if not self.strict:
            return []
        keep, stale = [], []
        for group in self._groups:
            (stale if self.is_stale(group, step - 1) else keep).append(group)
        for group in stale:
            self._count -= len(group)
            self._count_stale(group)
        self._groups = keep
        return stale

    def ready(self) -> bool:
        return self._count >= self.batch_size

    def emit(self, step: int) -> Batch:
        """Take B rollouts (whole groups, oldest first) as the batch for ``step``, fewer when the
        filter budget ran out.

        Advantages are ``trainer.advantage`` / ``trainer.scale_rewards``'s (see
        :mod:`rlorch.trainer.advantages`); groups of one sample are normalised across the
        batch instead. A batch whose advantages are then all 0 carries no signal: it is counted
        as empty and comes back with ``trainable`` false (its rollouts are the caller's to
        discard).
        """
        groups = self._groups
        sizes = [len(group) for group in groups]
        filled = list(accumulate(sizes))
        end = min(bisect_left(filled, self.batch_size) + 1, len(groups))
        count = filled[end - 1] if end else 0
        taken = groups[:end]
        del groups[:end]
        self._count -= count
        self._filtered_since_emit = 0
        if count < self.batch_size:
            self.totals.short_batches += 1
        rollouts = [r for group in taken for r in group]
        rewards = [[r.reward for r in group] for group in taken]
        advantages = [a for group in estimate(rewards, self.advantage, self.scale_rewards,
                                                             flat=self.flat_advantage, max_reward=self.max_reward) for a in group]
        batch = Batch(step=step, rollouts=rollouts, advantages=advantages,
                      unlikelihood=unlikelihood_marks(rewards, self.flat_advantage, self.max_reward))
        if not batch.trainable:
            reason = self.flat(rollouts) or Verdict.no_signal
            self.totals.empty_batches += 1
            self._count_filtered(reason, rollouts)
            # Kept flat groups were counted toward the guard as they came; groups that passed the
            # filters (one sample each: only the batch decides their signal) are counted now.
            if unnoted := [r for group in taken if not self._verdict(group) for r in group]:
                self.totals.consecutive_empty += 1
                self._note_flat(reason, unnoted)
            return batch
        # A group with a signal reset the guard as it came; a one-sample group's signal is the
        # batch's, decided here. Flat groups since the last signal still count, kept or not.
        if any(len(group) < 2 for group in taken):
            self.totals.consecutive_empty = 0
        self.totals.batches += 1
        self.totals.trained += len(rollouts)
        filtered = self.totals.filtered - self._filtered_at_emit
        self._filtered_at_emit = self.totals.filtered
        batch.filtered = filtered
        return batch


@dataclass
class EvalSink:
    """Eval rollouts: no advantages, no filtering, exempt from the staleness bound.

    ``step`` is the policy version the evaluation was asked of; ``version_min``/``version_max``
    are the versions that actually produced its tokens (a reload can land mid-evaluation).
    Prompts whose generation failed count as wrong and are reported in ``failed``.
    """

    results: list[dict] = field(default_factory=list)

    def add(self, step: int, rollouts: Sequence[Rollout], asked: int) -> dict:
        rewards = [r.reward for r in rollouts]
        versions = [v for r in rollouts for v, _ in r.versions.runs]
        record = {"kind": "eval", "step": step, "prompts": asked,
                  "accuracy": round(sum(1 for r in rollouts if r.correct) / asked, 6) if asked else None,
                  "reward_mean": round(sum(rewards) / len(rewards), 6) if rewards else None,
                  "failed": asked - len(rollouts),
                  "version_min": min(versions, default=None), "version_max": max(versions, default=None)}
        self.results.append(record)
        return record

    @property
    def first(self) -> Optional[dict]:
        return min(self.results, key=lambda r: r["step"], default=None)

    @property
    def last(self) -> Optional[dict]:
        return max(self.results, key=lambda r: r["step"], default=None)
