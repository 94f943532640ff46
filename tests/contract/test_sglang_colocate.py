"""A colocated run's swap step against SGLang's real HTTP app: the routes as SGLang answers them,
the order SGLang survives (pause, flush until it answers 200, release; resume the weights, load,
resume the rest, continue), and the run failing, named, when a release is refused or an engine is
lost while its memory is released (tests/contract/sglang_stand_in.py mirrors where SGLang's
scheduler dies)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest

from contract_apps import require_sglang, wait_for_requests
from rlorch.inference.client import EngineError, SGLangEngine
from rlorch.inference.pool import EnginePool
from rlorch.types import SamplingParams

SGLANG_SOURCE = Path(__import__("importlib").util.find_spec("sglang").origin).parent if \
    __import__("importlib").util.find_spec("sglang") else None
SWAP_IN = ["resume:weights", "update_weights_from_disk", "resume:kv_cache,cuda_graph", "continue"]


async def _call(address: str, method: str, path: str, payload: dict) -> tuple[int, object]:
    async with aiohttp.ClientSession() as session:
        async with session.request(method, f"http://{address}{path}", json=payload) as response:
            return response.status, await response.json(content_type=None)


async def _state(address: str) -> dict:
    async with aiohttp.ClientSession() as session:
        async with session.get(f"http://{address}/server_info") as response:
            return (await response.json())["internal_states"][0]


async def _sent(engines: list[SGLangEngine], rid: str, tokens: int = 1) -> None:
    """Until ``rid`` is at one of the apps with ``tokens`` generated."""
    for _ in range(3000):
        wire = [(e, e.wire_rid(rid)) for e in engines if e.wire_rid(rid)]
        if wire:
            engine, sent = wire[0]
            return await wait_for_requests([engine.url], [sent], tokens=tokens)
        await asyncio.sleep(0.01)
    raise AssertionError(f"{rid} never sent")


def _after_release(calls: list[str]) -> list[str]:
    """The calls of the last pause..continue window that released memory, flushes folded."""
    start = max(i for i, call in enumerate(calls) if call.startswith("pause"))
    window = calls[start:]
    return [call for i, call in enumerate(window) if not (call == "flush:refused" and window[i - 1] == call)]


def test_the_pinned_sglang_asserts_idle_and_removes_released_tags_as_the_stand_in_does():
    """The stand-in dies where these make SGLang's scheduler die; a drift in SGLang fails here."""
    require_sglang()
    updater = (SGLANG_SOURCE / "srt/managers/scheduler_components/weight_updater.py").read_text()
    release = updater[updater.index("def release_memory_occupation"):updater.index("def resume_memory_occupation")]
    resume = updater[updater.index("def resume_memory_occupation"):updater.index("def check_weights")]
    assert "assert self.is_fully_idle(" in release and "self.offload_tags.add(tag)" in release
    assert "self.offload_tags.remove(tag)" in resume
    constants = (SGLANG_SOURCE / "srt/constants.py").read_text()
    assert '"kv_cache"' in constants and '"weights"' in constants and '"cuda_graph"' in constants
    server = (SGLANG_SOURCE / "srt/entrypoints/http_server.py").read_text()
    route = server[server.index('"/release_memory_occupation"'):server.index('"/resume_memory_occupation"')]
    assert "return _create_error_response(e)" in route and "return " not in route.split("try:")[1].split("except")[0]


def test_release_and_resume_answer_null_with_tags_given_or_omitted_over_get_and_post(stand_in):
    app = stand_in("--token-delay", "0.01")

    async def scenario():
        answers = [await _call(app.address, "POST", "/pause_generation", {"mode": "abort"})]
        answers += [await _call(app.address, "POST", "/release_memory_occupation", {"tags": ["kv_cache"]}),
                    await _call(app.address, "GET", "/release_memory_occupation", {}),
                    await _call(app.address, "POST", "/resume_memory_occupation", {"tags": ["weights"]}),
                    await _call(app.address, "GET", "/resume_memory_occupation", {"tags": ["kv_cache", "cuda_graph"]})]
        return answers, await _state(app.address)

    answers, state = asyncio.run(scenario())
    assert [status for status, _ in answers] == [200] * 5 and [body for _, body in answers[1:]] == [None] * 4
    assert state["released"] == [] and app.process.poll() is None


