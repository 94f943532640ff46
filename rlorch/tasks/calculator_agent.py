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
    turn is one token (the call, or a guess), the answer as long as what the tool returned.
    Reward 1 for the right answer; short of it 0.1 for calling the tool (0.05 for a guess in
    digits instead) and up to 0.3 for the share of the answer's characters in place. ``http_client``: the one rlorch hands over (cheap
    to build; a client of one's own works too, slower)."""
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
                                                         max_tokens=len(result))
        answer = (reply.choices[0].message.content or "").strip()
    expected = str(sample["answer"])
    if answer == expected:
        return 1.0
    if not message.tool_calls:
        return 0.05 * answer.isdigit() + 0.3 * in_place(answer, expected)
    return 0.1 + 0.3 * in_place(answer, expected)


def in_place(text: str, target: str) -> float:
    """The share of ``target``'s characters ``text`` has at the same positions (the longer
    length counts: extra characters cost)."""
    return sum(a == b for a, b in zip(text, target)) / max(len(text), len(target), 1)
