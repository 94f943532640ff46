"""Agents through the gateway with the real ``openai.AsyncOpenAI`` client, against `rlorch serve`:
every call's prompt is what the engine received, the trained tokens and logprobs are the engine's,
retries are not sampled again, sessions do not mix, a weight update mid-call keeps the call."""

from __future__ import annotations

import asyncio
import contextlib
import json

import httpx
import pytest

from helpers import wait_generated
from rlorch.agents.gateway import AgentGateway
from rlorch.agents.trajectory import CallKind
from rlorch.inference.client import SGLangEngine
from rlorch.serve.server import CpuServer, ServerThread
from rlorch.tokenizer import load_tokenizer
from rlorch.types import SamplingParams

openai = pytest.importorskip("openai")

TOOL = {"type": "function", "function": {"name": "calculate", "parameters": {
    "type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}
PARAMS = SamplingParams(max_new_tokens=6, temperature=1.0)


@pytest.fixture(scope="module")
def server(model_dir):
    thread = ServerThread(CpuServer(model_dir, min_step_time=0.0, threads=1))
    yield thread
    thread.stop()


class Recorded:
    """The engine as the gateway sees it, keeping what each call sent and got back."""

    def __init__(self, engine):
        self.engine, self.calls = engine, []

    async def generate(self, input_ids, params, rid):
        generation = await self.engine.generate(input_ids, params, rid)
        self.calls.append((list(input_ids), generation, params))
        return generation


@contextlib.asynccontextmanager
async def _serving(server, model_dir, *, engine=None, tokenizer=None, **options):
    """A started gateway in front of ``engine`` (default: ``rlorch serve``'s, recorded)."""
    engine = engine or Recorded(SGLangEngine(server.address))
    options = {"tool_parser": "pipe", "max_calls": 8, **options}
    gateway = AgentGateway(engine=engine, tokenizer=tokenizer or load_tokenizer(model_dir), model_name="tiny",
                           **options)
    await gateway.start()
    try:
        yield gateway, engine
    finally:
        await gateway.stop()
        if isinstance(engine, Recorded):
            await engine.engine.close()


def _client(session, **options):
    return openai.AsyncOpenAI(base_url=session.base_url, api_key=session.key, **options)


async def _tool_episode(client, prompt: str) -> list:
    """A scripted agent: one call with the tool offered; if it calls, the tool's answer goes back."""
    messages = [{"role": "user", "content": prompt}]
    first = await client.chat.completions.create(model="m", messages=messages, tools=[TOOL], logprobs=True)
    message = first.choices[0].message
    messages.append(message.model_dump(exclude_none=True))
    for call in message.tool_calls or []:
        messages.append({"role": "tool", "tool_call_id": call.id, "content": "7"})
    if not message.tool_calls:
        messages.append({"role": "user", "content": "again"})
    second = await client.chat.completions.create(model="m", messages=messages, tools=[TOOL], logprobs=True)
    return [first, second]


def test_every_prompt_is_what_the_engine_received_and_the_trained_tokens_are_its_own(server, model_dir):
    async def scenario():
        async with _serving(server, model_dir) as (gateway, engine):
            session = gateway.open(params=PARAMS, rid="e0")
            async with _client(session) as client:
                replies = await _tool_episode(client, "3+4=")
            return engine, replies, await gateway.close(session)

    engine, replies, trajectory = asyncio.run(scenario())
    assert [c.kind for c in trajectory.calls] == [CallKind.first, CallKind.extended]
    assert [c.prompt_ids.tolist() for c in trajectory.calls] == [sent for sent, _, _ in engine.calls]
    tokens, mask, logprobs, versions, segments = trajectory.sequence()
    assert segments is None
    sampled = [t for _, g, _ in engine.calls for t in g.output_ids]
    assert [t for t, m in zip(tokens, mask) if m] == sampled
    assert [p for p, m in zip(logprobs, mask) if m] == [p for _, g, _ in engine.calls for p in g.logprobs]
    # The second prompt is the first one and its answer, then only the template's text.
    first_prompt, first_generation, _ = engine.calls[0]
    assert engine.calls[1][0][:len(first_prompt) + len(first_generation.output_ids)] == (
        first_prompt + list(first_generation.output_ids))
    # The client saw the engine's logprobs for the tokens it sampled.
    for reply, (_, generation, _) in zip(replies, engine.calls):
        got = [item.logprob for item in reply.choices[0].logprobs.content]
        assert got == pytest.approx(list(generation.logprobs), abs=1e-6)
        assert reply.usage.completion_tokens == len(generation.output_ids)


def test_the_runs_sampling_is_enforced_and_the_agents_length_and_stops_are_kept(server, model_dir):
    async def scenario():
        async with _serving(server, model_dir) as (gateway, engine):
            session = gateway.open(params=PARAMS, rid="e1")
            async with _client(session) as client:
                await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "1+1="}],
                                                     temperature=0.0, top_p=0.5, max_tokens=3, stop=["|"])
            return engine

    (_, generation, params), = asyncio.run(scenario()).calls
    assert (params.temperature, params.top_p) == (PARAMS.temperature, PARAMS.top_p)
    assert params.max_new_tokens == 3 and params.stop == ["|"] and len(generation.output_ids) <= 3