def test_the_stand_in_dies_where_sglangs_scheduler_does(stand_in):
    """A release while a request runs, and a resume of a tag never released, end the server."""
    running, resumed = stand_in("--token-delay", "0.05"), stand_in()

    async def scenario():
        engine = SGLangEngine(running.address)
        task = asyncio.ensure_future(engine.generate([5, 6, 7], SamplingParams(max_new_tokens=100), "busy"))
        await _sent([engine], "busy")
        for app, tags in ((running, ["kv_cache"]), (resumed, ["weights"])):
            path = "/release_memory_occupation" if app is running else "/resume_memory_occupation"
            try:
                await _call(app.address, "POST", path, {"tags": tags})
            except aiohttp.ClientError:
                pass
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await engine.close()

    asyncio.run(scenario())
    assert running.process.wait(10) == 3 and resumed.process.wait(10) == 3


def test_the_pools_swap_step_keeps_sglangs_order_and_carries_a_request_across_it(stand_in, tmp_path):
    """A request in flight when the trainer needs the device is aborted, held through the step and
    finished on the new version; each app sees pause, flushes until idle, releases everything,
    then resumes the weights, loads, resumes the rest and continues."""
    apps = [stand_in("--token-delay", "0.01") for _ in range(2)]

    async def scenario():
        engines = [SGLangEngine(app.address) for app in apps]
        pool = EnginePool(engines)
        try:
            task = asyncio.ensure_future(pool.generate([5, 6, 7], SamplingParams(max_new_tokens=60), "carried"))
            await _sent(engines, "carried", tokens=2)
            await asyncio.wait_for(pool.release_memory(), 30)
            released = [await _state(app.address) for app in apps]
            assert pool.released
            await asyncio.wait_for(pool.reload(str(tmp_path), 1), 30)
            out = await asyncio.wait_for(task, 30)
            return released, [await _state(app.address) for app in apps], out
        finally:
            await pool.close()

    released, after, out = asyncio.run(scenario())
    for state in released:
        assert state["released"] == ["cuda_graph", "kv_cache", "weights"]
        window = _after_release(state["calls"])
        assert window[0] == "pause:abort" and window[-2:] == ["flush:ok", "release:kv_cache,weights,cuda_graph"]
    for state in after:
        assert state["released"] == [] and _after_release(state["calls"])[-4:] == SWAP_IN
    assert len(out.output_ids) == 60 and out.finish_reason == "length"
    assert [version for version, _ in out.versions.runs] == [0, 1]
    assert all(app.process.poll() is None for app in apps)


def _swap_run(apps, model_dir: Path, run_dir: Path, steps: int) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "rlorch.cli", "train", "inference=sglang", "trainer=fsdp",
               "trainer.fsdp.device=cpu", f"model.path={model_dir}",
               f"inference.addresses=[{','.join(app.address for app in apps)}]", "run.colocate=swap",
               "rollout.max_staleness=0", f"run.dir={run_dir}", "run.progress=false", "run.report=false",
               f"train.steps={steps}", "rollout.batch_size=8", "rollout.group_size=4", "rollout.max_new_tokens=4",
               "eval.enabled=false", "inference.control_timeout=5", "inference.reload_timeout=20"]
    return subprocess.run(command, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_a_swap_run_through_two_real_apps_trains_to_the_end_in_sglangs_order(stand_in, model_dir, tmp_path):
    apps = [stand_in("--token-delay", "0.002") for _ in range(2)]
    steps = 3
    result = _swap_run(apps, model_dir, tmp_path / "run", steps)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["lost"] == 0 and summary["steps"] == steps and summary["version"] == steps, summary
    for app in apps:
        calls = asyncio.run(_state(app.address))["calls"]
        releases = [i for i, call in enumerate(calls) if call.startswith("release")]
        assert len(releases) == steps, calls
        for i in releases:
            assert calls[i - 1] == "flush:ok" and calls[i + 1:i + 5] == SWAP_IN, calls
        assert app.process.poll() is None


@pytest.mark.slow
@pytest.mark.parametrize("flag, named", [("--refuse-release", "release refused (--refuse-release)"),
                                         ("--exit-after-release", "lost while its memory was released")])
def test_a_refused_release_or_an_engine_lost_while_released_fails_the_run_naming_it(stand_in, model_dir, tmp_path,
                                                                                   flag, named):
    app = stand_in("--token-delay", "0.002", flag)
    result = _swap_run([app], model_dir, tmp_path / "run", 3)
    assert result.returncode == 1, result.stdout[-2000:] + result.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    reason = summary["reason"]
    assert summary["status"] == "failed" and app.address in reason and named in reason, summary
    assert "run.colocate=swap" in reason and summary["lost"] == 0, summary
