"""Weights over a process group against SGLang's real HTTP app: its routes and request parsing,
its own ``init_custom_process_group`` on the server's side (gloo on CPU) and the weight-update
session as its scheduler keeps it (tests/contract/sglang_stand_in.py)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from contract_apps import require_sglang
from rlorch.launch.local import free_port
from rlorch.inference.client import EngineError, SGLangEngine
from rlorch.launch.weight_group import GroupSpec, broadcast, close_group, dtype_name, open_group

SGLANG_SOURCE = Path(__import__("importlib").util.find_spec("sglang").origin).parent if \
    __import__("importlib").util.find_spec("sglang") else None


def test_the_pinned_sglang_keeps_the_session_rules_and_group_construction_the_stand_in_copies():
    """The stand-in mirrors these; a drift in SGLang fails here rather than in a GPU run. (Source
    only: no app is started for it.)"""
    require_sglang()
    updater = (SGLANG_SOURCE / "srt/managers/scheduler_components/weight_updater.py").read_text()
    for message in ("update_weights_from_distributed must run between", "a weight-update session is already open",
                    "no weight-update session is open"):
        assert message in updater, message
    common = (SGLANG_SOURCE / "srt/utils/common.py").read_text()
    assert "store = PrefixStore(group_name, store)" in common and "_new_process_group_helper(" in common
    runner = (SGLANG_SOURCE / "srt/model_executor/model_runner_components/weight_updater.py").read_text()
    assert "rank = rank_offset + self.tp_rank" in runner


def test_servers_at_addresses_take_one_rank_per_tp_rank_read_from_server_info(stand_in, model_dir):
    """The real app reports TP 2, `rlorch serve` TP 1: ranks [1, 2] and [3], world size 4."""
    from rlorch.inference.pool import EnginePool
    from rlorch.serve.server import CpuServer, ServerThread

    app = stand_in("--tp-size", "2")
    cpu = ServerThread(CpuServer(model_dir, threads=1))

    async def scenario():
        engines = [SGLangEngine(app.address), SGLangEngine(cpu.address)]
        pool = EnginePool(engines)
        try:
            for engine in engines:
                await engine.server_info()
            return pool.weight_group_ranks()
        finally:
            await pool.close()

    try:
        assert asyncio.run(scenario()) == ([1, 3], 4)
    finally:
        cpu.stop()


def test_a_version_broadcast_by_rlorchs_group_arrives_bit_for_bit_inside_a_session(stand_in, tmp_path):
    app = stand_in("--dump-dir", str(tmp_path))
    spec = GroupSpec(master_address="127.0.0.1", master_port=free_port(), rank_offset=1, world_size=2,
                     group_name="contract-group", backend="gloo")
    state = {"a.weight": torch.randn(3, 4), "b.bias": torch.arange(5, dtype=torch.bfloat16)}
    offer = {"names": list(state), "dtypes": [dtype_name(t.dtype) for t in state.values()],
             "shapes": [list(t.shape) for t in state.values()], "group_name": spec.group_name}
    trainer: dict = {}
    joined = threading.Thread(target=lambda: trainer.update(group=open_group(spec, rank=0, timeout=60)))

    async def scenario():
        engine = SGLangEngine(app.address, control_timeout=60)
        try:
            joined.start()
            await engine.init_weights_update_group(spec.to_json())
            await asyncio.to_thread(joined.join)
            with pytest.raises(EngineError, match="must run between begin_weight_update"):
                await engine._weights_call("/update_weights_from_distributed", {**offer, "weight_version": "9"}, "no")
            sender = threading.Thread(target=broadcast, args=(trainer["group"], list(state.values())))
            sender.start()
            await engine.begin_weight_update()
            await engine.update_weights_from_distributed(offer, 7)
            await engine.end_weight_update()
            await asyncio.to_thread(sender.join)
            assert await engine.weight_version() == 7
            await engine._weights_call("/begin_weight_update", {}, "begin")
            with pytest.raises(EngineError, match="already open"):
                await engine._weights_call("/begin_weight_update", {}, "begin twice")
            await engine._weights_call("/end_weight_update", {}, "end")
            await engine.destroy_weights_update_group(spec.group_name)
            with pytest.raises(EngineError, match="does not exist"):
                await engine.destroy_weights_update_group(spec.group_name)
        finally:
            await engine.close()

    asyncio.run(scenario())
    close_group(trainer["group"])
    from safetensors.torch import load_file

    received = load_file(str(tmp_path / "version-7.safetensors"))
    assert set(received) == set(state)
    for name, tensor in state.items():
        assert received[name].dtype == tensor.dtype and torch.equal(received[name], tensor), name


def _distributed_run(apps, model_dir, run_dir, steps: int, *extra: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "rlorch.cli", "train", "inference=sglang", "trainer=fsdp",
               "trainer.fsdp.device=cpu", f"model.path={model_dir}",
               f"inference.addresses=[{','.join(app.address for app in apps)}]",
               "inference.weight_transfer=distributed", f"run.dir={run_dir}", "run.progress=false",
               "run.report=false", f"train.steps={steps}", "rollout.batch_size=8", "rollout.group_size=4",
               "rollout.max_new_tokens=4", "rollout.max_staleness=1", "eval.enabled=false",
               "trainer.allow_uncorrected=true", *extra]
    return subprocess.run(command, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_a_distributed_run_against_two_real_apps_trains_to_the_end_receiving_every_version(stand_in, model_dir,
                                                                                        tmp_path):
    dumps = [tmp_path / "dump-0", tmp_path / "dump-1"]
    for dump in dumps:
        dump.mkdir()
    apps = [stand_in("--dump-dir", str(dump), "--token-delay", "0.002") for dump in dumps]
    run_dir = tmp_path / "run"
    steps = 4
    result = _distributed_run(apps, model_dir, run_dir, steps, "inference.transfer_timeout=60")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["lost"] == 0 and summary["steps"] == steps and summary["transfer_fallbacks"] == 0, summary
    from safetensors.torch import load_file

    published = load_file(str(next((run_dir / "weights" / f"step_{steps:06d}").glob("*.safetensors"))))
    for dump in dumps:
        versions = sorted(int(p.stem.split("-")[1]) for p in dump.glob("version-*.safetensors"))
        assert versions == list(range(1, steps + 1)), versions
        received = load_file(str(dump / f"version-{steps}.safetensors"))
        for name, tensor in published.items():
            key = name if name in received else next(k for k in received if k.endswith(name))
            assert torch.equal(received[key], tensor), name


@pytest.mark.slow
def test_a_server_that_refuses_weight_sessions_costs_no_wait_every_version_goes_by_disk(stand_in, model_dir,
                                                                                     tmp_path):
    """The refusal is answered to the trainer at once (``refused``), so nothing waits for
    ``inference.transfer_timeout``; the run trains to the end and says every version it loaded went
    by disk. (The watcher loads the newest version: one published while an older one was being
    refused is skipped, so fewer versions than steps may be loaded.)"""
    import time

    apps = [stand_in("--token-delay", "0.002"), stand_in("--token-delay", "0.002", "--refuse-sessions")]
    run_dir = tmp_path / "run"
    steps = 4
    started = time.monotonic()
    result = _distributed_run(apps, model_dir, run_dir, steps, "inference.transfer_timeout=120")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert time.monotonic() - started < 120, "a version waited for transfer_timeout"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["lost"] == 0 and summary["steps"] == steps and summary["version"] == steps, summary
    loaded = summary["reloads"]
    assert 1 <= loaded <= steps and summary["transfer_fallbacks"] == loaded, summary
    assert f"{loaded} of {loaded} loaded version(s) went by disk" in result.stderr + result.stdout
