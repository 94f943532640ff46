"""run.launcher=ray without a cluster: the keys, the missing-extra error, the dry-run plan."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

from rlorch.config.compose import compose
from rlorch.config.preflight import preflight
from rlorch.config.schema import ConfigError
from rlorch.launch.plan import ray_plan
from rlorch.launch.ray import node_trainer_command


def test_launcher_keys_are_checked():
    with pytest.raises(ConfigError) as err:
        compose(["run.launcher=slurm"])
    assert err.value.key == "run.launcher"
    with pytest.raises(ConfigError) as err:
        compose(["run.placement_timeout=0"])
    assert err.value.key == "run.placement_timeout"
    # Under Ray the rendezvous is node 0's: nnodes > 1 needs no endpoint.
    assert compose(["run.launcher=ray", "trainer.fsdp.nnodes=2"]).trainer.fsdp.rdzv_endpoint is None
    with pytest.raises(ConfigError):
        compose(["trainer.fsdp.nnodes=2"])


def test_ray_missing_is_a_config_error_naming_the_key_and_the_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray" else real(name, *a))
    with pytest.raises(ConfigError) as err:
        preflight(compose(["run.launcher=ray", "inference=sim", "trainer=sim"]))
    assert err.value.key == "run.launcher" and 'pip install "rlorch[ray]"' in str(err.value)
    preflight(compose(["inference=sim", "trainer=sim"]))


def test_the_ray_plan_names_groups_bundles_strategies_and_commands(tmp_path):
    config = compose(["run.launcher=ray", "inference=sglang", "inference.tp_size=2", "inference.num_servers=2",
                      "trainer=fsdp", "trainer.fsdp.nproc=4", "trainer.fsdp.nnodes=2", "run.gpus=8"])
    plan = ray_plan(config, run_dir=tmp_path)
    groups = {r["name"]: r for r in plan if r["role"] == "placement_group"}
    assert groups["server-0"]["bundles"] == [{"GPU": 1.0}, {"GPU": 1.0}]
    assert groups["server-1"]["strategy"] == "STRICT_PACK"
    assert groups["trainer"] == {"role": "placement_group", "name": "trainer", "bundles": [{"GPU": 4.0}] * 2,
                                 "strategy": "STRICT_SPREAD"}
    servers = [r for r in plan if r["role"].startswith("server-")]
    assert [s["placement_group"] for s in servers] == ["server-0", "server-1"]
    assert "--tp-size 2" in servers[0]["command"] and "'<port>'" in servers[0]["command"]
    trainers = [r for r in plan if r["role"] == "trainer"]
    assert [t["bundle"] for t in trainers] == [0, 1]
    assert "--node-rank 1 --master-addr '<node 0 ip>'" in trainers[1]["command"]


def test_dry_run_with_ray_starts_nothing_and_prints_json_lines(tmp_path):
    out = subprocess.run([sys.executable, "-m", "rlorch.cli", "train", "--dry-run", "run.launcher=ray",
                          "inference=cpu", "inference.num_servers=2", f"run.dir={tmp_path / 'run'}"],
                         capture_output=True, text=True, check=True)
    records = [json.loads(line) for line in out.stdout.splitlines()]
    assert [r["strategy"] for r in records if r["role"] == "placement_group"] == ["STRICT_PACK"] * 2 + ["STRICT_SPREAD"]
    assert not (tmp_path / "run").exists()
    assert "ray" not in out.stderr.lower()


def test_a_node_s_trainer_command_joins_node_0():
    command = ["torchrun", "--nnodes", "2", "--node-rank", "0", "--master-addr", "x", "--master-port", "0", "-m", "w"]
    assert node_trainer_command(command, 1, "10.0.0.5", 4242) == [
        "torchrun", "--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.5", "--master-port", "4242",
        "-m", "w"]


def test_the_ray_plan_fills_unset_counts_from_run_gpus():
    """``run.gpus`` is a node's GPUs under Ray too: unset counts split them as the local
    launcher does (8: four SGLang servers and a 4-GPU trainer), with no GPU on this machine."""
    config = compose(["run.launcher=ray", "inference=sglang", "trainer=fsdp", "run.gpus=8"])
    plan = ray_plan(config, run_dir=None)
    groups = {r["name"]: r["bundles"] for r in plan if r["role"] == "placement_group"}
    assert sorted(groups) == ["server-0", "server-1", "server-2", "server-3", "trainer"]
    assert groups["server-3"] == [{"GPU": 1.0}] and groups["trainer"] == [{"GPU": 4.0}]
    assert len([r for r in plan if r["role"].startswith("server-")]) == 4


def test_the_weight_group_meets_at_trainer_node_0_s_ip(tmp_path, monkeypatch):
    """Under run.launcher=ray the trainer's env names node 0's IP, and rank 0's broadcaster
    announces its group there, not at ``inference.transfer_address`` (127.0.0.1)."""
    from rlorch.config.compose import compose
    from rlorch.launch.ray import TRANSFER_ADDRESS_ENV, trainer_env
    from rlorch.rundir.layout import RunDir
    from rlorch.trainer import broadcast

    nodes = [{"ip": "127.0.0.3", "port": 29500}, {"ip": "10.0.0.9", "port": 29501}]
    env = trainer_env({"CUDA_VISIBLE_DEVICES": "0,1", "PATH": "/bin"}, nodes)
    assert env == {"PATH": "/bin", TRANSFER_ADDRESS_ENV: "127.0.0.3"}
    assert TRANSFER_ADDRESS_ENV == broadcast.TRANSFER_ADDRESS_ENV
    monkeypatch.setenv(TRANSFER_ADDRESS_ENV, env[TRANSFER_ADDRESS_ENV])
    config = compose(["inference=cpu", "trainer=fsdp", "inference.weight_transfer=distributed"])
    run = RunDir(tmp_path / "run").make()
    broadcast.plan(config, run, "cpu", log=print)
    assert json.loads(run.weight_group.read_text())["master_address"] == "127.0.0.3"
