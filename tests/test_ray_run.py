"""``rlorch train run.launcher=ray`` end to end on CPU engines: a server actor killed mid-run is
restarted and rejoins with nothing lost; neither a normal exit nor a kill -9 of the orchestrator leaves
anything of the run, on a private cluster or on one that outlives the run.

Each run starts a private local Ray cluster (seconds on a small machine): slow.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

pytest.importorskip("ray")
sys.path.insert(0, str(Path(__file__).parent))
import faults  # noqa: E402
from helpers import records_of  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.cluster]
RAY = ["run.launcher=ray", "inference=cpu", "inference.num_servers=2", "run.progress=false", "run.report=false",
       "inference.health_interval=0.5", "inference.health_timeout=2", "inference.hang_timeout=600"]


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _server_pids(run_dir: Path) -> list[int]:
    return [s["pid"] for s in json.loads((run_dir / "servers.json").read_text())]


def test_a_killed_server_actor_is_restarted_rejoins_and_nothing_is_lost(tmp_path):
    run_dir = tmp_path / "run"
    run = faults.Run("train", *RAY, f"run.dir={run_dir}", "train.steps=2000")
    try:
        faults.wait_for(lambda: faults.trainer_steps(run_dir) >= 3, 400, "three trainer steps")
        actor = _parent(_server_pids(run_dir)[0])
        assert b"ray::" in Path(f"/proc/{actor}/cmdline").read_bytes()
        os.kill(actor, signal.SIGKILL)
        faults.wait_for(lambda: any(r["engines_server_restarts"] >= 1 and r["engines_servers_up"] == 2
                                    and r["engines_servers_dead"] == 0 for r in records_of(run_dir, "periodic")), 300,
                        "the restarted server back in rotation")
        steps = faults.trainer_steps(run_dir)
        faults.wait_for(lambda: faults.trainer_steps(run_dir) >= steps + 2, 300, "two more steps")
        os.kill(run.pid, signal.SIGTERM)
        code = run.wait(300)
        leftovers = faults.leftovers_after(run.tag)
    finally:
        run.kill_all()
    assert code == 128 + signal.SIGTERM, run.output[-3000:]
    summary = faults.summary(run_dir)
    assert summary["lost"] == 0 and summary["status"] == "interrupted", summary
    assert summary["server_restarts"] == 1 and summary["servers_up"] == 2, summary
    assert "restart 1 of 3" in run.output
    assert leftovers == 0


def test_kill_9_of_the_orchestrator_leaves_nothing_of_the_run(tmp_path):
    run_dir = tmp_path / "run"
    run = faults.Run("train", *RAY, f"run.dir={run_dir}", "train.steps=400")
    try:
        faults.wait_for(lambda: faults.trainer_steps(run_dir) >= 1, 400, "a trainer step")
        assert faults.tagged(run.tag)
        os.kill(run.pid, signal.SIGKILL)
        leftovers = faults.leftovers_after(run.tag, 30.0)
        alive = [Path(f"/proc/{p}/cmdline").read_bytes()[:120] for p in faults.tagged(run.tag)]
    finally:
        run.kill_all()
    assert leftovers == 0, alive


def test_a_normal_exit_leaves_nothing_of_the_run(tmp_path):
    """A run that completes: its actors, servers, trainer ranks and private Ray cluster (all
    tagged processes of the run) are gone within 30 s of its exit."""
    run_dir = tmp_path / "run"
    run = faults.Run("train", *RAY, f"run.dir={run_dir}", "train.steps=3")
    try:
        code = run.wait(600)
        leftovers = faults.leftovers_after(run.tag, 30.0)
        alive = [Path(f"/proc/{p}/cmdline").read_bytes()[:120] for p in faults.tagged(run.tag)]
    finally:
        run.kill_all()
    assert code == 0, run.output[-3000:]
    assert faults.summary(run_dir)["status"] == "completed"
    assert leftovers == 0, alive


_CLUSTER_STATE = """
import json, sys, ray
ray.init(address=sys.argv[1], log_to_driver=False)
actors = [a for a in ray._private.state.actors().values() if a.get("State") not in ("DEAD", 4)]
groups = [g for g in ray.util.placement_group_table().values() if g.get("state") != "REMOVED"]
print(json.dumps({"actors": [a.get("ActorClassName") for a in actors], "groups": len(groups)}))
"""


def _cluster_state(address: str, env: dict) -> dict:
    done = subprocess.run([sys.executable, "-c", _CLUSTER_STATE, address], capture_output=True, text=True, timeout=120,
                          env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_kill_9_of_the_orchestrator_on_a_running_cluster_leaves_no_actor_or_placement_group(tmp_path):
    """``run.ray_address`` names a cluster that outlives the run (as ``auto`` does on a real
    one): after a kill -9 of the orchestrator, the cluster holds none of the run's actors or
    placement groups 30 s later, as Ray itself reports."""
    from helpers import free_port

    port = free_port()
    temp = tempfile.mkdtemp(prefix="rlorch-ray-")
    head = ["ray", "start", "--head", f"--port={port}", "--num-cpus=4", f"--temp-dir={temp}",
            "--include-dashboard=false", "--disable-usage-stats"]
    # A test cluster of this machine only: no token to hand around (the Slurm script's comment says
    # how a real cluster's token reaches its nodes).
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    subprocess.run(head, check=True, capture_output=True, timeout=180, env=env)
    address = f"127.0.0.1:{port}"
    run_dir = tmp_path / "run"
    try:
        run = faults.Run("train", *RAY, f"run.ray_address={address}", f"run.dir={run_dir}", "train.steps=400", env=env)
        try:
            faults.wait_for(lambda: faults.trainer_steps(run_dir) >= 1, 400, "a trainer step")
            during = _cluster_state(address, env)
            os.kill(run.pid, signal.SIGKILL)
            deadline = time.monotonic() + 30
            while (after := _cluster_state(address, env))["actors"] or after["groups"]:
                if time.monotonic() > deadline:
                    break
                time.sleep(1)
        finally:
            run.kill_all()
    finally:
        _stop_cluster(temp)
    assert during["actors"] and during["groups"], during  # the run did place its actors on that cluster
    assert not after["actors"] and not after["groups"], after


def _stop_cluster(temp: str) -> None:
    """End the cluster started at ``temp`` (only its processes: ``ray stop`` would end every
    cluster on the machine)."""
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            if temp.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                os.kill(int(pid), signal.SIGKILL)
        except (OSError, ValueError):
            pass
