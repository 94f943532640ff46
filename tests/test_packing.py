"""Packing: the groups one admission pass lets through share a task and one engine call, while
the gate, the output queue, the in-flight list and the failed list account for each group."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

import helpers
from rlorch.config.compose import compose
from rlorch.config.schema import ConfigError
from rlorch.orchestrator.dispatcher import Dispatcher, GenerationFailed
from rlorch.orchestrator.gate import CapacityGate
from rlorch.types import Origin, PolicyVersion, Prompt, Rollout, VersionStamps

GROUP = 2


def group_of(prompt: Prompt) -> list[Rollout]:
    return [Rollout(group_id=prompt.group_id, episode_id=f"g{prompt.group_id}-{i}", env="t", tokens=[1, 2],
                    loss_mask=[0, 1], logprobs=[0.0, -1.0], versions=VersionStamps([[0, 1]]), reward=float(i),
                    origin=Origin.live) for i in range(GROUP)]


class Packs:
    """A pack work function that records each call's group ids and can hold, fail or hang calls."""

    def __init__(self, *, fail_first: int = 0, fail_always: bool = False, hang_first: int = 0):
        self.calls: list[list[int]] = []
        self.fail_first, self.fail_always, self.hang_first = fail_first, fail_always, hang_first
        self.hold = asyncio.Event()
        self.hold.set()

    async def __call__(self, prompts: list[Prompt]) -> list[list[Rollout]]:
        self.calls.append([p.group_id for p in prompts])
        if len(self.calls) <= self.hang_first:
            await helpers.hang()
        await self.hold.wait()
        if self.fail_always or len(self.calls) <= self.fail_first:
            raise ConnectionError("engine died")
        return [group_of(prompt) for prompt in prompts]


async def single(prompt: Prompt) -> list[Rollout]:
    raise AssertionError("a packing dispatcher runs its pack work")


def dispatcher(pack: Packs, *, prompts: int = 10, capacity: int = 100, pack_groups: int = 4,
               **overrides) -> Dispatcher:
    gate = CapacityGate(max_staleness=100, batch_size=GROUP, max_concurrent=capacity, policy=PolicyVersion())
    source = (Prompt(group_id=i, input_ids=[1], env="t") for i in range(prompts))
    settings = dict(group_size=GROUP, queue_size=16, max_buffered=1000, request_timeout=5.0, max_retries=3)
    settings.update(overrides)
    return Dispatcher(gate=gate, work=single, prompts=source, pack=pack, pack_groups=pack_groups, **settings)


async def drain(d: Dispatcher, groups: int) -> list[list[Rollout]]:
    got = []
    while len(got) < groups and d.error is None:
        await asyncio.wait_for(d.wait_ready(), 5)
        while (group := d.try_get()) is not None:
            got.append(group)
    return got


def run_to_the_end(pack: Packs, groups: int, **settings) -> tuple[Dispatcher, list[list[Rollout]]]:
    """Start a packing dispatcher over ``groups`` prompts, take every finished group, stop."""
    async def scenario():
        d = dispatcher(pack, prompts=groups, **settings)
        await d.start()
        got = await drain(d, groups)
        await d.stop()
        return d, got

    return asyncio.run(scenario())


async def started_on_hold(pack, *, sent: int, **kwargs):
    """A started dispatcher whose packs the engine holds, once packs of ``sent`` groups are sent
    (and every ready task has run again, so a pack sent beyond them would show)."""
    pack.hold.clear()
    d = dispatcher(pack, **kwargs)
    await d.start()
    deadline = asyncio.get_running_loop().time() + 10
    while sum(map(len, pack.calls)) < sent:
        assert asyncio.get_running_loop().time() < deadline, f"packs sent: {pack.calls}, expected {sent} groups"
        await asyncio.sleep(0.005)
    for _ in range(50):
        await asyncio.sleep(0)
    return d


def test_admitted_groups_share_packs_of_at_most_pack_groups_and_each_is_accounted():
    pack = Packs()

    d, got = run_to_the_end(pack, 10)
    assert pack.calls == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert [g[0].group_id for g in got] == list(range(10)) and all(len(g) == GROUP for g in got)
    assert d.gate.submitted == d.gate.accepted == 10 * GROUP and d.gate.running == 0
    assert d.admitted == 10 * GROUP and d.in_flight == 0


