"""Unit tests of the orchestrator's components: stamps, sinks, dispatcher, watcher."""

from __future__ import annotations

import asyncio
from pathlib import Path

from helpers import hang, wait_until_async
from rlorch.orchestrator.dispatcher import Dispatcher, GenerationFailed
from rlorch.orchestrator.gate import CapacityGate
from rlorch.trainer.advantages import group_advantages
from rlorch.orchestrator.sinks import TrainSink, Verdict, zero_variance_filter
from rlorch.orchestrator.watcher import WeightWatcher, WatcherStalled
from rlorch.config.schema import WatcherConfig
from rlorch.rundir.layout import PUBLISHED, RunDir, mark
from rlorch.types import Origin, PolicyVersion, Prompt, Rollout, VersionStamps, head_ages


def rollout(group: int, reward: float, versions: list[list[int]], origin: Origin = Origin.live,
            token: int = 1) -> Rollout:
    stamps = VersionStamps([list(run) for run in versions])
    n = stamps.count
    return Rollout(group_id=group, episode_id=f"g{group}-0-0", env="t", tokens=[1, 1] + [token] * n,
                   loss_mask=[0, 0] + [1] * n, logprobs=[0.0, 0.0] + [-0.5] * n, versions=stamps,
                   reward=reward, origin=origin)


def test_version_stamps_are_run_length_encoded_with_head_and_tail():
    stamps = VersionStamps.from_tokens([3, 3, 3, 4, 4, 5])
    assert stamps.runs == [[3, 3], [4, 2], [5, 1]]
    assert (stamps.head, stamps.tail, stamps.count) == (3, 5, 6)
    assert stamps.expand() == [3, 3, 3, 4, 4, 5]
    stamps.concat(VersionStamps([[5, 2], [6, 1]]))
    assert stamps.runs == [[3, 3], [4, 2], [5, 3], [6, 1]]
    assert VersionStamps().head == -1


def test_rollout_json_round_trip_keeps_the_stamps():
    original = rollout(7, 0.5, [[2, 3], [3, 1]])
    again = Rollout.from_json(original.to_json())
    assert again == original and again.versions.head == 2 and again.versions.tail == 3


def test_head_age_uses_the_oldest_version_and_skips_replayed_rollouts():
    spanning = rollout(0, 1.0, [[3, 4], [5, 2]])
    replayed = rollout(1, 1.0, [[0, 4]], origin=Origin.replay)
    assert head_ages([spanning, replayed], train_version=5) == [2]


def test_group_advantages_and_zero_variance_filter():
    advantages = group_advantages([1.0, 0.0, 1.0, 0.0])
    assert advantages[0] > 0 > advantages[1] and abs(sum(advantages)) < 1e-9
    check = zero_variance_filter(max_reward=1.0)
    assert check([rollout(0, 1.0, [[0, 1]]), rollout(0, 1.0, [[0, 1]])]) is Verdict.solved
    assert check([rollout(0, 0.4, [[0, 1]]), rollout(0, 0.4, [[0, 1]])]) is Verdict.collapsed
    assert check([rollout(0, 0.4, [[0, 1]], token=1), rollout(0, 0.4, [[0, 1]], token=2)]) is Verdict.constant
    assert check([rollout(0, 1.0, [[0, 1]]), rollout(0, 0.0, [[0, 1]])]) is None
    assert zero_variance_filter(max_reward=2.0)([rollout(0, 1.0, [[0, 1]])] * 2) is Verdict.collapsed


def test_sink_remembers_why_recent_groups_were_filtered_until_one_is_kept():
    sink = TrainSink(batch_size=4, max_staleness=2, strict=False)
    sink.add([rollout(0, 1.0, [[0, 2]])] * 2, step=1)
    sink.add([rollout(1, 0.3, [[0, 2]])] * 2, step=1)
    assert sink.totals.recent == {Verdict.solved: 2, Verdict.collapsed: 2}
    assert sink.totals.recent_surprisal / sink.totals.recent_tokens == 0.5
    sink.add([rollout(2, 1.0, [[0, 2]]), rollout(2, 0.0, [[0, 2]])], step=1)
    assert not sink.totals.recent and sink.totals.recent_tokens == 0


