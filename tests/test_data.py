"""Tasks from data sets: file formats, chat-message prompts, the held-out split, order and
resume, bad rows, reward functions (TRL's signature) and the built-in math reward."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from rlorch.config.compose import compose
from rlorch.config.schema import ConfigError
from rlorch.tasks.dataset import DataError
from rlorch.tasks.episode import PromptSource
from rlorch.tasks.registry import make_environment

ROWS = [{"prompt": f"{i}+{i}=", "answer": str(2 * i), "level": i % 3} for i in range(20)]


def _env(*overrides: str):
    return make_environment(compose(list(overrides)))


def _jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _answers(env, count: int, seed: int = 0) -> list[str]:
    return [row.answer for _, row in (env.make_prompt(i, seed) for i in range(count))]


@pytest.mark.slow
def test_every_format_reads_the_same_rows(tmp_path):
    import datasets

    table = datasets.Dataset.from_list(ROWS)
    paths = [_jsonl(tmp_path / "d.jsonl", ROWS), tmp_path / "d.json", tmp_path / "d.csv", tmp_path / "d.parquet",
             tmp_path / "saved"]
    (tmp_path / "d.json").write_text(json.dumps(ROWS))
    table.to_csv(str(tmp_path / "d.csv"), index=False)
    table.to_parquet(str(tmp_path / "d.parquet"))
    table.save_to_disk(str(tmp_path / "saved"))
    for path in paths:
        env = _env(f"data.path={path}", "data.shuffle=false")
        got = [(prompt, str(row.answer), row.columns["level"]) for prompt, row in
               (env.make_prompt(i, 0) for i in range(20))]
        assert got == [(r["prompt"], r["answer"], r["level"]) for r in ROWS], path


@pytest.mark.parametrize("name, content, where, message", [
    ("bad.csv", "prompt,answer\n1+1=,2\n,3\n", "row 2", "'prompt' must be a string"),
    ("bad.csv", "prompt,level\n1+1=,2\n", "row 1", "missing key(s) 'answer'"),
    ("bad.jsonl", '{"messages": [{"role": "user", "content": "hi"}], "answer": "a"}\n{"messages": "hi", "answer": "b"}\n',
     ":2", "'messages' must be a non-empty list"),
])
def test_a_bad_row_is_refused_before_the_run_naming_file_and_row(tmp_path, name, content, where, message):
    path = tmp_path / name
    path.write_text(content)
    keys = ["data.messages_key=messages"] if "messages" in content else []
    with pytest.raises(DataError) as caught:
        _env(f"data.path={path}", *keys)
    assert f"{path}{' ' if where.startswith('row') else ''}{where}: " in str(caught.value), caught.value
    assert message in str(caught.value)
    with pytest.raises(ConfigError) as refused:
        from rlorch.config.preflight import preflight

        preflight(compose([f"data.path={path}", *keys]))
    assert refused.value.key == "data.path"


def test_the_held_out_split_is_fixed_and_never_trained_on(tmp_path):
    path = _jsonl(tmp_path / "d.jsonl", ROWS)
    env = _env(f"data.path={path}", "data.eval_fraction=0.25")
    held = {prompt for prompt, _ in env.eval_prompts(100)}
    assert len(held) == 5
    for seed in (0, 1, 2):
        again = _env(f"data.path={path}", "data.eval_fraction=0.25", f"run.seed={seed}")
        assert {prompt for prompt, _ in again.eval_prompts(100)} == held
        trained = {env.make_prompt(i, seed)[0] for i in range(200)}
        assert trained == {r["prompt"] for r in ROWS} - held
    source = PromptSource(env, tokenizer=None, seed=0)
    assert {p.text for p in source.eval_set(100)} == held and all(p.is_eval for p in source.eval_set(100))

    other = _jsonl(tmp_path / "eval.jsonl", [{"prompt": "9+9=", "answer": "18"}])
    env = _env(f"data.path={path}", f"data.eval_path={other}")
    assert [p for p, _ in env.eval_prompts(10)] == ["9+9="] and env.prompt_count == 20
    with pytest.raises(ConfigError, match="not both"):
        compose([f"data.path={path}", f"data.eval_path={other}", "data.eval_fraction=0.1"])


def test_order_is_a_fresh_permutation_each_pass_and_a_resume_continues_it(tmp_path):
    path = _jsonl(tmp_path / "d.jsonl", ROWS)
    env = _env(f"data.path={path}")
    stream = _answers(env, 60, seed=3)
    passes = [stream[i:i + 20] for i in (0, 20, 40)]
    assert all(sorted(p) == sorted(r["answer"] for r in ROWS) for p in passes)
    assert passes[0] != passes[1] and stream != _answers(env, 60, seed=4)
    assert _answers(_env(f"data.path={path}", "data.shuffle=false"), 40) == [r["answer"] for r in ROWS] * 2
    # A resume sets the source's position from the checkpoint and continues from there.
    full = PromptSource(env, tokenizer=None, seed=3)
    first = [next(full).answer.answer for _ in range(60)]
    resumed = PromptSource(env, tokenizer=None, seed=3, position=37)
    assert [next(resumed).answer.answer for _ in range(23)] == first[37:] == stream[37:]


def test_chat_messages_are_rendered_with_the_chat_template(tmp_path, model_dir):
    from transformers import AutoTokenizer

    rows = [{"messages": [{"role": "user", "content": "3+4="}], "answer": "7"}]
    path = _jsonl(tmp_path / "chat.jsonl", rows)
    env = _env(f"data.path={path}", "data.messages_key=messages")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompt = PromptSource(env, tokenizer=tokenizer, seed=0).make(0)
    assert prompt.text == rows[0]["messages"]
    assert tokenizer.decode(prompt.input_ids) == "<bos>user:3+4=<eos>assistant:"


def test_data_keys_are_checked_and_epochs_end_the_run(tmp_path):
    from types import SimpleNamespace

    from rlorch.config.schema import warnings_for
    from rlorch.runner import _cap_steps_at_epochs

    for key, value in (("data.eval_fraction", "1.0"), ("data.epochs", "0")):
        with pytest.raises(ConfigError) as caught:
            compose([f"{key}={value}"])
        assert caught.value.key == key
    path = _jsonl(tmp_path / "d.jsonl", ROWS)
    assert any("evaluation draws training rows" in w for w in warnings_for(compose([f"data.path={path}"])))
    assert not any("training rows" in w for w in warnings_for(compose([f"data.path={path}", "data.eval_fraction=0.1"])))
    config = compose([f"data.path={path}", "data.epochs=3", "rollout.batch_size=32", "rollout.group_size=8"])
    _cap_steps_at_epochs(config, SimpleNamespace(prompt_count=20))  # 4 prompts a batch: 60 / 4
    assert config.train.steps == 15
    config = compose([f"data.path={path}", "train.steps=5"])
    _cap_steps_at_epochs(config, SimpleNamespace(prompt_count=20))
    assert config.train.steps == 5


# reward functions ---------------------------------------------------------------------------------
REWARDS = '''
import asyncio

def length(prompts, completions, answer, level, **rest):
    return [float(len(c) == len(a)) for c, a in zip(completions, answer)]

async def levelled(prompts, completions, level, **rest):
    await asyncio.sleep(0)
    return [float(l) for l in level]

def boom(prompts, completions, **rest):
    raise ZeroDivisionError("no reward today")

def one(prompts, completions, **rest):
    return [1.0]
'''

GUESS = '''
class Guess:
    name = "guess"

    def make_prompt(self, index, seed):
        return f"{index % 10}=", str(index % 10)

    async def episode(self, conversation, answer):
        return float((await conversation.generate()).strip() == answer)
'''


@pytest.fixture()
def user_dir(tmp_path, monkeypatch):
    """A project directory with the user's own modules; rlorch runs in it."""
    (tmp_path / "myrewards.py").write_text(REWARDS)
    (tmp_path / "mytasks").mkdir()
    (tmp_path / "mytasks" / "__init__.py").write_text("")
    (tmp_path / "mytasks" / "guess.py").write_text(GUESS)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    yield tmp_path
    for name in ("myrewards", "mytasks", "mytasks.guess"):
        sys.modules.pop(name, None)