def test_a_tool_call_comes_back_parsed_and_its_round_trip_stays_one_sequence(server, model_dir):
    class Scripted:
        """An engine that writes a call, then an answer (the tiny model cannot be relied on to)."""

        def __init__(self, tokenizer):
            self.tokenizer, self.turns = tokenizer, ["3+4|<eos>", "7<eos>"]

        async def generate(self, input_ids, params, rid):
            from rlorch.types import Generation, VersionStamps

            ids = self.tokenizer(self.turns.pop(0), add_special_tokens=False)["input_ids"]
            return Generation(ids, [-0.5] * len(ids), VersionStamps.uniform(2, len(ids)), "stop")

    async def scenario():
        async with _serving(server, model_dir, engine=Scripted(load_tokenizer(model_dir))) as (gateway, _):
            session = gateway.open(params=PARAMS, rid="e2")
            async with _client(session) as client:
                replies = await _tool_episode(client, "3+4=")
            return replies, await gateway.close(session)

    (first, second), trajectory = asyncio.run(scenario())
    call = first.choices[0].message.tool_calls[0]
    assert first.choices[0].finish_reason == "tool_calls" and first.choices[0].message.content is None
    assert (call.function.name, json.loads(call.function.arguments)) == ("calculate", {"expression": "3+4"})
    assert second.choices[0].message.content == "7"
    assert [c.kind for c in trajectory.calls] == [CallKind.first, CallKind.extended] and trajectory.forks == 0


def test_tool_choice_none_answers_a_call_shaped_reply_as_text_and_forced_calls_are_refused(server, model_dir):
    class Scripted:
        def __init__(self, tokenizer):
            self.tokenizer = tokenizer

        async def generate(self, input_ids, params, rid):
            from rlorch.types import Generation, VersionStamps

            ids = self.tokenizer("3+4|<eos>", add_special_tokens=False)["input_ids"]
            return Generation(ids, [-0.5] * len(ids), VersionStamps.uniform(2, len(ids)), "stop")

    async def scenario():
        async with _serving(server, model_dir, engine=Scripted(load_tokenizer(model_dir))) as (gateway, _):
            session = gateway.open(params=PARAMS, rid="e2n")
            messages = [{"role": "user", "content": "3+4="}]
            async with _client(session, max_retries=0) as client:
                reply = await client.chat.completions.create(model="m", messages=messages, tools=[TOOL],
                                                             tool_choice="none")
                with pytest.raises(openai.BadRequestError) as forced:
                    await client.chat.completions.create(model="m", messages=messages, tools=[TOOL],
                                                         tool_choice="required")
            await gateway.close(session)
            return reply, forced.value

    reply, forced = asyncio.run(scenario())
    assert reply.choices[0].message.tool_calls is None and reply.choices[0].message.content == "3+4|"
    assert reply.choices[0].finish_reason == "stop"
    assert forced.param == "tool_choice" and "constrained decoding" in forced.message


