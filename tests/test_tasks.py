"""The environment registry and its tasks: determinism, rewards, data-file errors."""

from __future__ import annotations

import json

import pytest

from rlorch.compose import compose
from rlorch.config import ConfigError
from rlorch.tasks import make_environment, names
from rlorch.tasks.digits import digit_credit
from rlorch.tasks.jsonl import DataError
from rlorch.types import Environment


def _env(*overrides: str):
    return make_environment(compose(list(overrides)))


def test_registry_lists_the_tasks_and_rejects_unknown_names():
    assert {"reverse", "sort", "jsonl"} <= set(names())
    assert isinstance(_env(), Environment)
    with pytest.raises(ConfigError, match="task.name"):
        _env("task.name=nope")
    with pytest.raises(ConfigError, match="data.path"):
        _env("task.name=jsonl")


@pytest.mark.parametrize("task", ["reverse", "sort"])
def test_digit_prompts_are_deterministic_and_in_range(task):
    env, again = (_env(f"task.name={task}", "task.min_digits=2", "task.max_digits=4") for _ in range(2))
    prompts = [env.make_prompt(i, seed=7) for i in range(50)]
    assert prompts == [again.make_prompt(i, seed=7) for i in range(50)]
    assert prompts != [env.make_prompt(i, seed=8) for i in range(50)]
    for text, answer in prompts:
        digits = text[:-1]
        assert text.endswith("=") and digits.isdigit() and " " not in text
        assert 2 <= len(digits) <= 4
        assert answer == (digits[::-1] if task == "reverse" else "".join(sorted(digits)))
    assert len({text for text, _ in prompts}) > 40


def test_reverse_reward_gives_partial_credit():
    env = _env()
    assert env.score("321", "321") == 1.0
    assert env.score(" 321\n", "321") == 1.0
    assert env.score("321<eos>junk", "321") == 1.0
    assert env.score("", "321") == 0.0
    assert env.score("abc", "321") == 0.0
    scores = [env.score(c, "321") for c in ("3", "320", "32", "329", "000", "3210")]
    assert all(0.0 < s < 1.0 for s in scores[:4])
    assert env.score("320", "321") > env.score("300", "321") > env.score("000", "321") > env.score("00", "321")
    assert env.score("321x", "321") < 1.0
    for completion in ("9", "12345", "a1", "3x1", "321321"):
        assert 0.0 <= digit_credit(completion, "321") <= 1.0


def _write(tmp_path, lines: list[str]):
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_jsonl_task_is_exact_match_and_deterministic(tmp_path):
    rows = [json.dumps({"q": f"{i}+{i}=", "a": str(2 * i)}) for i in range(5)]
    path = _write(tmp_path, rows)
    env = _env(f"data.path={path}", "data.prompt_key=q", "data.answer_key=a")
    assert env.name == "jsonl"
    epoch = [env.make_prompt(i, seed=1) for i in range(5)]
    assert sorted(epoch) == sorted((f"{i}+{i}=", str(2 * i)) for i in range(5))  # each row once a pass
    assert epoch == [env.make_prompt(i, seed=1) for i in range(5)]
    assert env.score(" 4 ", "4") == 1.0 and env.score("5", "4") == 0.0 and env.score("4", 4) == 1.0


@pytest.mark.parametrize("bad, message", [
    ("{not json", "not valid JSON"),
    ('{"prompt": "x"}', "missing key(s) 'answer'"),
    ('[1, 2]', "expected a JSON object"),
    ('{"prompt": 3, "answer": "y"}', "'prompt' must be a string"),
])
def test_jsonl_errors_name_file_and_line(tmp_path, bad, message):
    path = _write(tmp_path, [json.dumps({"prompt": "a", "answer": "b"}), "", bad])
    with pytest.raises(DataError) as caught:
        _env(f"data.path={path}")
    assert f"{path}:3: " in str(caught.value) and message in str(caught.value)


def test_jsonl_missing_or_empty_file(tmp_path):
    with pytest.raises(DataError, match="no such data file"):
        _env(f"data.path={tmp_path / 'absent.jsonl'}")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(DataError, match="no examples"):
        _env(f"data.path={empty}")