def test_modules_in_the_working_directory_are_importable(user_dir):
    env = _env("task=custom", "task.name=mytasks.guess:Guess")
    assert env.name == "guess" and env.make_prompt(13, 0) == ("3=", "3")
    path = _jsonl(user_dir / "d.jsonl", ROWS)
    env = _env(f"data.path={path}", "task.reward=myrewards:length")
    assert env.functions[0].name == "myrewards:length"


def _score(env, completions: list[str], count: int = 2):
    import asyncio

    source = PromptSource(env, tokenizer=None, seed=0)
    prompts = [source.make(i) for i in range(count)]
    return prompts, asyncio.run(env.score_groups(prompts, [completions] * count))


def test_reward_functions_take_trl_arguments_sync_or_async_with_weights(user_dir):
    path = _jsonl(user_dir / "d.jsonl", ROWS)
    env = _env(f"data.path={path}", "data.shuffle=false", "task.reward=[myrewards:length,myrewards:levelled]",
               "task.reward_weights=[1.0,0.5]")
    prompts, scores = _score(env, ["0", "12"], count=3)
    levels = [p.answer.columns["level"] for p in prompts]
    lengths = [[float(len(c) == len(p.answer.answer)) for c in ("0", "12")] for p in prompts]
    assert scores == [[length + 0.5 * level for length in row] for row, level in zip(lengths, levels)]
    assert env.max_reward == 1.5
    with pytest.raises(ConfigError) as caught:
        compose([f"data.path={path}", "task.reward=[myrewards:length]", "task.reward_weights=[1,2]"])
    assert caught.value.key == "task.reward_weights"
    with pytest.raises(ConfigError, match="data.path"):
        _env("task.reward=myrewards:length")


