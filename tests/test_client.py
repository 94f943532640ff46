"""SGLangEngine against a real `rlorch serve` over HTTP: version stamps and interruptible generation.

The client reads SGLang v0.5.x's native response: meta_info.output_token_logprobs entries
[logprob, token_id, text] and meta_info.weight_version (a string; "default" means version 0),
and resubmits a request whose finish_reason type is "abort" (a pause) to the same server.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
from pathlib import Path

import pytest

from helpers import wait_generated
from rlorch.inference import client as client_module
from rlorch.inference.client import EngineError, SGLangEngine, parse_weight_version
from rlorch.serve.server import CpuServer, ServerThread
from rlorch.types import Engine, GroupRequest, SamplingParams, VersionStamps

PROMPT = [5, 6, 7, 8]


@pytest.fixture(scope="module")
def server(model_dir):
    thread = ServerThread(CpuServer(model_dir, min_step_time=0.01, threads=1))
    yield thread
    thread.stop()


def run(coro):
    return asyncio.run(coro)


def test_parse_weight_version():
    assert parse_weight_version("3") == 3 and parse_weight_version("default") == 0
    with pytest.raises(EngineError):
        parse_weight_version("v1")


def test_generate_stamps_every_token(server):
    async def scenario():
        engine = SGLangEngine(server.address, extra_params={"ignore_eos": True})
        assert isinstance(engine, Engine)
        try:
            return await engine.generate(PROMPT, SamplingParams(max_new_tokens=6), "plain")
        finally:
            await engine.close()

    gen = run(scenario())
    assert len(gen.output_ids) == len(gen.logprobs) == 6
    assert gen.versions == VersionStamps([[0, 6]]) and gen.finish_reason == "length"
    assert all(lp <= 0 for lp in gen.logprobs)


def test_generation_connections_bound_their_receive_buffer(server, monkeypatch):
    """Answers not yet read wait in their sockets: each /generate connection asks for a fixed
    receive buffer before it connects (Linux would grow it towards tcp_rmem's maximum, and a
    fleet's waiting answers past the kernel's TCP memory limit get dropped and retransmitted
    after timeouts)."""
    granted, bounded = [], client_module.bounded_receive_socket

    def recorded(address):
        sock = bounded(address)
        granted.append(sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF))
        return sock

    monkeypatch.setattr(client_module, "bounded_receive_socket", recorded)

    async def scenario():
        engine = SGLangEngine(server.address)
        try:
            await engine.generate(PROMPT, SamplingParams(max_new_tokens=2), "bounded")
        finally:
            await engine.close()

    run(scenario())
    limit = Path("/proc/sys/net/core/rmem_max")
    if not limit.exists():
        pytest.skip("reads Linux's net.core.rmem_max")
    with open(limit) as handle:   # the kernel doubles what it grants
        expected = 2 * min(client_module.RECEIVE_BUFFER, int(handle.read()))
    assert granted == [expected]


def test_generate_group_is_batched_on_the_server(server):
    async def scenario():
        engine = SGLangEngine(server.address, extra_params={"ignore_eos": True})
        try:
            before = (await engine.server_info())["internal_states"][0]
            group = await engine.generate_group(PROMPT, SamplingParams(max_new_tokens=5), 4, "g")
            after = (await engine.server_info())["internal_states"][0]
            return group, before, after
        finally:
            await engine.close()

    group, before, after = run(scenario())
    assert len(group) == 4 and all(g.versions == VersionStamps([[0, 5]]) for g in group)
    assert after["sequences"] - before["sequences"] == 4
    assert after["batches"] - before["batches"] < 4


def test_weight_update_mid_generation_spans_two_versions(server, model_dir, perturbed_dir):
    greedy = SamplingParams(max_new_tokens=10, temperature=0.0)

    async def scenario():
        engine = SGLangEngine(server.address, extra_params={"ignore_eos": True})
        control = SGLangEngine(server.address)
        try:
            before = await engine.generate(PROMPT, greedy, "greedy-before")
            pending = asyncio.ensure_future(engine.generate(PROMPT, SamplingParams(max_new_tokens=100), "long"))
            await wait_generated(control, 3)
            await control.pause()
            await control.reload(str(perturbed_dir), 1)
            assert await control.weight_version() == 1
            await control.resume()
            long = await pending
            after = await engine.generate(PROMPT, greedy, "greedy-after")
            await control.reload(str(model_dir), 0)
            return before, long, after
        finally:
            await engine.close()
            await control.close()

    before, long, after = run(scenario())
    assert len(long.output_ids) == len(long.logprobs) == 100 and long.finish_reason == "length"
    assert long.versions.head == 0 and long.versions.tail == 1
    assert len(long.versions.runs) == 2 and long.versions.count == 100
    (v0, first), (v1, second) = long.versions.runs
    assert (v0, v1) == (0, 1) and first >= 3 and second >= 1
    assert before.versions == VersionStamps([[0, 10]]) and after.versions == VersionStamps([[1, 10]])
    assert before.output_ids != after.output_ids, "the new weights were not loaded into the live model"


def test_reload_failure_raises_the_server_message(server, tmp_path):
    async def scenario():
        engine = SGLangEngine(server.address)
        try:
            with pytest.raises(EngineError, match="not a directory"):
                await engine.reload(str(tmp_path / "nope"), 5)
            return await engine.weight_version()
        finally:
            await engine.close()

    assert run(scenario()) == 0


def test_abort_returns_partial_without_resubmitting(server):
    async def scenario():
        engine = SGLangEngine(server.address, extra_params={"ignore_eos": True})
        try:
            pending = asyncio.ensure_future(engine.generate(PROMPT, SamplingParams(max_new_tokens=100), "stop-me"))
            await wait_generated(engine, 2)
            await engine.abort("stop-me")
            return await pending
        finally:
            await engine.close()

    gen = run(scenario())
    assert gen.finish_reason == "abort" and 2 <= len(gen.output_ids) < 100


def test_info_health_and_unreachable_server(server):
    async def scenario():
        engine = SGLangEngine(server.address)
        dead = SGLangEngine("127.0.0.1:9", request_timeout=2, control_timeout=2)
        try:
            info, model = await engine.server_info(), await engine.model_info()
            return info, model, await engine.healthy(), await dead.healthy()
        finally:
            await engine.close()
            await dead.close()

    info, model, up, down = run(scenario())
    assert info["status"] == "ready" and model["is_generation"] is True
    assert up is True and down is False


def test_a_dropped_keep_alive_connection_is_retried_once_on_a_fresh_one():
    """The first connection is closed by the server without an answer (what a client sees when it
    reuses a connection the server closed for idleness); the call succeeds on a fresh one. A
    server that drops every connection is unavailable."""
    from rlorch.inference import client

    assert client.KEEPALIVE_SECONDS < 5

    async def scenario(drop: int):
        seen = []

        async def handle(reader, writer):
            await reader.readuntil(b"\r\n\r\n")
            seen.append(1)
            if len(seen) <= drop:
                writer.close()
                return
            body = b'{"status": "ok"}'
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
                         + str(len(body)).encode() + b"\r\n\r\n" + body)
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        engine = SGLangEngine(f"127.0.0.1:{server.sockets[0].getsockname()[1]}")
        try:
            await engine.pause()
            return "paused", len(seen)
        except client.EngineUnavailable as err:
            return err, len(seen)
        finally:
            await engine.close()
            server.close()

    assert run(scenario(drop=1)) == ("paused", 2)
    failure, attempts = run(scenario(drop=10))
    assert isinstance(failure, client.EngineUnavailable) and attempts == 2


def test_generate_batch_is_one_request_answered_in_request_order(server):
    greedy = SamplingParams(max_new_tokens=5, temperature=0.0)
    requests = [GroupRequest(PROMPT, greedy, 2, "p"), GroupRequest([9, 10], greedy, 1, "q")]

    async def scenario():
        engine = SGLangEngine(server.address, extra_params={"ignore_eos": True})
        try:
            alone = [await engine.generate(r.input_ids, greedy, f"alone-{r.rid}") for r in requests]
            before = (await engine.server_info())["internal_states"][0]
            answers = await engine.generate_batch(requests)
            after = (await engine.server_info())["internal_states"][0]
            return alone, answers, before, after, engine.batch_form
        finally:
            await engine.close()

    alone, answers, before, after, batch_form = run(scenario())
    assert batch_form and [len(group) for group in answers] == [2, 1]
    assert [g.output_ids for g in answers[0]] == [alone[0].output_ids] * 2
    assert answers[1][0].output_ids == alone[1].output_ids
    assert all(g.versions == VersionStamps([[0, 5]]) and len(g.logprobs) == 5 for group in answers for g in group)
    assert after["sequences"] - before["sequences"] == 3
    assert after["batches"] - before["batches"] < 3


def test_generate_batch_sample_cut_short_by_a_weight_update_continues(server, model_dir, perturbed_dir):
    """The samples a pause cut short go on together: one more batch /generate per pause."""
    async def scenario():
        engine = SGLangEngine(server.address, extra_params={"ignore_eos": True})
        control = SGLangEngine(server.address)
        posted = []
        post = engine._post_generate

        async def counting(rids, payload, partial=None):
            posted.append(len(rids))
            return await post(rids, payload, partial)

        engine._post_generate = counting
        try:
            pending = asyncio.ensure_future(engine.generate_batch(
                [GroupRequest(PROMPT, SamplingParams(max_new_tokens=60), 2, "long")]))
            await wait_generated(control, 3)
            await control.pause()
            await control.reload(str(perturbed_dir), 1)
            await control.resume()
            answers = await pending
            await control.pause()
            await control.reload(str(model_dir), 0)
            await control.resume()
            return answers, engine.resubmits, posted
        finally:
            await engine.close()
            await control.close()

    (group,), resubmits, posted = run(scenario())
    assert resubmits == 2 and posted == [2, 2]
    for generation in group:
        assert len(generation.output_ids) == len(generation.logprobs) == 60 and generation.finish_reason == "length"
        assert generation.versions.count == 60 and generation.versions.tail == 1


def test_generate_batch_falls_back_to_separate_requests_where_the_batch_form_is_refused():
    from aiohttp import web

    seen = []

    async def single_only(request: web.Request) -> web.Response:
        body = await request.json()
        seen.append(body)
        if isinstance(body["input_ids"][0], list):
            return web.json_response({"error": {"message": "batch input not supported"}}, status=400)
        count = body["sampling_params"]["max_new_tokens"]
        return web.json_response({"text": "", "output_ids": [3] * count, "meta_info": {
            "id": body["rid"], "finish_reason": {"type": "length", "length": count}, "weight_version": "2",
            "output_token_logprobs": [[-0.5, 3, None]] * count}})

    async def scenario():
        async with _generate_stand_in(single_only) as engine:
            requests = [GroupRequest([1, 2], SamplingParams(max_new_tokens=2), 2, "a"),
                        GroupRequest([3], SamplingParams(max_new_tokens=2), 1, "b")]
            first = await engine.generate_batch(requests)
            batch_form = engine.batch_form
            sent = len(seen)
            second = await engine.generate_batch(requests)
            return first, second, batch_form, sent, len(seen) - sent

    first, second, batch_form, sent, later = run(scenario())
    assert not batch_form and sent == 1 + 3 and later == 3
    assert first == second and [len(group) for group in first] == [2, 1]
    assert all(g.versions == VersionStamps([[2, 2]]) for group in first for g in group)
    assert isinstance(seen[0]["rid"], list) and len(seen[0]["input_ids"]) == 3


def test_a_refused_continuation_fails_with_the_servers_message():
    """A server that took a batch and cut it short at a pause but refuses its continuation says
    why; the client does not take it for a server without the batch form."""
    from aiohttp import web

    seen = []

    async def refuses_continuations(request: web.Request) -> web.Response:
        body = await request.json()
        seen.append(body)
        if len(seen) > 1:
            return web.json_response({"error": {"message": "min_new_tokens exceeds max_new_tokens"}}, status=400)
        return web.json_response([{"text": "", "output_ids": [3], "meta_info": {
            "id": rid, "finish_reason": {"type": "abort", "message": "paused"}, "weight_version": "1",
            "output_token_logprobs": [[-0.5, 3, None]]}} for rid in body["rid"]])

    async def scenario():
        async with _generate_stand_in(refuses_continuations) as engine:
            with pytest.raises(EngineError) as caught:
                await engine.generate_batch([GroupRequest([1, 2], SamplingParams(max_new_tokens=4), 2, "a")])
            return str(caught.value), engine.batch_form

    message, batch_form = run(scenario())
    assert "min_new_tokens exceeds max_new_tokens" in message and batch_form
    assert len(seen) == 2 and seen[1]["input_ids"] == [[1, 2, 3], [1, 2, 3]]
    assert [p["max_new_tokens"] for p in seen[1]["sampling_params"]] == [3, 3]


@pytest.mark.parametrize("logprob", [None, float("nan")])
def test_bodies_keep_what_orjson_cannot_carry(logprob):
    """A request's integer past 64 bits goes out exact (orjson refuses it); an answer's NaN
    (which orjson refuses to read) is read, and like SGLang's null for a non-finite logprob it
    fails the call naming it."""
    from aiohttp import web

    seen = []

    async def answers_non_finite(request: web.Request) -> web.Response:
        seen.append(json.loads(await request.read()))
        answers = [{"text": "", "output_ids": [7], "meta_info": {
            "id": rid, "finish_reason": {"type": "length", "length": 1}, "weight_version": "3",
            "output_token_logprobs": [[logprob, 7, None]]}} for rid in seen[-1]["rid"]]
        return web.Response(text=json.dumps(answers), content_type="application/json")

    async def scenario():
        async with _generate_stand_in(answers_non_finite) as engine:
            engine.extra_params = {"custom_seed": 2**64 + 1}
            with pytest.raises(EngineError) as caught:
                await engine.generate_batch([GroupRequest([1, 2], SamplingParams(max_new_tokens=1), 2, "a")])
            return str(caught.value)

    message = run(scenario())
    assert "non-finite behaviour logprob" in message and ("nan" in message or "None" in message), message
    assert [p["custom_seed"] for p in seen[0]["sampling_params"]] == [2**64 + 1] * 2


@contextlib.asynccontextmanager
async def _generate_stand_in(handler):
    """A client of a local HTTP server whose /generate is ``handler``."""
    from aiohttp import web

    app = web.Application()
    app.router.add_post("/generate", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    engine = SGLangEngine(f"127.0.0.1:{site._server.sockets[0].getsockname()[1]}")
    try:
        yield engine
    finally:
        await engine.close()
        await runner.cleanup()


def test_wire_ids_are_fresh_equal_length_never_prefixes_and_a_forked_child_draws_its_own():
    from rlorch.inference.client import wire_rid

    sent = [wire_rid("g7-0") for _ in range(1000)]
    assert len(set(sent)) == len(sent) and len({len(rid) for rid in sent}) == 1
    assert not any(a != b and b.startswith(a) for a in sent[:50] for b in sent)
    read, write = os.pipe()
    child = os.fork()
    if child == 0:
        os.write(write, wire_rid("g7-0").encode())
        os._exit(0)
    os.waitpid(child, 0)
    theirs = os.read(read, 100).decode()
    os.close(read)
    os.close(write)
    assert len(theirs) == len(sent[0]) and theirs.rsplit(".", 1)[1][:16] != sent[0].rsplit(".", 1)[1][:16]
