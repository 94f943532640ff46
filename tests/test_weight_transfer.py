"""Weight transfer over a process group (``inference.weight_transfer=distributed``) with a real
`rlorch serve` engine, gloo and the trainer's own broadcaster; the disk is the reference."""

from __future__ import annotations

import asyncio
import json

import pytest

from rlorch.inference.client import EngineError, SGLangEngine
from rlorch.inference.pool import EnginePool
from rlorch.orchestrator.watcher import WeightWatcher
from rlorch.config.schema import WatcherConfig
from rlorch.rundir.layout import RunDir, write_json_atomic
from rlorch.serve.server import CpuServer, ServerThread
from rlorch.trainer.broadcast import Broadcaster, _free_port
from rlorch.types import PolicyVersion, SamplingParams
from rlorch.launch.weight_group import GroupSpec

PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 4]]
GREEDY = SamplingParams(max_new_tokens=6, temperature=0.0)


@pytest.fixture()
def server(model_dir):
    thread = ServerThread(CpuServer(model_dir, threads=1))
    yield thread.address
    thread.stop()


def _state(path):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()


def _broadcaster(run: RunDir, engines: int = 1) -> Broadcaster:
    spec = GroupSpec(master_address="127.0.0.1", master_port=_free_port("127.0.0.1"), rank_offset=1,
                     world_size=1 + engines, backend="gloo")
    run.offers.mkdir(parents=True, exist_ok=True)
    write_json_atomic(run.weight_group_members, {"world_size": 1 + engines})
    return Broadcaster(run, spec, timeout=30.0, device="cpu", log=print)


async def _outputs(engine) -> list[tuple[list[int], list[float], list[int]]]:
    answers = [await engine.generate(p, GREEDY, f"probe-{i}") for i, p in enumerate(PROMPTS)]
    return [(a.output_ids, a.logprobs, a.versions.expand()) for a in answers]


async def _send(broadcaster: Broadcaster, pool: EnginePool, watcher: WeightWatcher, step: int, state: dict) -> bool:
    """The trainer's send (on its own thread, as in its process) while the watcher polls."""
    sending = asyncio.create_task(asyncio.to_thread(broadcaster.send, step, state))
    while not sending.done():
        await watcher.poll_once()
        await asyncio.sleep(0.01)
    return sending.result()


def test_refused_transfer_leaves_weights_and_watcher_waits_for_disk(server, perturbed_dir, tmp_path):
    """An offer the engine cannot take (a wrong shape) fails on the engine before anything moves:
    the watcher records the fallback instead of failing the run, and loads the version from
    disk once it is published there."""
    run = RunDir(tmp_path / "run").make()

    async def scenario():
        pool = EnginePool([SGLangEngine(server)])
        watcher = WeightWatcher(WatcherConfig(), policy=PolicyVersion(0), engines=pool,
                                published=run.published_weights, offers=run.broadcast_offers,
                                receiving=run.receiving, distributed=True)
        try:
            before = await _outputs(pool)
            run.offers.mkdir(parents=True, exist_ok=True)
            run.offer_for(1).write_text(json.dumps({"names": ["model.norm.weight"], "dtypes": ["float32"],
                                                    "shapes": [[3]], "group_name": "weight_update_group"}))
            assert not await watcher.poll_once()
            assert watcher.failed_offers == {1} and watcher.policy.value == 0
            unchanged = await _outputs(pool)
            import shutil

            shutil.copytree(perturbed_dir, run.weights_for(1))
            (run.weights_for(1) / "PUBLISHED").touch()
            assert await watcher.poll_once()
            assert watcher.policy.value == 1 and watcher.gauges()["transfer_fallbacks"] == 1
            return before, unchanged
        finally:
            await pool.close()

    before, unchanged = asyncio.run(scenario())
    assert before == unchanged


def test_engine_refuses_bad_group_requests(server):
    async def scenario():
        engine = SGLangEngine(server)
        try:
            with pytest.raises(EngineError, match="gloo"):
                await engine.init_weights_update_group({"master_address": "127.0.0.1", "master_port": 1,
                                                        "rank_offset": 1, "world_size": 2, "backend": "nccl"})
            with pytest.raises(EngineError, match="rank_offset"):
                await engine.init_weights_update_group({"master_address": "127.0.0.1", "master_port": 1,
                                                        "rank_offset": 0, "world_size": 2, "backend": "gloo"})
            with pytest.raises(EngineError, match="init_weights_update_group first"):
                await engine.update_weights_from_distributed({"names": [], "dtypes": [], "shapes": []}, 1)
        finally:
            await engine.close()

    asyncio.run(scenario())


def test_distributed_transfer_needs_real_backends():
    from rlorch.config.compose import compose
    from rlorch.config.schema import ConfigError

    with pytest.raises(ConfigError) as err:
        compose(["conf=sim", "inference.weight_transfer=distributed"])
    assert err.value.key == "inference.weight_transfer"
    assert compose(["inference.weight_transfer=distributed"]).inference.weight_transfer.value == "distributed"


def test_summary_says_where_the_start_went(tmp_path):
    from rlorch.config.compose import compose
    from rlorch.runner import run_training

    config = compose(["conf=sim", f"run.dir={tmp_path / 'run'}", "run.progress=false", "train.steps=3"])
    assert run_training(config, []) == 0
    startup = json.loads((tmp_path / "run" / "summary.json").read_text())["startup"]
    assert {"engines", "trainer", "ready", "eval", "first_step", "total"} <= set(startup)
    assert startup["ready"] <= startup["total"] and startup["first_step"] <= startup["total"]


def test_a_version_nobody_receives_goes_by_disk_within_the_timeout(tmp_path):
    """No engine asked to receive (no ``receiving`` mark): the trainer gives the version to the
    disk after ``transfer_timeout`` rather than waiting in its broadcast, and abandons the group."""
    import time

    import torch

    run = RunDir(tmp_path / "run").make()
    broadcaster = _broadcaster(run)
    broadcaster.timeout = 0.5
    broadcaster.group = object()
    started = time.monotonic()
    assert not broadcaster.send(1, {"w": torch.zeros(2)})
    assert time.monotonic() - started < 5 and broadcaster.group is None
    assert not run.offer_for(1).exists()


def test_a_refused_group_leaves_every_version_to_the_disk(tmp_path):
    run = RunDir(tmp_path / "run").make()
    broadcaster = _broadcaster(run)
    write_json_atomic(run.weight_group_members, {"refused": "the engines did not join"})
    broadcaster.join()
    assert broadcaster.group is None


def test_tp_servers_take_consecutive_ranks_after_the_trainer():
    from rlorch.launch.weight_group import rank_offsets

    assert rank_offsets([2, 2]) == ([1, 3], 5)
    assert rank_offsets([1, 4, 2]) == ([1, 2, 6], 8)
