"""A real two-node trainer on one machine: two torchrun agents (``--nnodes 2``, static rendezvous at
127.0.0.1, one gloo process each) replay the batches of a single-node ``trainer.fsdp.nproc=2`` run
and must reproduce its losses."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from rlorch.config.compose import compose
from rlorch.launch.local import free_port
from rlorch.rundir.layout import RunDir, load_config, save_config
from rlorch.launch.trainer_command import trainer_command

STEPS = 3
LOSS_TOLERANCE = 1e-4
"""Same batches, same initial weights, same world size and reduction order: the losses agree to
float32 rounding."""


def _losses(run_dir: Path) -> list[float]:
    lines = (run_dir / "trainer" / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["loss"] for line in lines]


@pytest.mark.slow
def test_two_torchrun_agents_match_the_single_node_losses(tmp_path):
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    single = tmp_path / "single"
    result = subprocess.run([sys.executable, "-m", "rlorch.cli", "train", f"run.dir={single}", "run.progress=false",
                             f"train.steps={STEPS}", "trainer.fsdp.nproc=2", "trainer.fsdp.device=cpu",
                             "rollout.batch_size=8", "rollout.group_size=4", "rollout.max_concurrent=16",
                             "eval.enabled=false", "trainer.checkpoint_every=1000"],
                            env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]

    replay = tmp_path / "replay"
    shutil.copytree(RunDir(single).rollouts, RunDir(replay).rollouts)
    endpoint = f"127.0.0.1:{free_port()}"
    config = load_config(single / "config.yaml")
    save_config(config, replay / "config.yaml")
    two_nodes = compose([f"run.dir={replay}", "trainer.fsdp.nproc=1", "trainer.fsdp.nnodes=2",
                         f"trainer.fsdp.rdzv_endpoint={endpoint}"])
    logs = [open(tmp_path / f"node{rank}.log", "wb") for rank in (0, 1)]
    agents = [subprocess.Popen(trainer_command(two_nodes, replay, node_rank=rank), env=env, stdout=logs[rank],
                               stderr=subprocess.STDOUT) for rank in (0, 1)]
    try:
        codes = [agent.wait(timeout=600) for agent in agents]
    finally:
        for agent in agents:
            if agent.poll() is None:
                agent.kill()
        for log in logs:
            log.close()
    assert codes == [0, 0], (tmp_path / "node0.log").read_text()[-3000:] + (tmp_path / "node1.log").read_text()[-2000:]
    ready = json.loads((replay / "trainer" / "ready").read_text())
    assert ready["world_size"] == 2
    reference, replayed = _losses(single), _losses(replay)
    assert len(replayed) == STEPS == len(reference)
    assert replayed == pytest.approx(reference, rel=LOSS_TOLERANCE, abs=LOSS_TOLERANCE)
