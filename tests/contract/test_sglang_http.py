"""rlorch's client, pool and `rlorch train` against SGLang's real HTTP app (tests/contract/conftest.py)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import aiohttp
import pytest

from contract_apps import wait_for_requests
from rlorch.inference.client import SGLangEngine
from rlorch.inference.pool import EnginePool
from rlorch.types import GroupRequest, SamplingParams

PROMPT = [5, 6, 7]


def params(tokens: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=tokens)


async def _post(address: str, path: str, payload: dict) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as session:
        async with session.post(f"http://{address}{path}", json=payload) as response:
            return response.status, await response.json(content_type=None)


async def _in_flight(engine: SGLangEngine, rids: list[str], *, tokens: int = 1) -> None:
    """Every rid is at the app with ``tokens`` generated (1: a pause now cuts it mid-generation;
    0: it is queued there)."""
    deadline = time.monotonic() + 30
    while not all(engine.wire_rid(rid) for rid in rids):
        assert time.monotonic() < deadline, f"{rids} never sent"
        await asyncio.sleep(0.01)
    await wait_for_requests([engine.url], [engine.wire_rid(rid) for rid in rids], tokens=tokens)


def test_generate_answers_with_tokens_logprobs_and_version(sglang_app):
    async def scenario():
        engine = SGLangEngine(sglang_app.address)
        try:
            out = await engine.generate(PROMPT, params(6), "one")
            info = await engine.server_info()
            return out, info, await engine.weight_version()
        finally:
            await engine.close()

    out, info, version = asyncio.run(scenario())
    assert len(out.output_ids) == 6 and out.logprobs.tolist() == [-1.0] * 6 and out.finish_reason == "length"
    assert out.versions.runs == [[version, 6]] and info["version"] == "0.5.23"


def test_a_batch_generate_goes_as_one_batch_request_and_is_answered_in_order(sglang_app):
    async def scenario():
        engine = SGLangEngine(sglang_app.address)
        try:
            answers = await engine.generate_batch([GroupRequest(PROMPT, params(4), 2, "b"),
                                                   GroupRequest([9, 10], params(3), 1, "c")])
            return answers, engine.batch_form, await engine.weight_version()
        finally:
            await engine.close()

    answers, batch_form, version = asyncio.run(scenario())
    assert batch_form, "SGLang refused the batch form of /generate"
    assert [len(group) for group in answers] == [2, 1]
    assert [len(sample.output_ids) for group in answers for sample in group] == [4, 4, 3]
    assert all(sample.versions.runs == [[version, len(sample.output_ids)]] for group in answers for sample in group)


def test_weight_version_is_read_from_model_info_because_get_weight_version_is_gone(sglang_app):
    async def scenario():
        engine = SGLangEngine(sglang_app.address)
        try:
            missing, _ = await engine._request("GET", "/get_weight_version", timeout=10)
            await engine.pause()
            await engine.reload("/checkpoints/step_7", 7)
            await engine.resume()
            engine.version = None
            return missing, await engine.weight_version()
        finally:
            await engine.close()

    missing, version = asyncio.run(scenario())
    assert missing == 404 and version == 7


def test_pause_with_in_flight_and_queued_requests_then_reload_and_continue(sglang_app):
    async def scenario():
        engine = SGLangEngine(sglang_app.address)
        try:
            await engine.pause()
            await engine.reload("/checkpoints/step_1", 1)
            await engine.resume()
            running = [asyncio.ensure_future(engine.generate(PROMPT, params(30), f"run-{i}")) for i in range(3)]
            await _in_flight(engine, [f"run-{i}" for i in range(3)])
            await engine.pause()
            queued = asyncio.ensure_future(engine.generate(PROMPT, params(5), "queued"))
            await _in_flight(engine, ["queued"], tokens=0)
            await engine.reload("/checkpoints/step_2", 2)
            await engine.resume()
            return await asyncio.gather(*running, queued), engine.resubmits
        finally:
            await engine.close()

    outs, resubmits = asyncio.run(scenario())
    assert [len(o.output_ids) for o in outs] == [30, 30, 30, 5] and resubmits >= 3
    for out in outs[:3]:
        assert [v for v, _ in out.versions.runs] == [1, 2], out.versions.runs
        assert out.finish_reason == "length"
    assert outs[3].versions.runs == [[2, 5]]


def test_abort_of_one_request_spares_requests_whose_id_it_prefixes(sglang_app):
    async def scenario():
        engine = SGLangEngine(sglang_app.address)
        try:
            rids = [f"g3-0-{i}" for i in (1, 10, 11)]
            tasks = [asyncio.ensure_future(engine.generate(PROMPT, params(40), rid)) for rid in rids]
            await _in_flight(engine, rids)
            await engine.abort("g3-0-1")
            return await asyncio.gather(*tasks)
        finally:
            await engine.close()

    aborted, *spared = asyncio.run(scenario())
    assert aborted.finish_reason == "abort" and len(aborted.output_ids) < 40
    assert [(o.finish_reason, len(o.output_ids)) for o in spared] == [("length", 40), ("length", 40)]


def _method_source(relative: str, cls: str, method: str) -> str:
    """The source of ``cls.method`` in the installed sglang (read, not imported: the scheduler
    imports GPU-only packages)."""
    import ast
    import importlib.util
    from pathlib import Path

    from contract_apps import require_sglang

    require_sglang()
    path = Path(importlib.util.find_spec("sglang").origin).parent / relative
    source = path.read_text()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == method:
                    return ast.get_source_segment(source, item)
    raise AssertionError(f"sglang/{relative} has no {cls}.{method}: the stand-in copies it")


def test_the_pinned_sglang_refuses_a_duplicate_id_and_aborts_by_prefix_as_the_stand_in_does():
    """The stand-in's duplicate-rid refusal and prefix-match abort, checked against the code it
    copies, so that a drift in SGLang fails the contract rather than a GPU run."""
    init = _method_source("srt/managers/tokenizer_manager.py", "TokenizerManager", "_init_req_state")
    assert "if rid in self.rid_to_state" in init, init
    assert 'raise ValueError(f"Duplicate request ID detected: {rid}")' in init, init
    abort = _method_source("srt/managers/tokenizer_manager.py", "TokenizerManager", "abort_request")
    # An abort acts only on a rid in flight (with one tokenizer worker) ...
    assert "state = None if abort_all else self.rid_to_state.get(rid)" in abort, abort
    assert "elif get_serving().tokenizer_worker_num == 1:\n                return" in abort, abort
    # ... and then the scheduler aborts every request whose rid starts with it.
    scheduler = _method_source("srt/managers/scheduler.py", "Scheduler", "abort_request")
    assert "req.rid.startswith(recv_req.rid)" in scheduler, scheduler


def test_the_app_refuses_a_duplicate_id_and_the_client_never_sends_one(sglang_app):
    async def scenario():
        body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 20}, "rid": "dup"}
        first = asyncio.ensure_future(_post(sglang_app.address, "/generate", body))
        await wait_for_requests([sglang_app.address], ["dup"])
        second = await _post(sglang_app.address, "/generate", body)
        await first
        engine = SGLangEngine(sglang_app.address)
        try:
            same = await asyncio.gather(*(engine.generate(PROMPT, params(5), "g0-0") for _ in range(3)))
        finally:
            await engine.close()
        return second, same

    (status, body), same = asyncio.run(scenario())
    assert status == 400 and "Duplicate request ID" in json.dumps(body)
    assert [len(o.output_ids) for o in same] == [5, 5, 5]


def test_a_segment_that_spans_versions_is_stamped_from_its_spans(sglang_app):
    async def scenario():
        engine = SGLangEngine(sglang_app.address)
        try:
            await engine.pause()
            await engine.reload("/checkpoints/step_4", 4)
            await engine.resume()
            task = asyncio.ensure_future(engine.generate(PROMPT, params(30), "span"))
            await _in_flight(engine, ["span"])
            status, _ = await _post(sglang_app.address, "/pause_generation", {"mode": "in_place"})
            assert status == 200
            await engine.reload("/checkpoints/step_5", 5)
            await engine.resume()
            return await task
        finally:
            await engine.close()

    out = asyncio.run(scenario())
    assert out.finish_reason == "length" and [v for v, _ in out.versions.runs] == [4, 5]
    assert sum(n for _, n in out.versions.runs) == 30 and out.versions.runs[0][1] > 0


def test_health_waits_behind_a_pause_and_the_pool_resumes_a_server_before_probing(sglang_app):
    async def scenario():
        engine = SGLangEngine(sglang_app.address)
        pool = EnginePool([engine], probe_interval=0.1)
        try:
            await engine.pause()
            paused_health = await engine.healthy()
            pool._mark_down(engine, "reload timed out")
            for _ in range(100):
                if pool.gauges()["servers_up"] == 1:
                    break
                await asyncio.sleep(0.1)
            return paused_health, pool.gauges()["servers_up"], await engine.healthy()
        finally:
            await pool.stop()

    paused_health, up, healthy = asyncio.run(scenario())
    assert paused_health is False and up == 1 and healthy is True


@pytest.mark.parametrize("shape", ["0.5.3", "0.5.5"])
def test_older_answer_shapes(stand_in, shape):
    """0.5.3: a request aborted while queued has no logprobs and no version; 0.5.5: no version."""
    app = stand_in("--shape", shape, "--token-delay", "0.02")

    async def scenario():
        engine = SGLangEngine(app.address)
        try:
            await engine.pause()
            await engine.reload("/checkpoints/step_3", 3)
            queued = asyncio.ensure_future(engine.generate(PROMPT, params(6), "q"))
            await _in_flight(engine, ["q"], tokens=0)
            await engine.pause()
            await engine.resume()
            return await queued, engine.resubmits
        finally:
            await engine.close()

    out, resubmits = asyncio.run(scenario())
    assert resubmits == 1 and len(out.output_ids) == 6 and out.versions.runs == [[3, 6]]


@pytest.mark.slow
def test_short_training_run_through_the_real_app_loses_nothing(sglang_app, tmp_path):
    run_dir = tmp_path / "run"
    command = [sys.executable, "-m", "rlorch.cli", "train", "inference=sglang", "trainer=sim",
               f"inference.addresses=[{sglang_app.address}]", f"run.dir={run_dir}", "run.progress=false",
               "train.steps=6", "rollout.batch_size=8", "rollout.group_size=4", "rollout.max_new_tokens=8",
               "eval.enabled=false", "trainer.sim.step_time=0.05"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["lost"] == 0 and summary["steps"] == 6, summary
