"""Digit-string tasks for the tiny character-level model: ``reverse`` and ``sort``.

Prompts carry no whitespace (the tiny tokenizer has none): ``"407="``, answer ``"704"``.
The reward gives partial credit so a randomly initialised model gets a learning signal from
its first batch: a format part (the answer is a digit string of the right length) and a
per-position part (each position that matches, over the longer of the two lengths).

Held out: one digit string in ten (by a hash of the string, so the split is the same for every
seed and process) is never a training prompt; evaluation draws only from those.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass
from typing import Callable

from rlorch.config.schema import Config
from rlorch.tasks.base import SingleTurn, require, task_params
from rlorch.types import Conversation

FORMAT_WEIGHT = 0.2
"""Default share of the reward for the answer's form (digits only, the right length). Enough for
a randomly initialised model to learn to answer in digits within a few steps, small enough that
the per-position part, which is what teaches the task, carries most of each group's variance."""

HELD_OUT_MODULUS = 10
"""One digit string in this many is held out for evaluation."""


def clean_completion(text: str) -> str:
    """The answer part of a completion: up to the first end-of-sequence, without whitespace."""
    return text.split("<eos>", 1)[0].strip()


def digit_credit(completion: str, answer: str, format_weight: float = FORMAT_WEIGHT, *,
                 opening_only: bool = False) -> float:
    """Reward in [0, 1]; 1 exactly when the completion equals the answer.

    The format part is smooth (share of digit characters times length closeness) so that even
    a model emitting random characters sees which samples were better. The rest is the share of
    positions that match, or with ``opening_only`` of those before the first that does not.
    """
    got = clean_completion(completion)
    if got == answer:
        return 1.0
    if not answer or not got:
        return 0.0
    length = max(len(got), len(answer))
    same = [a == b for a, b in zip(got, answer)]
    if opening_only:
        matches = same.index(False) if False in same else len(same)
    else:
        matches = sum(same)
    digits = sum(c.isdigit() for c in got) / len(got)
    well_formed = digits * min(len(got), len(answer)) / length
    return (1.0 - format_weight) * matches / length + format_weight * well_formed


def prefix_credit(completion: str, answer: str, format_weight: float = FORMAT_WEIGHT) -> float:
    """:func:`digit_credit` of the answer's right opening: a position counts only while every one
    before it matched. A model writes its answer left to right, and credit for a later digit
    behind a wrong first one rewards an answer that cannot become right without giving that
    credit up; this one grows only as the answer is right further along."""
    return digit_credit(completion, answer, format_weight, opening_only=True)


@dataclass
class DigitParams:
    """``task.params`` of the digit tasks."""

    min_digits: int = 3
    """Shortest digit string."""
    max_digits: int = 5
    """Longest digit string."""
    format_weight: float = FORMAT_WEIGHT
    """Share of the reward for a well-formed answer (digits, right length); the rest is
    per-position credit. An exact answer scores 1."""

    def __post_init__(self) -> None:
        require(1 <= self.min_digits <= self.max_digits, "min_digits",
                "must satisfy 1 <= min_digits <= max_digits")
        require(0 <= self.format_weight < 1, "format_weight", "must be in [0, 1)")


@dataclass
class RetryParams(DigitParams):
    max_turns: int = 3
    """Model turns per episode: after a wrong answer the environment says ``no=``."""

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.max_turns >= 1, "max_turns", "must be >= 1")


_shake = hashlib.shake_256
_POWERS = tuple(10 ** n for n in range(64))


@functools.lru_cache(maxsize=1 << 16)
def is_held_out(digits: str) -> bool:
    """Whether a digit string belongs to the evaluation split (fixed, seed-independent)."""
    return hashlib.blake2b(digits.encode(), digest_size=4).digest()[0] % HELD_OUT_MODULUS == 0


