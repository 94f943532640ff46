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
    the right answer; short of it 0.3 for a call the tool could evaluate and up to 0.3 for an
    answer of digits (the calculator task's partial credit). ``http_client``: the one rlorch
    hands over (cheap to build; a client of one's own works too, slower)."""
    async with AsyncOpenAI(base_url=base_url, api_key=api_key, http_client=http_client) as client:
        messages = [{"role": "user", "content": sample["prompt"]}]
        reply = await client.chat.completions.create(model="policy", messages=messages, tools=[CALCULATE],
                                                     max_tokens=CALL_TOKENS)
        message = reply.choices[0].message
        evaluated = False
        if message.tool_calls:
            messages.append(message.model_dump(exclude_none=True))
            for call in message.tool_calls:
                result = calculate(json.loads(call.function.arguments).get("expression", ""))
                evaluated = evaluated or result != "x"
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
            reply = await client.chat.completions.create(model="policy", messages=messages, tools=[CALCULATE],
                                                         max_tokens=ANSWER_TOKENS)
        answer = (reply.choices[0].message.content or "").strip()
    if answer == str(sample["answer"]):
        return 1.0
    digits = sum(c.isdigit() for c in answer) / len(answer) if answer else 0.0
    return 0.3 * evaluated + 0.3 * digits
