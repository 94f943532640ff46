"""``rlorch scale RUN_DIR inference.num_servers=N`` on a running run (launcher=local): servers
join at the current version and leave with nothing lost; the step records show the fleet."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import faults  # noqa: E402
from helpers import records_of  # noqa: E402


def _scale(run_dir: Path, n: int) -> None:
    subprocess.run([sys.executable, "-m", "rlorch.cli", "scale", str(run_dir), f"inference.num_servers={n}"],
                   check=True, capture_output=True)


def test_scale_refuses_anything_but_a_server_count_of_a_running_run(tmp_path):
    from rlorch.launch.runlock import RunLock

    out = subprocess.run([sys.executable, "-m", "rlorch.cli", "scale", str(tmp_path), "inference.num_servers=2"],
                         capture_output=True, text=True)
    assert out.returncode == 2 and "not a run directory" in out.stderr
    (tmp_path / "config.yaml").write_text("{}")
    out = subprocess.run([sys.executable, "-m", "rlorch.cli", "scale", str(tmp_path), "rollout.batch_size=2"],
                         capture_output=True, text=True)
    assert out.returncode == 2 and "inference.num_servers=N" in out.stderr
    assert not (tmp_path / "SCALE").exists()
    out = subprocess.run([sys.executable, "-m", "rlorch.cli", "scale", str(tmp_path), "inference.num_servers=3"],
                         capture_output=True, text=True)
    assert out.returncode == 2 and f"no process is running {tmp_path}" in out.stderr
    assert f"rlorch resume {tmp_path} inference.num_servers=3" in out.stderr and not (tmp_path / "SCALE").exists()
    with RunLock(tmp_path):   # as the run's own process holds it
        _scale(tmp_path, 3)
    assert json.loads((tmp_path / "SCALE").read_text()) == {"num_servers": 3}


def test_a_scale_request_that_cannot_be_met_is_pending_then_dropped_and_the_next_is_read(tmp_path):
    """The follower shows a request while it is met (the size asked for, the servers now, what the
    launcher waits for); a server that cannot start drops the request, counted, with a warning
    naming it; a later request is met as usual."""
    import asyncio

    from rlorch.inference.scale import ScaleFollower
    from rlorch.launch.base import LaunchError

    fleet, seen = ["server 0"], []

    async def scenario() -> None:
        placeable = asyncio.Event()

        async def add() -> None:
            seen.append(follower.pending())
            if not placeable.is_set():
                raise LaunchError("placement group server-1 not placed after run.placement_timeout=1s")
            fleet.append(f"server {len(fleet)}")

        async def remove() -> None:
            fleet.pop()

        follower = ScaleFollower(tmp_path / "SCALE", fleet, add=add, remove=remove,
                                 waiting=lambda: "placement group server-1 (STRICT_PACK)", interval=0.01)
        assert follower.fields() == {"scale_pending": None, "scale_dropped": 0}
        await follower.meet(3)
        assert follower.fields() == {"scale_pending": None, "scale_dropped": 1} and fleet == ["server 0"]
        placeable.set()
        await follower.meet(2)
        await follower.meet(0)
        assert follower.dropped == 1 and fleet == ["server 0"]

    asyncio.run(scenario())
    assert seen[0]["requested"] == 3 and seen[0]["servers"] == 1
    assert seen[0]["waiting_for"] == "placement group server-1 (STRICT_PACK)" and seen[0]["waiting_s"] >= 0


def _fleet(run_dir):
    """The server indices ``servers.json`` lists now."""
    return [r["index"] for r in json.loads((run_dir / "servers.json").read_text())]


@pytest.mark.slow
@pytest.mark.cluster
def test_a_fleet_grows_from_one_to_three_and_shrinks_back_with_nothing_lost(tmp_path):
    run_dir = tmp_path / "run"
    run = faults.Run("train", "inference=cpu", "inference.num_servers=1", "train.steps=2000", f"run.dir={run_dir}",
                     "run.progress=false", "run.report=false", "rollout.max_new_tokens=32")
    try:
        faults.wait_for(lambda: faults.trainer_steps(run_dir) >= 2, 300, "two trainer steps")
        _scale(run_dir, 3)
        faults.wait_for(lambda: any(r["engines_servers"] == 3 and r["engines_servers_up"] == 3
                                    for r in records_of(run_dir, "periodic")), 300, "three servers up")
        grown = faults.trainer_steps(run_dir)
        fleet = faults.wait_for(lambda: len(_fleet(run_dir)) == 3 and _fleet(run_dir), 30, "servers.json of three")
        faults.wait_for(lambda: faults.trainer_steps(run_dir) >= grown + 2, 300, "two steps on three servers")
        _scale(run_dir, 1)
        faults.wait_for(lambda: records_of(run_dir, "periodic")[-1]["engines_servers"] == 1, 300, "back to one server")
        shrunk_fleet = faults.wait_for(lambda: len(_fleet(run_dir)) == 1 and _fleet(run_dir), 30, "servers.json of one")
        shrunk = faults.trainer_steps(run_dir)
        faults.wait_for(lambda: faults.trainer_steps(run_dir) >= shrunk + 2, 300, "two steps on one server")
        run.process.send_signal(signal.SIGTERM)
        code = run.wait(300)
        leftovers = faults.leftovers_after(run.tag)
    finally:
        run.kill_all()
    assert code == 143, run.output[-3000:]
    summary = faults.summary(run_dir)
    assert summary["lost"] == 0 and summary["servers_dead"] == 0, summary
    assert summary["admitted"] == (summary["trained"] + summary["filtered"] + summary["dropped_stale"]
                                   + summary["persisted_untrained"]), summary
    sizes = [r["engines_servers"] for r in records_of(run_dir, "periodic")]
    assert sizes[0] == 1 and 3 in sizes and sizes[-1] == 1
    assert {r.get("servers") for r in records_of(run_dir, "step")} >= {1, 3}
    assert "rlorch scale: 1 -> 3 servers" in run.output and "rlorch scale: 3 -> 1 servers" in run.output
    assert leftovers == 0
    assert fleet == [0, 1, 2] and shrunk_fleet == [0], (fleet, shrunk_fleet)


def _distributed_run(run_dir: Path, *, servers: int, extra: tuple[str, ...] = ()) -> faults.Run:
    """A CPU run with weights over a process group and no end of its own (SIGTERM ends it)."""
    return faults.Run("train", "inference=cpu", "trainer=fsdp", "inference.weight_transfer=distributed",
                      f"inference.num_servers={servers}", "train.steps=5000", "rollout.batch_size=32",
                      "rollout.group_size=4", "rollout.max_concurrent=32", "eval.enabled=false", *extra,
                      f"run.dir={run_dir}", "run.progress=false", "run.report=false")


def _terminated(run: faults.Run, run_dir: Path) -> dict:
    """SIGTERM the run; its summary once it has exited as a stopped run does (143)."""
    run.process.send_signal(signal.SIGTERM)
    code = run.wait(300)
    assert code == 143, run.output[-3000:]
    return faults.summary(run_dir)


def _received(log: Path) -> list[tuple[str, int]]:
    """(group, version) of every version a server's log says it received over a weight group."""
    import re

    text = log.read_text(errors="replace") if log.exists() else ""
    return [(group, int(version)) for group, version
            in re.findall(r"received \d+ tensors over (\S+) \(weight_version (\d+)\)", text)]


