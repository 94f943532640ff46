"""The chat form of a conversation: messages rendered by the tokenizer's chat template, model
turns kept as the engine's own ids, environment messages appended as the template's suffix."""

from __future__ import annotations

import asyncio

import pytest

from rlorch.model import build_tokenizer
from rlorch.tasks.episode import EngineConversation
from rlorch.tasks.prompts import ChatTemplateError, encode_prompt, encode_text
from rlorch.types import Generation, Prompt, SamplingParams, VersionStamps


class ScriptedEngine:
    """Answers each call with the next scripted ids; keeps what each call was sent."""

    def __init__(self, turns: list[tuple[list[int], str]]):
        self.turns, self.sent = list(turns), []

    async def generate(self, input_ids, params, rid):
        self.sent.append(list(input_ids))
        ids, finish = self.turns.pop(0)
        return Generation(ids, [-0.5] * len(ids), VersionStamps([[len(self.sent), len(ids)]]), finish)


def test_three_turns_keep_the_engine_ids_and_append_only_the_new_messages():
    tokenizer = build_tokenizer()
    ids = lambda text: encode_text(tokenizer, text)  # noqa: E731
    messages = [{"role": "user", "content": "3+4="}]
    prompt_ids = encode_prompt(tokenizer, messages)
    assert tokenizer.decode(prompt_ids) == "<bos>user:3+4=<eos>assistant:"
    # Turn 2 holds a <bos> that decoding drops: re-tokenized text would lose it. It is cut by the
    # length limit, so the template's closer (<eos>) comes with the next message.
    first, second, third = ids("8<eos>"), ids("6<bos>9"), ids("7<eos>")
    engine = ScriptedEngine([(first, "stop"), (second, "length"), (third, "stop")])
    conversation = EngineConversation(Prompt(0, prompt_ids, "t", messages, "7"), engine=engine,
                                      tokenizer=tokenizer, params=SamplingParams(), rid="r")

    async def episode():
        assert await conversation.generate() == "8"
        conversation.add("no")
        assert await conversation.generate() == "69"
        conversation.add("x", role="tool")
        return await conversation.generate()

    assert asyncio.run(episode()) == "7"
    reply, tool = ids("user:no<eos>assistant:"), ids("<eos>tool:x<eos>assistant:")
    assert conversation.tokens.tolist() == prompt_ids + first + reply + second + tool + third
    assert engine.sent == [prompt_ids, prompt_ids + first + reply, prompt_ids + first + reply + second + tool]
    assert conversation.loss_mask.tolist() == ([0] * len(prompt_ids) + [1] * len(first) + [0] * len(reply)
                                      + [1] * len(second) + [0] * len(tool) + [1] * len(third))
    assert conversation.versions.expand() == [1] * len(first) + [2] * len(second) + [3] * len(third)
    assert [m["role"] for m in conversation.messages] == ["user", "assistant", "user", "assistant", "tool",
                                                          "assistant"]


def test_a_tokenizer_without_a_chat_template_refuses_messages_but_not_text():
    tokenizer = build_tokenizer()
    tokenizer.chat_template = None
    assert encode_prompt(tokenizer, "407=")[0] == tokenizer.bos_token_id
    with pytest.raises(ChatTemplateError, match="no chat template"):
        encode_prompt(tokenizer, [{"role": "user", "content": "407="}])
