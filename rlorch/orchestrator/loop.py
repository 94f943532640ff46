"""The orchestrator: owns the shared objects, wires the components, and runs the control loop.

Invariants kept here rather than in a dashboard:
- every admitted rollout is trained, filtered, dropped as stale, persisted untrained, or
  re-queued as a prompt (the ledger checks ``lost`` = 0);
- the rollouts of a batch are on disk before the trainer is handed the batch;
- at train.steps admission stops, in-flight work finishes and is persisted with the checkpoint;
- after train.max_empty_batches batch-worths in a row with no reward spread the run stops, saying
  why (a solved task, or a collapsed one, ends ``converged`` once held-out accuracy agrees), and
  eval.stop_after evaluations in a row at eval.stop_at end it ``converged`` too;
- the first step after a resume admits at most (S + 1) * B rollouts, else the run fails;
- with ``run.colocate=swap``, see :mod:`rlorch.orchestrator.swap`.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Optional

from rlorch.config.schema import Colocate, Config, Enforce, FlatAdvantage
from rlorch.launch.startup import StartupClock
from rlorch.lifecycle import cancel_and_wait
from rlorch.orchestrator.checkpoints import Snapshots, Unfinished
from rlorch.orchestrator.dispatcher import Dispatcher, Work
from rlorch.orchestrator.evaluation import Evaluations
from rlorch.orchestrator.filing import Filing
from rlorch.orchestrator.gate import CapacityGate
from rlorch.orchestrator.idle import LoopIdle
from rlorch.orchestrator.ledger import Ledger, unaccounted
from rlorch.orchestrator.loggers import make_loggers
from rlorch.orchestrator.metrics import MetricsLoop
from rlorch.orchestrator.runstats import RunStats
from rlorch.orchestrator.shipping import Shipping
from rlorch.orchestrator.sinks import KEPT, SOLVED_SHARE, EvalSink, TrainSink, Verdict, failure_window
from rlorch.orchestrator.steps import StepRecords
from rlorch.orchestrator.swap import SwapStep
from rlorch.orchestrator.stops import Convergence, Converged, Outcome, RunFailed, StopKind, StopReason
from rlorch.orchestrator.watcher import WeightWatcher
from rlorch.rundir.layout import RunDir, write_atomic, write_json_atomic
from rlorch.rundir.state import ResumeState
from rlorch.types import Batch, Engine, Fate, PolicyVersion, Rollout, Trainer, max_reward


class Orchestrator:
    def __init__(self, config: Config, *, run_dir: RunDir, policy: PolicyVersion, engines: Engine,
                 trainer: Trainer, work: Work, prompts: Any, resume: Optional[ResumeState] = None,
                 startup: StartupClock):
        self.config, self.run_dir, self.policy, self.engines = config, run_dir, policy, engines
        self.trainer, self.work, self.prompts, self.resume = trainer, work, prompts, resume
        r = config.rollout
        self.batch_size, self.batch_format = r.batch_size, config.run.batch_format
        self.ship_side = r.enforce is Enforce.ship
        self.shipping = Shipping(policy=policy, max_staleness=r.max_staleness, park=self.ship_side,
                                 poll_interval=config.watcher.poll_interval, on_shipped=self._on_shipped, check=self._check_alarm,
                                 # The batch file, fsynced off the event loop (parked until shipped: checkpoints list it).
                                 persist=lambda b: asyncio.to_thread(write_atomic, run_dir.batch(b.step, self.batch_format), b.file(self.batch_format)))
        self.idle, self.alarm, self.stop_reason = LoopIdle(), asyncio.Event(), None
        self.stats = RunStats(idle=self.idle, startup=startup)
        self.gate = CapacityGate(max_staleness=r.max_staleness, batch_size=r.batch_size,
                                 max_concurrent=r.max_concurrent,
                                 policy=self.shipping.shipped_handle if self.ship_side else policy)
        # Multi-turn episodes share no engine call: packed, they would only share one timeout, one
        # retry and the slowest's latency. Training groups and evaluations pack alike.
        packs = getattr(work, "pack", None) if getattr(work, "batched", True) else None
        self.dispatcher = Dispatcher(gate=self.gate, work=work, prompts=iter(prompts), group_size=r.group_size,
                                     queue_size=r.queue_size, max_buffered=r.max_buffered,
                                     request_timeout=r.request_timeout, max_retries=r.max_retries,
                                     on_idle=self.idle.engines.set, pack=packs, pack_groups=r.pack_groups if packs else 1)
        env = getattr(prompts, "env", None)
        self.sink = TrainSink(batch_size=r.batch_size, max_staleness=r.max_staleness, strict=r.enforce is Enforce.strict,
                              max_reward=max_reward(env) if env else 1.0, filter_budget=r.filter_budget * r.batch_size,
                              keep_flat=not r.filter_groups, advantage=config.trainer.advantage,
                              scale_rewards=config.trainer.scale_rewards, flat_advantage=config.trainer.flat_advantage)
        self.version_changed = asyncio.Event()
        self.swap = (SwapStep(release=lambda: engines.release_memory(), published=run_dir.published_weights,
                              offloaded=run_dir.offloaded_step) if config.run.colocate is Colocate.swap else None)
        self.watcher = WeightWatcher(config.watcher, policy=policy, engines=engines,
                                     published=self.swap.swappable if self.swap else run_dir.published_weights, offers=run_dir.broadcast_offers,
                                     offer_mark=run_dir.offer_mark, distributed=config.inference.distributed,
                                     expecting=lambda: self.shipping.shipped > self.policy.value,
                                     on_version=self._on_version, on_idle=self.idle.engines.set, on_error=lambda err:
                                     self._raise_alarm(StopReason(StopKind.watcher, f"weight watcher failed: {err}")))
        self.metrics = MetricsLoop(loggers=make_loggers(config, run_dir), interval=config.metrics.interval, gauges={
            "dispatcher": self.dispatcher.gauges, "watcher": self.watcher.gauges, "gate": self.gate.gauges,
            "sink": self.sink.gauges, "loop": lambda: {**self.shipping.gauges(), "admitted_total": self.dispatcher.admitted},
            "engines": lambda: {f"engines_{key}": value for key, value in engines.gauges().items()}})
        self.evaluations = Evaluations(config.eval, work=work, prompts=prompts, sink=EvalSink(), write=self.metrics.write,
                                       request_timeout=r.request_timeout, pack=packs, pack_samples=r.pack_samples)
        self.ledger = Ledger(group_size=r.group_size, admissions=lambda: self.gate.submitted,
                             restored=resume.totals if resume else None)
        self.steps = StepRecords(run_dir.trainer_metrics)
        self.filing = Filing(sink=self.sink, ledger=self.ledger, gate=self.gate, dispatcher=self.dispatcher,
                             prompts=prompts, max_regenerations=r.max_regenerations,
                             max_empty_batches=config.train.max_empty_batches, on_guard=self._on_guard,
                             kept=KEPT, stale=Verdict.stale, observe=getattr(prompts, "observe", None),
                             failure_window=failure_window(config.train.max_empty_batches, getattr(env, "prompt_count", None),
                                                           r.prompts_per_batch, config.trainer.flat_advantage is not FlatAdvantage.zero))
        self.snapshots = Snapshots(run_dir, ledger=self.ledger, group_size=r.group_size,
                                   unfinished=lambda: Unfinished(self.dispatcher.state(), self.sink.pending_groups(), self.shipping.parked),
                                   prompt_position=lambda: prompts.position, empty_batches=lambda: self.sink.totals.empty_batches,
                                   replay=replay.state_dict if (replay := getattr(prompts, "replay", None)) else dict,
                                   keep=config.trainer.keep_checkpoints, keep_every=config.trainer.keep_checkpoints_every)
        self.convergence = Convergence(stop_on_converged=config.train.stop_on_converged, evaluating=config.eval.enabled,
                                       share=SOLVED_SHARE, stop_at=config.eval.stop_at, stop_after=config.eval.stop_after)

    # wiring ----------------------------------------------------------------------------------
    def _on_version(self, version: int) -> None:
        # Checked before the dispatcher can run: the admissions made on the resumed version alone.
        if (alarm := self.gate.resume_alarm()) is not None:
            self._raise_alarm(StopReason(StopKind.resume_alarm, alarm))
        self.idle.trainer.set("waiting", self.policy.value >= self.shipping.shipped)
        self.dispatcher.notify()
        self.version_changed.set()

    def _raise_alarm(self, reason: StopReason) -> None:
        self.stop_reason = self.stop_reason or reason
        self.alarm.set()

    def request_shutdown(self, signal_name: str) -> None:
        self._raise_alarm(StopReason(StopKind.signal, signal_name))

    def _restore(self) -> None:
        if (state := self.resume) is None:
            return
        self.policy.bump(state.step)
        self.shipping.restore(state.step)
        self.gate.on_version_recovered(state.step, buffered=sum(len(group) for group in state.untrained))
        for group in state.untrained:
            self.filing.file(group, state.step + 1)
        self.dispatcher.restore(state.pending_prompts)
        if not self.ship_side:
            self.gate.arm_resume_check(self.gate.pending_limit)
        self.snapshots.resumed_at(state.step)

    def _on_guard(self, verdict: Verdict, message: str) -> None:
        """Solved or collapsed: converged once held-out accuracy agrees (else solved, or collapsed under the push, trains on); the rest fail."""
        last, idle = self.evaluations.sink.last, self.policy.value >= self.shipping.shipped and not self.sink.buffered_signal
        outcome = (self.convergence.outcome(self.policy.value, last, idle, self.sink.pushing) if verdict is Verdict.solved else
                   self.convergence.after_collapse(self.policy.value, last, self.sink.pushing) if verdict is Verdict.collapsed else None)
        if outcome in (None, Outcome.converged, Outcome.stalled):
            message = message.rstrip(".") + (self.convergence.explain(outcome, last) if outcome else "") + "."
            raise Converged(message) if outcome is Outcome.converged else RunFailed(
                StopReason(StopKind.empty_batches, message))
        if outcome is Outcome.evaluate:
            self.evaluations.start(self.policy.value)
        self.sink.rearm()

    # the loop --------------------------------------------------------------------------------
    def _admission_room(self) -> int:
        """Admit only what the remaining steps need (the drain budget); the dispatcher applies
        the backpressure bound (rollout.max_buffered) to its own queue."""
        buffered = self.sink.buffered + self.dispatcher.out_rollouts
        remaining = (self.config.train.steps - self.shipping.shipped) * self.batch_size - self.shipping.parked_rollouts
        return remaining - (buffered + self.dispatcher.in_flight)

    async def run(self) -> dict:
        self.loop_started = time.monotonic()
        self.idle.start()
        self.dispatcher.admission_room = self._admission_room
        self._restore()
        self.metrics.write({"kind": "start", "version": self.policy.value, "resumed": self.resume is not None,
                            "pending_limit": self.gate.pending_limit})
        alarm_task = asyncio.create_task(self.alarm.wait())
        helpers = [asyncio.create_task(self._health_loop()), asyncio.create_task(self._bookkeeping_loop())]
        await self.metrics.start()
        if self.config.eval.enabled:
            async with self.stats.startup.part("eval"):
                await self.evaluations.run(self.policy.value)
        await self.watcher.start()
        await self.dispatcher.start()
        status, error = "completed", None
        try:
            await self._train(alarm_task)
            await self._drain(alarm_task)
        except Converged as solved:
            status, self.stop_reason = "converged", StopReason(StopKind.converged, str(solved))
            await self._drain(alarm_task)
        except RunFailed as err:
            self.stop_reason = self.stop_reason or err.reason
            status, error = ("interrupted", None) if err.reason.kind is StopKind.signal else ("failed", str(err))
            await self._shutdown()
        finally:
            await cancel_and_wait(alarm_task, *helpers)
            for component in (self.evaluations, self.dispatcher, self.watcher, self.metrics):
                await component.stop()
        summary = self._summary(status, error)
        write_json_atomic(self.run_dir.summary, summary)
        self.metrics.write({"kind": "summary", **summary})
        self.metrics.close()
        return summary

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(0.2)
            if problem := self.trainer.error():
                self._raise_alarm(StopReason(StopKind.trainer, problem))
            if self.metrics.failure:
                self._raise_alarm(StopReason(StopKind.bookkeeping, self.metrics.failure))

    async def _bookkeeping_loop(self) -> None:
        """After each version bump: step records, evaluations, snapshots. A failure stops the run."""
        try:
            while True:
                await self.version_changed.wait()
                self.version_changed.clear()
                self._after_version()
        except Exception as error:
            self._raise_alarm(StopReason(StopKind.bookkeeping, f"bookkeeping failed: {type(error).__name__}: {error}"))

    def _after_version(self, evaluate: bool = True, final: bool = False) -> None:
        extra = {"version": self.policy.value, **self.dispatcher.gauges(), **self.watcher.step_fields(), **self.engines.health(),
                 **(self.swap.step_fields() if self.swap else {}), **getattr(self.work, "gauges", dict)()}
        records = self.steps.ready(self.policy.value, extra, final=final)
        self.stats.stamp(records, loop_started=self.loop_started)
        for record in records:
            self.metrics.write(record)
            if evaluate and self.evaluations.due(record["step"]):
                self.evaluations.start(record["step"])
        self.snapshots.catch_up(self.policy.value)

    def _check_alarm(self) -> None:
        if self.stop_reason is not None and self.stop_reason.kind is not StopKind.converged:
            raise RunFailed(self.stop_reason)

    async def _next_group(self, alarm_task: asyncio.Task) -> list[Rollout]:
        """The oldest finished group. The caller files it before yielding to the event loop, so
        the admission budget always finds it in the dispatcher's queue or in the sink."""
        while True:
            group = self.dispatcher.try_get()
            if group is not None:
                return group
            if self.dispatcher.error is not None:
                raise RunFailed(StopReason(StopKind.generation, f"generation failed: {self.dispatcher.error}"))
            ready = asyncio.create_task(self.dispatcher.wait_ready())
            await asyncio.wait({ready, alarm_task}, return_when=asyncio.FIRST_COMPLETED)
            await cancel_and_wait(ready)
            self._check_alarm()

    async def _fill(self, step: int, alarm_task: asyncio.Task) -> None:
        """File finished groups until the sink holds batch ``step`` (or its filter budget ran out).
        Groups already waiting are filed without yielding to the event loop, where alone the
        alarm can be raised; :meth:`_next_group` checks it after every wait."""
        while not (self.sink.ready() or self.sink.over_budget()):
            group = self.dispatcher.try_get()
            self.filing.file(group if group is not None else await self._next_group(alarm_task), step)

    async def _train(self, alarm_task: asyncio.Task) -> None:
        while self.shipping.shipped < self.config.train.steps:
            self._check_alarm()
            if solved := self.convergence.held_out_solved(self.evaluations.sink.results):
                raise Converged(solved)
            step = self.shipping.shipped + 1
            for stale in self.sink.restale(step):
                self.filing.stale(stale)
            await self._fill(step, alarm_task)
            batch = self.sink.emit(step)
            if not batch.trainable:
                self.filing.filtered(len(batch.rollouts))
                continue
            self.gate.on_short_batch(self.batch_size - len(batch.rollouts))    # 0 for a full batch
            if self.swap:
                self.shipping.parked = batch    # until shipped: a failed release leaves it to the checkpoint
                if problem := await self.swap.release_engines():
                    raise RunFailed(StopReason(StopKind.generation, problem))
            await self.shipping.ship(batch)
            await self.trainer.submit(batch)

    def _on_shipped(self, batch: Batch, parked_s: float) -> None:
        self.idle.trainer.set("waiting", False)
        self.ledger.ship(batch.filed(self.run_dir.batch(batch.step, self.batch_format)))
        self.steps.shipped(batch, admitted_total=self.dispatcher.admitted, parked_s=parked_s)
        self.dispatcher.notify()

    # checkpoints, drain, shutdown ------------------------------------------------------------
    async def _drain(self, alarm_task: asyncio.Task) -> None:
        """At the step target (or converged): admit nothing more, let in-flight work finish,
        wait for the trainer, evaluate the final version and checkpoint it all."""
        await self.dispatcher.stop_admitting()
        while not await self.dispatcher.wait_idle(0.2):
            self._check_alarm()
        await self.shipping.wait_version(self.shipping.shipped)
        await self.trainer.stop(self.config.run.shutdown_timeout)
        self._after_version(final=True)
        await self.evaluations.finish(self.policy.value, alarm_task, self._check_alarm)
        self.snapshots.finish(self.policy.value, abandoned=[])

    async def _shutdown(self) -> None:
        """Bounded: stop admitting, drain for at most run.shutdown_timeout, checkpoint, exit."""
        deadline = time.monotonic() + self.config.run.shutdown_timeout
        await self.dispatcher.stop_admitting()
        await self.dispatcher.wait_idle(max(0.0, deadline - time.monotonic()) * 0.5)
        abandoned = await self.dispatcher.cancel_in_flight()
        self.ledger.record(Fate.requeued, len(abandoned) * self.config.rollout.group_size)
        await self.trainer.stop(max(0.5, deadline - time.monotonic()))
        await self.watcher.stop()
        await self.watcher.last_poll(max(0.5, deadline - time.monotonic()))
        self._after_version(evaluate=False, final=True)
        # The trainer may be ahead of the engines (a reload failed): its checkpoints up to the
        # last shipped batch are complete states of this run and get theirs too.
        self.snapshots.finish(max(self.policy.value, self.shipping.shipped), abandoned=abandoned)

    def _summary(self, status: str, error: Optional[str]) -> dict:
        accounting = self.snapshots.account(self.policy.value)
        if problem := unaccounted(accounting["lost"]):    # the ledger's invariant, checked on every run
            status, error, self.stop_reason = "failed", problem, StopReason(StopKind.bookkeeping, problem)
        return {"status": status, "error": error, **StopReason.fields(self.stop_reason), "version": self.policy.value,
                **self.engines.health(), **accounting, "short_batches": self.sink.totals.short_batches,
                "parked_s": round(self.shipping.parked_s, 4), **self.watcher.summary(),
                **self.evaluations.summary(), **self.stats.summary(loop_started=self.loop_started, gauges=getattr(self.work, "gauges", dict)())}
