"""Advantage estimators: one baseline and one scale per batch of groups, as pure functions.

Plain Python on reward lists: the train sink computes them in the orchestrator, which never
imports torch. A batch is a list of groups, each the rewards of one prompt's samples; the result
has the same shape. An estimator is a baseline (what is subtracted from each reward) followed by
a scale (what the difference is divided by):

* ``grpo``: group mean, divided by the group's std (``scale_rewards=group``, the default);
* ``dr_grpo``: group mean, no division (Dr. GRPO: the std divisor over-weights easy and hard
  prompts);
* ``rloo``: leave-one-out mean of the other samples of the group, ``r_i - mean_{j != i} r_j``
  (an unbiased baseline: it does not depend on ``r_i``);
* ``reinforce``: the batch mean.

Scales: ``group`` (population std of the group's rewards), ``batch`` (population std of all the
batch's rewards), ``none``. A divisor is ``std + EPS``, so a zero-variance group's advantages stay
0 instead of dividing by zero.

Flat groups (``trainer.flat_advantage``): a group whose samples all scored the same below the
maximum reward (a prompt the policy answers one wrong way) gets 0 from every group baseline, so
nothing moves it once the policy is deterministic there. ``batch`` gives such a group
``(r - batch mean) / (batch std + EPS)`` instead (mixed groups keep the estimator's advantages,
flat groups at the maximum stay 0): negative wherever the batch does better on average, and
the policy-gradient term grows as the stuck answer's probability falls back from 1. Where most of
a batch is stuck, a flat group above the batch mean gets a *positive* advantage under ``batch``,
reinforcing a wrong answer; ``negative`` is the same formula capped at 0 (a flat wrong group is
pushed down or left alone, never reinforced). Where nearly every group is solved the batch's std
is small and a flat wrong group's advantage reaches -3 to -5, a push that can wreck a converged
policy; ``bounded`` also floors it at -1, no more than a mixed group's typical sample.

None of these moves a *deterministic* wrong answer: the policy gradient of a token's logprob
with respect to its logit is ``1 - p``, about 4e-4 at the entropies stuck runs reach, so any
bounded advantage on such a token is lost. ``unlikelihood`` gives a flat wrong group -1 and marks
it (:func:`unlikelihood_marks`); the trainer scales each marked token's advantage by
``p / (1 - p)`` of its current policy (:func:`rlorch.trainer.loss.unlikelihood_weights`), which
makes the step the gradient of the unlikelihood loss ``-log(1 - p)`` (Welleck et al.): ``p`` on
the token's logit, about 1 on a deterministic wrong one, at most 1 on any; ``trainer.
unlikelihood_scale`` (0.1 by default) multiplies it.

Groups of one sample have no group baseline: when every group of a batch has one sample, the
batch is treated as one group (GRPO across prompts); a lone sample among larger groups gets 0
under the group baselines (``grpo``, ``dr_grpo``, ``rloo``).
"""

from __future__ import annotations

import math
from typing import Callable, Optional, Sequence

EPS = 1e-6
"""Added to every std divisor (a zero-variance group divides by EPS: its differences are 0)."""

Groups = Sequence[Sequence[float]]


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def _std(values: Sequence[float]) -> float:
    mean = _mean(values)
    return math.sqrt(sum([(v - mean) ** 2 for v in values]) / len(values))


def group_mean_baseline(groups: Groups) -> list[list[float]]:
    """``r - mean(group)`` (GRPO, Dr. GRPO)."""
    return [[r - mean for r in group] for group in groups for mean in (_mean(group),)]


def leave_one_out_baseline(groups: Groups) -> list[list[float]]:
    """``r_i - mean_{j != i} r_j`` (RLOO); a group of one has no other sample: 0."""
    out = []
    for group in groups:
        n, total = len(group), sum(group)
        out.append([r - (total - r) / (n - 1) for r in group] if n > 1 else [0.0])
    return out


def batch_mean_baseline(groups: Groups) -> list[list[float]]:
    """``r - mean(batch)`` (REINFORCE with a batch-mean baseline)."""
    mean = _mean([r for group in groups for r in group])
    return [[r - mean for r in group] for group in groups]


BASELINES: dict[str, Callable[[Groups], list[list[float]]]] = {
    "grpo": group_mean_baseline, "dr_grpo": group_mean_baseline,
    "rloo": leave_one_out_baseline, "reinforce": batch_mean_baseline}
"""``trainer.advantage`` -> its baseline."""