def test_the_guard_diagnosis_tells_solved_collapsed_and_constant_apart():
    def after(*groups):
        sink = TrainSink(batch_size=4, max_staleness=2, strict=False)
        for group in groups:
            sink.add(group, step=1)
        return sink.diagnose()

    solved = [rollout(0, 1.0, [[0, 1]])] * 2
    same = [rollout(1, 0.3, [[0, 1]])] * 2
    different = [rollout(2, 0.3, [[0, 1]], token=1), rollout(2, 0.3, [[0, 1]], token=2)]
    assert after(*[solved] * 9, same)[0] is Verdict.solved
    assert after(solved, solved, same)[0] is Verdict.collapsed  # a third of the prompts stuck wrong
    verdict, message = after(same, same, solved)
    assert verdict is Verdict.collapsed and "entropy estimate 0.5 nats" in message
    assert after(different, different, same)[0] is Verdict.constant
    message = after(different)[1]
    assert "broken environment" in message and "entropy estimate 0.5 nats" in message


def test_filter_budget_ships_a_short_batch_instead_of_generating_on():
    sink = TrainSink(batch_size=4, max_staleness=2, strict=False, filter_budget=4)
    assert sink.add([rollout(0, 1.0, [[0, 1]]), rollout(0, 0.0, [[0, 1]])], step=1) is Verdict.kept
    for group in range(1, 3):
        sink.add([rollout(group, 1.0, [[0, 1]])] * 2, step=1)
    assert not sink.over_budget()  # 4 filtered: at the budget, not past it
    sink.add([rollout(3, 1.0, [[0, 1]])] * 2, step=1)
    assert sink.over_budget() and not sink.ready()
    batch = sink.emit(step=1)
    assert len(batch.rollouts) == 2 and sink.totals.short_batches == 1 and not sink.over_budget()
    nothing_kept = TrainSink(batch_size=4, max_staleness=2, strict=False, filter_budget=1)
    nothing_kept.add([rollout(0, 1.0, [[0, 1]])] * 2, step=1)
    assert not nothing_kept.over_budget()  # no group to ship: the empty-batch guard decides


def test_sink_filters_flat_groups_on_arrival_and_emits_full_batches():
    sink = TrainSink(batch_size=4, max_staleness=2, strict=False)
    assert sink.add([rollout(0, 1.0, [[0, 2]]), rollout(0, 0.0, [[0, 2]])], step=1) is Verdict.kept
    assert sink.add([rollout(1, 0.5, [[0, 2]]), rollout(1, 0.5, [[0, 2]])], step=1) is Verdict.collapsed
    assert not sink.ready()
    assert sink.add([rollout(2, 0.0, [[0, 2]]), rollout(2, 0.2, [[0, 2]])], step=1) is Verdict.kept
    batch = sink.emit(step=1)
    assert [r.group_id for r in batch.rollouts] == [0, 0, 2, 2] and batch.filtered == 2
    assert sink.totals.filtered_by == {"collapsed": 2} and sink.buffered == 0


def test_sink_counts_each_batch_worth_of_filtered_rollouts_as_an_empty_batch():
    sink = TrainSink(batch_size=4, max_staleness=0, strict=False)
    for group in range(4):
        sink.add([rollout(group, 1.0, [[0, 1]]), rollout(group, 1.0, [[0, 1]])], step=1)
    assert sink.totals.empty_batches == 2 and sink.totals.consecutive_empty == 2
    sink.add([rollout(9, 1.0, [[0, 1]]), rollout(9, 0.0, [[0, 1]])], step=1)
    sink.add([rollout(10, 1.0, [[0, 1]]), rollout(10, 0.0, [[0, 1]])], step=1)
    assert sink.totals.consecutive_empty == 0
    # A batch of groups kept earlier does not end the run of groups without a signal since.
    for group in (11, 12):
        sink.add([rollout(group, 1.0, [[0, 1]])] * 2, step=1)
    assert sink.emit(step=1).trainable and sink.totals.consecutive_empty == 1


