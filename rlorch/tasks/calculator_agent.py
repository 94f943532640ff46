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


def calculate(expression: str) -> str:
    """The tool: ``37+45`` -> ``82``; ``x`` for anything that is not such an expression."""
    from rlorch.tasks.calculator import calculate as evaluate

    return evaluate(expression)


async def solve(sample: dict, *, base_url: str, api_key: str, http_client=None) -> float:
    """One episode: ``sample["prompt"]`` is ``37+45=``, ``sample["answer"]`` ``82``. The call may
    be as long as the expression and its ``|``, the answer as long as what the tool returned.
    Reward 1 for the right answer. Short of it, credit for the parts of the skill: up to 0.4 for
    the prompt's expression in the first turn (the share of its characters in place), 0.05 for
    calling the tool, and once the call holds some of the expression, up to 0.2 for an answer
    repeating what the tool returned. Only the whole solution scores 1. ``http_client``: the one
    rlorch hands over (cheap to build; a client of one's own works too, slower)."""
    expression = sample["prompt"].removesuffix("=")
    async with AsyncOpenAI(base_url=base_url, api_key=api_key, http_client=http_client) as client:
        messages = [{"role": "user", "content": sample["prompt"]}]
        reply = await client.chat.completions.create(model="policy", messages=messages, tools=[CALCULATE],
                                                     max_tokens=len(expression) + 1)
        message = reply.choices[0].message
        first, result = message.content or "", None
        if message.tool_calls:
            messages.append(message.model_dump(exclude_none=True))
            call = message.tool_calls[0]
            first = json.loads(call.function.arguments).get("expression", "")
            result = calculate(first)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
            reply = await client.chat.completions.create(model="policy", messages=messages, tools=[CALCULATE],
                                                         max_tokens=max(len(result), 1))
        answer = (reply.choices[0].message.content or "").strip()
    if answer == str(sample["answer"]):
        return 1.0
    expressed = in_place(first, expression)
    if result is None:
        return 0.4 * expressed
    repeated = in_place(answer, result) if expressed and result.lstrip("-").isdigit() else 0.0
    return 0.4 * expressed + 0.05 + 0.2 * repeated


def in_place(text: str, target: str) -> float:
    """The share of ``target``'s characters ``text`` has at the same positions (the longer
    length counts: extra characters cost)."""
    return sum(a == b for a, b in zip(text, target)) / max(len(text), len(target), 1)
