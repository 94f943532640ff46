"""scripts/slurm/ray-on-slurm.sbatch on one machine: stand-ins for ``scontrol`` and ``srun`` on
PATH start the Ray head and one worker here, and the run trains through them (slow)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

pytest.importorskip("ray")
sys.path.insert(0, str(Path(__file__).parent))
import faults  # noqa: E402

from rlorch.launch.local import free_port  # noqa: E402

SCRIPT = Path(__file__).parent.parent / "scripts" / "slurm" / "ray-on-slurm.sbatch"
SCONTROL = "#!/bin/sh\n[ \"$1 $2\" = 'show hostnames' ] && printf 'node-a\\nnode-b\\n'\n"
SRUN = """#!/bin/sh
# srun stand-in: drop the step's options, run the command here.
while [ $# -gt 0 ]; do
  case "$1" in -w) shift 2;; -*) shift;; *) break;; esac
done
echo "$@" >> "$SRUN_LOG"
exec "$@"
"""


@pytest.mark.slow
@pytest.mark.cluster
def test_the_sbatch_script_starts_a_head_and_a_worker_and_trains_through_them(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("scontrol", SCONTROL), ("srun", SRUN)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    run_dir = tmp_path / "run"
    port = free_port()
    # Ray's unix sockets live under its temp dir: a pytest path is past their 107-byte limit.
    ray_temp = tempfile.mkdtemp(prefix="rlorch-ray-")
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "node-[a-b]",
           "SRUN_LOG": str(tmp_path / "srun.log"), "RLORCH_RAY_PORT": str(port), "RLORCH_RAY_WAIT": "240",
           "RLORCH_RAY_NODE_ARGS": "--num-cpus=2", "RLORCH_RAY_HEAD_ARGS": f"--temp-dir={ray_temp}",
           faults.TAG: "slurm-" + tmp_path.name, "PYTHON": sys.executable, "PYTHONUNBUFFERED": "1",
           # One machine, one user: no token to hand from the head to the worker.
           "RAY_AUTH_MODE": "disabled",
           # A raylet on a busy 2-core machine can take longer than Ray's default to register.
           "RAY_raylet_start_wait_time_s": "120"}
    env.pop("RAY_ADDRESS", None)
    try:
        out = subprocess.run(["bash", str(SCRIPT), "inference=cpu", "inference.num_servers=1", "train.steps=3",
                              f"run.dir={run_dir}", "run.progress=false", "run.report=false"],
                             env=env, capture_output=True, text=True, timeout=600)
    finally:
        leftovers = faults.leftovers_after(env[faults.TAG], 30.0)
        for pid in faults.tagged(env[faults.TAG]):
            os.kill(pid, 9)
        shutil.rmtree(ray_temp, ignore_errors=True)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "2 nodes" in out.stdout
    steps = (tmp_path / "srun.log").read_text().splitlines()
    assert any("ray start --head" in s for s in steps) and any("ray start --address=" in s for s in steps)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["lost"] == 0
    assert leftovers == 0