@dataclass(frozen=True)
class DigitTask(SingleTurn):
    """Prompt ``<digits>=``; the answer is ``transform(digits)``."""

    name: str
    transform: Callable[[str], str]
    min_digits: int
    max_digits: int
    format_weight: float = FORMAT_WEIGHT
    max_reward: float = 1.0

    @classmethod
    def from_params(cls, name: str, transform: Callable[[str], str], params: DigitParams, **extra) -> "DigitTask":
        return cls(name, transform, params.min_digits, params.max_digits, params.format_weight, **extra)

    def _draw(self, key: str) -> str:
        # A keyed hash rather than a seeded Random: the same prompt in every process, and
        # cheap enough that making prompts never shows in the loop's throughput.
        low, high = self.min_digits, self.max_digits
        draw, pick = divmod(int.from_bytes(_shake(key.encode()).digest(8 + high), "big"), high - low + 1)
        length = low + pick
        return str(draw % _POWERS[length] if length < len(_POWERS) else draw % 10 ** length).zfill(length)[::-1]

    @property
    def answer_tokens(self) -> int:
        """Most tokens an answer takes (one a digit with the tiny model's tokenizer): a completion
        that reached them holds a whole answer, so ending at the length limit there is no
        truncation."""
        return self.max_digits

    def make_prompt(self, index: int, seed: int) -> tuple[str, str]:
        """Training prompt ``index``: never one of the held-out strings."""
        text = self._draw(f"{self.name}:{seed}:{index}")
        retry = 0
        while is_held_out(text):
            retry += 1
            text = self._draw(f"{self.name}:{seed}:{index}:{retry}")
        return f"{text}=", self.transform(text)

    def eval_prompts(self, count: int) -> list[tuple[str, str]]:
        """Up to ``count`` distinct held-out prompts, the same list for every run. The draws stop
        once ``count`` are found, or once the whole held-out split is found where it may hold
        fewer: there it is counted first, over fewer strings than finding ``count`` draws."""
        wanted = count
        if self._strings() <= count * HELD_OUT_MODULUS:
            wanted = min(count, self._held_out_size())
        found: dict[str, None] = {}
        for index in range(count * HELD_OUT_MODULUS * 20):
            text = self._draw(f"{self.name}:eval:{index}")
            if is_held_out(text):
                found.setdefault(text)
                if len(found) == wanted:
                    break
        return [(f"{text}=", self.transform(text)) for text in found]

    def _strings(self) -> int:
        """How many digit strings the task's lengths allow."""
        return sum(10 ** length for length in range(self.min_digits, self.max_digits + 1))

    def _held_out_size(self) -> int:
        return sum(is_held_out(str(value).zfill(length))
                   for length in range(self.min_digits, self.max_digits + 1) for value in range(10 ** length))

    def score(self, completion: str, answer: str) -> float:
        return digit_credit(completion, answer, self.format_weight)

    def is_correct(self, completion: str, answer: str) -> bool:
        return clean_completion(completion) == answer


def reverse_task(config: Config) -> DigitTask:
    return DigitTask.from_params("reverse", _reverse, task_params(DigitParams, config.task.params))


def _reverse(digits: str) -> str:
    return digits[::-1]


def _sort(digits: str) -> str:
    return "".join(sorted(digits))


@dataclass(frozen=True)
class RetryTask(DigitTask):
    """Reverse, with feedback: after a wrong answer the environment replies ``no=`` and the
    model tries again, up to ``max_turns`` turns; the last answer is scored."""

    max_turns: int = 3

    async def episode(self, conversation: Conversation, answer: str) -> float:
        completion = await conversation.generate()
        for _ in range(1, self.max_turns):
            if clean_completion(completion) == answer:
                break
            conversation.add("no=")
            completion = await conversation.generate()
        return self.score(completion, answer)


def reverse_retry_task(config: Config) -> RetryTask:
    params = task_params(RetryParams, config.task.params)
    return RetryTask.from_params("reverse_retry", _reverse, params, max_turns=params.max_turns)


def sort_task(config: Config) -> DigitTask:
    return DigitTask.from_params("sort", _sort, task_params(DigitParams, config.task.params))
