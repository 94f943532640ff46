"""``rlorch scale RUN_DIR inference.num_servers=N`` on a running run (launcher=local): servers
join at the current version and leave with nothing lost; the step records show the fleet."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import faults  # noqa: E402


def _periodic(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    return [r for r in records if r.get("kind") == "periodic"]


def _scale(run_dir: Path, n: int) -> None:
    subprocess.run([sys.executable, "-m", "rlorch.cli", "scale", str(run_dir), f"inference.num_servers={n}"],
                   check=True, capture_output=True)


def test_scale_refuses_anything_but_a_server_count_of_a_run(tmp_path):
    out = subprocess.run([sys.executable, "-m", "rlorch.cli", "scale", str(tmp_path), "inference.num_servers=2"],
                         capture_output=True, text=True)
    assert out.returncode == 2 and "not a run directory" in out.stderr
    (tmp_path / "config.yaml").write_text("{}")
    out = subprocess.run([sys.executable, "-m", "rlorch.cli", "scale", str(tmp_path), "rollout.batch_size=2"],
                         capture_output=True, text=True)
    assert out.returncode == 2 and "inference.num_servers=N" in out.stderr
    assert not (tmp_path / "SCALE").exists()
    _scale(tmp_path, 3)
    assert json.loads((tmp_path / "SCALE").read_text()) == {"num_servers": 3}


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
                                    for r in _periodic(run_dir)), 300, "three servers up")
        grown = faults.trainer_steps(run_dir)
        fleet = faults.wait_for(lambda: len(_fleet(run_dir)) == 3 and _fleet(run_dir), 30, "servers.json of three")
        faults.wait_for(lambda: faults.trainer_steps(run_dir) >= grown + 2, 300, "two steps on three servers")
        _scale(run_dir, 1)
        faults.wait_for(lambda: _periodic(run_dir)[-1]["engines_servers"] == 1, 300, "back to one server")
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
    sizes = [r["engines_servers"] for r in _periodic(run_dir)]
    assert sizes[0] == 1 and 3 in sizes and sizes[-1] == 1
    steps = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines() if "\"step\"" in l]
    assert {r.get("servers") for r in steps if r.get("kind") == "step"} >= {1, 3}
    assert "rlorch scale: 1 -> 3 servers" in run.output and "rlorch scale: 3 -> 1 servers" in run.output
    assert leftovers == 0
    assert fleet == [0, 1, 2] and shrunk_fleet == [0], (fleet, shrunk_fleet)