DEFAULT_SCALE = {"grpo": "group", "dr_grpo": "none", "rloo": "none", "reinforce": "none"}
"""The scale an estimator uses when ``trainer.scale_rewards`` is unset."""


def scaled(groups: Groups, centred: Groups, scale: str) -> list[list[float]]:
    """``centred`` divided by the rewards' std (+ EPS) per ``scale``: group, batch or none."""
    if scale == "none":
        return [list(group) for group in centred]
    if scale == "batch":
        divisor = _std([r for group in groups for r in group]) + EPS
        return [[a / divisor for a in group] for group in centred]
    if scale == "group":
        return [[a / divisor for a in advantages]
                for rewards, advantages in zip(groups, centred) for divisor in (_std(rewards) + EPS,)]
    raise ValueError(f"trainer.scale_rewards: unknown scale {scale!r} (group, batch or none)")


def is_flat_below(group: Sequence[float], max_reward: float) -> bool:
    """Whether ``group`` has two or more samples, all with one reward below ``max_reward``."""
    return len(group) > 1 and group[0] < max_reward and all(r == group[0] for r in group)


def flat_below_max(groups: Groups, estimated: Groups, max_reward: float = 1.0,
                   most: float = math.inf, least: float = -math.inf) -> list[list[float]]:
    """``estimated`` with every flat group below ``max_reward`` replaced by
    ``(r - batch mean) / (batch std + EPS)`` clipped to ``[least, most]``
    (``trainer.flat_advantage=batch``; ``negative``: ``most`` 0; ``bounded``: ``[-1, 0]``)."""
    rewards = [r for group in groups for r in group]
    mean, divisor = _mean(rewards), _std(rewards) + EPS
    return [[max(min((r - mean) / divisor, most), least) for r in group] if is_flat_below(group, max_reward)
            else list(advantage) for group, advantage in zip(groups, estimated)]


def flat_below_max_at(groups: Groups, estimated: Groups, max_reward: float = 1.0,
                      value: float = -1.0) -> list[list[float]]:
    """``estimated`` with every flat group below ``max_reward`` set to ``value``
    (``trainer.flat_advantage=unlikelihood``, whose trainer scales it per token)."""
    return [[value] * len(group) if is_flat_below(group, max_reward) else list(advantage)
            for group, advantage in zip(groups, estimated)]


def unlikelihood_marks(groups: Groups, flat: str, max_reward: float = 1.0) -> list[bool]:
    """Per sample (flattened in batch order), whether the trainer scales its advantage by
    ``p / (1 - p)`` per token: the flat groups below ``max_reward`` under ``unlikelihood``."""
    marked = flat == "unlikelihood"
    return [marked and is_flat_below(group, max_reward) for group in groups for _ in group]


FLAT = {"zero": lambda groups, estimated, max_reward: [list(group) for group in estimated],
        "batch": flat_below_max,
        "negative": lambda groups, estimated, max_reward: flat_below_max(groups, estimated, max_reward, most=0.0),
        "bounded": lambda groups, estimated, max_reward: flat_below_max(groups, estimated, max_reward, most=0.0,
                                                                       least=-1.0),
        "unlikelihood": flat_below_max_at}
"""``trainer.flat_advantage`` -> what flat groups below the maximum get."""


def advantages(groups: Groups, estimator: str = "grpo", scale: Optional[str] = None, *,
               flat: str = "zero", max_reward: float = 1.0) -> list[list[float]]:
    """Per-sample advantages of a batch of groups (same shape as ``groups``).

    ``scale`` None uses the estimator's own (:data:`DEFAULT_SCALE`). A batch whose groups all
    have one sample is normalised as one group; see the module docstring. ``flat`` says what
    zero-variance groups below ``max_reward`` get (:data:`FLAT`)."""
    if estimator not in BASELINES:
        raise ValueError(f"trainer.advantage: unknown estimator {estimator!r} ({', '.join(BASELINES)})")
    if flat not in FLAT:
        raise ValueError(f"trainer.flat_advantage: unknown choice {flat!r} ({', '.join(FLAT)})")
    if len(groups) > 1 and all(len(group) == 1 for group in groups):
        return [[a] for a in advantages([[r for group in groups for r in group]], estimator, scale)[0]]
    estimated = scaled(groups, BASELINES[estimator](groups), scale or DEFAULT_SCALE[estimator])
    return FLAT[flat](groups, estimated, max_reward)


def group_advantages(rewards: Sequence[float]) -> list[float]:
    """(r - mean) / (std + EPS) within one group (GRPO)."""
    return advantages([rewards])[0]