def test_a_retried_request_is_answered_from_the_record_not_sampled_again(server, model_dir):
    class DropFirstAnswer(httpx.AsyncBaseTransport):
        """Delivers the first request, then loses its answer (a timeout, as the client sees it)."""

        def __init__(self):
            self.inner, self.dropped = httpx.AsyncHTTPTransport(), False

        async def handle_async_request(self, request):
            response = await self.inner.handle_async_request(request)
            if not self.dropped:
                self.dropped = True
                await response.aread()
                raise httpx.ReadTimeout("answer lost", request=request)
            return response

    async def scenario():
        async with _serving(server, model_dir) as (gateway, engine):
            session = gateway.open(params=PARAMS, rid="e3")
            http = httpx.AsyncClient(transport=DropFirstAnswer())
            async with _client(session, http_client=http, max_retries=2) as client:
                reply = await client.chat.completions.create(
                    model="m", messages=[{"role": "user", "content": "2+2="}], logprobs=True)
            return engine, reply, await gateway.close(session)

    engine, reply, trajectory = asyncio.run(scenario())
    assert len(engine.calls) == 1 and len(trajectory.calls) == 1
    assert [item.logprob for item in reply.choices[0].logprobs.content] == pytest.approx(
        list(engine.calls[0][1].logprobs), abs=1e-6)


def test_64_concurrent_sessions_do_not_mix(server, model_dir):
    async def scenario():
        async with _serving(server, model_dir) as (gateway, engine):
            sessions = [gateway.open(params=PARAMS, rid=f"c{i}") for i in range(64)]

            async def episode(i, session):
                async with _client(session) as client:
                    return await _tool_episode(client, f"{i}+{i}=")

            await asyncio.gather(*(episode(i, s) for i, s in enumerate(sessions)))
            return engine, [await gateway.close(s) for s in sessions]

    engine, trajectories = asyncio.run(scenario())
    tokenizer = load_tokenizer(model_dir)
    sent = {tuple(ids): generation for ids, generation, _ in engine.calls}
    assert len(engine.calls) == 128
    for i, trajectory in enumerate(trajectories):
        assert trajectory.forks == 0 and len(trajectory.calls) == 2
        assert tokenizer.decode(trajectory.calls[0].prompt_ids.tolist()).startswith(f"<bos>user:{i}+{i}=<eos>")
        for record in trajectory.calls:
            assert list(sent[tuple(record.prompt_ids.tolist())].output_ids) == record.output_ids.tolist()


def test_a_weight_update_mid_call_keeps_the_call_and_stamps_two_versions(server, model_dir, perturbed_dir):
    async def scenario():
        control = SGLangEngine(server.address)
        engine = Recorded(SGLangEngine(server.address, extra_params={"ignore_eos": True}))
        async with _serving(server, model_dir, engine=engine) as (gateway, _), contextlib.AsyncExitStack() as stack:
            stack.push_async_callback(control.close)
            session = gateway.open(params=SamplingParams(max_new_tokens=100), rid="w")
            async with _client(session) as client:
                pending = asyncio.ensure_future(client.chat.completions.create(
                    model="m", messages=[{"role": "user", "content": "1+2="}], max_tokens=100))
                await wait_generated(control, 3)
                await control.pause()
                await control.reload(str(perturbed_dir), 1)
                await control.resume()
                reply = await pending
            await control.reload(str(model_dir), 0)
            return reply, await gateway.close(session)

    reply, trajectory = asyncio.run(scenario())
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 100
    (record,) = trajectory.calls
    assert [v for v, _ in record.versions.runs] == [0, 1] and record.versions.count == 100


def test_unknown_closed_and_wrongly_keyed_sessions_and_bad_requests_are_refused(server, model_dir):
    async def scenario():
        async with _serving(server, model_dir, max_calls=1) as (gateway, engine):
            session = gateway.open(params=PARAMS, rid="r")
            errors = {}
            async with openai.AsyncOpenAI(base_url=session.base_url, api_key="wrong", max_retries=0) as client:
                with pytest.raises(openai.AuthenticationError):
                    await client.models.list()
            async with openai.AsyncOpenAI(base_url=f"{gateway.url}/s/nope/v1", api_key="k", max_retries=0) as client:
                with pytest.raises(openai.AuthenticationError):
                    await client.models.list()
            async with _client(session, max_retries=0) as client:
                assert [m.id for m in (await client.models.list()).data] == ["tiny"]
                with pytest.raises(openai.BadRequestError) as n:
                    await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "1="}], n=2)
                errors["n"] = n.value
                await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "1="}])
                with pytest.raises(openai.RateLimitError) as limit:
                    await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "2="}])
                errors["max_calls"] = limit.value
            await gateway.close(session)
            async with _client(session, max_retries=0) as client:
                with pytest.raises(openai.ConflictError):
                    await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "1="}])
            return errors, session

    errors, session = asyncio.run(scenario())
    assert errors["n"].body["param"] == "n"
    assert "task.max_calls" in str(errors["max_calls"]) and "task.max_calls" in session.errors[0]


