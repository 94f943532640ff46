"""GPU placement and the --dry-run launch plan (planned for N GPUs with run.gpus on a CPU machine)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from rlorch.config.compose import compose
from rlorch.config.schema import ConfigError
from rlorch.launch.placement import (cpu_engines_for, idle_gpu_warning, layout_choice, place, resolve_layout, server_env,
                                     trainer_env, usable_cores)
from rlorch.launch.plan import launch_plan
from rlorch.launch.trainer_command import trainer_command


@pytest.fixture(autouse=True)
def no_inherited_devices(monkeypatch):
    """Plans here are for N GPUs of a bare node, whatever this machine's CUDA_VISIBLE_DEVICES."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


def plan(*overrides: str) -> list[dict]:
    return launch_plan(compose(["inference=sglang", *overrides]), run_dir="RUN")


def gpus_of(records: list[dict]) -> dict[str, str]:
    return {r["role"]: r["env"].get("CUDA_VISIBLE_DEVICES") for r in records if r["role"] != "orchestrator"}


def test_one_gpu_without_colocation_cannot_hold_a_server_and_the_trainer():
    with pytest.raises(ConfigError) as err:
        plan("run.gpus=1", "run.colocate=off")
    assert err.value.key == "run.gpus" and "need 2" in str(err.value) and "run.colocate=resident" in str(err.value)


def test_one_gpu_colocates_the_server_and_the_trainer_by_default():
    records = plan("run.gpus=1", "run.gpu_memory_gb=80")
    assert [(r["role"], r["env"].get("CUDA_VISIBLE_DEVICES")) for r in records] == [
        ("orchestrator", None), ("server-0", "0"), ("trainer", "0")]
    assert "--mem-fraction-static" in records[1]["command"]


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
    (["inference.gpus=[0,1]", "inference.num_servers=1"], "inference.gpus"),
    (["trainer.fsdp.gpus=[1,2]", "trainer.fsdp.nproc=1"], "trainer.fsdp.gpus"),
    (["trainer.fsdp.gpus=[9]"], "trainer.fsdp.gpus"),
    (["inference.num_servers=4", "inference.tp_size=2"], "run.gpus"),
])
def test_bad_placements_name_the_keys(overrides, key):
    with pytest.raises(ConfigError) as err:
        place(compose(["inference=sglang", *overrides]), 8)
    assert err.value.key == key


def test_two_nodes_use_a_static_rendezvous_and_each_node_its_own_gpus():
    records = plan("run.gpus=8", "inference.num_servers=1", "inference.tp_size=4", "trainer.fsdp.nproc=4",
                   "trainer.fsdp.nnodes=2", "trainer.fsdp.rdzv_endpoint=10.0.0.1:29400")
    trainers = [r for r in records if r["role"] == "trainer"]
    assert [t["node"] for t in trainers] == [0, 1]
    for node, record in enumerate(trainers):
        assert f"--nnodes 2 --node-rank {node} --master-addr 10.0.0.1 --master-port 29400" in record["command"]
        assert not {"--standalone", "--rdzv-backend", "--rdzv-endpoint", "--rdzv-id"} & set(record["command"].split())
    assert [t["env"]["CUDA_VISIBLE_DEVICES"] for t in trainers] == ["4,5,6,7", "0,1,2,3"]
    assert [(r["node"], r["env"]["CUDA_VISIBLE_DEVICES"]) for r in records if r["role"].startswith("server")] == [
        (0, "0,1,2,3")]


def test_other_nodes_get_the_pinned_trainer_gpus_and_are_not_translated(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "8,9,10,11")
    config = compose(["inference=sglang", "run.gpus=4", "inference.num_servers=1", "inference.tp_size=2",
                      "trainer.fsdp.gpus=[2,3]", "trainer.fsdp.nnodes=2", "trainer.fsdp.rdzv_endpoint='[::1]:29400'"])
    assert [trainer_env(config, node) for node in (0, 1)] == [{"CUDA_VISIBLE_DEVICES": "10,11"},
                                                              {"CUDA_VISIBLE_DEVICES": "2,3"}]
    assert "--master-addr ::1 --master-port 29400" in " ".join(trainer_command(config, "RUN", node_rank=1))
    with pytest.raises(ConfigError) as err:
        compose(["trainer.fsdp.nnodes=2", "trainer.fsdp.rdzv_endpoint=10.0.0.1"])
    assert err.value.key == "trainer.fsdp.rdzv_endpoint"


