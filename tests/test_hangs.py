"""A hung engine (alive, answering nothing: SIGSTOP) never stops the run: it is found by the
health probe, routed around, killed after ``inference.hang_timeout`` and restarted; a slow one is
kept. Real `rlorch serve` engines over HTTP, the sim trainer."""

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


def steps_of(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [record for record in map(json.loads, lines) if record["kind"] == "step"]


def freeze_server_after(run_dir: Path, index: int, steps: int) -> int:
    """SIGSTOP launched server ``index`` once ``steps`` steps are recorded; its pid."""
    deadline = time.monotonic() + 120
    while len(steps_of(run_dir)) < steps:
        assert time.monotonic() < deadline, "the run made no progress"
        time.sleep(0.05)
    pid = json.loads((run_dir / "servers.json").read_text())[index]["pid"]
    os.kill(pid, signal.SIGSTOP)
    return pid


def test_a_frozen_engine_is_routed_around_killed_restarted_and_loses_nothing(tmp_path):
    run_dir = tmp_path / "frozen"
    process = start_train(run_dir, "train.steps=200", "inference.num_servers=2")
    frozen = freeze_server_after(run_dir, 0, 10)
    frozen_at = time.monotonic()
    try:
        output, _ = process.communicate(timeout=300)
    finally:
        os.kill(frozen, signal.SIGCONT) if _alive(frozen) else None
    assert process.returncode == 0, output[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["lost"] == 0 and summary["steps"] == 200, summary
    assert summary["server_restarts"] >= 1 and summary["servers_dead"] == 0, summary
    assert not _alive(frozen), "the frozen server was not killed"
    steps = steps_of(run_dir)
    # Training went on while the server was frozen: steps were recorded before the hang timeout.
    assert any(r["step"] > 10 and r.get("servers_suspect") for r in steps), "no step while the server was suspect"
    # ... and the restarted server rejoined: both up again after a restart.
    assert any(r.get("server_restarts") and r.get("servers_up") == 2 for r in steps), "the restarted server never rejoined"
    assert time.monotonic() - frozen_at < 300


def test_the_only_engine_frozen_fails_the_run_naming_it_and_the_keys(tmp_path):
    run_dir = tmp_path / "only"
    process = start_train(run_dir, "train.steps=400", "inference.num_servers=1", "inference.max_restarts=0")
    frozen = freeze_server_after(run_dir, 0, 3)
    frozen_at = time.monotonic()
    try:
        output, _ = process.communicate(timeout=120)
    finally:
        os.kill(frozen, signal.SIGCONT) if _alive(frozen) else None
    took = time.monotonic() - frozen_at
    assert process.returncode == 1, output[-3000:]
    assert took < 4 + 15, f"the run took {took:.0f}s to fail after the freeze"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "failed", summary
    assert "hung" in summary["error"] and "inference.hang_timeout" in summary["error"], summary["error"]
    assert "inference.max_restarts" in summary["error"], summary["error"]


def test_a_slow_engine_is_kept_and_shows_as_the_slowest(tmp_path, model_dir):
    ports = [free_port(), free_port()]
    servers = [subprocess.Popen([sys.executable, "-m", "rlorch.cli", "serve", f"model.path={model_dir}",
                                 "--port", str(port), *(["--min-step-time", "0.05"] if i else [])],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
               for i, port in enumerate(ports)]
    try:
        run_dir = tmp_path / "slow"
        addresses = ",".join(f"127.0.0.1:{port}" for port in ports)
        process = start_train(run_dir, "train.steps=20", f"inference.addresses=[{addresses}]",
                              "inference.ready_timeout=120")
        output, _ = process.communicate(timeout=300)
    finally:
        for server in servers:
            server.terminate()
            server.wait(30)
    assert process.returncode == 0, output[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["lost"] == 0 and summary["servers_dead"] == 0 and summary["servers_suspect"] == 0, summary
    assert summary["server_slowest"] == f"127.0.0.1:{ports[1]}", summary
    assert summary["server_tokens_per_s_p10"] < summary["server_tokens_per_s_p90"], summary


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_a_weight_update_goes_live_on_the_engines_that_answer_within_the_control_deadline(tmp_path, model_dir,
                                                                                          perturbed_dir):
    """One engine frozen as the update starts: the update waits for it no longer than
    inference.control_timeout, goes live on the other, and the frozen one is suspect."""
    import asyncio

    from rlorch.inference.client import SGLangEngine
    from rlorch.inference.pool import EnginePool
    from rlorch.serve.server import CpuServer, ServerThread

    port = free_port()
    frozen = subprocess.Popen([sys.executable, "-m", "rlorch.cli", "serve", f"model.path={model_dir}", "--port",
                               str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
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
        frozen.kill()
        frozen.wait(30)
        healthy.stop()
    assert live_version == 1 and health["servers_up"] == 1 and health["servers_suspect"] == 1, health
    assert took < 1.0 + 10, f"the update waited {took:.1f}s for the frozen engine"
