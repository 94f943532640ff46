"""A task read from a JSONL file of ``{prompt_key: ..., answer_key: ...}`` lines; exact-match reward.

The file is read once and checked whole: a bad line fails at load time, naming file and line,
not hours later when the prompt stream reaches it.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from pathlib import Path
from functools import lru_cache
from typing import Any

from rlorch.config.schema import Config, ConfigError
from rlorch.jsonlines import parse_record
from rlorch.tasks.base import SingleTurn


class DataError(ValueError):
    """The data file is unreadable or a line is malformed; the message names file and line."""


def load_rows(path: Path, prompt_key: str, answer_key: str) -> list[tuple[str, Any]]:
    if not path.is_file():
        raise DataError(f"{path}: no such data file")
    if not os.access(path, os.R_OK):
        raise DataError(f"{path}: not readable")
    rows = []
    with open(path, "rb") as handle:
        for number, raw in enumerate(handle, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise DataError(f"{path}:{number}: not UTF-8 ({err.reason} at byte {err.start})") from None
            if not line.strip():
                continue
            item = parse_record(line, f"{path}:{number}", (prompt_key, answer_key), DataError)
            if not isinstance(item[prompt_key], str):
                raise DataError(f"{path}:{number}: {prompt_key!r} must be a string")
            rows.append((item[prompt_key], item[answer_key]))
    if not rows:
        raise DataError(f"{path}: no examples")
    return rows


@dataclass(frozen=True)
class JsonlTask(SingleTurn):
    """Each pass over the file is a fresh permutation seeded by ``(seed, epoch)``."""

    rows: tuple[tuple[str, Any], ...]
    name: str = "jsonl"
    max_reward: float = 1.0

    @property
    def prompt_count(self) -> int:
        """Prompts in the data set: one pass over them is how long the empty-batch guard looks
        before it calls a reward flat (rlorch.orchestrator.sinks.failure_window)."""
        return len(self.rows)

    def make_prompt(self, index: int, seed: int) -> tuple[str, Any]:
        epoch, offset = divmod(index, len(self.rows))
        return self.rows[_order(len(self.rows), seed, epoch)[offset]]

    def score(self, completion: str, answer: Any) -> float:
        return float(self.is_correct(completion, answer))

    def is_correct(self, completion: str, answer: Any) -> bool:
        return completion.strip() == str(answer).strip()


@lru_cache(maxsize=8)
def _order(size: int, seed: int, epoch: int) -> tuple[int, ...]:
    order = list(range(size))
    random.Random(f"jsonl:{seed}:{epoch}").shuffle(order)
    return tuple(order)


def jsonl_task(config: Config) -> JsonlTask:
    if not config.data.path:
        raise ConfigError("data.path", "the jsonl task needs data.path")
    path = Path(config.data.path).expanduser()
    return JsonlTask(tuple(load_rows(path, config.data.prompt_key, config.data.answer_key)))