def test_an_inherited_cuda_visible_devices_translates_plan_ids(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    overrides = ["run.gpus=4", "inference.num_servers=2", "inference.tp_size=1", "trainer.fsdp.nproc=2"]
    assert gpus_of(plan(*overrides)) == {"server-0": "4", "server-1": "5", "trainer": "6,7"}
    config = compose(["inference=sglang", *overrides])
    children = [server_env(config, 0), server_env(config, 1), trainer_env(config)]
    seen = [set(env["CUDA_VISIBLE_DEVICES"].split(",")) for env in children]
    assert set().union(*seen) == {"4", "5", "6", "7"} and sum(map(len, seen)) == 4  # only 4-7, disjoint
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    with pytest.raises(ConfigError) as err:
        plan(*overrides)
    assert err.value.key == "run.gpus" and "'4,5'" in str(err.value)


def test_unset_counts_fill_the_node():
    records = plan("run.gpus=8", "inference.tp_size=2")
    assert gpus_of(records) == {"server-0": "0,1", "server-1": "2,3", "trainer": "4,5,6,7"}
    assert "--nproc-per-node 4" in records[-1]["command"]
    assert gpus_of(plan("run.gpus=8")) == {"server-0": "0", "server-1": "1", "server-2": "2", "server-3": "3",
                                           "trainer": "4,5,6,7"}
    assert gpus_of(plan("run.gpus=6", "trainer.fsdp.nproc=1", "inference.tp_size=2")) == {
        "server-0": "0,1", "server-1": "2,3", "trainer": "4"}
    assert gpus_of(plan("run.gpus=8", "inference.num_servers=1", "inference.tp_size=2")) == {
        "server-0": "0,1", "trainer": "2,3,4,5,6,7"}
    assert gpus_of(plan("run.gpus=4", "trainer.fsdp.device=cpu", "inference.tp_size=2")) == {
        "server-0": "0,1", "server-1": "2,3", "trainer": None}


@pytest.mark.parametrize("overrides, gpus, servers", [
    (["inference=sglang"], 0, 1),                              # no GPUs
    (["inference=sglang", "trainer.fsdp.device=cpu"], 0, 1),
    (["inference.num_servers=2"], 8, 2),                       # CPU engines beside the trainer: as set
])
def test_unset_counts_are_one_without_gpus_or_beside_cpu_engines(overrides, gpus, servers):
    resolved = resolve_layout(compose(overrides), gpus)
    assert (resolved.inference.num_servers, resolved.trainer.fsdp.nproc) == (servers, 1)
    explicit = compose(["inference.num_servers=3", "trainer.fsdp.nproc=2", "inference.cpu.max_batch=64"])
    assert resolve_layout(explicit, 8) is explicit


@pytest.mark.parametrize("cores, engines, batch", [(1, 1, 128), (2, 1, 128), (5, 1, 128), (6, 2, 64),
                                                   (8, 3, 43), (16, 7, 19)])
def test_cpu_engines_are_counted_from_the_cores_and_split_a_step_between_them(cores, engines, batch):
    unset = compose([])
    resolved = resolve_layout(unset, 0, cores=cores)
    assert (resolved.inference.num_servers, resolved.inference.cpu.max_batch) == (engines, batch)
    assert engines * batch >= unset.rollout.batch_size > (engines * batch) - engines
    assert layout_choice(unset, resolved, cores) == (
        f"layout for {cores} usable core{'s' * (cores != 1)}: inference.num_servers={engines}, "
        f"inference.cpu.max_batch={batch} (set them to choose)")


def test_a_set_cpu_engine_count_or_batch_is_kept_and_not_announced():
    pinned = compose(["inference.num_servers=2"])
    resolved = resolve_layout(pinned, 0, cores=16)
    assert (resolved.inference.num_servers, resolved.inference.cpu.max_batch) == (2, 64)
    assert layout_choice(pinned, resolved, 16) == "layout for 16 usable cores: inference.cpu.max_batch=64 (set them to choose)"
    both = compose(["inference.num_servers=2", "inference.cpu.max_batch=8"])
    assert resolve_layout(both, 0, cores=16).inference == both.inference
    assert layout_choice(both, resolve_layout(both, 0, cores=16), 16) is None
    for elsewhere in (["conf=sim"], ["inference.addresses=[127.0.0.1:1]"]):
        config = compose(elsewhere)
        assert resolve_layout(config, 0, cores=16).inference.num_servers == 1
        assert layout_choice(config, resolve_layout(config, 0, cores=16), 16) is None


def test_usable_cores_follow_the_affinity_mask():
    probe = ("import os; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); "
             "from rlorch.launch.placement import usable_cores; print(usable_cores())")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert result.returncode == 0 and result.stdout.strip() == "1", result.stderr[-2000:]
    assert 1 <= usable_cores() <= (os.cpu_count() or 1)


def test_the_validated_config_says_what_layout_the_cores_chose():
    from typer.testing import CliRunner

    from rlorch.cli import app

    result = CliRunner().invoke(app, ["validate-config"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    engines = cpu_engines_for(usable_cores())
    assert f"inference.num_servers={engines}, inference.cpu.max_batch={-(-128 // engines)}" in result.output


def test_idle_gpus_are_a_warning_naming_the_keys():
    config = compose(["inference=sglang", "inference.num_servers=1", "trainer.fsdp.nproc=1"])
    warning = idle_gpu_warning(config, 8)
    assert "inference.num_servers" in warning and "trainer.fsdp.nproc" in warning and "[2, 3, 4, 5, 6, 7]" in warning
    assert idle_gpu_warning(compose(["inference=sglang", "inference.tp_size=2"]), 8) is None
    assert idle_gpu_warning(compose(["inference=sglang"]), 0) is None
    leftover = idle_gpu_warning(compose(["inference=sglang", "inference.tp_size=3"]), 8)
    assert "[7]" in leftover and "inference.tp_size=3" in leftover


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
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    result = subprocess.run([sys.executable, "-m", "rlorch.cli", "train", "inference=sglang", "run.gpus=8",
                             "inference.num_servers=2", "inference.tp_size=2", "trainer.fsdp.nproc=4",
                             f"run.dir={run_dir}", "--dry-run"], capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in result.stdout.splitlines()]
    assert [r["role"] for r in records] == ["orchestrator", "server-0", "server-1", "trainer"]
    assert all(set(r) == {"role", "node", "command", "env"} for r in records)
    assert not run_dir.exists()
    bad = subprocess.run([sys.executable, "-m", "rlorch.cli", "train", "inference=sglang", "run.gpus=2",
                          "inference.tp_size=2", "run.colocate=off", "--dry-run"], capture_output=True, text=True,
                         timeout=120, env=env)
    assert bad.returncode == 2 and "run.gpus" in bad.stderr and not bad.stdout


def test_resolving_the_cpu_default_layout_imports_no_torch():
    """The runner resolves the layout and builds each child's environment before the run starts:
    on a machine without a GPU driver the CPU default must not pay a torch import for it on the
    critical path (seconds of CPU; the trainer's ``fsdp.device=auto`` would ask torch)."""
    probe = ("import sys; from rlorch.config.compose import compose; from rlorch.launch.placement import "
             "resolve_layout, server_env, trainer_env, has_gpu_driver; config = resolve_layout(compose([])); "
             "assert config.trainer.fsdp.nproc == 1 and config.inference.num_servers >= 1; "
             "assert trainer_env(config) == {} and server_env(config, 0) == {}; "
             "assert has_gpu_driver() or 'torch' not in sys.modules, 'torch imported'")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]


def test_a_gpu_driver_on_the_machine_makes_torch_count_the_gpus(monkeypatch, tmp_path):
    import rlorch.launch.placement as placement

    config = compose([])
    monkeypatch.setattr(placement, "GPU_DEVICE_FILES", (str(tmp_path / "nvidia[0-9]*"),))
    assert not placement.has_gpu_driver() and placement.visible_gpus(config) == 0
    (tmp_path / "nvidia0").touch()
    import torch

    asked = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: asked.append("is_available") or True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    assert placement.has_gpu_driver() and placement.visible_gpus(config) == 3 and asked
    assert placement.visible_gpus(compose(["trainer.fsdp.device=cpu"])) == 0
