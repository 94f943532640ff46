"""EnginePool and the launcher over real servers: failover loses no request, reloads reach every
live server, a returning server is synced before it rejoins, launch failures show the log tail.

Servers speak SGLang v0.5.x's native API (/generate, /update_weights_from_disk,
/pause_generation, /continue_generation, /health_generate, /get_server_info).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import time

import pytest

from helpers import wait_until_async
from rlorch.config.schema import Config, ConfigError, InferenceBackend
from rlorch.inference.client import EngineError, SGLangEngine
from rlorch.inference.servers import LaunchError, start_engines
from rlorch.inference.pool import EnginePool
from rlorch.serve.server import CpuServer, ServerThread, rlorch_version
from rlorch.types import Engine, SamplingParams

PROMPT = [5, 6, 7, 8]


def cpu_config(num_servers: int) -> Config:
    config = Config()
    config.inference.backend = InferenceBackend.cpu
    config.inference.num_servers = num_servers
    config.inference.ready_timeout = 120
    config.inference.shutdown_timeout = 5
    config.inference.cpu.threads = 1
    config.rollout.request_timeout = 60
    return config


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def _progress(engine: SGLangEngine) -> int:
    return (await engine.server_info())["internal_states"][0]["generated_tokens"]


def test_launched_pool_reloads_and_survives_a_killed_server(model_dir, perturbed_dir, tmp_path):
    config = cpu_config(2)
    config.inference.max_restarts = 0  # a dead server stays dead here (restarts: test_ray_run, test_scale)
    log_dir = tmp_path / "run" / "logs"

    async def scenario():
        pool = await start_engines(config, log_dir=log_dir, servers_file=log_dir.parent / "servers.json",
                                   model_path=model_dir)
        try:
            assert isinstance(pool, Engine)
            for engine in pool.engines:
                engine.extra_params = {"ignore_eos": True}
            await pool.reload(str(perturbed_dir), 1)
            versions = [await e.weight_version() for e in pool.engines]
            with pytest.raises(EngineError, match="not a directory"):
                await pool.reload(str(tmp_path / "missing"), 2)
            assert pool.gauges()["version"] == 1
            servers = json.loads((tmp_path / "run" / "servers.json").read_text())
            victim = pool.engines[0]
            start = await _progress(victim)
            params = SamplingParams(max_new_tokens=100)
            pending = [asyncio.ensure_future(pool.generate(PROMPT, params, f"r{i}")) for i in range(16)]
            deadline = time.monotonic() + 120
            while await _progress(victim) < start + 5:
                assert time.monotonic() < deadline, "the first server generated nothing in 120 s"
                await asyncio.sleep(0.01)
            assert pool.gauges()["in_flight"][victim.name] > 0
            os.kill(servers[0]["pid"], signal.SIGKILL)
            results = await asyncio.gather(*pending)
            gauges = pool.gauges()
            # README: a launched engine that exits is out of the pool within a second, even with
            # no request to notice it (its exit is looked for every 0.5 s); 3 s leaves room for a
            # loaded machine.
            os.kill(servers[1]["pid"], signal.SIGKILL)
            killed = time.monotonic()
            while pool.health()["servers_dead"] < 2:
                assert time.monotonic() - killed < 3, f"an idle server killed 3 s ago is in the pool: {pool.health()}"
                await asyncio.sleep(0.02)
        finally:
            await pool.close()
        return versions, servers, results, gauges

    versions, servers, results, gauges = asyncio.run(scenario())
    assert versions == [1, 1]
    assert [s["version"] for s in servers] == [rlorch_version()] * 2
    assert all(len(r.output_ids) == 100 and r.versions.count == 100 for r in results)
    assert all(r.versions.head == r.versions.tail == 1 for r in results)
    assert gauges["servers_up"] == 1 and gauges["failovers"] >= 1 and gauges["completed"] == 16
    assert not any(alive(s["pid"]) for s in servers)
    assert (log_dir / "server-0.log").exists() and (log_dir / "server-1.log").exists()


def test_launch_with_a_bad_model_path_fails_with_the_log_tail(tmp_path):
    config = cpu_config(1)
    (tmp_path / "not-a-model").mkdir()

    async def scenario():
        await start_engines(config, log_dir=tmp_path / "logs", servers_file=tmp_path / "servers.json",
                            model_path=tmp_path / "not-a-model")

    with pytest.raises(LaunchError, match="not an HF model directory") as info:
        asyncio.run(scenario())
    assert "server-0.log" in str(info.value)


def test_a_server_whose_port_was_taken_before_it_bound_starts_again_on_another(model_dir, tmp_path, monkeypatch):
    """free_port lets its socket go and the server binds seconds later, after loading the model:
    another process may take the port in between. That server starts again on a new port rather
    than failing the run."""
    import rlorch.launch.local

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    first_choice = iter([port])
    choose = rlorch.launch.local.free_port
    monkeypatch.setattr(rlorch.launch.local, "free_port",
                        lambda host="127.0.0.1": next(first_choice, None) or choose(host))

    async def scenario():
        pool = await start_engines(cpu_config(1), log_dir=tmp_path / "logs", servers_file=tmp_path / "servers.json",
                                   model_path=model_dir)
        try:
            return await pool.engines[0].healthy()
        finally:
            await pool.close()

    try:
        assert asyncio.run(scenario())
    finally:
        taken.close()
    [record] = json.loads((tmp_path / "servers.json").read_text())
    assert record["address"] != f"127.0.0.1:{port}"
    assert "address already in use" in (tmp_path / "logs" / "server-0.log").read_text().lower()


def test_down_server_rejoins_synced_to_the_current_version(model_dir, perturbed_dir):
    first = ServerThread(CpuServer(model_dir, threads=1))
    second = ServerThread(CpuServer(model_dir, threads=1))
    port = int(second.address.rsplit(":", 1)[1])
    replacement = None

    async def scenario():
        nonlocal replacement
        engines = [SGLangEngine(thread.address, request_timeout=30) for thread in (first, second)]
        pool = EnginePool(engines, request_timeout=30, max_retries=3, probe_interval=0.1)
        try:
            second.stop()
            results = await asyncio.gather(*(pool.generate(PROMPT, SamplingParams(max_new_tokens=4), f"q{i}")
                                             for i in range(2)))
            results += await pool.generate_group(PROMPT, SamplingParams(max_new_tokens=4), 2, "group")
            assert pool.gauges()["servers_up"] == 1
            await pool.reload(str(perturbed_dir), 1)
            replacement = ServerThread(CpuServer(model_dir, threads=1), port=port)
            for _ in range(300):
                if pool.gauges()["servers_up"] == 2:
                    break
                await asyncio.sleep(0.05)
            return results, pool.gauges(), await engines[1].weight_version()
        finally:
            await pool.close()

    try:
        results, gauges, rejoined_version = asyncio.run(scenario())
    finally:
        first.stop()
        if replacement is not None:
            replacement.stop()
    assert len(results) == 4 and all(r.output_ids for r in results)
    assert gauges["servers_up"] == 2 and gauges["version"] == 1
    assert rejoined_version == 1


def test_server_versions_are_recorded_and_a_mismatch_is_refused(model_dir, tmp_path):
    from rlorch.inference.servers import record_versions
    from rlorch.launch.base import Launched

    thread = ServerThread(CpuServer(model_dir, threads=1))

    async def scenario():
        engine = SGLangEngine(thread.address)
        servers = [Launched("server", 0, thread.address, None)]
        try:
            await record_versions(servers, [engine], tmp_path / "servers.json", rlorch_version())
            with pytest.raises(LaunchError, match="expect_version"):
                await record_versions(servers, [engine], tmp_path / "mismatch.json", "0.0.0-other")
        finally:
            await engine.close()

    try:
        asyncio.run(scenario())
    finally:
        thread.stop()
    (record,) = json.loads((tmp_path / "servers.json").read_text())
    assert record["version"] == rlorch_version() and record["address"] == thread.address


def test_server_commands(tmp_path):
    from rlorch.launch.server_command import server_command
    from rlorch.serve.arguments import launched_parser

    config = cpu_config(1)
    config.inference.launch_args = ["--max-batch", "8"]
    cpu = server_command(config, model_path=tmp_path, port=1234)
    assert cpu[1:3] == ["-m", "rlorch.serve.server"] and cpu[cpu.index("--model-path") + 1] == str(tmp_path)
    parsed = launched_parser().parse_args(cpu[3:])  # the launched engine's own parser takes it
    assert (parsed.port, parsed.threads, parsed.max_batch) == (1234, 1, 8)  # a launch arg given again wins
    # The engine's weight group waits no longer than the run waits for a transfer.
    assert parsed.transfer_timeout == config.inference.transfer_timeout
    config.inference.backend = InferenceBackend.sglang
    config.inference.launch_args = ["--mem-fraction-static", "0.8"]
    sglang = server_command(config, model_path=tmp_path, port=1234)
    assert sglang[1:3] == ["-m", "sglang.launch_server"] and sglang[-4:-2] == ["--mem-fraction-static", "0.8"]
    assert sglang[sglang.index("--model-path") + 1] == str(tmp_path) and "--weight-version" in sglang
    assert sglang[-2:] == ["--attention-backend", "triton"]  # float32: FA3 (Hopper) has no fp32 kernels
    config.model.dtype = "bfloat16"
    assert "--attention-backend" not in server_command(config, model_path=tmp_path, port=1234)


def test_connecting_to_running_servers_launches_nothing_and_sends_the_api_key(model_dir, tmp_path, monkeypatch):
    """README: for servers given by inference.addresses the client sends RLORCH_API_KEY if set
    (the server refuses requests without it: see test_faults)."""
    thread = ServerThread(CpuServer(model_dir, threads=1, api_key="s3cret-key"))
    config = cpu_config(1)
    config.inference.addresses = [thread.address]
    monkeypatch.setenv("RLORCH_API_KEY", "s3cret-key")

    async def scenario():
        pool = await start_engines(config, log_dir=tmp_path / "logs", servers_file=tmp_path / "servers.json",
                                   model_path=model_dir)
        try:
            return await pool.generate(PROMPT, SamplingParams(max_new_tokens=3), "remote")
        finally:
            await pool.close()

    try:
        result = asyncio.run(scenario())
        assert call_ok(thread.address)
    finally:
        thread.stop()
    assert result.versions.count == len(result.output_ids) >= 1
    assert json.loads((tmp_path / "servers.json").read_text())[0]["pid"] is None


def call_ok(address: str) -> bool:
    import urllib.request

    with urllib.request.urlopen(f"http://{address}/health", timeout=10) as response:
        return response.status == 200


def test_batch_on_a_server_that_is_gone_starts_again_on_a_live_one(model_dir):
    from rlorch.types import GroupRequest

    first = ServerThread(CpuServer(model_dir, threads=1))
    second = ServerThread(CpuServer(model_dir, threads=1))
    requests = [GroupRequest(PROMPT, SamplingParams(max_new_tokens=4), 2, "a"),
                GroupRequest([9, 10], SamplingParams(max_new_tokens=3), 1, "b")]

    async def scenario():
        engines = [SGLangEngine(thread.address, request_timeout=30, extra_params={"ignore_eos": True}) for thread in (first, second)]
        pool = EnginePool(engines, request_timeout=30, max_retries=3, probe_interval=0.1)
        try:
            second.stop()
            answers = [await pool.generate_batch(requests) for _ in range(2)]
            return answers, pool.gauges()
        finally:
            await pool.close()

    try:
        answers, gauges = asyncio.run(scenario())
    finally:
        first.stop()
    assert gauges["failovers"] >= 1 and gauges["servers_up"] == 1 and gauges["in_flight_total"] == 0
    for groups in answers:
        assert [len(group) for group in groups] == [2, 1]
        assert [len(g.output_ids) for group in groups for g in group] == [4, 4, 3]


def test_a_launched_server_that_exits_is_started_again_and_rejoins_at_the_current_version(
        model_dir, perturbed_dir, tmp_path):
    config = cpu_config(1)
    config.inference.max_restarts = 1
    log_dir = tmp_path / "run" / "logs"

    async def scenario():
        pool = await start_engines(config, log_dir=log_dir, servers_file=log_dir.parent / "servers.json",
                                   model_path=model_dir)
        try:
            await pool.reload(str(perturbed_dir), 1)
            pid = json.loads((tmp_path / "run" / "servers.json").read_text())[0]["pid"]
            os.kill(pid, signal.SIGKILL)
            deadline = time.monotonic() + 120
            while pool.health()["server_restarts"] < 1 or pool.health()["servers_up"] < 1:
                assert time.monotonic() < deadline, f"not restarted within 120 s: {pool.health()}"
                await asyncio.sleep(0.05)
            generation = await pool.generate(PROMPT, SamplingParams(max_new_tokens=4), "after")
            recorded = json.loads((tmp_path / "run" / "servers.json").read_text())
            return generation, await pool.engines[0].weight_version(), pool.health(), pid, recorded
        finally:
            await pool.close()

    generation, version, health, killed, recorded = asyncio.run(scenario())
    assert version == 1 and generation.versions.head == generation.versions.tail == 1
    assert health["servers_dead"] == 0 and health["server_restarts"] == 1
    # servers.json names the restarted process, not the killed one.
    assert [r["index"] for r in recorded] == [0] and recorded[0]["pid"] not in (None, killed)


class Restartable:
    """A server as the pool sees it that is down (connection refused) until ``alive`` is set."""

    name, tp_size = "a", 1

    def __init__(self) -> None:
        self.alive = False

    async def generate(self, input_ids, params, rid, prefix=None):
        from types import SimpleNamespace

        from rlorch.inference.client import EngineUnavailable

        if not self.alive:
            raise EngineUnavailable(f"{self.name}: connection refused")
        return SimpleNamespace(output_ids=[1, 2])

    async def healthy(self, timeout=None) -> bool:
        return self.alive

    async def resume(self) -> None:
        if not self.alive:
            raise EngineError(f"{self.name}: connection refused")

    async def weight_version(self):
        return None

    async def close(self) -> None: ...


def test_a_request_waits_for_a_dead_server_that_will_be_restarted_and_fails_at_once_otherwise():
    """The sole server's process exited: while the supervisor has a restart left, a request waits
    for it (and completes on the new process) instead of failing at once, which would end a run
    whose only server crashed; with no restart left it fails at once, naming the exit."""
    server = Restartable()

    async def scenario():
        pool = EnginePool([server], probe_interval=0.01,
                          diagnose=lambda name: None if server.alive else "a exited with status -9")
        pool.restartable = lambda name: True
        waiting = asyncio.create_task(pool.generate(PROMPT, SamplingParams(max_new_tokens=2), "r0"))
        await wait_until_async(lambda: pool.health()["servers_dead"] == 1 or waiting.done(), 10, "the server dead")
        await asyncio.sleep(0.3)    # a window in which the request must not fail: what it must not do, not a state
        assert not waiting.done() and pool.health()["servers_dead"] == 1
        server.alive = True
        pool.restarted("a")
        assert (await asyncio.wait_for(waiting, 10)).output_ids == [1, 2]
        server.alive = False
        pool.restartable = lambda name: False
        started = time.monotonic()
        with pytest.raises(EngineError, match="no live server: a exited with status -9"):
            await pool.generate(PROMPT, SamplingParams(max_new_tokens=2), "r1")
        assert time.monotonic() - started < 1.0
        await pool.close()

    asyncio.run(scenario())


@pytest.mark.parametrize("launch_args, fragment", [
    (["inference.cpu.max_batch=8"], "not a flag of the CPU engine: inference.cpu.max_batch=8"),
    (["--threads", "two"], "argument --threads: invalid int value"),
    (["--max-batch"], "expected one argument"),
])
def test_cpu_launch_args_the_engine_would_refuse_are_refused_before_the_run_naming_the_key(launch_args, fragment):
    from rlorch.config.preflight import preflight

    config = cpu_config(1)
    config.inference.launch_args = launch_args
    with pytest.raises(ConfigError, match=fragment) as raised:
        preflight(config)
    assert raised.value.key == "inference.launch_args"
    config.inference.launch_args = ["--min-step-time", "0.05"]
    preflight(config)
