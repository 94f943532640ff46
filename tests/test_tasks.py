"""The environment registry and its tasks: determinism, rewards, data-file errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlorch.config.compose import compose
from rlorch.config.schema import ConfigError
from rlorch.tasks.base import SingleTurn
from rlorch.tasks.registry import make_environment, names
from rlorch.tasks.digits import digit_credit
from rlorch.tasks.dataset import DataError
from rlorch.types import Environment


def _env(*overrides: str):
    return make_environment(compose(list(overrides)))


def test_registry_lists_the_tasks_and_rejects_unknown_names():
    assert {"reverse", "sort", "reverse_retry", "calculator", "jsonl"} <= set(names())
    assert isinstance(_env(), Environment)
    with pytest.raises(ConfigError, match="task.name"):
        _env("task.name=nope")
    with pytest.raises(ConfigError, match="data.path"):
        _env("task.name=jsonl")


@pytest.mark.parametrize("task", ["reverse", "sort"])
def test_digit_prompts_are_deterministic_and_in_range(task):
    env, again = (_env(f"task={task}", "task.params.min_digits=2", "task.params.max_digits=4") for _ in range(2))
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
    epoch = [(prompt, row.answer) for prompt, row in (env.make_prompt(i, seed=1) for i in range(5))]
    assert sorted(epoch) == sorted((f"{i}+{i}=", str(2 * i)) for i in range(5))  # each row once a pass
    assert epoch == [(prompt, row.answer) for prompt, row in (env.make_prompt(i, seed=1) for i in range(5))]
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


def test_task_params_belong_to_the_task_and_bad_ones_name_the_key():
    with pytest.raises(ConfigError) as caught:
        _env("task=calculator", "+task.params.min_digits=3")
    assert caught.value.key == "task.params.min_digits" and "max_operand" in str(caught.value)
    with pytest.raises(ConfigError) as caught:
        _env("task.params.min_digits=5", "task.params.max_digits=2")
    assert caught.value.key == "task.params.min_digits"
    assert _env("task=reverse_retry", "task.params.max_turns=2").max_turns == 2


def test_calculator_operands_stay_within_min_and_max_operand():
    env = _env("task=calculator", "task.params.min_operand=10", "task.params.max_operand=49")
    operands = [int(part) for i in range(300) for part in env.make_prompt(i, seed=3)[0][:-1].split("+")]
    assert min(operands) == 10 and max(operands) == 49
    with pytest.raises(ConfigError) as caught:
        _env("task=calculator", "task.params.min_operand=50", "task.params.max_operand=49")
    assert caught.value.key == "task.params.max_operand"


def test_held_out_prompts_are_never_training_prompts():
    env = _env()
    held_out = {text for text, _ in env.eval_prompts(200)}
    assert 90 <= len(held_out) <= 110  # one 3-digit string in ten
    assert not held_out & {env.make_prompt(i, seed)[0] for seed in range(3) for i in range(3000)}
    assert env.is_correct("321", "321") and not env.is_correct("320", "321")


def test_a_held_out_split_smaller_than_the_eval_set_is_evaluated_whole_in_draw_order():
    from rlorch.tasks.digits import is_held_out

    env = _env("task.params.min_digits=2", "task.params.max_digits=2")
    split = {f"{value:02d}=" for value in range(100) if is_held_out(f"{value:02d}")}
    prompts = [text for text, _ in env.eval_prompts(50)]
    assert sorted(prompts) == sorted(split)
    assert prompts == [text for text, _ in env.eval_prompts(len(split))]


def test_sim_token_ids_are_one_per_character_for_any_text():
    from rlorch.tasks.episode import encode_text

    for text in ("", "4071=", "no=", "naïve €", "".join(map(chr, range(200)))):
        assert encode_text(None, text) == [1 + (ord(c) % 60) for c in text]


def test_the_calculator_tool_evaluates_sums_and_refuses_the_rest():
    from rlorch.tasks.calculator import calculate

    assert calculate("37+45|") == "82" and calculate("100-1+2") == "101" and calculate("7") == "7"
    for bad in ("", "+3", "3++4", "ab", "3*4", "1234567+1"):
        assert calculate(bad) == "x", bad


class CountingEnvironment:
    """A user's environment, as README shows: two model turns, the second told how long the first was."""

    def __init__(self, words: int = 2):
        self.name, self.words = "counting", words

    def make_prompt(self, index: int, seed: int):
        return f"{index % 10}=", str(index % 10)

    async def episode(self, conversation, answer):
        first = await conversation.generate(max_new_tokens=self.words)
        conversation.add(f"{len(first)}:")
        second = await conversation.generate(max_new_tokens=2)
        return float(second.strip() == answer)