@pytest.mark.slow
@pytest.mark.cluster
def test_under_distributed_transfer_the_weight_group_follows_the_fleet_from_2_to_3_and_back(tmp_path):
    """inference.weight_transfer=distributed: grown from 2 servers to 3, every server receives
    the later versions over a group rebuilt for them (a new name); shrunk back to 2, the two
    left receive over another. Nothing is lost, and after each rebuild no version goes by disk."""
    run_dir = tmp_path / "run"
    run = _distributed_run(run_dir, servers=2)
    logs = run_dir / "logs"

    def generation(server: int) -> int:
        """The newest rebuilt group (its generation) a server received a version over; 0: none."""
        return max((int(g.rsplit("-g", 1)[1]) for g, _ in _received(logs / f"server-{server}.log") if "-g" in g),
                   default=0)

    try:
        faults.wait_for(lambda: faults.trainer_steps(run_dir) >= 3, 300, "three trainer steps")
        _scale(run_dir, 3)
        faults.wait_for(lambda: all(generation(i) >= 1 for i in range(3)), 300,
                        "three servers receiving over a group rebuilt for them")
        grown = generation(2)
        _scale(run_dir, 2)
        faults.wait_for(lambda: all(generation(i) > grown for i in range(2)), 300,
                        "two servers receiving over a group rebuilt for them")
        settled = faults.trainer_steps(run_dir)
        faults.wait_for(lambda: faults.trainer_steps(run_dir) >= settled + 3, 300, "three more steps")
        summary = _terminated(run, run_dir)
    finally:
        run.kill_all()
    assert summary["lost"] == 0 and summary["transfer_fallbacks"] == 0, summary
    newest = [max(v for _, v in _received(logs / f"server-{i}.log")) for i in range(2)]
    assert min(newest) >= settled, (newest, settled)
    assert "rlorch scale: 2 -> 3 servers" in run.output and "rlorch scale: 3 -> 2 servers" in run.output


def _loaded_from_disk(log: Path) -> list[int]:
    """Versions a server's log says it loaded from a checkpoint directory."""
    import re

    text = log.read_text(errors="replace") if log.exists() else ""
    return [int(v) for v in re.findall(r"loaded weights from \S+ \(weight_version (\d+)\)", text)]


@pytest.mark.slow
@pytest.mark.cluster
def test_a_sole_server_restarted_under_distributed_transfer_catches_up_from_disk_and_the_run_goes_on(tmp_path):
    """inference.weight_transfer=distributed with one server: it is killed once versions reach it
    over the group only, so no checkpoint and no other server holds the current one. Restarted, it
    does not rejoin on its start-up weights (all it would generate is stale): the trainer writes its
    weights to disk when the pool asks, the server loads them, later versions reach it over a
    rebuilt group, and training goes on with nothing lost."""
    run_dir = tmp_path / "run"
    run = _distributed_run(run_dir, servers=1, extra=("trainer.checkpoint_every=1000",))
    log = run_dir / "logs" / "server-0.log"
    try:
        faults.wait_for(lambda: max((v for _, v in _received(log)), default=0) >= 3, 300,
                        "version 3 over the weight group")
        killed = json.loads((run_dir / "servers.json").read_text())[0]["pid"]
        current = max(v for _, v in _received(log))
        os.kill(killed, signal.SIGKILL)
        faults.wait_for(lambda: any(v >= current for v in _loaded_from_disk(log)), 180,
                        f"the restarted server loading version >= {current} from disk")
        caught_up = faults.trainer_steps(run_dir)
        faults.wait_for(lambda: max(v for _, v in _received(log)) >= caught_up + 2, 180,
                        "two more versions over the rebuilt group")
        summary = _terminated(run, run_dir)
    finally:
        run.kill_all()
    assert summary["lost"] == 0 and summary["server_restarts"] >= 1, summary
    assert json.loads((run_dir / "servers.json").read_text())[0]["pid"] != killed
