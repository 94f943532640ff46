"""The simulated fleet (``rlorch fleet``) and the control plane's shared HTTP client, driven by the
real SGLang client and pool."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import numpy
import pytest

from helpers import hang, wait_until_async
from rlorch.inference.client import SGLangEngine
from rlorch.inference.control import ControlHTTP
from rlorch.inference.pool import EnginePool
from rlorch.serve.fleet import Fleet, FleetEngine, FleetProfile
from rlorch.types import GroupRequest, SamplingParams


def run(coroutine):
    return asyncio.run(coroutine)


async def _fleet(count: int, profile: FleetProfile) -> Fleet:
    fleet = Fleet(list(range(count)), 0, profile)
    await fleet.start()
    return fleet


def test_a_version_reaches_every_engine_through_one_shared_connection_pool():
    async def scenario():
        fleet = await _fleet(5, FleetProfile())
        control = ControlHTTP(concurrency=2)
        engines = [SGLangEngine(fleet.addresses[i], control_http=control) for i in range(5)]
        pool = EnginePool(engines)
        try:
            await pool.reload("/weights/step_3", 3)
            held = [await e.weight_version() for e in engines]
            kept = sum(len(connections) for connections in control._idle.values())
            return held, kept, [fleet.engines[i].version for i in range(5)]
        finally:
            await pool.stop()
            await fleet.stop()

    held, kept, versions = run(scenario())
    assert held == [3] * 5 and versions == ["3"] * 5
    assert 1 <= kept <= 5, "control calls reuse kept connections, at most one per server here"


def test_a_pause_cuts_a_running_generation_which_resumes_under_the_new_version():
    """The fleet aborts what runs on a pause, as SGLang does; the client resubmits after the
    update, and the trajectory's tokens carry both versions."""
    profile = FleetProfile(tokens_per_s=200.0, speed_spread=0.0, length_median=100, length_sigma=0.0)

    async def scenario():
        fleet = await _fleet(1, profile)
        engine = SGLangEngine(fleet.addresses[0])
        pool = EnginePool([engine])
        try:
            params = SamplingParams(max_new_tokens=100, temperature=1.0)
            running = asyncio.ensure_future(pool.generate_batch([GroupRequest([1, 2, 3], params, 1, "g")]))
            await wait_until_async(lambda: fleet.engines[0].running, 30, "the generation to start")
            await asyncio.sleep(0.02)   # tokens are counted by time generated: a few of the 100 (0.5 s)
            await pool.reload("/weights/step_1", 1)
            [[generation]] = await running
            return generation
        finally:
            await pool.stop()
            await fleet.stop()

    generation = run(scenario())
    assert len(generation.output_ids) == len(generation.logprobs) == 100
    assert generation.finish_reason == "length"
    versions = [version for version, _ in generation.versions.runs]
    assert versions[0] == 0 and versions[-1] == 1, generation.versions.runs


