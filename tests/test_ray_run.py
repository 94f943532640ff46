"""``rlorch train run.launcher=ray`` end to end on CPU engines: a server actor killed mid-run is
restarted and rejoins with nothing lost; neither a normal exit nor a kill -9 of the orchestrator leaves
anything of the run, on a private cluster (its processes found by the process tree and by Ray's
session directory, not only by the run's tag) or on one that outlives the run; ``rlorch scale``
grows the fleet when the cluster has room and says what a request waits for when it has not.

Each run starts a private local Ray cluster (seconds on a small machine): slow.
"""

from __future__ import annotations

import json
import os
import re
import shutil
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

from rlorch.launch.guard import descendants  # noqa: E402
from rlorch.lifecycle import process_running  # noqa: E402

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


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _private_cluster_temp_dir(pids) -> Path:
    """The private cluster's temp dir, read off its ``ray start`` command line."""
    for pid in pids:
        if found := re.search(r"--temp-dir=(\S+)", _cmdline(pid)):
            return Path(found.group(1))
    raise LookupError("no ray start among the run's processes")


def _session_pids(temp_dir: Path) -> set[int]:
    """The pids Ray's session directory names: its drivers' and workers' log files end in their pid."""
    logs = temp_dir / "session_latest" / "logs"
    return {int(m.group(1)) for f in logs.iterdir() if (m := re.search(r"[-_](\d+)\.(?:log|out|err)$", f.name))}


def _everything_of(run: faults.Run) -> tuple[set[int], Path]:
    """Every process of a running run: the orchestrator's process tree (the private cluster's
    guard, ray start, gcs_server, raylet, the agents, workers, actors and what they started), the
    pids in the cluster's session directory, and the tagged ones; and the cluster's temp dir."""
    tree = {run.pid, *descendants(run.pid)}
    temp_dir = _private_cluster_temp_dir(tree)
    session = _session_pids(temp_dir)
    assert session - {run.pid}, f"no worker pid in {temp_dir}"
    names = " ".join(_cmdline(pid) for pid in tree)
    for part in ("gcs_server", "raylet", "ray::DashboardAgent", "ray::RuntimeEnvAgent", "rlorch.launch.guard"):
        assert part in names, f"{part} not in the run's process tree"
    return tree | session | set(faults.tagged(run.tag)), temp_dir


def _gone_within(pids: set[int], seconds: float) -> tuple[float, list[str]]:
    """Seconds until none of ``pids`` runs (polled), and the command lines of those left after ``seconds``."""
    started = time.monotonic()
    while (alive := [pid for pid in pids if process_running(pid)]) and time.monotonic() - started < seconds:
        time.sleep(0.1)
    return round(time.monotonic() - started, 1), [f"{pid} {_cmdline(pid)[:120]}" for pid in alive]


def test_kill_9_of_the_orchestrator_leaves_nothing_of_the_run_or_its_private_cluster(tmp_path):
    """Within 30 s of a kill -9 of the orchestrator no process of the run or of its private
    cluster runs, and the cluster's temp dir is gone."""
    run_dir = tmp_path / "run"
    run = faults.Run("train", *RAY, f"run.dir={run_dir}", "train.steps=400")
    try:
        faults.wait_for(lambda: faults.trainer_steps(run_dir) >= 1, 400, "a trainer step")
        everything, temp_dir = _everything_of(run)
        os.kill(run.pid, signal.SIGKILL)
        seconds, alive = _gone_within(everything - {run.pid}, 30.0)
        leftovers = faults.leftovers_after(run.tag, 1.0)
    finally:
        run.kill_all()
    print(f"kill -9: {len(everything)} processes of the run gone {seconds} s after")
    assert not alive and leftovers == 0, alive
    assert not temp_dir.exists()


def test_a_normal_exit_leaves_nothing_of_the_run_or_its_private_cluster(tmp_path):
    """A run that completes: its actors, servers, trainer ranks and private Ray cluster (its
    process tree, the pids in the cluster's session directory, every tagged process) are gone
    within 30 s of its exit, and so is the cluster's temp dir."""
    run_dir = tmp_path / "run"
    run = faults.Run("train", *RAY, f"run.dir={run_dir}", "train.steps=12")
    try:
        faults.wait_for(lambda: faults.trainer_steps(run_dir) >= 1, 400, "a trainer step")
        everything, temp_dir = _everything_of(run)
        code = run.wait(600)
        seconds, alive = _gone_within(everything, 30.0)
        leftovers = faults.leftovers_after(run.tag, 1.0)
    finally:
        run.kill_all()
    print(f"normal exit: {len(everything)} processes of the run gone {seconds} s after its exit")
    assert code == 0, run.output[-3000:]
    assert faults.summary(run_dir)["status"] == "completed"
    assert not alive and leftovers == 0, alive
    assert not temp_dir.exists()