def test_a_reward_that_answers_the_wrong_count_names_every_row_of_its_call(user_dir):
    path = _jsonl(user_dir / "d.jsonl", ROWS)
    with pytest.raises(ValueError) as caught:
        _score(_env(f"data.path={path}", "data.shuffle=false", "task.reward=myrewards:one"), ["1", "2"], count=3)
    said = str(caught.value)
    assert "myrewards:one answered 1 value(s) for 6 completions (of rows " in said and said.endswith("one each")
    assert said.count(f"{path}:") == 3, said


def test_a_reward_that_raises_fails_the_run_naming_function_and_row(user_dir):
    import json as _json

    from rlorch.runner import run_training

    path = _jsonl(user_dir / "d.jsonl", ROWS)
    with pytest.raises(ValueError, match=r"myrewards:boom raised on .*d\.jsonl:\d+.*no reward today"):
        _score(_env(f"data.path={path}", "task.reward=myrewards:boom"), ["1"], count=1)
    run = user_dir / "run"
    config = compose(["conf=sim", f"run.dir={run}", f"data.path={path}", "task.reward=myrewards:boom",
                      "inference.sim.reward=task", "train.steps=2", "eval.enabled=false", "run.report=false"])
    assert run_training(config, []) != 0
    summary = _json.loads((run / "summary.json").read_text())
    assert summary["status"] == "failed" and "myrewards:boom raised on" in summary["error"]
    assert f"{path}:" in summary["error"]


def test_the_math_reward_reads_gsm8k_answers_and_needs_math_verify(tmp_path, monkeypatch):
    from rlorch.tasks.rewards import load_rewards, math_reward

    got = math_reward(["q"] * 4, ["72", "so \\boxed{72}", "71", [{"role": "assistant", "content": "72"}]],
                      answer=["Natalia sold... #### 72"] * 4)
    assert got == [1.0, 1.0, 0.0, 1.0]
    monkeypatch.setitem(sys.modules, "math_verify", None)
    with pytest.raises(ConfigError) as caught:
        load_rewards(["math"], None)
    assert caught.value.key == "task.reward" and "pip install 'rlorch[data]'" in str(caught.value)


def test_the_math_reward_compares_plain_numbers_by_value_and_the_rest_with_math_verify(monkeypatch):
    from rlorch.tasks.rewards import math_reward

    plain = math_reward(["q"] * 5, ["7", " 7 ", "7.0", "-3", "8"], answer=["7", "7", "7", "x #### -3", "7"])
    assert plain == [1.0, 1.0, 1.0, 1.0, 0.0]
    calls = []
    import math_verify
    monkeypatch.setattr(math_verify, "parse", lambda text, *a, **k: calls.append(text) or [text])
    monkeypatch.setattr(math_verify, "verify", lambda gold, got, *a, **k: gold == got)
    assert math_reward(["q"] * 2, ["12", "12"], answer=["12", "13"]) == [1.0, 0.0] and calls == []
    assert math_reward(["q"] * 2, ["\\boxed{12}", "3/4"], answer=["12", "0.75"]) == [0.0, 0.0]
    assert calls == ["12", "\\boxed{12}", "0.75", "3/4"]


