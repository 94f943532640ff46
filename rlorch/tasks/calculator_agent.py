"""The calculator task as an agent written against the ``openai`` client (``task=agent``).

Nothing here knows about rlorch: the agent asks the model with one tool offered, runs the tool
when the model calls it, sends the result back and reads the answer, as any OpenAI-client agent
does. Trained on the tiny default model, the model learns to call ``calculate`` with the
expression (its tool-call format is ``expression|``: ``task.tool_call_parser=pipe``) and to
answer with the result.
"""

from __future__ import annotations

import json

from openai import AsyncOpenAI

CALCULATE = {
    "type": "function",
    "function": {
        "name": "calculate",
        "description": "Evaluate an expression of integers, + and -.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                       "required": ["expression"]},
    },
}
CALL_TOKENS, ANSWER_TOKENS = 8, 4


def calculate(expression: str) -> str:
    """The tool: ``37+45`` -> ``82``; ``x`` for anything that is not such an expression."""
    from rlorch.tasks.calculator import calculate as evaluate

    return evaluate(expression)


async def solve(sample: dict, *, base_url: str, api_key: str, http_client=None) -> float:
    """One episode: ``sample["prompt"]`` is ``37+45=``, ``sample["answer"]`` ``82``. Reward 1 for
    the right answer. Short of it, credit for each part of the skill: 0.1 for a call the tool can
    evaluate, up to 0.3 for the prompt's expression in it (the share of characters in place), up
    to 0.2 for an answer repeating what the tool returned. All of them in full is the solution,
    which scores 1: no partial skill is worth more than learning the rest. ``http_client``: the
    one rlorch hands over (cheap to build; a client of one's own works too, slower)."""
    expression = sample["prompt"].removesuffix("=")
    async with AsyncOpenAI(base_url=base_url, api_key=api_key, http_client=http_client) as client:
        messages = [{"role": "user", "content": sample["prompt"]}]
        reply = await client.chat.completions.create(model="policy", messages=messages, tools=[CALCULATE],
                                                     max_tokens=CALL_TOKENS)
        message = reply.choices[0].message
        called, result = "", None
        if message.tool_calls:
            messages.append(message.model_dump(exclude_none=True))
            for call in message.tool_calls:
                called = json.loads(call.function.arguments).get("expression", "")
                result = calculate(called)
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
            reply = await client.chat.completions.create(model="policy", messages=messages, tools=[CALCULATE],
                                                         max_tokens=ANSWER_TOKENS)
        answer = (reply.choices[0].message.content or "").strip()
    if answer == str(sample["answer"]):
        return 1.0
    if result is None or not result.lstrip("-").isdigit():
        return 0.0
    return 0.1 + 0.3 * in_place(called, expression) + 0.2 * in_place(answer, result)


def in_place(text: str, target: str) -> float:
    """The share of ``target``'s characters ``text`` has at the same positions (the longer
    length counts: extra characters cost)."""
    return sum(a == b for a, b in zip(text, target)) / max(len(text), len(target), 1)