def test_kept_flat_groups_train_with_zero_advantage_and_still_trip_the_guard():
    sink = TrainSink(batch_size=4, max_staleness=0, strict=False, keep_flat=True)
    assert sink.add([rollout(0, 1.0, [[0, 1]]), rollout(0, 0.0, [[0, 1]])], step=1) is Verdict.kept
    assert sink.add([rollout(1, 1.0, [[0, 1]])] * 2, step=1) is Verdict.kept
    batch = sink.emit(step=1)
    assert [r.group_id for r in batch.rollouts] == [0, 0, 1, 1] and batch.advantages[2:] == [0.0, 0.0]
    assert batch.trainable and sink.totals.filtered == 0 and sink.totals.recent == {Verdict.solved: 2}
    # Four flat groups are two batch-worths without a signal, trained or not; a batch of them
    # alone carries none and is discarded as an empty batch.
    for group in range(2, 6):
        assert sink.add([rollout(group, 1.0, [[0, 1]])] * 2, step=2) is Verdict.kept
    assert sink.totals.consecutive_empty == 2 and sink.guard(max_empty_batches=2)[0] is Verdict.solved
    assert not sink.emit(step=2).trainable and sink.totals.filtered_by == {"solved": 4}
    assert sink.totals.consecutive_empty == 2    # counted as the groups came, not again
    sink.add([rollout(9, 1.0, [[0, 1]]), rollout(9, 0.0, [[0, 1]])], step=2)
    assert sink.totals.consecutive_empty == 0 and not sink.totals.recent


def test_a_collapsed_wrong_group_pushed_by_unlikelihood_counts_toward_the_guard_and_marks_its_window():
    """Under trainer.flat_advantage=unlikelihood a group that sampled one wrong completion trains
    with a push of its own: it is trainable (not idle), and it still counts toward the guard's
    run, so a solved run holding a few such prompts can end; ``pushing`` tells the convergence
    check the window held one (or a flat wrong group of different completions, pushed alike).
    Under ``zero`` nothing is pushed."""
    collapsed = [rollout(0, 0.5, [[0, 1]])] * 2
    constant = [rollout(1, 0.5, [[0, 1]]), rollout(1, 0.5, [[0, 1]], token=2)]
    pushed = TrainSink(batch_size=2, max_staleness=0, strict=False, keep_flat=True, flat_advantage="unlikelihood")
    plain = TrainSink(batch_size=2, max_staleness=0, strict=False, keep_flat=True, flat_advantage="zero")
    for sink in (pushed, plain):
        assert sink.add(constant, step=1) is Verdict.kept and sink.totals.consecutive_empty == 1
        assert sink.pushing is (sink is pushed)  # a flat wrong group too is pushed
        assert sink.add(collapsed, step=1) is Verdict.kept
        assert sink.totals.consecutive_empty == 2 and sink.totals.recent == {Verdict.constant: 2, Verdict.collapsed: 2}
        assert sink.guard(max_empty_batches=2) is not None
    assert pushed.pushing and not plain.pushing
    assert pushed.buffered_signal == 4 and plain.buffered_signal == 0
    pushed.rearm()
    assert not pushed.pushing
    assert pushed.emit(step=1).unlikelihood == [True, True]  # every flat group below the maximum is pushed


def test_single_sample_groups_are_normalised_across_the_batch():
    sink = TrainSink(batch_size=2, max_staleness=0, strict=False)
    sink.add([rollout(0, 1.0, [[0, 1]])], step=1)
    sink.add([rollout(1, 0.0, [[0, 1]])], step=1)
    assert sink.emit(step=1).advantages[0] > 0
    sink.add([rollout(2, 1.0, [[0, 1]])], step=2)
    sink.add([rollout(3, 1.0, [[0, 1]])], step=2)
    assert not sink.emit(step=2).trainable and sink.totals.filtered_by == {"solved": 2}


def test_strict_sink_hands_back_groups_older_than_the_bound():
    sink = TrainSink(batch_size=2, max_staleness=1, strict=True)
    fresh = [rollout(0, 1.0, [[4, 3]]), rollout(0, 0.0, [[4, 3]])]
    spanning_old = [rollout(1, 1.0, [[2, 1], [4, 2]]), rollout(1, 0.0, [[4, 3]])]
    assert sink.add(fresh, step=6) is Verdict.kept        # trained at version 5: age 1
    assert sink.add(spanning_old, step=6) is Verdict.stale  # head 2: age 3 > 1
    assert sink.totals.stale_rollouts == 2 and sink.totals.stale_tokens == 6
    assert sink.restale(step=7) == [fresh]        # by step 7 the fresh group is age 2


def make_dispatcher(work, **overrides) -> Dispatcher:
    gate = CapacityGate(max_staleness=10, batch_size=2, max_concurrent=4, policy=PolicyVersion())
    prompts = (Prompt(group_id=i, input_ids=[1], env="t") for i in range(overrides.pop("prompts", 6)))
    settings = dict(group_size=1, queue_size=8, max_buffered=100, request_timeout=5.0, max_retries=3)
    settings.update(overrides)
    return Dispatcher(gate=gate, work=work, prompts=prompts, **settings)


