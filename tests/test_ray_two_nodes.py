"""The Ray launcher's trainer on two Ray nodes of one machine (``ray.cluster_utils.Cluster``):
one gloo rank per node, STRICT_SPREAD, rendezvous at node 0's IP; it replays the batches of a
single-node ``trainer.fsdp.nproc=2`` run and must reproduce its losses (slow)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from ray.cluster_utils import Cluster  # noqa: E402

from rlorch.config.compose import compose  # noqa: E402
from rlorch.launch.ray import RayLauncher  # noqa: E402
from rlorch.launch.trainer_command import trainer_command  # noqa: E402
from rlorch.rundir.layout import RunDir, load_config, save_config  # noqa: E402

STEPS = 3
LOSS_TOLERANCE = 1e-4


def _losses(run_dir: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run_dir / "trainer" / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.cluster
def test_a_trainer_spread_over_two_ray_nodes_matches_the_single_node_losses(tmp_path):
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    single = tmp_path / "single"
    result = subprocess.run([sys.executable, "-m", "rlorch.cli", "train", f"run.dir={single}", "run.progress=false",
                             f"train.steps={STEPS}", "trainer.fsdp.nproc=2", "trainer.fsdp.device=cpu",
                             "rollout.batch_size=8", "rollout.group_size=4", "rollout.max_concurrent=16",
                             "eval.enabled=false", "trainer.checkpoint_every=1000", "run.report=false"],
                            env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    replay = tmp_path / "replay"
    shutil.copytree(RunDir(single).rollouts, RunDir(replay).rollouts)
    save_config(load_config(single / "config.yaml"), replay / "config.yaml")
    two_nodes = compose([f"run.dir={replay}", "trainer.fsdp.nproc=1", "trainer.fsdp.nnodes=2",
                         "trainer.fsdp.device=cpu", "run.launcher=ray"])

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    cluster.add_node(num_cpus=1)
    ray.init(address=cluster.address, log_to_driver=False)
    launcher = RayLauncher(two_nodes)
    try:
        cluster.wait_for_nodes()
        trainer = launcher.start_trainer(trainer_command(two_nodes, replay), env={},
                                         log=replay / "logs" / "trainer.log", workers=replay / "trainer" / "workers")
        deadline = time.monotonic() + 600
        while any(ray.wait([w], timeout=0)[0] == [] for w in trainer.extra["waits"]) and time.monotonic() < deadline:
            time.sleep(0.2)
        codes = [ray.get(w)["code"] for w in trainer.extra["waits"]]
        nodes = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    finally:
        launcher.close()
        ray.shutdown()
        cluster.shutdown()
    logs = "".join(p.read_text()[-2000:] for p in sorted((replay / "logs").glob("trainer*.log")))
    assert codes == [0, 0], logs
    assert len(nodes) == 2
    assert "--node-rank 1" in (replay / "logs" / "trainer-node1.log").read_text().splitlines()[0]
    assert json.loads((replay / "trainer" / "ready").read_text())["world_size"] == 2
    reference, replayed = _losses(single), _losses(replay)
    assert len(replayed) == STEPS == len(reference)
    assert replayed == pytest.approx(reference, rel=LOSS_TOLERANCE, abs=LOSS_TOLERANCE)
