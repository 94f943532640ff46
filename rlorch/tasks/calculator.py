"""A tool-using task: the model may call a calculator before it answers.

Prompt ``37+45=``, answer ``82``. Each episode has two model turns around one tool call:

1. the model writes an expression and ends it with ``|`` (the call), e.g. ``37+45|``;
2. the environment evaluates it and appends the result, ``=82|`` (or ``=?|`` when the call is
   not an expression of digits, ``+`` and ``-``) — environment text, never trained on;
3. the model writes its answer; exact match scores 1. Short of that, partial credit teaches the
   form first: 0.3 for a call the tool could evaluate, up to 0.3 for the share of digits in the
   answer.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

from rlorch.config.schema import Config
from rlorch.tasks.base import require, task_params
from rlorch.types import Conversation

CALL_END = "|"
NOT_AN_EXPRESSION = "x"
"""The tool's answer to a call it cannot evaluate (a character the tiny tokenizer has)."""
_EXPRESSION = re.compile(r"^\d{1,6}([+-]\d{1,6}){0,3}$")


def calculate(expression: str) -> str:
    """The tool: ``12+30-5`` -> ``37``; NOT_AN_EXPRESSION for anything else."""
    expression = expression.strip().removesuffix(CALL_END)
    if not _EXPRESSION.match(expression):
        return NOT_AN_EXPRESSION
    total, sign, number = 0, 1, ""
    for char in expression + "+":
        if char.isdigit():
            number += char
        else:
            total += sign * int(number)
            sign, number = (1 if char == "+" else -1), ""
    return str(total)


@dataclass
class CalculatorParams:
    min_operand: int = 0
    """Operands are drawn from min_operand..max_operand."""
    max_operand: int = 99
    """See min_operand. With both of the same digit count (10..49), every prompt and answer has
    one length, so an answer's digits sit at the same positions in every episode."""
    call_tokens: int = 8
    """Most tokens of the model's call."""
    answer_tokens: int = 4
    """Most tokens of the model's answer."""

    def __post_init__(self) -> None:
        require(self.min_operand >= 0, "min_operand", "must be >= 0")
        require(self.max_operand >= max(1, self.min_operand), "max_operand", "must be >= 1 and >= min_operand")
        require(self.call_tokens >= 1, "call_tokens", "must be >= 1")
        require(self.answer_tokens >= 1, "answer_tokens", "must be >= 1")


@dataclass(frozen=True)
class CalculatorTask:
    params: CalculatorParams
    name: str = "calculator"
    max_reward: float = 1.0

    def make_prompt(self, index: int, seed: int) -> tuple[str, str]:
        draw = int.from_bytes(hashlib.shake_256(f"{self.name}:{seed}:{index}".encode()).digest(8), "big")
        low, span = self.params.min_operand, self.params.max_operand - self.params.min_operand + 1
        a, b = low + draw % span, low + (draw >> 20) % span
        return f"{a}+{b}=", str(a + b)

    async def episode(self, conversation: Conversation, answer: str) -> float:
        call = await conversation.generate(max_new_tokens=self.params.call_tokens, stop=[CALL_END])
        result = calculate(call)
        conversation.add(f"={result}{CALL_END}")
        final = await conversation.generate(max_new_tokens=self.params.answer_tokens)
        if self.is_correct(final, answer):
            return 1.0
        return (0.3 if result != NOT_AN_EXPRESSION else 0.0) + 0.3 * self.score(final, answer)

    def score(self, completion: str, answer: str) -> float:
        """Exact match 1; else the share of digit characters in the answer."""
        got = completion.strip()
        if got == answer:
            return 1.0
        return sum(c.isdigit() for c in got) / len(got) if got else 0.0

    def is_correct(self, completion: str, answer: str) -> bool:
        return completion.strip() == answer


def calculator_task(config: Config) -> CalculatorTask:
    return CalculatorTask(task_params(CalculatorParams, config.task.params))
