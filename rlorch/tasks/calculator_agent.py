"""The calculator task as an agent written against the ``openai`` client (``task=agent``).

Nothing here knows about rlorch: the agent asks the model with one tool offered, runs the tool
when the model calls it, sends the result back and reads the answer, as any OpenAI-client agent
does. The tool, ``calculate``, evaluates the question it is asked about; the model cannot add,
so the skill it learns is the agent's loop itself: call the tool (the tiny model's tool-call
format is ``|``: ``task.tool_call_parser=pipe``), then answer with what came back.
"""

from __future__ import annotations

from openai import AsyncOpenAI

from rlorch.tasks.calculator import calculate
from rlorch.tasks.digits import prefix_credit

CALCULATE = {
    "type": "function",
    "function": {
        "name": "calculate",
        "description": "Evaluate the expression the user asks about (integers, + and -).",
        "parameters": {"type": "object", "properties": {}},
    },
}


async def solve(sample: dict, *, base_url: str, api_key: str, http_client=None) -> float:
    """One episode: ``sample["prompt"]`` is ``37+45=``, ``sample["answer"]`` ``82``. The first
    turn is one token (the call, or a guess); the answer turn, as long as what the tool
    returned, is asked with ``tool_choice="none"``: a second call there is text, and wrong.
    Reward 1 for the right answer; short of it, after a call 0.1 plus up to 0.6 for the
    answer's right opening (``prefix_credit``: a digit counts only behind right ones), without
    one at most 0.1. ``http_client``: the one rlorch hands over (cheap to build; a client of
    one's own works too, slower)."""
    question = sample["prompt"]
    async with AsyncOpenAI(base_url=base_url, api_key=api_key, http_client=http_client) as client:
        messages = [{"role": "user", "content": question}]
        reply = await client.chat.completions.create(model="policy", messages=messages, tools=[CALCULATE],
                                                     max_tokens=1)
        message = reply.choices[0].message
        if message.tool_calls:
            result = calculate(question.removesuffix("="))
            messages += [message.model_dump(exclude_none=True),
                         {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": result}]
            reply = await client.chat.completions.create(model="policy", messages=messages, tools=[CALCULATE],
                                                         tool_choice="none", max_tokens=len(result))
        answer = (reply.choices[0].message.content or "").strip()
    expected = str(sample["answer"])
    if answer == expected:
        return 1.0
    if not message.tool_calls:
        return 0.1 * prefix_credit(answer, expected)
    return 0.1 + 0.6 * prefix_credit(answer, expected)
