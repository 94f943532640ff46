"""Weight transfer over a process group (``inference.weight_transfer=distributed``) with a real
`rlorch serve` engine, gloo and the trainer's own broadcaster; the disk is the reference."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from helpers import wait_answering
from rlorch.inference.client import EngineError, EngineUnavailable, SGLangEngine
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


def _serve(model_dir, port: int = 0):
    """``rlorch serve`` started in a process of its own (not yet answering) and its address."""
    import subprocess
    import sys

    port = port or _free_port("127.0.0.1")
    process = subprocess.Popen([sys.executable, "-m", "rlorch.cli", "serve", f"model.path={model_dir}",
                                "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return process, f"127.0.0.1:{port}"


def _answering(process, address: str) -> None:
    wait_answering(f"http://{address}/health", process, what="rlorch serve")


@pytest.fixture()
def served(model_dir):
    """``rlorch serve`` in a process of its own; its address once it answers."""
    process, address = _serve(model_dir)
    _answering(process, address)
    yield address
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


class GroupEngine:
    """A server's weight-group endpoints as the pool sees them: the groups it is in (name ->
    rank, world size) and the version it holds; ``restart()`` is a fresh process on its address."""

    def __init__(self, name: str, tp_size: int = 1):
        self.name, self.tp_size = name, tp_size
        self.groups: dict[str, tuple[int, int]] = {}
        self.version, self.destroyed = 0, []

    def restart(self) -> None:
        self.groups, self.version = {}, 0

    async def init_weights_update_group(self, spec: dict) -> None:
        self.groups[spec["group_name"]] = (spec["rank_offset"], spec["world_size"])

    async def destroy_weights_update_group(self, name: str) -> None:
        if self.groups.pop(name, None) is None:
            raise EngineError(f"{self.name}: The group to be destroyed does not exist.")
        self.destroyed.append(name)

    async def update_weights_from_distributed(self, offer: dict, version: int) -> None:
        if offer["group_name"] not in self.groups:
            raise EngineError(f"{self.name}: no weight group {offer['group_name']!r}")
        self.version = version

    async def weight_version(self) -> int:
        return self.version

    async def reload(self, path: str, version: int) -> None:
        self.version, self.loaded_from = version, path

    async def pause(self) -> None:
        if self.unreachable:
            raise EngineUnavailable(f"{self.name}: POST /pause_generation failed: connection reset")

    async def resume(self) -> None: ...
    refuse = False
    unreachable = False

    async def begin_weight_update(self) -> None:
        if self.refuse:
            raise EngineError(f"{self.name}: a weight-update session is already open")

    async def end_weight_update(self) -> None: ...
    async def close(self) -> None: ...

    async def healthy(self, timeout=None) -> bool:
        return True


def test_the_pool_rebuilds_the_weight_group_whenever_its_servers_change():
    """Per version: receivers == the group's members, ranked in server order after the trainer
    (a TP 2 server takes two ranks); a restarted or added server joins (and takes work) only
    with the next version; the survivors leave the old group; a rebuild that fails sends that
    version by disk and the next one rebuilds again."""
    a, b, c = GroupEngine("a"), GroupEngine("b", tp_size=2), GroupEngine("c")
    asked: list[tuple[int, int]] = []

    async def regroup(version: int, world_size: int) -> dict:
        asked.append((version, world_size))
        if version == 6:
            raise TimeoutError("the trainer announced no new weight group")
        return {"master_address": "127.0.0.1", "master_port": 1, "group_name": f"g{len(asked)}", "backend": "gloo"}

    async def scenario():
        pool = EnginePool([a, b], probe_interval=0.01)
        pool.regroup = regroup
        await pool.init_weights_update_group({"master_address": "127.0.0.1", "master_port": 1, "group_name": "g0",
                                              "backend": "gloo", "world_size": 4})
        assert a.groups == {"g0": (1, 4)} and b.groups == {"g0": (2, 4)}
        await pool.update_weights_from_distributed({"group_name": "g0"}, 1)
        assert asked == [] and (a.version, b.version) == (1, 1)

        async def settle(name):
            for _ in range(500):
                if name in pool._awaiting_group:
                    return
                await asyncio.sleep(0.01)
            raise AssertionError(f"{name} never waited for the group")

        pool.mark_dead("b", "killed")
        b.restart()
        pool.restarted("b")
        await settle("b")
        assert pool.health()["servers_up"] == 1        # not at version 1: no work yet
        await pool.update_weights_from_distributed({"group_name": "g0"}, 2)
        assert asked == [(2, 4)] and a.destroyed == ["g0"]
        assert a.groups == {"g1": (1, 4)} and b.groups == {"g1": (2, 4)} and (a.version, b.version) == (2, 2)
        assert pool.health()["servers_up"] == 2

        pool.add(c)
        await settle("c")
        await pool.update_weights_from_distributed({"group_name": "g1"}, 3)
        assert asked[-1] == (3, 5) and c.groups == {"g2": (4, 5)} and c.version == 3

        await pool.remove("b", timeout=1.0)
        await pool.update_weights_from_distributed({"group_name": "g2"}, 4)
        assert asked[-1] == (4, 3) and a.groups == {"g3": (1, 3)} and c.groups == {"g3": (2, 3)}

        await pool.update_weights_from_distributed({"group_name": "g3"}, 4)   # nothing changed: no rebuild
        a.refuse = True     # refused before anything was sent: the group is intact
        with pytest.raises(EngineError, match="session is already open"):
            await pool.update_weights_from_distributed({"group_name": "g3"}, 5)
        a.refuse = False
        await pool.update_weights_from_distributed({"group_name": "g3"}, 5)
        assert len(asked) == 3
        pool.mark_dead("c", "killed")
        with pytest.raises(EngineError, match="did not open a new weight group"):
            await pool.update_weights_from_distributed({"group_name": "g3"}, 6)
        await pool.update_weights_from_distributed({"group_name": None}, 7)    # the trainer lost its group
        assert asked[-1] == (7, 2) and a.groups == {"g5": (1, 2)} and a.version == 7
        assert pool.health()["weight_group_rebuilds"] == 4
        await pool.close()

    asyncio.run(scenario())


def test_a_regroup_ends_at_once_when_the_trainer_has_withdrawn_its_offer(tmp_path):
    """The trainer gave up on version 5 (no answer in time) and sent it by disk: asking it to
    regroup for that version fails at once instead of waiting out the timeout."""
    from rlorch.inference.weight_transfer import regroup

    run = RunDir(tmp_path / "run").make()
    run.offers.mkdir(parents=True)
    write_json_atomic(run.weight_group, {"group_name": "g0"})
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="withdrew its offer of version 5"):
        asyncio.run(regroup(run, 5, 2, timeout=30.0))
    assert time.monotonic() - started < 1.0


def test_a_sole_server_restarted_after_a_version_over_the_group_catches_up_from_disk():
    """Version 2 reached the only server over the group, then it died: restarted, it holds its
    start-up weights and no one is left to receive version 3, so it must not take work as it is.
    The pool asks the trainer for its weights on disk, waits out of rotation until they are
    there, loads the newest (at least 2), and the next version rebuilds the group for it."""
    a = GroupEngine("a")
    published: list[tuple[int, str]] = []
    requests: list[int] = []

    async def regroup(version: int, world_size: int) -> dict:
        asked.append(version)
        return {"master_address": "127.0.0.1", "master_port": 1, "group_name": f"g{version}", "backend": "gloo"}

    asked: list[int] = []

    async def scenario():
        pool = EnginePool([a], probe_interval=0.01)
        pool.regroup, pool.published, pool.request_publish = regroup, lambda: iter(published), requests.append
        await pool.init_weights_update_group({"master_address": "127.0.0.1", "master_port": 1, "group_name": "g0",
                                              "backend": "gloo", "world_size": 2})
        await pool.update_weights_from_distributed({"group_name": "g0"}, 2)
        a.unreachable = True    # killed as version 3 comes: its pause fails, no group is rebuilt for nobody
        with pytest.raises(EngineError, match="no live server to receive version 3"):
            await pool.update_weights_from_distributed({"group_name": "g0"}, 3)
        assert asked == []
        a.unreachable = False
        pool.mark_dead("a", "killed")
        a.restart()
        pool.restarted("a")
        for _ in range(500):
            if len(requests) >= 3:
                break
            await asyncio.sleep(0.01)
        assert set(requests) == {2} and pool.health()["servers_up"] == 0 and a.version == 0
        started = time.monotonic()    # an offer now is refused at once: the trainer puts it on disk
        with pytest.raises(EngineError, match="no live server to receive version 3"):
            await pool.update_weights_from_distributed({"group_name": "g0"}, 3)
        assert time.monotonic() - started < 1.0 and asked == []
        published.extend([(1, "weights/step_000001"), (3, "weights/step_000003")])
        for _ in range(500):
            if pool.health()["servers_up"]:
                break
            await asyncio.sleep(0.01)
        assert pool.health()["servers_up"] == 1 and (a.version, a.loaded_from) == (3, "weights/step_000003")
        await pool.update_weights_from_distributed({"group_name": "g0"}, 4)
        assert a.groups == {"g4": (1, 2)} and a.version == 4 and asked == [4]
        await pool.close()

    asyncio.run(asyncio.wait_for(scenario(), 60))


@pytest.mark.slow
@pytest.mark.cluster
def test_the_weight_group_is_rebuilt_when_a_server_restarts_and_when_one_leaves(model_dir, perturbed_dir, tmp_path):
    """Two engines in the group; one is killed and started again (version 0, in no group): the
    next version rebuilds the group (new name, the survivor leaves the old one) and reaches both
    over it, and the restarted one takes work again only then. Then one leaves the fleet: the
    next version rebuilds the group for the one left. No version goes by disk."""
    import signal

    from rlorch.inference.weight_transfer import regroup

    processes = dict(a=_serve(model_dir), b=_serve(model_dir))
    for process, address in processes.values():
        _answering(process, address)
    run = RunDir(tmp_path / "run").make()
    broadcaster = _broadcaster(run, engines=2)
    tuned, base = _state(perturbed_dir), _state(model_dir)

    async def scenario():
        a, b = SGLangEngine(processes["a"][1]), SGLangEngine(processes["b"][1])
        pool = EnginePool([a, b], probe_interval=0.1)
        pool.regroup = lambda version, world_size: regroup(run, version, world_size, 30.0)
        watcher = WeightWatcher(WatcherConfig(), policy=PolicyVersion(0), engines=pool,
                                published=run.published_weights, offers=run.broadcast_offers,
                                offer_mark=run.offer_mark, distributed=True)
        try:
            await asyncio.gather(asyncio.to_thread(broadcaster.join),
                                 pool.init_weights_update_group(broadcaster.spec.to_json()))
            assert await _send(broadcaster, pool, watcher, 1, base)
            first_group = broadcaster.spec.group_name

            old, address = processes["b"]
            old.send_signal(signal.SIGKILL)
            old.wait(30)
            pool.mark_dead(b.name, "killed")
            processes["b"] = (await asyncio.to_thread(_serve, model_dir, int(address.rsplit(":", 1)[1])))
            await asyncio.to_thread(_answering, *processes["b"])
            pool.restarted(b.name)
            for _ in range(300):
                if b.name in pool._awaiting_group:
                    break
                await asyncio.sleep(0.1)
            assert pool.health()["servers_up"] == 1, "the restarted engine took work before it held version 1"

            assert await _send(broadcaster, pool, watcher, 2, tuned)
            assert broadcaster.spec.group_name != first_group and broadcaster.spec.world_size == 3
            versions = [await a.weight_version(), await b.weight_version()]
            assert pool.health()["servers_up"] == 2
            outputs = [await _outputs(a), await _outputs(b)]

            await pool.remove(b.name, timeout=5.0)
            assert await _send(broadcaster, pool, watcher, 3, base)
            assert broadcaster.spec.world_size == 2
            versions.append(await a.weight_version())
            return versions, outputs, watcher, pool.group_rebuilds
        finally:
            await pool.close()
            for process, _ in processes.values():
                process.terminate()
                process.wait(30)

    versions, (on_a, on_b), watcher, rebuilds = asyncio.run(scenario())
    assert versions == [2, 2, 3] and watcher.policy.value == 3
    assert watcher.transfer_fallbacks == 0 and not watcher.failed_offers and rebuilds == 2
    assert [(ids, lps) for ids, lps, _ in on_a] == [(ids, lps) for ids, lps, _ in on_b]


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
    import torch

    run = RunDir(tmp_path / "run").make()
    broadcaster = _broadcaster(run)
    broadcaster.timeout = 0.5
    broadcaster.group, broadcaster.joined = object(), True
    started = time.monotonic()
    assert not broadcaster.send(1, {"w": torch.zeros(2)})
    assert time.monotonic() - started < 5 and broadcaster.group is None
    assert not run.offer_for(1).exists()


def test_a_refused_version_goes_by_disk_at_once_and_the_group_stays(tmp_path):
    """The engines could not open their sessions: the orchestrator answers ``refused`` and the
    trainer publishes that version to disk without waiting, keeping the group for the next."""
    import torch

    run = RunDir(tmp_path / "run").make()
    broadcaster = _broadcaster(run)
    broadcaster.group = group = object()
    broadcaster.joined = True
    run.offer_mark(3, "refused").touch()
    started = time.monotonic()
    assert not broadcaster.send(3, {"w": torch.zeros(2)})
    assert time.monotonic() - started < broadcaster.timeout / 2 and broadcaster.group is group
    assert not run.offer_for(3).exists()


def test_asked_to_regroup_the_trainer_announces_a_new_group_joins_it_and_broadcasts(tmp_path):
    """The orchestrator's ``regroup`` answer: rank 0 leaves its group, announces a new name and
    port in ``weight_group.json`` (what :func:`regroup` returns to the pool), forms it with the
    size asked for (1 here: only itself) and broadcasts the version over it."""
    import torch

    from rlorch.inference.weight_transfer import regroup

    run = RunDir(tmp_path / "run").make()
    broadcaster = _broadcaster(run)
    broadcaster.group, broadcaster.joined = object(), True
    first = broadcaster.spec

    async def scenario():
        sending = asyncio.create_task(asyncio.to_thread(broadcaster.send, 4, {"w": torch.ones(2)}))
        while not run.offer_for(4).exists():
            await asyncio.sleep(0.01)
        offer = json.loads(run.offer_for(4).read_text())
        spec = await regroup(run, 4, 1, timeout=30.0)
        run.offer_mark(4, "receiving").touch()
        return offer, spec, await sending

    offer, spec, sent = asyncio.run(scenario())
    assert offer["group_name"] == first.group_name and sent
    assert spec["group_name"] == f"{first.group_name}-g1" and spec["master_port"] != first.master_port
    assert broadcaster.spec.world_size == 1 and broadcaster.group is not None
    assert json.loads(run.weight_group.read_text())["generation"] == 1


def test_a_group_the_orchestrator_never_sizes_leaves_every_version_to_the_disk(tmp_path):
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