# the GSM8K recipe ------------------------------------------------------------------------------
def test_the_gsm8k_recipe_validates_and_plans_one_8_gpu_node(tmp_path, model_dir):
    from typer.testing import CliRunner

    from rlorch.cli import app

    row = {"messages": [{"role": "user", "content": "Tom has 3 apples and buys 4. How many?"}],
           "answer": "3 + 4 = 7\n#### 7"}
    data = _jsonl(tmp_path / "gsm8k.jsonl", [row] * 60)
    recipe = ["conf=recipes/gsm8k_qwen05b", f"model.path={model_dir}", f"data.path={data}"]
    runner = CliRunner()
    checked = runner.invoke(app, ["validate-config", *recipe, "--show"], env={"COLUMNS": "200"})
    assert checked.exit_code == 0, checked.output
    assert "backend: sglang" in checked.output and "dtype: bfloat16" in checked.output
    config = compose(recipe)
    assert config.task.reward == ["math"] and config.data.messages_key == "messages"
    env = make_environment(config)
    assert len(env.held_out) == 1 and env.max_reward == 1.0
    planned = runner.invoke(app, ["train", *recipe, f"run.dir={tmp_path / 'never'}", "--dry-run"])
    assert planned.exit_code == 0, planned.output
    records = [json.loads(line) for line in planned.output.splitlines() if line.startswith("{")]
    assert [r["role"] for r in records] == ["orchestrator", *(f"server-{i}" for i in range(4)), "trainer"]
    assert not (tmp_path / "never").exists()
    unset = runner.invoke(app, ["validate-config", "conf=recipes/gsm8k_qwen05b", f"data.path={data}"])
    assert unset.exit_code == 2 and "model.path" in unset.output
    for missing, key in ((["model.path=/nowhere/qwen05b", f"data.path={data}"], "model.path"),
                         ([f"model.path={model_dir}", f"data.path={tmp_path / 'absent.jsonl'}"], "data.path")):
        refused = runner.invoke(app, ["train", "conf=recipes/gsm8k_qwen05b", *missing, "--dry-run"])
        assert refused.exit_code == 2 and f"invalid config {key}:" in " ".join(refused.output.split()), refused.output


@pytest.mark.slow
def test_a_chat_task_from_data_with_the_math_reward_trains_on_the_tiny_model(tmp_path):
    """The recipe's code paths on CPU: messages, the chat template, a data file, the math reward,
    `rlorch serve` engines and the FSDP2 trainer, for a few steps."""
    import os
    import subprocess

    rows = [{"messages": [{"role": "user", "content": f"{a}+{b}="}], "answer": str(a + b)}
            for a in range(10) for b in range(10)]
    data = _jsonl(tmp_path / "sums.jsonl", rows)
    run_dir = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "rlorch.cli", "train", f"run.dir={run_dir}", f"data.path={data}",
                           "data.messages_key=messages", "task.reward=math", "data.eval_fraction=0.2",
                           "train.steps=3", "rollout.batch_size=16", "rollout.group_size=4", "rollout.max_concurrent=32",
                           "inference.num_servers=1", "run.progress=false", "run.report=false"],
                          capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert done.returncode == 0, done.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 3 and summary["lost"] == 0
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["prompts"] for r in lines if r["kind"] == "eval"][0] == 20
    from helpers import trained
    from rlorch.model import build_tokenizer

    tokenizer = build_tokenizer()
    for rollout in trained(run_dir, 1):
        text = tokenizer.decode(rollout["tokens"])
        assert text.startswith("<bos>user:") and "<eos>assistant:" in text
        first = rollout["loss_mask"].index(1)  # the model's turn starts after the generation prompt
        assert tokenizer.decode(rollout["tokens"][:first]).endswith("<eos>assistant:")
