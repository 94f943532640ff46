"""Slow and hung engines: a slow one is kept and reported as the slowest; a weight update does not
wait for a frozen one (SIGSTOP) longer than ``inference.control_timeout``. Real `rlorch serve`
engines over HTTP, the sim trainer. The frozen engine mid-run (routed around, killed after
``inference.hang_timeout`` and restarted; or, the only one, failing the run) is a case of the fault
suite: ``freeze_engine`` and ``freeze_only_engine`` in tests/faults.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlorch.launch.local import free_port

pytestmark = [pytest.mark.slow, pytest.mark.faults]

FAST_DETECTION = ("inference.health_interval=0.5", "inference.health_timeout=1", "inference.health_failures=2",
                  "inference.control_timeout=2", "inference.reload_timeout=10", "inference.hang_timeout=4")


def start_train(run_dir: Path, *overrides: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "rlorch.cli", "train", "inference=cpu", "trainer=sim", f"run.dir={run_dir}",
               "run.progress=false", "run.report=false", "eval.enabled=false", "rollout.batch_size=16",
               "rollout.group_size=4", "rollout.max_concurrent=32", "rollout.max_new_tokens=8",
               "trainer.sim.step_time=0.1", *FAST_DETECTION, *overrides]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.fixture(scope="module")
def served(model_dir):
    """One `rlorch serve` process for the module, started once: its port and process. The tests
    that freeze it (SIGSTOP) let it go again (SIGCONT) before they end."""
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "rlorch.cli", "serve", f"model.path={model_dir}", "--port",
                               str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    yield port, server
    server.terminate()
    server.wait(30)


def test_a_slow_engine_is_kept_and_shows_as_the_slowest(tmp_path, model_dir, served):
    port, slow_port = served[0], free_port()
    slow = subprocess.Popen([sys.executable, "-m", "rlorch.cli", "serve", f"model.path={model_dir}",
                             "--port", str(slow_port), "--min-step-time", "0.05"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ports = [port, slow_port]
    try:
        run_dir = tmp_path / "slow"
        addresses = ",".join(f"127.0.0.1:{port}" for port in ports)
        process = start_train(run_dir, "train.steps=20", f"inference.addresses=[{addresses}]",
                              "inference.ready_timeout=120")
        output, _ = process.communicate(timeout=300)
    finally:
        slow.terminate()
        slow.wait(30)
    assert process.returncode == 0, output[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["lost"] == 0 and summary["servers_dead"] == 0 and summary["servers_suspect"] == 0, summary
    assert summary["server_slowest"] == f"127.0.0.1:{ports[1]}", summary
    assert summary["server_tokens_per_s_p10"] < summary["server_tokens_per_s_p90"], summary


def test_a_weight_update_goes_live_on_the_engines_that_answer_within_the_control_deadline(tmp_path, model_dir,
                                                                                          perturbed_dir, served):
    """One engine frozen as the update starts: the update waits for it no longer than
    inference.control_timeout, goes live on the other, and the frozen one is suspect."""
    import asyncio

    from rlorch.inference.client import SGLangEngine
    from rlorch.inference.pool import EnginePool
    from rlorch.serve.server import CpuServer, ServerThread

    port, frozen = served
    healthy = ServerThread(CpuServer(model_dir, threads=1))
    try:
        async def scenario():
            engines = [SGLangEngine(f"127.0.0.1:{port}", control_timeout=1.0, reload_timeout=30.0),
                       SGLangEngine(healthy.address, control_timeout=1.0, reload_timeout=30.0)]
            pool = EnginePool(engines)
            try:
                deadline = time.monotonic() + 120
                while not await engines[0].healthy(2.0):
                    assert time.monotonic() < deadline, "rlorch serve did not start"
                os.kill(frozen.pid, signal.SIGSTOP)
                started = time.monotonic()
                await pool.reload(str(perturbed_dir), 1)
                took = time.monotonic() - started
                return took, await engines[1].weight_version(), pool.health()
            finally:
                os.kill(frozen.pid, signal.SIGCONT)
                await pool.close()

        took, live_version, health = asyncio.run(scenario())
    finally:
        healthy.stop()
    assert live_version == 1 and health["servers_up"] == 1 and health["servers_suspect"] == 1, health
    assert took < 1.0 + 10, f"the update waited {took:.1f}s for the frozen engine"