def test_a_pack_holds_only_what_the_gate_admits_now():
    pack = Packs()

    async def scenario():
        d = await started_on_hold(pack, sent=3, prompts=10, capacity=3 * GROUP)
        first = list(pack.calls), d.in_flight, d.gate.running
        pack.hold.set()
        await drain(d, 10)
        await d.stop()
        return first, d

    (calls, in_flight, running), d = asyncio.run(scenario())
    assert calls == [[0, 1, 2]] and in_flight == running == 3 * GROUP
    assert sum(len(call) for call in pack.calls) == 10 and all(len(call) <= 3 for call in pack.calls)
    assert d.gate.accepted == 10 * GROUP and d.gate.running == 0


def test_a_failed_pack_is_retried_whole_and_every_group_is_accepted():
    pack = Packs(fail_first=1)

    d, got = run_to_the_end(pack, 4)
    assert pack.calls == [[0, 1, 2, 3], [0, 1, 2, 3]] and d.retries == 1
    assert sorted(g[0].group_id for g in got) == [0, 1, 2, 3]
    assert d.gate.accepted == 4 * GROUP and d.gate.rejected == 0 and d.gate.running == 0


def test_a_timed_out_pack_is_retried():
    pack = Packs(hang_first=1)

    d, got = run_to_the_end(pack, 3, request_timeout=0.2)
    assert pack.calls == [[0, 1, 2], [0, 1, 2]] and d.retries == 1 and len(got) == 3
    assert d.gate.accepted == 3 * GROUP and d.gate.running == 0


def test_a_pack_that_fails_every_retry_rejects_each_group_and_keeps_every_prompt():
    pack = Packs(fail_always=True)

    async def scenario():
        d = dispatcher(pack, prompts=3, max_retries=2)
        await d.start()
        await asyncio.wait_for(d.wait_ready(), 5)
        await d.stop()
        return d

    d = asyncio.run(scenario())
    assert isinstance(d.error, GenerationFailed) and "groups 0, 1, 2 (one pack) failed 2 times" in str(d.error)
    assert [p.group_id for p in d.state().failed] == [0, 1, 2]
    assert d.gate.rejected == 3 * GROUP and d.gate.accepted == 0 and d.gate.running == 0


def test_checkpoint_state_lists_every_prompt_of_a_pack_in_flight_and_cancel_returns_them():
    pack = Packs()

    async def scenario():
        d = await started_on_hold(pack, sent=5, prompts=6, capacity=5 * GROUP)
        state = d.state()
        abandoned = await d.cancel_in_flight()
        return d, state, abandoned

    d, state, abandoned = asyncio.run(scenario())
    assert pack.calls == [[0, 1, 2, 3], [4]]
    assert [p.group_id for p in state.in_flight] == [0, 1, 2, 3, 4] and [p.group_id for p in state.queued] == [5]
    assert [p.group_id for p in abandoned] == [0, 1, 2, 3, 4]
    assert d.gate.rejected == 5 * GROUP and d.gate.running == 0 and d.in_flight == 0

    restored = dispatcher(Packs(), prompts=0)
    restored.restore(abandoned + state.queued)
    assert [p.group_id for p in restored.in_queue] == [0, 1, 2, 3, 4, 5]


def test_pack_samples_is_validated_naming_the_key():
    with pytest.raises(ConfigError, match="rollout.pack_samples"):
        compose(["conf=sim", "rollout.pack_samples=0"])
    assert compose(["conf=sim", "rollout.group_size=4", "rollout.batch_size=8",
                    "rollout.pack_samples=10"]).rollout.pack_groups == 2
    assert compose(["conf=sim", "rollout.group_size=4", "rollout.batch_size=8",
                    "rollout.pack_samples=2"]).rollout.pack_groups == 1


def trained_rollouts(tmp_path: Path, name: str, *overrides: str) -> tuple[dict, list[dict]]:
    run_dir = tmp_path / name
    code, summary, _ = helpers.train(run_dir, "eval.enabled=false", "inference.sim.latency=[0,0]",
                                     "trainer.sim.step_time=0", "train.steps=6", "rollout.batch_size=16",
                                     "rollout.group_size=2", "rollout.max_concurrent=64", "metrics.interval=0.001",
                                     *overrides)
    assert code == 0
    summary["engine_calls"] = max(record.get("engines_calls", 0) for record in helpers.read_metrics(run_dir))
    lines = [record for step in range(1, 7) for record in helpers.trained(run_dir, step)]
    return summary, lines


