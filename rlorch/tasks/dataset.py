"""A task from a data set (``data.path``): one row per prompt, scored by exact match or by reward
functions (``task.reward``, see :mod:`rlorch.tasks.rewards`).

Files: JSONL (read line by line, no extra package), JSON, CSV, Parquet or a ``datasets``
directory (``save_to_disk``), the last four through the ``datasets`` library. Every row is read and
checked when the task is built, before anything starts: a bad row fails naming file and row
(``FILE:LINE`` for JSONL), not hours later when the prompt stream reaches it.

Evaluation rows come from ``data.eval_path``, or a fixed share of ``data.path`` (``data.eval_fraction``:
the same rows for every seed), and are never trained on. Training row ``index`` is a pure function
of ``(index, seed)``: pass ``index // rows`` in a permutation seeded by ``(seed, pass)`` (file order
with ``data.shuffle=false``), so a resumed run, which restarts the stream at its saved position,
continues the same order.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Optional, Sequence

from rlorch.config.schema import Config, ConfigError
from rlorch.jsonlines import parse_record
from rlorch.tasks.base import SingleTurn
from rlorch.tasks.prompts import is_messages
from rlorch.tasks.rewards import INSTALL_DATA, RewardFunction, load_rewards, weighted_rewards

EVAL_SPLIT_SEED = "rlorch-eval-split"
"""The held-out share is the same rows for every run seed."""


class DataError(ValueError):
    """The data file is unreadable or a row is malformed; the message names file and row."""


@dataclass(frozen=True)
class Row:
    """One data row: the prompt (text or messages), the answer, every other column, and where
    it came from (``FILE:LINE`` or ``FILE row N``)."""

    prompt: Any
    answer: Any
    columns: dict = field(hash=False, compare=False)
    where: str = ""

    def __str__(self) -> str:
        return str(self.answer)


@dataclass(frozen=True)
class Keys:
    prompt: str = "prompt"
    messages: Optional[str] = None
    answer: str = "answer"

    @property
    def source(self) -> str:
        return self.messages or self.prompt


def read_records(path: Path) -> list[tuple[str, Any]]:
    """``(where, record)`` for every row of ``path``."""
    if not path.exists():
        raise DataError(f"{path}: no such data file")
    if not os.access(path, os.R_OK):
        raise DataError(f"{path}: not readable")
    if path.is_file() and path.suffix == ".jsonl":
        return _jsonl_records(path)
    return _datasets_records(path)


def _jsonl_records(path: Path) -> list[tuple[str, Any]]:
    records = []
    with open(path, "rb") as handle:
        for number, raw in enumerate(handle, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise DataError(f"{path}:{number}: not UTF-8 ({err.reason} at byte {err.start})") from None
            if line.strip():
                records.append((f"{path}:{number}", parse_record(line, f"{path}:{number}", (), DataError)))
    return records


def _datasets_records(path: Path) -> list[tuple[str, Any]]:
    try:
        import datasets
    except ImportError as err:
        raise ConfigError("data.path", f"{path}: reading this format needs the datasets package: "
                                       f"{INSTALL_DATA} (or give a .jsonl file)") from err
    datasets.disable_progress_bars()
    try:
        if path.is_dir():
            loaded = datasets.load_from_disk(str(path))
            if isinstance(loaded, datasets.DatasetDict):
                split = "train" if "train" in loaded else next(iter(loaded))
                loaded = loaded[split]
        else:
            builder = {".json": "json", ".csv": "csv", ".parquet": "parquet"}.get(path.suffix)
            if builder is None:
                raise DataError(f"{path}: unknown format (expected .jsonl, .json, .csv, .parquet or a "
                                "directory saved by datasets)")
            loaded = datasets.load_dataset(builder, data_files=str(path), split="train")
    except DataError:
        raise
    except Exception as err:
        raise DataError(f"{path}: cannot read it: {err}") from err
    return [(f"{path} row {number}", record) for number, record in enumerate(loaded, start=1)]


def load_rows(path: Path, keys: Keys) -> list[Row]:
    """Every row of ``path``, checked: the prompt column holds text (or chat messages), the
    answer column is present."""
    rows = []
    for where, record in read_records(path):
        if not isinstance(record, dict):
            raise DataError(f"{where}: expected a JSON object")
        missing = [key for key in (keys.source, keys.answer) if key not in record]
        if missing:
            raise DataError(f"{where}: missing key(s) {', '.join(map(repr, missing))}")
        prompt = record[keys.source]
        if keys.messages and not is_messages(prompt):
            raise DataError(f"{where}: {keys.messages!r} must be a non-empty list of "
                            "{role, content} messages with string values")
        if not keys.messages and not isinstance(prompt, str):
            raise DataError(f"{where}: {keys.prompt!r} must be a string")
        columns = {k: v for k, v in record.items() if k != keys.source}
        if keys.messages:
            prompt = [{"role": m["role"], "content": m["content"]} for m in prompt]
        rows.append(Row(prompt, record[keys.answer], columns, where))
    if not rows:
        raise DataError(f"{path}: no examples")
    return rows


def split_off(rows: list[Row], fraction: float) -> tuple[list[Row], list[Row]]:
    """(training rows, held-out rows): ``fraction`` of the rows, the same ones for every seed."""
    if not fraction:
        return rows, []
    order = list(range(len(rows)))
    random.Random(EVAL_SPLIT_SEED).shuffle(order)
    held = set(order[:max(1, round(fraction * len(rows)))])
    if len(held) >= len(rows):
        raise ConfigError("data.eval_fraction", f"holds out all {len(rows)} rows: nothing is left to train on")
    return [r for i, r in enumerate(rows) if i not in held], [r for i, r in enumerate(rows) if i in held]


@dataclass(frozen=True)
class DataTask(SingleTurn):
    """One model turn per row; exact match of the completion with the answer."""

    rows: tuple[Row, ...]
    held_out: tuple[Row, ...] = ()
    shuffle: bool = True
    name: str = "jsonl"
    max_reward: float = 1.0

    @property
    def prompt_count(self) -> int:
        """Training rows: one pass over them is how long the empty-batch guard looks before it
        calls a reward flat (rlorch.orchestrator.sinks.failure_window)."""
        return len(self.rows)

    def make_prompt(self, index: int, seed: int) -> tuple[Any, Row]:
        epoch, offset = divmod(index, len(self.rows))
        row = self.rows[_order(len(self.rows), seed, epoch)[offset] if self.shuffle else offset]
        return row.prompt, row

    def eval_prompts(self, count: int) -> Optional[list[tuple[Any, Row]]]:
        """The held-out rows (up to ``count``); without any, training rows (file order)."""
        rows = self.held_out or self.rows
        return [(row.prompt, row) for row in rows[:count]]

    def score(self, completion: str, answer: Any) -> float:
        return float(self.is_correct(completion, answer))

    def is_correct(self, completion: str, answer: Any) -> bool:
        return completion.strip() == str(answer).strip()


@dataclass(frozen=True)
class RewardTask(DataTask):
    """A data task scored by reward functions: a group's samples are scored by one call of each
    function (TRL's batch form). Eval accuracy: the reward at its maximum (the weights' sum)."""

    functions: tuple[RewardFunction, ...] = ()
    is_correct = None  # type: ignore[assignment]  # correct: the reward at max_reward (rlorch.types.is_correct)

    def score(self, completion: str, answer: Any) -> float:
        raise TypeError("a task scored by reward functions is scored a group at a time (score_groups)")

    async def score_groups(self, prompts: Sequence[Any], completions: Sequence[Sequence[str]]) -> list[list[float]]:
        """Rewards of each prompt's samples (``prompts[i].answer`` is its :class:`Row`)."""
        flat_prompts, flat_completions, rows, columns = [], [], [], {}
        for prompt, samples in zip(prompts, completions):
            row: Row = prompt.answer
            for completion in samples:
                flat_prompts.append(row.prompt)
                chat = not isinstance(row.prompt, str)
                flat_completions.append([{"role": "assistant", "content": completion}] if chat else completion)
                rows.append(row.where)
                for key, value in row.columns.items():
                    columns.setdefault(key, []).append(value)
        flat = await weighted_rewards(self.functions, flat_prompts, flat_completions, columns, rows)
        out, start = [], 0
        for samples in completions:
            out.append(flat[start:start + len(samples)])
            start += len(samples)
        return out


@lru_cache(maxsize=8)
def _order(size: int, seed: int, epoch: int) -> tuple[int, ...]:
    order = list(range(size))
    random.Random(f"jsonl:{seed}:{epoch}").shuffle(order)
    return tuple(order)


def data_task(config: Config) -> DataTask:
    data = config.data
    if not data.path:
        raise ConfigError("data.path", "the data task needs data.path")
    keys = Keys(data.prompt_key, data.messages_key, data.answer_key)
    rows = load_rows(Path(data.path).expanduser(), keys)
    if data.eval_path:
        try:
            held_out = load_rows(Path(data.eval_path).expanduser(), keys)
        except DataError as err:
            raise ConfigError("data.eval_path", str(err)) from err
    else:
        rows, held_out = split_off(rows, data.eval_fraction)
    common = dict(rows=tuple(rows), held_out=tuple(held_out), shuffle=data.shuffle)
    if config.task.reward:
        functions = load_rewards(config.task.reward, config.task.reward_weights)
        best = sum(f.weight for f in functions if f.weight > 0) or 1.0
        return RewardTask(**common, functions=tuple(functions), max_reward=best)
    return DataTask(**common)
