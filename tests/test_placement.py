"""GPU placement and the --dry-run launch plan (planned for N GPUs with run.gpus on a CPU machine)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from rlorch.config.compose import compose
from rlorch.config.schema import ConfigError
from rlorch.launch.placement import place
from rlorch.launch.plan import launch_plan
from rlorch.launch.trainer_command import trainer_command


def plan(*overrides: str) -> list[dict]:
    return launch_plan(compose(["inference=sglang", *overrides]), run_dir="RUN")


def test_one_gpu_cannot_hold_a_server_and_the_trainer():
    with pytest.raises(ConfigError) as err:
        plan("run.gpus=1")
    assert err.value.key == "run.gpus" and "need 2" in str(err.value)


def test_one_gpu_holds_the_server_when_the_trainer_runs_on_cpu():
    records = plan("run.gpus=1", "trainer.fsdp.device=cpu")
    assert [(r["role"], r["env"].get("CUDA_VISIBLE_DEVICES")) for r in records] == [
        ("orchestrator", None), ("server-0", "0"), ("trainer", None)]


def test_two_gpus_split_server_then_trainer():
    records = {r["role"]: r for r in plan("run.gpus=2")}
    assert records["server-0"]["env"]["CUDA_VISIBLE_DEVICES"] == "0"
    assert records["trainer"]["env"]["CUDA_VISIBLE_DEVICES"] == "1"
    assert "--tp-size 1" in records["server-0"]["command"]
    assert "-m rlorch.trainer.fsdp" in records["trainer"]["command"]  # one process: no torchrun agent


def test_eight_gpus_two_tp2_servers_and_four_trainers():
    records = {r["role"]: r for r in plan("run.gpus=8", "inference.num_servers=2", "inference.tp_size=2",
                                          "trainer.fsdp.nproc=4")}
    assert [records[k]["env"]["CUDA_VISIBLE_DEVICES"] for k in ("server-0", "server-1", "trainer")] == [
        "0,1", "2,3", "4,5,6,7"]
    assert "--tp-size 2" in records["server-1"]["command"]
    assert "--nproc-per-node 4" in records["trainer"]["command"]


def test_explicit_lists_pin_both_sides():
    placement = place(compose(["inference=sglang", "inference.gpus=[6,7]", "inference.tp_size=2",
                               "trainer.fsdp.gpus=[0,1,2]", "trainer.fsdp.nproc=3"]), 8)
    assert placement.servers == [[6, 7]] and placement.trainer == [0, 1, 2]


@pytest.mark.parametrize("overrides, key", [
    (["inference.gpus=[0]", "trainer.fsdp.gpus=[0]"], "inference.gpus"),
    (["inference.gpus=[0,1,2]", "inference.tp_size=2"], "inference.gpus"),
    (["inference.gpus=[0,1]"], "inference.gpus"),
    (["trainer.fsdp.gpus=[1,2]"], "trainer.fsdp.gpus"),
    (["trainer.fsdp.gpus=[9]"], "trainer.fsdp.gpus"),
    (["inference.num_servers=4", "inference.tp_size=2"], "run.gpus"),
])
def test_bad_placements_name_the_keys(overrides, key):
    with pytest.raises(ConfigError) as err:
        place(compose(["inference=sglang", *overrides]), 8)
    assert err.value.key == key


def test_two_nodes_run_one_torchrun_agent_each_against_one_rendezvous():
    records = plan("run.gpus=8", "inference.num_servers=2", "inference.tp_size=2", "trainer.fsdp.nproc=4",
                   "trainer.fsdp.nnodes=2", "trainer.fsdp.rdzv_endpoint=10.0.0.1:29400")
    trainers = [r for r in records if r["role"] == "trainer"]
    assert [t["node"] for t in trainers] == [0, 1]
    for node, record in enumerate(trainers):
        assert f"--nnodes 2 --node-rank {node} --rdzv-backend c10d --rdzv-endpoint 10.0.0.1:29400" in record["command"]
        assert "--standalone" not in record["command"] and record["env"]["CUDA_VISIBLE_DEVICES"] == "4,5,6,7"
    assert [r["node"] for r in records if r["role"].startswith("server")] == [0, 0]


def test_multi_node_keys_are_checked():
    with pytest.raises(ConfigError) as err:
        compose(["trainer.fsdp.nnodes=2"])
    assert err.value.key == "trainer.fsdp.rdzv_endpoint"
    with pytest.raises(ConfigError) as err:
        compose(["trainer.fsdp.nnodes=2", "trainer.fsdp.node_rank=2", "trainer.fsdp.rdzv_endpoint=h:1"])
    assert err.value.key == "trainer.fsdp.node_rank"


def test_single_node_command_keeps_standalone_or_the_users_rendezvous():
    assert "--standalone" in trainer_command(compose(["trainer.fsdp.nproc=2"]), "RUN")
    custom = trainer_command(compose(["trainer.fsdp.torchrun_args=['--nnodes=1','--rdzv-endpoint=h:1']"]), "RUN")
    assert "--standalone" not in custom


def test_dry_run_prints_one_json_line_per_process_and_starts_nothing(tmp_path):
    run_dir = tmp_path / "never"
    result = subprocess.run([sys.executable, "-m", "rlorch.cli", "train", "inference=sglang", "run.gpus=8",
                             "inference.num_servers=2", "inference.tp_size=2", "trainer.fsdp.nproc=4",
                             f"run.dir={run_dir}", "--dry-run"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in result.stdout.splitlines()]
    assert [r["role"] for r in records] == ["orchestrator", "server-0", "server-1", "trainer"]
    assert all(set(r) == {"role", "node", "command", "env"} for r in records)
    assert not run_dir.exists()
    bad = subprocess.run([sys.executable, "-m", "rlorch.cli", "train", "inference=sglang", "run.gpus=2",
                          "inference.tp_size=2", "--dry-run"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "run.gpus" in bad.stderr and not bad.stdout