def test_streaming_answers_the_same_text_in_chunks(server, model_dir):
    async def scenario():
        async with _serving(server, model_dir) as (gateway, engine):
            session = gateway.open(params=PARAMS, rid="s")
            async with _client(session) as client:
                stream = await client.chat.completions.create(model="m", stream=True,
                                                              messages=[{"role": "user", "content": "4+4="}])
                text = "".join([chunk.choices[0].delta.content or "" async for chunk in stream if chunk.choices])
            return engine, text

    engine, text = asyncio.run(scenario())
    tokenizer = load_tokenizer(model_dir)
    assert text == tokenizer.decode(list(engine.calls[0][1].output_ids), skip_special_tokens=True)


def test_a_template_that_rewrites_earlier_turns_forks_and_says_so_or_is_bridged(server, model_dir):
    from rlorch.agents.trajectory import ForkReason
    from rlorch.model import build_tokenizer
    from rlorch.types import Generation, VersionStamps

    tokenizer = build_tokenizer()
    # Drops what an earlier assistant turn wrote up to its last "z" (as Qwen3 drops past reasoning).
    tokenizer.chat_template = (
        "{{ bos_token }}{% for m in messages %}{{ m['role'] }}:{% if m['role'] == 'assistant' and not loop.last %}"
        "{{ m['content'].split('z')[-1] }}{% else %}{{ m['content'] }}{% endif %}{{ eos_token }}{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}")

    class Thinking:
        async def generate(self, input_ids, params, rid):
            ids = tokenizer("abz7<eos>", add_special_tokens=False)["input_ids"]
            return Generation(ids, [-0.5] * len(ids), VersionStamps.uniform(0, len(ids)), "stop")

    async def scenario(bridge):
        async with _serving(server, model_dir, engine=Thinking(), tokenizer=tokenizer, bridge=bridge) as (gateway, _):
            session = gateway.open(params=PARAMS, rid="t")
            async with _client(session) as client:
                messages = [{"role": "user", "content": "3+4="}]
                reply = await client.chat.completions.create(model="m", messages=messages)
                messages += [reply.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "no"}]
                await client.chat.completions.create(model="m", messages=messages)
            return await gateway.close(session)

    forked, bridged = asyncio.run(scenario(False)), asyncio.run(scenario(True))
    assert forked.forks == 1 and forked.fork_reasons == [ForkReason.template]
    assert [c.kind for c in forked.calls] == [CallKind.first, CallKind.forked]
    assert bridged.forks == 0 and [c.kind for c in bridged.calls] == [CallKind.first, CallKind.bridged]
    first, second = bridged.calls
    assert second.prompt_ids[:len(first.prompt_ids) + len(first.output_ids)].tolist() == (
        first.prompt_ids.tolist() + first.output_ids.tolist())


def test_a_turn_cut_by_the_agents_max_tokens_is_not_counted_truncated_and_one_cut_by_the_runs_is(server, model_dir):
    async def scenario():
        engine = SGLangEngine(server.address, extra_params={"ignore_eos": True})
        async with _serving(server, model_dir, engine=engine) as (gateway, _):
            records = []
            for rid, limit in (("own", {"max_tokens": 2}), ("run", {})):
                session = gateway.open(params=SamplingParams(max_new_tokens=3), rid=rid)
                async with _client(session) as client:
                    reply = await client.chat.completions.create(
                        model="m", messages=[{"role": "user", "content": "1+2="}], **limit)
                records.append((reply.choices[0].finish_reason, (await gateway.close(session)).calls[0]))
            return records

    (own_reply, own), (run_reply, run) = asyncio.run(scenario())
    assert own_reply == run_reply == "length"
    assert (len(own.output_ids), own.finish_reason) == (2, "stop")
    assert (len(run.output_ids), run.finish_reason) == (3, "length")