def test_completion_lengths_are_long_tailed_and_capped_and_stragglers_are_slower():
    profile = FleetProfile(tokens_per_s=100.0, stragglers=0.2, length_median=200, length_sigma=1.0, seed=3)
    engines = [FleetEngine(i, profile) for i in range(200)]
    lengths = [engines[0].draw_length(1000) for _ in range(2000)]
    assert max(lengths) == 1000 and min(lengths) >= 1
    assert sorted(lengths)[1000] < sum(lengths) / len(lengths), "mean above median: a long tail"
    slow = [e for e in engines if e.straggler]
    fast = [e for e in engines if not e.straggler]
    assert 20 <= len(slow) <= 60
    assert max(e.speed for e in slow) < sorted(e.speed for e in fast)[len(fast) // 2]


def test_the_control_client_reads_chunked_and_read_to_close_answers_and_bounds_concurrency():
    async def scenario():
        on_wire, most = 0, 0
        release = asyncio.Event()   # the /y calls are held until as many as the bound are on the wire

        async def handle(reader, writer):
            nonlocal on_wire, most
            request = await reader.readuntil(b"\r\n\r\n")
            on_wire += 1
            most = max(most, on_wire)
            if b"/y" in request:
                await release.wait()
            on_wire -= 1
            if b"/chunked" in request:
                writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\n{\"a\r\n5\r\n\": 1}\r\n0\r\n\r\n")
            else:
                writer.write(b"HTTP/1.0 201 Created\r\n\r\n{\"b\": 2}")
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        control = ControlHTTP(concurrency=3)
        try:
            chunked = await control.request("127.0.0.1", port, "GET", "/chunked", timeout=5)
            closed = await control.request("127.0.0.1", port, "POST", "/x", body=b"{}", timeout=5)
            calls = asyncio.gather(*(control.request("127.0.0.1", port, "GET", "/y", timeout=5) for _ in range(10)))
            await wait_until_async(lambda: on_wire >= 3, 5, "three calls on the wire")
            release.set()
            await calls
            return chunked, closed, most
        finally:
            control.close()
            server.close()

    chunked, closed, most = run(scenario())
    assert chunked == (200, b'{"a": 1}')
    assert closed == (201, b'{"b": 2}')
    assert most == 3


def test_a_control_call_past_its_deadline_is_an_unavailable_server():
    from rlorch.inference.client import EngineUnavailable

    async def scenario():
        async def handle(reader, writer):
            await hang()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        engine = SGLangEngine(f"127.0.0.1:{server.sockets[0].getsockname()[1]}", control_timeout=0.3)
        try:
            await engine.pause()
        except EngineUnavailable as err:
            return str(err)
        finally:
            await engine.close()
            server.close()

    message = run(asyncio.wait_for(scenario(), 30))
    assert message and "/pause_generation" in message and "TimeoutError" in message


@pytest.mark.slow
def test_rlorch_trains_against_a_fleet_served_by_rlorch_fleet(tmp_path):
    fleet_file = tmp_path / "fleet.txt"
    fleet = subprocess.Popen([sys.executable, "-m", "rlorch.cli", "fleet", "--engines", "6", "--port-base", "0",
                              "--processes", "2", "--fleet-file", str(fleet_file), "--length-median", "8"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while not fleet_file.exists():
            assert fleet.poll() is None, fleet.stderr.read().decode()
            assert time.monotonic() < deadline, "the fleet did not start"
            time.sleep(0.1)
        addresses = fleet_file.read_text().split()
        assert len(addresses) == len(set(addresses)) == 6
        run_dir = tmp_path / "run"
        done = subprocess.run([sys.executable, "-m", "rlorch.cli", "train", "inference=sglang",
                               f"inference.addresses=[{','.join(addresses)}]", "trainer=sim", f"run.dir={run_dir}",
                               "train.steps=6", "rollout.max_new_tokens=16", "run.report=false",
                               "inference.parse_workers=1"],
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["status"] == "completed" and summary["steps"] == 6
        assert summary["lost"] == 0 and summary["trained"] == summary["admitted"]
        steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        assert max(s["version"] for s in steps if s["kind"] == "step") == 6
    finally:
        fleet.terminate()
        fleet.wait(10)


def test_a_weight_update_waits_for_the_last_servers_of_a_large_fleet_but_not_for_a_hung_one(monkeypatch):
    """In a large fleet the calls' own issuing spreads their answers: the update waits
    SETTLE_FACTOR times as long as *half* the servers took, not the first one."""
    from rlorch.inference import pool

    monkeypatch.setattr(pool, "SETTLE_MIN_S", 0.0)

    async def scenario():
        tasks = [asyncio.ensure_future(asyncio.sleep(0.2 * i)) for i in range(1, 11)]
        hung = asyncio.ensure_future(asyncio.sleep(100))
        await pool._settle(tasks + [hung])
        await asyncio.sleep(0)
        return [t.cancelled() for t in tasks], hung.cancelled()

    cancelled, hung = run(scenario())
    assert not any(cancelled), "every server finished within 4x the time half of them took"
    assert hung


def test_full_logprobs_are_written_as_sglang_writes_a_float32():
    rounded = Fleet([0], 0, FleetProfile())._entries[:200]
    full = Fleet([0], 0, FleetProfile(full_logprobs=True))._entries[:200]
    assert all(round(lp, 4) == lp for lp, _, _ in rounded)
    assert all(float(numpy.float32(lp)) == lp for lp, _, _ in full)
    assert sum(len(repr(lp)) for lp, _, _ in full) > 2 * sum(len(repr(lp)) for lp, _, _ in rounded)


@pytest.mark.parametrize("option", ["--engines", "--processes", "--slots"])
def test_a_count_below_one_is_refused_naming_the_option(option):
    from typer.testing import CliRunner

    from rlorch.cli import app

    result = CliRunner().invoke(app, ["fleet", option, "0"], env={"COLUMNS": "200"})
    assert result.exit_code == 2, result.output
    assert f"Invalid value for '{option}': Input should be greater than or equal to 1" in result.output, result.output