def run_until_ready(work, **overrides) -> Dispatcher:
    """Start a dispatcher, wait for the first finished (or failed) group, stop it."""
    async def scenario():
        dispatcher = make_dispatcher(work, **overrides)
        await dispatcher.start()
        await asyncio.wait_for(dispatcher.wait_ready(), 5)
        await dispatcher.stop()
        return dispatcher

    return asyncio.run(scenario())


def test_dispatcher_retries_a_failed_request_and_loses_nothing():
    attempts: dict[int, int] = {}

    async def flaky(prompt: Prompt):
        attempts[prompt.group_id] = attempts.get(prompt.group_id, 0) + 1
        if attempts[prompt.group_id] == 1:
            raise ConnectionError("engine died")
        return [rollout(prompt.group_id, 1.0, [[0, 1]])]

    async def scenario():
        dispatcher = make_dispatcher(flaky)
        await dispatcher.start()
        got = []
        while len(got) < 6:
            await dispatcher.wait_ready()
            got.append(dispatcher.try_get())
        await dispatcher.stop()
        return dispatcher, got

    dispatcher, got = asyncio.run(scenario())
    assert sorted(g[0].group_id for g in got) == list(range(6))
    assert dispatcher.retries == 6 and dispatcher.gate.accepted == 6 and dispatcher.gate.running == 0


def test_dispatcher_times_out_a_hung_request_and_retries_it():
    calls = []

    async def hangs_once(prompt: Prompt):
        calls.append(prompt.group_id)
        if len(calls) == 1:
            await hang()
        return [rollout(prompt.group_id, 1.0, [[0, 1]])]

    dispatcher = run_until_ready(hangs_once, prompts=1, request_timeout=0.2)
    assert calls == [0, 0] and dispatcher.retries == 1 and len(dispatcher.out_queue) == 1


def test_dispatcher_fails_loudly_after_max_retries():
    async def broken(prompt: Prompt):
        raise ConnectionError("no engine")

    dispatcher = run_until_ready(broken, prompts=1, max_retries=2)
    assert isinstance(dispatcher.error, GenerationFailed) and "failed 2 times" in str(dispatcher.error)
    assert dispatcher.gate.rejected == 1 and dispatcher.gate.running == 0


def test_dispatcher_respects_the_gate_and_pause():
    hold = asyncio.Event()

    async def slow(prompt: Prompt):
        await hold.wait()
        return [rollout(prompt.group_id, 1.0, [[0, 1]])]

    async def turns(n: int = 50) -> None:
        """Let every ready task run, ``n`` times over (no clock involved)."""
        for _ in range(n):
            await asyncio.sleep(0)

    async def scenario():
        dispatcher = make_dispatcher(slow, prompts=20)
        await dispatcher.start()
        deadline = asyncio.get_running_loop().time() + 10
        while dispatcher.in_flight < 4 and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.005)
        await turns()
        capped = dispatcher.in_flight
        hold.set()
        dispatcher.pause()
        await dispatcher.wait_idle(5)
        paused_admitted = dispatcher.admitted
        await turns()
        assert dispatcher.admitted == paused_admitted
        await dispatcher.stop()
        return capped

    assert asyncio.run(scenario()) == 4


class RecordingEngines:
    """Records each reload with the live policy version at the time the engines were asked."""

    def __init__(self, policy: PolicyVersion | None = None):
        self.reloads, self.live_during_reload, self.policy = [], [], policy

    async def reload(self, path: str, version: int) -> None:
        self.reloads.append((Path(path).name, version))
        if self.policy is not None:
            self.live_during_reload.append(self.policy.value)


def test_watcher_loads_only_published_checkpoints_and_bumps_after_reload(tmp_path):
    run = RunDir(tmp_path).make()
    policy = PolicyVersion()
    engines = RecordingEngines(policy)
    watcher = WeightWatcher(WatcherConfig(), policy=policy, engines=engines, published=run.published_weights)
    run.weights_for(1).mkdir()
    assert not asyncio.run(watcher.poll_once()) and policy.value == 0      # no marker yet
    mark(run.weights_for(1), PUBLISHED)
    run.weights_for(2).mkdir()
    mark(run.weights_for(2), PUBLISHED)
    assert asyncio.run(watcher.poll_once())
    assert engines.reloads == [("step_000002", 2)] and policy.value == 2
    # While the engines loaded version 2 the live version was still 0: the bump follows the reload.
    assert engines.live_during_reload == [0]
    assert watcher.reload_s is not None


