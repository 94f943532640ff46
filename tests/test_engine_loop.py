"""The orchestrator with real generation: `rlorch serve` engines over HTTP, the sim trainer."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path



def start_train(run_dir: Path, *overrides: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "rlorch.cli", "train", "inference=cpu", "trainer=sim",
               f"run.dir={run_dir}", "run.progress=false", "rollout.batch_size=16", "rollout.group_size=4",
               "rollout.max_concurrent=32", "rollout.max_new_tokens=8", "trainer.sim.step_time=0.2", *overrides]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(process: subprocess.Popen, run_dir: Path) -> tuple[dict, list[dict]]:
    output, _ = process.communicate(timeout=240)
    assert process.returncode == 0, output
    summary = json.loads((run_dir / "summary.json").read_text())
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return summary, [r for r in steps if r["kind"] == "step"]


def test_train_with_real_generation_end_to_end(tmp_path):
    run_dir = tmp_path / "cpu"
    summary, steps = finish(start_train(run_dir, "train.steps=6", "inference.num_servers=1",
                                        "rollout.enforce=strict"), run_dir)
    assert summary["lost"] == 0 and summary["trained"] == 6 * 16
    first = json.loads((run_dir / "rollouts" / "step_000001.jsonl").read_text().splitlines()[0])
    assert first["prompt_len"] > 0 and sum(first["loss_mask"]) == len(first["tokens"]) - first["prompt_len"]
    assert len(first["logprobs"]) == len(first["tokens"]) and all(lp <= 0 for lp in first["logprobs"])
    assert sum(count for _, count in first["versions"]) == sum(first["loss_mask"])
    servers = json.loads((run_dir / "servers.json").read_text())
    assert servers[0]["version"]
    assert max(r["age_max"] for r in steps) <= 2


def test_killing_one_of_two_servers_mid_run_loses_no_rollout(tmp_path):
    run_dir = tmp_path / "kill"
    process = start_train(run_dir, "train.steps=10", "inference.num_servers=2",
                          "rollout.request_timeout=30")
    servers_file, metrics = run_dir / "servers.json", run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if servers_file.exists() and metrics.exists() and metrics.read_text().count('"kind": "step"') >= 2:
            break
        time.sleep(0.1)
    victim = json.loads(servers_file.read_text())[0]["pid"]
    os.killpg(victim, signal.SIGKILL)
    summary, steps = finish(process, run_dir)
    assert summary["status"] == "completed" and summary["lost"] == 0
    assert summary["trained"] == 10 * 16 and len(steps) == 10


def test_a_launched_server_exits_when_its_launcher_is_gone(tmp_path):
    launcher = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    server = subprocess.Popen([sys.executable, "-m", "rlorch.cli", "serve", "--port", "0",
                               "--parent-pid", str(launcher.pid)], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    time.sleep(8)
    assert server.poll() is None
    launcher.kill()
    launcher.wait()
    output, _ = server.communicate(timeout=30)
    assert f"launching process {launcher.pid} is gone" in output