def test_a_users_environment_loads_from_its_module_with_its_own_params():
    env = _env("task=custom", "task.name=tests.test_tasks:CountingEnvironment", "+task.params.words=3")
    assert env.words == 3 and env.name == "counting"
    with pytest.raises(ConfigError, match="task.params"):
        _env("task=custom", "task.name=tests.test_tasks:CountingEnvironment", "+task.params.nope=1")
    with pytest.raises(ConfigError, match="cannot load"):
        _env("task=custom", "task.name=tests.test_tasks:Missing")
    with pytest.raises(ConfigError, match="not an environment"):
        _env("task=custom", "task.name=json:JSONDecoder")
    with pytest.raises(ConfigError, match="task.name"):
        _env("task=custom")


def test_a_data_file_answer_past_64_bits_stays_exact(tmp_path):
    answer = 2**64 + 1  # no float holds it
    path = _write(tmp_path, [json.dumps({"prompt": "2**64+1=", "answer": answer})])
    env = _env(f"data.path={path}")
    prompt, expected = env.make_prompt(0, seed=0)
    assert type(expected.answer) is int and expected.answer == answer
    assert env.score(str(answer), expected) == 1.0


def test_own_lines_read_by_the_fast_parser_keep_the_standard_parsers_errors_and_values():
    from rlorch.jsonlines import parse_record

    line = '{"tokens": [1, 2], "advantage": -0.5, "logprobs": [0.0, NaN]}'
    fast = parse_record(line, "f:1", ("tokens",), ValueError, own=True)
    assert fast["tokens"] == [1, 2] and fast["advantage"] == -0.5 and fast["logprobs"][1] != fast["logprobs"][1]
    for bad, message in (("{not json", "f:1: not valid JSON"), ("[1]", "f:1: expected a JSON object")):
        with pytest.raises(ValueError, match=message):
            parse_record(bad, "f:1", (), ValueError, own=True)


def test_the_fast_codec_says_exactly_what_pythons_json_says():
    """orjson where it is exact; Python's codec for big integers, NaN and strings orjson cannot
    write, which it keeps exact or escapes."""
    from rlorch.jsonlines import dumps, loads

    big, text = 2**64 + 1, '{"ids": [1, 18446744073709551617], "t": NaN}'
    value = loads(text.encode())
    assert value["ids"] == [1, big] and type(value["ids"][1]) is int and value["t"] != value["t"]
    assert loads(b'{"rid": "g1-0.4f1e2d3c1234567890123456789a", "x": 1.5}')["x"] == 1.5
    assert json.loads(dumps({"seed": big, "rid": "a\ud800"})) == {"seed": big, "rid": "a\ud800"}
    with pytest.raises(json.JSONDecodeError):
        loads(b"{not json")


def _readme() -> str:
    return (Path(__file__).resolve().parent.parent / "README.md").read_text()


def test_the_readmes_reverse_example_is_the_default_tasks_own():
    """The README's example prompt and answer are a reversal of the default preset's length."""
    import re

    import yaml

    prompt, answer = re.search(r'`"(\d+)="` → `"(\d+)"`', _readme()).groups()
    params = yaml.safe_load((Path(__file__).resolve().parent.parent / "conf" / "task" / "reverse.yaml").read_text())["params"]
    assert params["min_digits"] <= len(prompt) <= params["max_digits"] and answer == prompt[::-1]


def test_the_readmes_guess_example_can_be_learned():
    """Its prompt determines its answer: the same prompt text never asks for two answers."""
    import re

    code = re.search(r"```python\n# mytasks/guess.py\n(.*?)```", _readme(), re.S).group(1)
    scope: dict = {}
    exec(code, scope)
    env = scope["Guess"]()
    answers: dict = {}
    for seed in range(3):
        for index in range(50):
            text, answer = env.make_prompt(index, seed)
            answers.setdefault(text, set()).add(answer)
    assert all(len(found) == 1 for found in answers.values()), answers