def _scale(run_dir: Path, n: int) -> None:
    subprocess.run([sys.executable, "-m", "rlorch.cli", "scale", str(run_dir), f"inference.num_servers={n}"],
                   check=True, capture_output=True)


def test_scale_under_ray_grows_when_placed_and_a_request_that_cannot_be_placed_is_shown_then_dropped(tmp_path):
    """A private cluster of 3 logical CPUs (run.ray_cpus) holds the trainer and one server: a
    request for 2 servers is placed and ``servers`` is 2 in the step records; one for 3 cannot be
    placed (a fourth CPU), so the step records, the periodic records and the progress line show
    it pending with what it waits for, until run.placement_timeout drops it with a warning naming
    it; the run goes on and ends with nothing lost."""
    run_dir = tmp_path / "run"
    options = [o for o in RAY if o != "run.progress=false" and not o.startswith("inference.num_servers")]
    run = faults.Run("train", *options, "inference.num_servers=1", "run.ray_cpus=3", "run.placement_timeout=25",
                     "run.log_every=1", "train.steps=2000", f"run.dir={run_dir}", "rollout.max_new_tokens=32")
    try:
        faults.wait_for(lambda: faults.trainer_steps(run_dir) >= 2, 400, "two trainer steps")
        _scale(run_dir, 2)
        faults.wait_for(lambda: any(r.get("servers") == 2 for r in records_of(run_dir, "step")), 300,
                        "a step record with two servers")
        _scale(run_dir, 3)
        pending = faults.wait_for(lambda: [r["scale_pending"] for r in records_of(run_dir, "step")
                                           if r.get("scale_pending") and "free" in (r["scale_pending"]["waiting_for"] or "")],
                                  120, "a step record with the pending request and what the cluster has free")
        faults.wait_for(lambda: any(r.get("scale_dropped") == 1 and r.get("scale_pending") is None
                                    for r in records_of(run_dir, "step")), 120, "the request dropped")
        steps = faults.trainer_steps(run_dir)
        faults.wait_for(lambda: faults.trainer_steps(run_dir) >= steps + 2, 300, "two steps after the drop")
        os.kill(run.pid, signal.SIGTERM)
        code = run.wait(300)
        leftovers = faults.leftovers_after(run.tag, 30.0)
    finally:
        run.kill_all()
    assert code == 128 + signal.SIGTERM, run.output[-3000:]
    assert pending[0]["requested"] == 3 and pending[0]["servers"] == 2, pending[0]
    assert "placement group server-2" in pending[0]["waiting_for"], pending[0]
    periodic = [r["engines_scale_pending"] for r in records_of(run_dir, "periodic") if r.get("engines_scale_pending")]
    assert periodic and periodic[-1]["requested"] == 3
    assert re.search(r"scale_pending=2/3@\d+s", run.output), run.output[-3000:]
    assert "rlorch scale: request inference.num_servers=3 dropped at 2 servers" in run.output
    assert "run.placement_timeout=25s" in run.output
    steps = records_of(run_dir, "step")
    assert {r["servers"] for r in steps} >= {1, 2} and max(r["servers"] for r in steps) == 2
    summary = faults.summary(run_dir)
    assert summary["lost"] == 0 and summary["servers_dead"] == 0 and summary["scale_dropped"] == 1, summary
    assert "scale       1 request(s) dropped" in run.output
    assert leftovers == 0


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
    cluster on the machine): those whose command line names it and everything below them (the
    raylet's agents rename themselves, ``ray::DashboardAgent``), all found before any is killed;
    then its temp dir."""
    named = [int(pid) for pid in os.listdir("/proc") if pid.isdigit() and temp in _cmdline(int(pid))]
    for pid in {*named, *(child for pid in named for child in descendants(pid))}:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    shutil.rmtree(temp, ignore_errors=True)