def test_watcher_alarms_when_the_version_stalls(tmp_path):
    run = RunDir(tmp_path).make()
    watcher = WeightWatcher(WatcherConfig(poll_interval=0.01, stall_timeout=0.1), policy=PolicyVersion(),
                            engines=RecordingEngines(), published=run.published_weights, expecting=lambda: True)

    async def scenario():
        await watcher.start()
        await wait_until_async(lambda: watcher.error is not None, 10, "the watcher to alarm")
        await watcher.stop()

    asyncio.run(scenario())
    assert isinstance(watcher.error, WatcherStalled) and "stuck at 0" in str(watcher.error)


class PruningEngines(RecordingEngines):
    """The trainer publishes two more versions and prunes this one while the engines load it."""

    def __init__(self, run: RunDir):
        super().__init__()
        self.run = run

    async def reload(self, path: str, version: int) -> None:
        if version == 1:
            import shutil

            for newer in (2, 3):
                self.run.weights_for(newer).mkdir()
                mark(self.run.weights_for(newer), PUBLISHED)
            shutil.rmtree(path)
            raise RuntimeError(f"model_path {path!r} is not a directory")
        await super().reload(path, version)


def test_watcher_moves_on_when_the_trainer_pruned_the_version_it_was_loading(tmp_path):
    run = RunDir(tmp_path).make()
    policy, engines = PolicyVersion(), PruningEngines(run)
    failures = []
    watcher = WeightWatcher(WatcherConfig(poll_interval=0.01), policy=policy, engines=engines,
                            published=run.published_weights, on_error=failures.append)
    run.weights_for(1).mkdir()
    mark(run.weights_for(1), PUBLISHED)

    async def polling():
        # The watcher's own loop: a superseded reload must not reach on_error or end the loop.
        await watcher.start()
        deadline = asyncio.get_running_loop().time() + 10
        while policy.value < 3 and not failures and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.01)
        await watcher.stop()

    asyncio.run(polling())
    assert not failures and watcher.error is None, failures
    assert policy.value == 3 and engines.reloads == [("step_000003", 3)] and watcher.superseded == 1
    run.weights_for(4).mkdir()
    mark(run.weights_for(4), PUBLISHED)
    engines.reload = lambda path, version: (_ for _ in ()).throw(RuntimeError("engine down"))
    try:
        asyncio.run(watcher.poll_once())
    except RuntimeError as err:
        assert "engine down" in str(err)  # a version that still exists: a real failure
    else:
        raise AssertionError("a failed reload of an existing version must raise")


def test_step_age_figures_match_numpy_on_the_few_ages_a_batch_has():
    import numpy as np

    from rlorch.orchestrator.steps import age_stats

    for ages in ([3] * 97 + [4] * 3, [0, 1], [4, 3, 3, 2], [-1, 0, 2, 2], [5], list(range(300)), [1] * 98 + [7] * 2):
        values = np.asarray(ages)
        assert age_stats(ages) == {"age_max": int(values.max()), "age_p99": float(np.percentile(values, 99)),
                                   "age_mean": round(float(values.mean()), 4),
                                   "age_counts": np.bincount(np.maximum(values, 0)).tolist()}, ages


def test_dispatcher_admits_nothing_while_max_buffered_rollouts_wait_and_resumes_once_taken():
    """Backpressure (``rollout.max_buffered``): finished rollouts nobody has taken stop admission
    at the bound (a pass in progress may overshoot it by at most the gate's concurrency), and
    taking them lets admission go on."""
    async def instant(prompt: Prompt):
        return [rollout(prompt.group_id, 1.0, [[0, 1]])]

    async def turns(n: int = 50) -> None:
        for _ in range(n):
            await asyncio.sleep(0)

    async def scenario():
        dispatcher = make_dispatcher(instant, prompts=40, max_buffered=3)
        await dispatcher.start()
        deadline = asyncio.get_running_loop().time() + 10
        while dispatcher.out_rollouts < 3 and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.005)
        await dispatcher.wait_idle(5)
        await turns()
        held = dispatcher.admitted, dispatcher.out_rollouts
        while dispatcher.try_get() is not None:
            pass
        dispatcher.notify()
        await turns()
        await dispatcher.stop()
        return held, dispatcher.admitted

    (held_admitted, held_buffered), later = asyncio.run(scenario())
    assert 3 <= held_buffered == held_admitted <= 3 + 4 - 1
    assert later > held_admitted
