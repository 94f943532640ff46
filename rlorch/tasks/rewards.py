"""Reward functions for tasks from data, named by ``task.reward``: TRL's signature,
``f(prompts, completions, **columns) -> list[float]``, sync or async.

- ``prompts``: each sample's prompt (text, or its list of chat messages);
- ``completions``: each sample's completion (text; for a chat prompt, TRL's conversational form
  ``[{"role": "assistant", "content": text}]``);
- ``columns``: every other column of the data row (the answer under ``data.answer_key``'s
  name), one value per sample.

The reward of a sample is the weighted sum (``task.reward_weights``) of the functions' values. A
function that raises, or answers with the wrong number of values, fails the run with an error
naming the function and the data row. ``math`` is built in (:func:`math_reward`).
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass
from decimal import Decimal
from typing import Any, Callable, Optional, Sequence

from rlorch.config.schema import ConfigError
from rlorch.tasks.base import import_spec

BUILT_IN = {"math": "rlorch.tasks.rewards:math_reward"}
INSTALL_DATA = "pip install 'rlorch[data]'"


class RewardError(ValueError):
    """A reward function raised or answered badly; the message names the function and row."""


@dataclass(frozen=True)
class RewardFunction:
    name: str
    function: Callable[..., Any]
    weight: float


def load_rewards(specs: Sequence[str], weights: Sequence[float] | None) -> list[RewardFunction]:
    """``task.reward`` and ``task.reward_weights`` as callables (checked: each is callable)."""
    loaded = []
    for spec, weight in zip(specs, weights or [1.0] * len(specs)):
        function = import_spec(BUILT_IN.get(spec, spec), "task.reward")
        if not callable(function):
            raise ConfigError("task.reward", f"{spec} is not a function")
        if function is math_reward:
            require_math_verify()
        loaded.append(RewardFunction(spec, function, float(weight)))
    return loaded


async def weighted_rewards(functions: Sequence[RewardFunction], prompts: list, completions: list,
                           columns: dict[str, list], rows: Sequence[str]) -> list[float]:
    """Each sample's weighted sum of the functions' rewards; ``rows`` names each sample's data row."""
    total = [0.0] * len(completions)
    for reward in functions:
        try:
            values = reward.function(prompts, completions, **columns)
            if inspect.isawaitable(values):
                values = await values
            values = list(values)
        except Exception as err:
            raise RewardError(f"reward function {reward.name} raised on {_where(rows)}: {err!r}") from err
        if len(values) != len(completions):
            raise RewardError(f"reward function {reward.name} answered {len(values)} value(s) for "
                              f"{len(completions)} completions (of {_where(rows, 'rows ')}), one each")
        for i, value in enumerate(values):
            if value is None:
                continue
            try:
                total[i] += reward.weight * float(value)
            except (TypeError, ValueError) as err:
                raise RewardError(f"reward function {reward.name} answered {value!r} for {rows[i]}: "
                                  "not a number") from err
    return total


def require_math_verify() -> None:
    try:
        import math_verify  # noqa: F401
    except ImportError as err:
        raise ConfigError("task.reward", f"the math reward needs the math-verify package: {INSTALL_DATA}") from err


def _text(completion: Any) -> str:
    if isinstance(completion, str):
        return completion
    return "".join(m.get("content", "") for m in completion if isinstance(m, dict))


def gold_answer(answer: Any) -> str:
    """A GSM8K-style reference: the part after ``####`` when there is one."""
    text = str(answer)
    return text.rsplit("####", 1)[-1].strip() if "####" in text else text.strip()


PLAIN_NUMBER = re.compile(r"-?[0-9]+(\.[0-9]+)?")
"""An integer or decimal with nothing around it: two of these are equal exactly when their values are."""


def _plain_number(text: str) -> Optional[Decimal]:
    text = text.strip()
    return Decimal(text) if PLAIN_NUMBER.fullmatch(text) else None


def math_reward(prompts: list, completions: list, answer: list, **columns: Any) -> list[float]:
    """1 where the completion's final answer equals the reference mathematically (math-verify:
    ``\\boxed{}``, LaTeX, plain numbers; the reference may be GSM8K's ``... #### 72``), else 0.

    When both are plain numbers (``72``, ``-3``, ``0.50``) they are compared by value without
    math-verify, whose sympy parse costs milliseconds a sample; anything else goes to math-verify."""
    rewards = []
    for completion, reference in zip(completions, answer):
        gold, got = gold_answer(reference), _text(completion)
        plain_gold, plain_got = _plain_number(gold), _plain_number(got)
        if plain_gold is not None and plain_got is not None:
            rewards.append(1.0 if plain_gold == plain_got else 0.0)
        else:
            rewards.append(_verified(gold, got))
    return rewards


def _verified(gold_text: str, text: str) -> float:
    from math_verify import parse, verify

    gold, got = parse(gold_text), parse(text)
    return 1.0 if gold and got and verify(gold, got) else 0.0


def _where(rows: Sequence[str], plural: str = "one of ") -> str:
    """The data rows a call scored: its one row, or the rows of the groups it covered."""
    unique = sorted(set(rows))
    return unique[0] if len(unique) == 1 else plural + ", ".join(unique)
