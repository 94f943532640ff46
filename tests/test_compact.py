"""Token ids, behaviour logprobs and loss masks stay compact arrays from the HTTP answer to the
batch file (no Python object per token), and the batch file says exactly what they hold."""

from __future__ import annotations

import asyncio
from array import array

import numpy
import orjson
import pytest

from rlorch.rundir.batchfile import SUFFIXES
from rlorch.config.compose import compose
from rlorch.inference.answers import COMPACT_ANSWER_BYTES, SMALL_BODY, Segment, parse_generate
from rlorch.inference.client import SGLangEngine, empty_generation
from rlorch.tasks.episode import make_work
from rlorch.tasks.registry import make_environment
from rlorch.trainer.batch import NO_VERSION, read_batch
from rlorch.types import Batch, Prompt, Rollout


class AnsweredEngine:
    """Answers every sample of a batch with the generation one HTTP answer made."""

    name = "answered"

    def __init__(self, generation):
        self.generation = generation

    async def generate_batch(self, requests):
        return [[self.generation] * request.n for request in requests]


@pytest.mark.parametrize("fmt", ["safetensors", "jsonl"])
def test_an_http_answer_stays_arrays_into_rollouts_and_its_batch_file_round_trips(tmp_path, fmt):
    entries = [[-0.5, 5, None], [-0.12345679104328156, 151935, None], [-3.0517578125e-05, 7, None]] * 300
    body = orjson.dumps([{"text": "7", "output_ids": [e[1] for e in entries],
                          "meta_info": {"id": "a", "finish_reason": {"type": "stop"}, "completion_tokens": 3,
                                        "output_token_logprobs": entries, "weight_version": "3"}}])
    answer = parse_generate(body)[0]
    assert isinstance(answer["meta_info"]["output_token_logprobs"], Segment) and answer["output_ids"] is None
    generation = empty_generation()
    asyncio.run(SGLangEngine("127.0.0.1:9")._append(generation, answer))
    assert generation.output_ids == array("i", [e[1] for e in entries]) and generation.versions.runs == [[3, 900]]
    assert generation.logprobs == array("f", [e[0] for e in entries])

    config = compose(["rollout.group_size=2"])
    env = make_environment(config)
    text, expected = env.make_prompt(0, 0)
    work = make_work(config, engine=AnsweredEngine(generation), tokenizer=None, env=env)
    rollouts = asyncio.run(work.pack([Prompt(0, [1, 2], env.name, text, expected)]))[0]
    for rollout in rollouts:
        assert (rollout.tokens.typecode, rollout.loss_mask.typecode, rollout.logprobs.typecode) == ("i", "b", "f")
        assert rollout.tokens.tolist() == [1, 2] + [5, 151935, 7] * 300
        assert rollout.loss_mask.tolist() == [0, 0] + [1] * 900
        assert Rollout.from_json(orjson.loads(orjson.dumps(rollout.to_json()))) == rollout

    path = tmp_path / f"batch{SUFFIXES[fmt]}"
    path.write_bytes(b"".join(Batch(1, rollouts, [0.5, -0.5]).file(fmt)))
    for rollout, sequence in zip(rollouts, read_batch(path, vocab_size=151936)):
        assert sequence.tokens == rollout.tokens.tolist() and sequence.loss_mask == rollout.loss_mask.tolist()
        assert numpy.array_equal(numpy.float32(sequence.logprobs), numpy.frombuffer(rollout.logprobs, "f"))
        assert sequence.versions == [NO_VERSION, NO_VERSION] + [3] * 900


def test_a_body_of_many_short_answers_is_parsed_in_full_and_one_of_long_answers_is_cut():
    def body(answers: int, tokens: int) -> bytes:
        entries = [[-0.5, 5, None]] * tokens
        return orjson.dumps([{"text": "x", "output_ids": [5] * tokens,
                              "meta_info": {"id": str(index), "output_token_logprobs": entries}}
                             for index in range(answers)])

    short = body(512, 3)  # past SMALL_BODY, some 100 bytes an answer
    assert len(short) > SMALL_BODY
    parsed = parse_generate(short)
    assert all(answer["meta_info"]["output_token_logprobs"] == [[-0.5, 5, None]] * 3 for answer in parsed)
    long = body(8, 300)
    assert len(long) > COMPACT_ANSWER_BYTES * 8
    assert all(isinstance(answer["meta_info"]["output_token_logprobs"], Segment) for answer in parse_generate(long))


def test_an_answer_the_fast_path_cannot_read_exactly_is_parsed_in_full():
    pad = ' "padding": "' + "x" * 20000 + '"}'  # past SMALL_BODY: the fast path is tried

    def entries(raw: str):
        return parse_generate(('{"meta_info":{"output_token_logprobs":' + raw + "}," + pad).encode())[
            "meta_info"]["output_token_logprobs"]

    assert entries("[[-0.5, 5, null], [-1, 6, null]]") == Segment(array("i", [5, 6]), array("f", [-0.5, -1]))
    assert isinstance(entries("[" + ",".join(["[-0.5,5,null]"] * 300) + "]"), Segment)
    spaced = "[" + ", ".join(["[-0.5, 5, null]"] * 300) + "]"
    assert entries(spaced) == [[-0.5, 5, None]] * 300
    assert entries('[[-0.5,5,"]]"]]') == [[-0.5, 5, "]]"]]
    assert entries("[[null,5,null]]") == [[None, 5, None]]
    quoted = orjson.dumps({"text": '"output_token_logprobs":[[1,2,null]]' + "x" * 20000,
                           "meta_info": {"output_token_logprobs": [[-0.5, 5, None]]}})
    assert parse_generate(quoted)["text"].startswith('"output_token_logprobs":[[1,2,null]]')