class _OneTurn(SingleTurn):
    """A user's single-turn environment: only ``score``."""

    name = "t"

    def score(self, completion: str, answer: str) -> float:
        return 1.0


class _OwnEpisode(_OneTurn):
    """The same, with an episode of its own (one conversation per sample)."""

    async def episode(self, conversation, answer) -> float:
        return self.score(await conversation.generate(), answer)


@pytest.mark.parametrize("env_type, calls", [(_OneTurn, 1), (_OwnEpisode, 3 * 4)])
def test_a_single_turn_environment_samples_a_pack_of_groups_in_one_engine_call(env_type, calls):
    """The README's promise: an environment with only ``score`` on the ``SingleTurn`` base has
    its groups' samples generated by one engine call; one with its own ``episode`` makes one
    call per sample."""
    import asyncio

    from rlorch.inference.sim import SimEngine
    from rlorch.tasks.episode import make_work
    from rlorch.types import PolicyVersion, Prompt

    config = compose(["inference=sim", "trainer=sim", "rollout.group_size=4"])
    engine = SimEngine(config.inference.sim, policy=PolicyVersion())
    work = make_work(config, engine=engine, tokenizer=None, env=env_type())
    prompts = [Prompt(group_id=i, input_ids=[1, 2], env="t", answer="a") for i in range(3)]
    groups = asyncio.run(work.pack(prompts))
    assert [len(group) for group in groups] == [4, 4, 4]
    assert engine.calls == calls and engine.requests == 12


class _CapsItsTurns(_OneTurn):
    """A multi-turn environment that caps its own turns (the README's guess: one token a turn)."""

    def __init__(self, cap: int):
        self.cap = cap

    async def episode(self, conversation, answer) -> float:
        await conversation.generate(max_new_tokens=self.cap)
        return 0.0


@pytest.mark.parametrize("cap, reason", [(1, "stop"), (None, "length")])
def test_a_turn_the_environment_caps_below_the_runs_limit_is_not_counted_truncated(cap, reason):
    """The truncation warning names rollout.max_new_tokens; a cap the environment chose is not
    that limit, and raising it would change nothing."""
    import asyncio

    from rlorch.inference.sim import SimEngine
    from rlorch.orchestrator.steps import truncated_share
    from rlorch.tasks.episode import make_work
    from rlorch.types import PolicyVersion, Prompt

    config = compose(["inference=sim", "trainer=sim", "rollout.group_size=2", "rollout.max_new_tokens=4",
                      "inference.sim.tokens=8"])
    engine = SimEngine(config.inference.sim, policy=PolicyVersion())
    work = make_work(config, engine=engine, tokenizer=None, env=_CapsItsTurns(cap))
    (group,) = asyncio.run(work.pack([Prompt(group_id=0, input_ids=[1, 2], env="t", answer="a")]))
    assert [r.finish_reason for r in group] == [reason, reason]
    assert truncated_share(group) == (0.0 if cap else 1.0)


def test_a_length_limit_shorter_than_the_tasks_answers_is_refused_naming_it():
    """Every 4-digit answer cut at 3 tokens: a run that could never score, refused before it starts."""
    from rlorch.config.preflight import preflight

    with pytest.raises(ConfigError) as caught:
        preflight(compose(["task.params.min_digits=4", "task.params.max_digits=4"]))
    assert caught.value.key == "rollout.max_new_tokens" and "rollout.max_new_tokens=4" in str(caught.value)
    with pytest.raises(ConfigError) as caught:
        preflight(compose(["task=sort"]))
    assert caught.value.key == "rollout.max_new_tokens" and "5 tokens" in str(caught.value)
    preflight(compose(["task=sort", "rollout.max_new_tokens=5"]))


def test_prefix_credit_counts_digits_only_behind_a_right_opening():
    from rlorch.tasks.digits import prefix_credit

    assert prefix_credit("52", "52") == 1.0
    assert prefix_credit("57", "52") == digit_credit("57", "52")     # the first digit right: the same credit
    # A right second digit behind a wrong first one: digit_credit's place credit, not this one's.
    assert prefix_credit("|2", "52") < prefix_credit("5|", "52")
    assert prefix_credit("|2", "52") < digit_credit("|2", "52")
    assert prefix_credit("72", "52") == prefix_credit("79", "52") < prefix_credit("5", "52")
    assert prefix_credit("", "52") == 0.0 and 0.0 <= prefix_credit("x", "52") <= 1.0
