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
def served(model_dir):
    """``rlorch serve`` in a process of its own; its address once it answers."""
    import subprocess
    import sys
    import time
    import urllib.request

    port = _free_port("127.0.0.1")
    process = subprocess.Popen([sys.executable, "-m", "rlorch.cli", "serve", f"model.path={model_dir}",
                                "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while True:
        assert process.poll() is None and time.monotonic() < deadline, "rlorch serve did not start"
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).read()
            break
        except OSError:
            time.sleep(0.1)
    yield f"127.0.0.1:{port}"
    process.terminate()
    process.wait(30)


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


def test_engine_generates_the_same_after_gloo_as_after_disk(served, model_dir, perturbed_dir, tmp_path):
    """The engine is its own process, as in a run: torch keeps one registry of group names per
    process, so both ends of a group cannot live in one."""
    server = served
    run = RunDir(tmp_path / "run").make()
    broadcaster = _broadcaster(run)
    state = _state(perturbed_dir)

    async def scenario():
        pool = EnginePool([SGLangEngine(server)])
        watcher = WeightWatcher(WatcherConfig(), policy=PolicyVersion(0), engines=pool,
                                published=run.published_weights, offers=run.broadcast_offers,
                                offer_mark=run.offer_mark, distributed=True)
        try:
            before = await _outputs(pool)
            await asyncio.gather(asyncio.to_thread(broadcaster.join),
                                 pool.init_weights_update_group(broadcaster.spec.to_json()))
            assert broadcaster.group is not None
            assert await _send(broadcaster, pool, watcher, 1, state)
            assert watcher.policy.value == 1 and not watcher.failed_offers
            over_group = await _outputs(pool)
            await pool.reload(str(perturbed_dir), 2)
            from_disk = await _outputs(pool)
            await pool.reload(str(model_dir), 3)
            base_again = await _outputs(pool)
        finally:
            await pool.close()
        return before, over_group, from_disk, base_again

    before, over_group, from_disk, base_again = asyncio.run(scenario())
    assert [(ids, lps) for ids, lps, _ in over_group] == [(ids, lps) for ids, lps, _ in from_disk]
    assert [versions for _, _, versions in over_group] == [[1] * len(ids) for ids, _, _ in over_group]
    assert [lps for _, lps, _ in before] != [lps for _, lps, _ in over_group]
    assert [(ids, lps) for ids, lps, _ in before] == [(ids, lps) for ids, lps, _ in base_again]


def test_refused_transfer_leaves_weights_and_watcher_waits_for_disk(server, perturbed_dir, tmp_path):
    """An offer the engine cannot take (a wrong shape) fails on the engine before anything moves:
    the watcher records the fallback instead of failing the run, and loads the version from
    disk once it is published there."""
    run = RunDir(tmp_path / "run").make()

    async def scenario():
        pool = EnginePool([SGLangEngine(server)])
        watcher = WeightWatcher(WatcherConfig(), policy=PolicyVersion(0), engines=pool,
                                published=run.published_weights, offers=run.broadcast_offers,
                                offer_mark=run.offer_mark, distributed=True)
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
            with pytest.raises(EngineError, match="must run between begin_weight_update"):
                await engine.update_weights_from_distributed({"names": [], "dtypes": [], "shapes": []}, 1)
            await engine.begin_weight_update()
            with pytest.raises(EngineError, match="init_weights_update_group first"):
                await engine.update_weights_from_distributed({"names": [], "dtypes": [], "shapes": []}, 1)
            await engine.end_weight_update()
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


def test_a_refused_version_goes_by_disk_at_once_and_the_group_stays(tmp_path):
    """The engines could not open their sessions: the orchestrator answers ``refused`` and the
    trainer publishes that version to disk without waiting, keeping the group for the next."""
    import time

    import torch

    run = RunDir(tmp_path / "run").make()
    broadcaster = _broadcaster(run)
    broadcaster.group = group = object()
    run.offer_mark(3, "refused").touch()
    started = time.monotonic()
    assert not broadcaster.send(3, {"w": torch.zeros(2)})
    assert time.monotonic() - started < broadcaster.timeout / 2 and broadcaster.group is group
    assert not run.offer_for(3).exists()


def test_a_group_the_orchestrator_never_sizes_leaves_every_version_to_the_disk(tmp_path):
    import time

    run = RunDir(tmp_path / "run").make()
    broadcaster = _broadcaster(run)
    run.weight_group_members.unlink()
    broadcaster.timeout = 0.5
    started = time.monotonic()
    broadcaster.join()
    assert broadcaster.group is None and time.monotonic() - started < 5


def test_a_trainer_that_dies_while_the_engines_join_fails_the_join_at_once(server, tmp_path, monkeypatch):
    """The engine waits for a trainer that never comes; the trainer's exit ends the wait, naming
    it, instead of the engine's join timeout."""
    import time

    from rlorch.config.compose import compose
    from rlorch.inference.weight_transfer import TrainerExited, join_weight_group
    from rlorch.serve import weight_sync

    monkeypatch.setattr(weight_sync, "GROUP_TIMEOUT_S", 5.0)
    run = RunDir(tmp_path / "run").make()
    write_json_atomic(run.weight_group, {"master_address": "127.0.0.1", "master_port": _free_port("127.0.0.1"),
                                         "group_name": "never", "backend": "gloo"})
    config = compose(["inference=cpu", "trainer=fsdp", "inference.weight_transfer=distributed"])
    dies_at = time.monotonic() + 0.5

    async def scenario():
        pool = EnginePool([SGLangEngine(server)])
        try:
            started = time.monotonic()
            with pytest.raises(TrainerExited, match="trainer exited with code 1"):
                await join_weight_group(config, run, pool, lambda: "trainer exited with code 1"
                                        if time.monotonic() > dies_at else None)
            return time.monotonic() - started
        finally:
            await pool.close()

    assert asyncio.run(scenario()) < 2.0
    assert json.loads(run.weight_group_members.read_text()) == {"world_size": 2}


def test_joining_closes_a_weight_update_session_left_open(server):
    """An orchestrator that died mid-update leaves the server's session open; the next join
    closes it, or every later version would be refused."""
    async def scenario():
        engine = SGLangEngine(server, control_timeout=10)
        try:
            await engine._weights_call("/begin_weight_update", {}, "begin")
            spec = GroupSpec(master_address="127.0.0.1", master_port=_free_port("127.0.0.1"), rank_offset=1,
                             world_size=2, group_name="nobody", backend="nccl")
            with pytest.raises(EngineError):
                await engine.init_weights_update_group(spec.to_json())
            await engine._weights_call("/begin_weight_update", {}, "begin after the join")
        finally:
            await engine.close()

    asyncio.run(scenario())


def test_tp_servers_take_consecutive_ranks_after_the_trainer():
    from rlorch.launch.weight_group import rank_offsets

    assert rank_offsets([2, 2]) == ([1, 3], 5)
    assert rank_offsets([1, 4, 2]) == ([1, 2, 6], 8)
