"""The real sglang-router in front of two real SGLang apps, and rlorch's launch commands parsed by
the real ``ServerArgs``."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from rlorch.config.compose import compose
from rlorch.inference.client import SGLangEngine
from rlorch.launch.server_command import server_command
from rlorch.inference.pool import EnginePool
from rlorch.inference.routed import RoutedServer
from rlorch.types import SamplingParams

from contract_apps import StandIn, require_sglang, wait_for_requests
from rlorch.launch.local import free_port


@pytest.fixture(scope="module")
def routed(model_dir):
    require_sglang()
    if importlib.util.find_spec("sglang_router") is None:
        message = "sglang-router is not installed (pip install --no-deps sglang-router==0.3.2)"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(message)
        pytest.skip(message)
    workers = [StandIn(model_dir, "--token-delay", "0.02") for _ in range(2)]
    port = free_port()
    log = Path(os.environ.get("TMPDIR", "/tmp")) / f"sglang-router-{port}.log"
    with open(log, "wb") as handle:
        router = subprocess.Popen([sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
                                   "--port", str(port), "--prometheus-port", str(free_port()), "--worker-urls",
                                   *(f"http://{w.address}" for w in workers)],
                                  stdout=handle, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert router.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health_generate", timeout=5).read()
                break
            except OSError:
                time.sleep(0.3)
        yield f"127.0.0.1:{port}", [w.address for w in workers]
    finally:
        router.terminate()
        router.wait(10)
        for worker in workers:
            worker.stop()


def test_the_router_refuses_control_routes_so_they_go_to_every_worker(routed):
    router, workers = routed

    async def scenario():
        refused = {}
        probe = SGLangEngine(router)
        for path in ("/pause_generation", "/continue_generation", "/update_weights_from_disk", "/abort_request"):
            refused[path], _ = await probe._request("POST", path, timeout=10, payload={})
        info = await probe.server_info()
        await probe.close()
        server = RoutedServer(SGLangEngine(router), [SGLangEngine(w) for w in workers])
        pool = EnginePool([server])
        try:
            await pool.reload("/checkpoints/step_3", 3)
            outs = await pool.generate_group([5, 6, 7], SamplingParams(max_new_tokens=20), 4, "g0")
            running = asyncio.ensure_future(pool.generate([5, 6, 7], SamplingParams(max_new_tokens=40), "r"))
            while not server.router.wire_rid("r"):
                await asyncio.sleep(0.01)
            await wait_for_requests(workers, [server.router.wire_rid("r")], tokens=1)
            await pool.reload("/checkpoints/step_4", 4)
            return refused, info, outs, await running, await server.weight_version()
        finally:
            await pool.stop()

    refused, info, outs, running, version = asyncio.run(scenario())
    assert set(refused.values()) == {404} and "version" not in info
    assert all(o.versions.runs == [[3, 20]] for o in outs)
    assert [v for v, _ in running.versions.runs] == [3, 4] and len(running.output_ids) == 40
    assert version == 4


@pytest.mark.slow
def test_training_through_the_router_loses_nothing(routed, tmp_path):
    router, workers = routed
    run_dir = tmp_path / "run"
    command = [sys.executable, "-m", "rlorch.cli", "train", "inference=sglang", "trainer=sim",
               f"inference.router={router}", f"inference.addresses=[{','.join(workers)}]", f"run.dir={run_dir}",
               "run.progress=false", "train.steps=4", "rollout.batch_size=8", "rollout.group_size=4",
               "rollout.max_new_tokens=8", "eval.enabled=false", "trainer.sim.step_time=0.05"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["lost"] == 0 and summary["steps"] == 4, summary


PARSE = """
import json, sys
sys.path.insert(0, {stand_in_dir!r})
from sglang_stand_in import install_torchvision_placeholder
install_torchvision_placeholder()
from sglang.srt.server_args import prepare_server_args
out = []
for argv in json.loads(sys.stdin.read()):
    args = prepare_server_args(argv)
    out.append({{k: getattr(args, k) for k in ("model_path", "host", "port", "weight_version", "dtype",
                                               "random_seed", "tp_size", "mem_fraction_static",
                                               "enable_memory_saver")}})
print(json.dumps(out))
"""


def test_every_launch_command_parses_with_the_real_server_args(model_dir):
    require_sglang()
    variants = [[], ["model.dtype=bfloat16", "run.seed=7"], ["inference.tp_size=2", "inference.num_servers=2"],
                ["inference.launch_args=[--mem-fraction-static,0.5]"],
                ["run.colocate=swap", "rollout.max_staleness=0", "trainer=fsdp", "inference.memory_fraction=0.4"]]
    commands = []
    for overrides in variants:
        config = compose(["inference=sglang", *overrides])
        command = server_command(config, model_path=model_dir, port=30000)
        assert command[1:3] == ["-m", "sglang.launch_server"]
        commands.append(command[3:])
    result = subprocess.run([sys.executable, "-c", PARSE.format(stand_in_dir=str(Path(__file__).parent))],
                            input=json.dumps(commands), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    parsed = json.loads(result.stdout.strip().splitlines()[-1])
    assert [(p["dtype"], p["random_seed"], p["tp_size"], p["weight_version"]) for p in parsed] == [
        ("float32", 0, 1, "0"), ("bfloat16", 7, 1, "0"), ("float32", 0, 2, "0"), ("float32", 0, 1, "0"),
        ("float32", 0, 1, "0")]
    assert parsed[3]["mem_fraction_static"] == 0.5 and parsed[0]["port"] == 30000
    # A swap run's servers release real memory only with the memory saver on.
    assert parsed[4]["mem_fraction_static"] == 0.4 and parsed[4]["enable_memory_saver"]
    assert not any(p["enable_memory_saver"] for p in parsed[:4])