def test_a_deterministic_sim_run_trains_the_same_rollouts_with_and_without_packing(tmp_path):
    def fields(lines):
        return sorted((r["group_id"], r["episode_id"], r["tokens"], r["loss_mask"], r["logprobs"], r["reward"],
                       r["completion"]) for r in lines)

    packed_summary, packed = trained_rollouts(tmp_path, "packed", "rollout.pack_samples=64")
    alone_summary, alone = trained_rollouts(tmp_path, "alone", "rollout.pack_samples=1")
    assert packed_summary["lost"] == alone_summary["lost"] == 0
    assert packed_summary["trained"] == alone_summary["trained"] == 6 * 16
    assert len(packed) == 6 * 16 and fields(packed) == fields(alone)
    # 48 groups of 2: one engine call each alone, packs of up to 32 groups packed.
    assert alone_summary["engine_calls"] == 48 and 2 <= packed_summary["engine_calls"] < 48


def test_admitting_groups_at_once_matches_admitting_them_one_by_one():
    for capacity, staleness, version, size, most in [(10, 5, 0, 3, 9), (64, 0, 2, 4, 100), (7, 1, 0, 8, 3),
                                                     (100, 3, 1, 1, 5)]:
        gates = [CapacityGate(max_staleness=staleness, batch_size=8, max_concurrent=capacity,
                              policy=PolicyVersion(version)) for _ in range(2)]
        together = gates[0].admit_groups(size, most)
        one_by_one = 0
        while one_by_one < most and gates[1].try_admit(size):
            one_by_one += 1
        assert together == one_by_one and gates[0].counts() == gates[1].counts()


class HeldOut:
    """Prompts whose eval set is ``count`` held-out prompts."""

    def __init__(self, count: int):
        self.count = count

    def eval_set(self, wanted) -> list[Prompt]:
        return [Prompt(group_id=i, input_ids=[1], env="t", is_eval=True) for i in range(self.count)]


class EvalWork(Packs):
    """Single-turn work: packs prompts into one call, and counts the prompts sent alone."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.alone = 0

    async def pack(self, prompts: list[Prompt]) -> list[list[Rollout]]:
        return [[rollout] for rollout, *_ in await Packs.__call__(self, prompts)]

    async def __call__(self, prompt: Prompt) -> list[Rollout]:
        self.alone += 1
        return group_of(prompt)[:1]


def evaluate(work, prompts: int, pack_samples: int, packs: bool = True) -> dict:
    from rlorch.config.schema import EvalConfig
    from rlorch.orchestrator.evaluation import Evaluations
    from rlorch.orchestrator.sinks import EvalSink

    records = []
    evaluations = Evaluations(EvalConfig(), work=work, prompts=HeldOut(prompts), sink=EvalSink(), write=records.append,
                              request_timeout=5.0, pack=work.pack if packs else None, pack_samples=pack_samples)
    asyncio.run(evaluations.run(0))
    return records[0]


def test_an_evaluation_sends_its_prompts_in_equal_packs_of_at_most_pack_samples():
    work = EvalWork()
    record = evaluate(work, prompts=97, pack_samples=64)
    assert [len(call) for call in work.calls] == [49, 48] and work.alone == 0
    assert sorted(i for call in work.calls for i in call) == list(range(97))
    assert record["prompts"] == 97 and record["failed"] == 0

    alone = EvalWork()
    evaluate(alone, prompts=5, pack_samples=1)
    assert alone.calls == [] and alone.alone == 5


def test_a_failed_evaluation_pack_counts_its_prompts_failed_and_the_others_are_kept():
    work = EvalWork(fail_first=1)
    record = evaluate(work, prompts=10, pack_samples=4)
    assert [len(call) for call in work.calls] == [4, 3, 3]
    assert record["prompts"] == 10 and record["failed"] == 4


def test_without_a_pack_an_evaluation_sends_each_prompt_alone():
    """Multi-turn work gets no pack from the loop (its episodes share no engine call)."""
    work = EvalWork()
    record = evaluate(work, prompts=6, pack_samples=64, packs=False)
    assert work.calls == [] and work.alone == 6 and record["failed"] == 0
    empty = EvalWork()
    assert evaluate(empty, prompts=0, pack_samples=64)["prompts"] == 0 and empty.calls == []
