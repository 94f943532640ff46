"""Digit-string tasks for the tiny character-level model: ``reverse`` and ``sort``.

Prompts carry no whitespace (the tiny tokenizer has none): ``"4071="``, answer ``"1704"``.
The reward gives partial credit so a randomly initialised model gets a learning signal from
its first batch: a format part (the answer is a digit string of the right length) and a
per-position part (each position that matches, over the longer of the two lengths).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Callable

from rlorch.config import Config
from rlorch.tasks import register

DIGITS = "0123456789"

FORMAT_WEIGHT = 0.5
"""Share of the reward for the answer's form (digits only, the right length). Half, because a
randomly initialised model first has to learn to answer in digits at all; with less, the
per-position part is too sparse for a 60-step CPU run to show a clear gain."""


def clean_completion(text: str) -> str:
    """The answer part of a completion: up to the first end-of-sequence, without whitespace."""
    return text.split("<eos>", 1)[0].strip()


def digit_credit(completion: str, answer: str, format_weight: float = FORMAT_WEIGHT) -> float:
    """Reward in [0, 1]; 1 exactly when the completion equals the answer.

    The format part is smooth (share of digit characters times length closeness) so that even
    a model emitting random characters sees which samples were better.
    """
    got = clean_completion(completion)
    if got == answer:
        return 1.0
    if not answer or not got:
        return 0.0
    length = max(len(got), len(answer))
    matches = sum(a == b for a, b in zip(got, answer))
    digits = sum(c.isdigit() for c in got) / len(got)
    well_formed = digits * min(len(got), len(answer)) / length
    return (1.0 - format_weight) * matches / length + format_weight * well_formed


@dataclass(frozen=True)
class DigitTask:
    """Prompt ``<digits>=``; the answer is ``transform(digits)``."""

    name: str
    transform: Callable[[str], str]
    min_digits: int
    max_digits: int

    def make_prompt(self, index: int, seed: int) -> tuple[str, str]:
        # A keyed hash rather than a seeded Random: the same prompt in every process, and
        # cheap enough that making prompts never shows in the loop's throughput.
        span = self.max_digits - self.min_digits + 1
        draw = int.from_bytes(hashlib.shake_256(f"{self.name}:{seed}:{index}".encode())
                              .digest(8 + self.max_digits), "big")
        draw, pick = divmod(draw, span)
        digits = []
        for _ in range(self.min_digits + pick):
            draw, digit = divmod(draw, 10)
            digits.append(DIGITS[digit])
        text = "".join(digits)
        return f"{text}=", self.transform(text)

    def score(self, completion: str, answer: str) -> float:
        return digit_credit(completion, answer)


@register("reverse")
def reverse_task(config: Config) -> DigitTask:
    return DigitTask("reverse", lambda s: s[::-1], config.task.min_digits, config.task.max_digits)


@dataclass(frozen=True)
class RetryTask(DigitTask):
    """Reverse, with feedback: after a wrong answer the environment replies ``no=`` and the
    model tries again (up to task.max_turns turns); the last answer is scored."""

    def reply(self, completion: str, answer: str, turn: int) -> str | None:
        return None if clean_completion(completion) == answer else "no="


@register("reverse_retry")
def reverse_retry_task(config: Config) -> RetryTask:
    return RetryTask("reverse_retry", lambda s: s[::-1], config.task.min_digits, config.task.max_digits)


@register("sort")
def sort_task(config: Config) -> DigitTask:
    return DigitTask("sort", lambda s: "".join(sorted(s)), config.task.min_digits, config.task.max_digits)
