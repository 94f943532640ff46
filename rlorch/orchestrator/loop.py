"""The orchestrator: owns the shared objects and wires the components into one control loop.

Invariants kept here rather than in a dashboard:
- every admitted rollout is trained, filtered, dropped as stale (counted), persisted untrained,
  or (abandoned in flight at shutdown) re-queued as a prompt; ``lost`` in the summary is the rest
  and must be 0;
- the rollouts of a batch are on disk before the trainer is handed the batch;
- at train.steps admission stops, in-flight work finishes and is persisted with the checkpoint;
- after train.max_empty_batches consecutive batches with nothing trainable the run stops;
- the first step after a resume admits at most (S + 1) * B rollouts, else the run fails.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import numpy as np
import orjson

from rlorch.config import Config, Enforce
from rlorch.orchestrator.dispatcher import Dispatcher, Work
from rlorch.orchestrator.gate import CapacityGate
from rlorch.orchestrator.metrics import MetricsLoop
from rlorch.orchestrator.sinks import EvalSink, TrainSink, Verdict, head_ages
from rlorch.orchestrator.watcher import WeightWatcher
from rlorch.rundir import CheckpointDir, RunDir, write_atomic, write_json_atomic
from rlorch.types import Batch, Engine, PolicyVersion, Prompt, Rollout, Trainer, max_reward

TOTAL_KEYS = ("admitted", "trained", "filtered", "dropped_stale", "requeued", "regenerated",
              "stale_tokens", "empty_batches")


class RunFailed(RuntimeError):
    """The run stopped on one of its own invariants; the message says which and why."""


class ShutdownRequested(Exception):
    pass


class Converged(Exception):
    """Every recent group earned the maximum reward: the task is solved, the run ends well."""


@dataclass
class ResumeState:
    """What a checkpoint carries for the orchestrator (``orchestrator.json``)."""

    step: int
    prompt_position: int
    untrained: list[list[Rollout]]
    pending_prompts: list[Prompt]
    totals: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"step": self.step, "prompt_position": self.prompt_position, "totals": self.totals,
                "untrained": [[r.to_json() for r in group] for group in self.untrained],
                "pending_prompts": [{"group_id": p.group_id, "attempt": p.attempt} for p in self.pending_prompts]}

    @classmethod
    def from_json(cls, data: dict, make_prompt: Callable[[int], Prompt]) -> "ResumeState":
        prompts = []
        for item in data["pending_prompts"]:
            prompt = make_prompt(item["group_id"])
            prompt.attempt = item.get("attempt", 0)
            prompts.append(prompt)
        return cls(step=data["step"], prompt_position=data["prompt_position"], totals=data.get("totals", {}),
                   untrained=[[Rollout.from_json(r) for r in group] for group in data["untrained"]],
                   pending_prompts=prompts)


def age_stats(ages: list[int]) -> dict:
    if not ages:
        return {"age_max": None, "age_p99": None, "age_mean": None}
    values = np.asarray(ages)
    return {"age_max": int(values.max()), "age_p99": float(np.percentile(values, 99)),
            "age_mean": round(float(values.mean()), 4)}


class Orchestrator:
    def __init__(self, config: Config, *, run_dir: RunDir, policy: PolicyVersion, engines: Engine,
                 trainer: Trainer, work: Work, prompts: Any, resume: Optional[ResumeState] = None,
                 started: Optional[float] = None):
        self.config = config
        self.run_dir = run_dir
        self.policy = policy
        self.engines = engines
        self.trainer = trainer
        self.work = work
        self.prompts = prompts
        self.resume = resume
        r = config.rollout
        self.batch_size = r.batch_size
        self.strict = r.enforce is Enforce.strict
        self.ship_side = r.enforce is Enforce.ship
        # Ship-side gating counts batches shipped rather than versions trained: at most (S+1)*B
        # rollouts wait unshipped, and parking keeps shipping within S versions of the trainer,
        # so generation never waits on the trainer at admission and age stays bounded by 2S+2.
        self.shipped_handle = PolicyVersion(0)
        self.gate = CapacityGate(max_staleness=r.max_staleness, batch_size=r.batch_size,
                                 max_concurrent=r.max_concurrent,
                                 policy=self.shipped_handle if self.ship_side else policy)
        self.dispatcher = Dispatcher(gate=self.gate, work=work, prompts=iter(prompts), group_size=r.group_size,
                                     queue_size=r.queue_size, max_buffered=r.max_buffered,
                                     request_timeout=r.request_timeout, max_retries=r.max_retries)
        env = getattr(prompts, "env", None)
        self.sink = TrainSink(batch_size=r.batch_size, max_staleness=r.max_staleness, strict=self.strict,
                              max_reward=max_reward(env) if env is not None else 1.0,
                              filter_budget=r.filter_budget * r.batch_size)
        self.eval_sink = EvalSink()
        self.watcher = WeightWatcher(config.watcher, policy=policy, engines=engines,
                                     published=run_dir.published_weights,
                                     expecting=lambda: self.shipped > self.policy.value,
                                     on_version=self._on_version)
        gauges = {"dispatcher": self.dispatcher.gauges, "watcher": self.watcher.gauges,
                  "loop": self._gauges}
        if hasattr(engines, "gauges"):
            gauges["engines"] = lambda: {f"engines_{key}": value for key, value in engines.gauges().items()}
        self.metrics = MetricsLoop(path=run_dir.metrics, interval=config.metrics.interval, gauges=gauges)
        if config.metrics.tensorboard:
            self.metrics.enable_tensorboard(run_dir.tensorboard)
        self.shipped = 0
        self.shipped_batches: deque[Batch] = deque()
        self.totals = {key: 0 for key in TOTAL_KEYS}
        self.base_admitted = 0
        self.parked_s = 0.0
        self.step_records: dict[int, dict] = {}
        metrics_file = run_dir.trainer_metrics
        # A resumed run reads only the trainer lines written from now on: older ones belong to
        # steps this run does not train (or to an abandoned trajectory).
        self.trainer_metrics_offset = metrics_file.stat().st_size if metrics_file.exists() else 0
        self.trainer_backlog: dict[int, dict] = {}
        self.admitted_at_last_step = 0
        self.resume_admitted_limit: Optional[int] = None
        self.resume_admissions_checked = False
        self.snapshotted: set[int] = set()
        self.first_step = 1
        self.last_snapshot = 0
        self.parked: Optional[Batch] = None
        self.alarm = asyncio.Event()
        self.alarm_reason: Optional[str] = None
        self.started = started if started is not None else time.monotonic()
        self.last_step_record: dict = {}
        self.checkpoint_step: Optional[int] = None
        self.eval_tasks: set[asyncio.Task] = set()
        self.eval_prompts: Optional[list[Prompt]] = None
        self.converged: Optional[str] = None
        self.evaluated: set[int] = set()
        self._park_last = 0.0

    # wiring ----------------------------------------------------------------------------------
    def _gauges(self) -> dict:
        gate = self.gate.counts()
        return {"step": self.shipped, "buffered": self.sink.buffered, "admitted_total": self.dispatcher.admitted,
                "parked_s_total": round(self.parked_s, 4), "capacity": gate.capacity,
                "gate_running": gate.running, "gate_accepted": gate.accepted, "gate_rejected": gate.rejected}

    def _on_version(self, version: int) -> None:
        self.dispatcher.notify()
        if self.watcher.error is not None:
            self._raise_alarm(f"weight watcher failed: {self.watcher.error}")
            return
        if self.resume_admitted_limit is not None and not self.resume_admissions_checked:
            self.resume_admissions_checked = True
            self._check_resume_admissions()
        self._flush_step_records()
        self._snapshot_new_checkpoints()

    def _raise_alarm(self, reason: str) -> None:
        if self.alarm_reason is None:
            self.alarm_reason = reason
        self.alarm.set()

    def request_shutdown(self, signal_name: str) -> None:
        self._raise_alarm(f"shutdown:{signal_name}")

    def _check_resume_admissions(self) -> None:
        """Admissions kept in the system since the resume (discarded ones freed their slots)."""
        admitted = self.gate.submitted - self.gate.rejected
        if self.resume_admitted_limit is not None and admitted > self.resume_admitted_limit:
            self._raise_alarm(f"resume alarm: {admitted} rollouts admitted before the first step after "
                              f"resume, more than (S+1)*B = {self.resume_admitted_limit}: the staleness bound is lost")

    def _restore(self) -> None:
        state = self.resume
        if state is None:
            return
        self.policy.bump(state.step)
        self.shipped = state.step
        self.shipped_handle.bump(state.step)
        for key in TOTAL_KEYS:
            self.totals[key] = state.totals.get(key, 0)
        self.base_admitted = state.totals.get("admitted", 0)
        buffered = sum(len(group) for group in state.untrained)
        self.gate.on_version_recovered(state.step, buffered=buffered)
        for group in state.untrained:
            self._file(group, state.step + 1)
        for prompt in reversed(state.pending_prompts):
            self.dispatcher.requeue(prompt)
        if not self.ship_side:
            self.resume_admitted_limit = (self.config.rollout.max_staleness + 1) * self.batch_size
        self.first_step = state.step + 1
        self.last_snapshot = state.step
        self.snapshotted.update(step for step, _ in self.run_dir.complete_checkpoints() if step <= state.step)

    def _file(self, group: list[Rollout], step: int) -> None:
        """Hand a finished group to the sink; a rejected one leaves the gate's accounting."""
        verdict = self.sink.add(group, step)
        if verdict is Verdict.stale:
            self._stale(group)
        elif verdict is not Verdict.kept:
            self.gate.on_discarded(len(group))
            self.dispatcher.notify()
            self._check_empty()

    def _stale(self, group: list[Rollout]) -> None:
        """Strict mode: a group too old to train is regenerated, or dropped after max_regenerations."""
        self.totals["dropped_stale"] += len(group)
        self.totals["stale_tokens"] += sum(r.generated_tokens for r in group)
        self.gate.on_discarded(len(group))
        attempt = max(r.attempt for r in group)
        if attempt < self.config.rollout.max_regenerations:
            prompt = self.prompts.make(group[0].group_id)
            prompt.attempt = attempt + 1
            self.totals["regenerated"] += 1
            self.dispatcher.requeue(prompt)

    # the loop --------------------------------------------------------------------------------
    def _admission_open(self) -> bool:
        """Admit only what the remaining steps need (the drain budget); the dispatcher applies
        the backpressure bound (rollout.max_buffered) to its own queue."""
        buffered = self.sink.buffered + self.dispatcher.out_rollouts
        parked = len(self.parked.rollouts) if self.parked is not None else 0
        remaining = (self.config.train.steps - self.shipped) * self.batch_size - parked
        return remaining - (buffered + self.dispatcher.in_flight) > 0

    async def run(self) -> dict:
        self.loop_started = time.monotonic()
        self.dispatcher.admission_open = self._admission_open
        self._restore()
        self.metrics.write({"kind": "start", "version": self.policy.value, "resumed": self.resume is not None,
                            "pending_limit": self.gate.pending_limit})
        alarm_task = asyncio.create_task(self.alarm.wait())
        health_task = asyncio.create_task(self._health_loop())
        await self.metrics.start()
        if self.config.eval.enabled:
            await self._evaluate(self.policy.value)
        await self.watcher.start()
        await self.dispatcher.start()
        status, error = "completed", None
        try:
            await self._train(alarm_task)
            await self._drain(alarm_task)
        except Converged as solved:
            status, self.converged = "converged", str(solved)
            await self._drain(alarm_task)
        except ShutdownRequested:
            status = "interrupted"
            await self._shutdown()
        except RunFailed as err:
            status, error = "failed", str(err)
            await self._shutdown()
        finally:
            alarm_task.cancel()
            health_task.cancel()
            for task in self.eval_tasks:
                task.cancel()
            await self.dispatcher.close()
            await self.watcher.stop()
            await self.metrics.stop()
        summary = self._summary(status, error)
        write_json_atomic(self.run_dir.summary, summary)
        self.metrics.write({"kind": "summary", **summary})
        self.metrics.close()
        return summary

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(0.2)
            problem = self.trainer.error()
            if problem:
                self._raise_alarm(problem)
            if self.watcher.error is not None:
                self._raise_alarm(f"weight watcher failed: {self.watcher.error}")

    def _check_alarm(self) -> None:
        reason = self.alarm_reason
        if reason is None:
            return
        if reason.startswith("shutdown:"):
            raise ShutdownRequested(reason)
        raise RunFailed(reason)

    async def _next_group(self, alarm_task: asyncio.Task) -> list[Rollout]:
        """The oldest finished group. The caller files it before yielding to the event loop, so
        the admission budget always finds it in the dispatcher's queue or in the sink."""
        while True:
            group = self.dispatcher.try_get()
            if group is not None:
                return group
            if self.dispatcher.error is not None:
                raise RunFailed(f"generation failed: {self.dispatcher.error}")
            ready = asyncio.create_task(self.dispatcher.wait_ready())
            await asyncio.wait({ready, alarm_task}, return_when=asyncio.FIRST_COMPLETED)
            if not ready.done():
                ready.cancel()
                await asyncio.gather(ready, return_exceptions=True)
            self._check_alarm()

    async def _train(self, alarm_task: asyncio.Task) -> None:
        steps = self.config.train.steps
        while self.shipped < steps:
            self._check_alarm()
            step = self.shipped + 1
            for stale in self.sink.restale(step):
                self._stale(stale)
            while not (self.sink.ready() or self.sink.over_budget()):
                self._file(await self._next_group(alarm_task), step)
                self._check_alarm()
            batch = self.sink.emit(step)
            if batch is None:
                self.gate.on_discarded(self.batch_size)
                self.dispatcher.notify()
                self._check_empty()
                continue
            if len(batch.rollouts) < self.batch_size:
                self.gate.on_short_batch(self.batch_size - len(batch.rollouts))
            if self.ship_side:
                self.parked = batch
                await self._park(step, alarm_task)
                self.parked = None
            self._ship(batch)
            await self.trainer.submit(batch)

    def _check_empty(self) -> None:
        """The empty-batch guard: after train.max_empty_batches consecutive batch-worths with
        nothing trainable, end the run, saying which cause it was (a solved task ends well)."""
        totals = self.sink.totals
        if totals.consecutive_empty < self.config.train.max_empty_batches:
            return
        verdict, why = self.sink.diagnose()
        message = (f"{totals.consecutive_empty} consecutive batches had nothing trainable "
                   f"(train.max_empty_batches={self.config.train.max_empty_batches}); {why}.")
        if verdict is Verdict.solved:
            raise Converged(message)
        entropy = self.last_step_record.get("entropy")
        if verdict is Verdict.collapsed and entropy is not None:
            message += f" The trainer's last entropy was {entropy:.3g} nats per token."
        raise RunFailed(message)

    async def _park(self, step: int, alarm_task: asyncio.Task) -> None:
        """Ship-side gating: hold batch ``step`` until the trainer is within S versions of it."""
        target = step - 1 - self.config.rollout.max_staleness
        started = time.monotonic()
        while self.policy.value < target:
            self._check_alarm()
            await asyncio.sleep(self.config.watcher.poll_interval)
        self.parked_s += time.monotonic() - started
        self._park_last = time.monotonic() - started

    def _ship(self, batch: Batch) -> None:
        lines = []
        for rollout, advantage in zip(batch.rollouts, batch.advantages):
            record = rollout.to_json()
            record["advantage"] = advantage
            lines.append(orjson.dumps(record))
        write_atomic(self.run_dir.batch(batch.step), b"\n".join(lines) + b"\n")
        self.shipped = batch.step
        self.shipped_handle.bump(batch.step)
        self.shipped_batches.append(batch)
        admitted = self.dispatcher.admitted
        rewards = [r.reward for r in batch.rollouts]
        self.step_records[batch.step] = {
            "kind": "step", "step": batch.step, "admitted": admitted - self.admitted_at_last_step,
            **age_stats(head_ages(batch.rollouts, batch.step - 1)),
            "trainable": sum(1 for a in batch.advantages if abs(a) > 1e-8), "filtered": batch.filtered,
            "reward_mean": round(sum(rewards) / len(rewards), 6),
            "parked_s": round(self._park_last, 4),
            "tokens": sum(r.generated_tokens for r in batch.rollouts)}
        self._park_last = 0.0
        self.admitted_at_last_step = admitted
        self.dispatcher.notify()

    def _read_trainer_lines(self) -> None:
        """Add the trainer's newly completed metric lines to the backlog, keyed by step."""
        path = self.run_dir.trainer_metrics
        try:
            with open(path, "rb") as handle:
                handle.seek(self.trainer_metrics_offset)
                data = handle.read()
        except OSError:
            return
        complete = data[: data.rfind(b"\n") + 1]
        self.trainer_metrics_offset += len(complete)
        for line in complete.splitlines():
            if line.strip():
                record = json.loads(line)
                self.trainer_backlog[record["step"]] = record

    def _flush_step_records(self) -> None:
        """Write the step records of trained batches, joined with the trainer's own line."""
        trained = self.policy.value
        self._read_trainer_lines()
        for step in sorted(self.step_records):
            if step > trained:
                break
            record = self.step_records.pop(step)
            extra = self.trainer_backlog.pop(step, {})
            record.update({"loss": extra.get("loss"), "grad_norm": extra.get("grad_norm"),
                           "version": self.policy.value, **self.dispatcher.gauges(),
                           "reload_s": self.watcher.reload_s, "wall_s": round(time.monotonic() - self.started, 3)})
            for key in ("kl", "ratio_mean", "ratio_max", "clip_frac", "is_capped_frac", "step_s",
                        "mismatch_kl", "mismatch_max", "mismatch_tokens", "entropy", "skipped_updates"):
                if key in extra:
                    record[key] = extra[key]
            self.last_step_record = record
            self.metrics.write(record)
            every = self.config.eval.every
            if self.config.eval.enabled and every and step % every == 0:
                self._start_evaluation(step)

    def _start_evaluation(self, step: int) -> None:
        self.evaluated.add(step)
        task = asyncio.get_running_loop().create_task(self._evaluate(step))
        self.eval_tasks.add(task)
        task.add_done_callback(self.eval_tasks.discard)

    async def _evaluate(self, step: int) -> None:
        """Greedy decoding of the held-out prompts on the weights of version ``step``."""
        self.evaluated.add(step)
        if self.eval_prompts is None:
            self.eval_prompts = self.prompts.eval_set(self.config.eval.prompts)
        timeout = self.config.rollout.request_timeout
        groups = await asyncio.gather(*(asyncio.wait_for(self.work(p), timeout) for p in self.eval_prompts),
                                      return_exceptions=True)
        rollouts = [r for g in groups if not isinstance(g, BaseException) for r in g]
        self.metrics.write(self.eval_sink.add(step, rollouts, asked=len(self.eval_prompts)))

    # checkpoints, drain, shutdown ------------------------------------------------------------
    def _untrained(self, trained_step: int) -> list[list[Rollout]]:
        groups: list[list[Rollout]] = []
        for batch in self.shipped_batches:
            if batch.step > trained_step:
                groups.extend(_regroup(batch.rollouts))
        if self.parked is not None:
            groups.extend(_regroup(self.parked.rollouts))
        groups.extend(self.sink.pending_groups())
        groups.extend(self.dispatcher.out_queue)
        return groups

    def _snapshot(self, step: int, abandoned: Optional[list[Prompt]] = None) -> None:
        """Write orchestrator.json beside the trainer's checkpoint of ``step``.

        Prompts still in flight (or abandoned by a shutdown) and those waiting in the input queue
        are saved, so a resume neither skips nor repeats data.
        """
        untrained = self._untrained(step)
        trained = self._trained_through(step)
        in_flight = self.dispatcher.in_flight_prompts() if abandoned is None else abandoned
        requeued = self._requeued()
        if abandoned is None:
            requeued += len(in_flight) * self.config.rollout.group_size
        pending = in_flight + self.dispatcher.failed + list(self.dispatcher.in_queue)
        totals = {**self.totals, "admitted": self._admitted(), "trained": trained,
                  "filtered": self._filtered(), "untrained": sum(len(g) for g in untrained),
                  "requeued": requeued,
                  "empty_batches": self._empty_batches()}
        state = ResumeState(step=step, prompt_position=self.prompts.position, untrained=untrained,
                            pending_prompts=pending, totals=totals)
        write_json_atomic(CheckpointDir(self.run_dir.checkpoint(step)).state, state.to_json())
        self.snapshotted.add(step)
        self.last_snapshot = max(self.last_snapshot, step)
        # Batches at or below the newest snapshot can no longer be untrained in any checkpoint
        # this run writes; the rest stay so a snapshot of an older step still lists them.
        while self.shipped_batches and self.shipped_batches[0].step <= self.last_snapshot:
            self.totals["trained"] += len(self.shipped_batches.popleft().rollouts)

    def _snapshot_new_checkpoints(self) -> None:
        for step, _ in self.run_dir.complete_checkpoints():
            if step not in self.snapshotted and self.first_step <= step <= self.policy.value:
                self._snapshot(step)

    def _requeued(self) -> int:
        """Rollouts whose prompts go back to the queue: abandoned at shutdown, or whose group
        failed on every retry (the run stops; a resume generates them again)."""
        return self.totals["requeued"] + len(self.dispatcher.failed) * self.config.rollout.group_size

    def _trained_through(self, step: int) -> int:
        return self.totals["trained"] + sum(len(b.rollouts) for b in self.shipped_batches if b.step <= step)

    def _empty_batches(self) -> int:
        return self.totals["empty_batches"] + self.sink.totals.empty_batches

    def _admitted(self) -> int:
        return self.base_admitted + self.gate.submitted

    def _filtered(self) -> int:
        return self.totals["filtered"] + self.sink.totals.filtered

    async def _wait_version(self, version: int) -> None:
        while self.policy.value < version:
            self._check_alarm()
            await asyncio.sleep(self.config.watcher.poll_interval)

    async def _drain(self, alarm_task: asyncio.Task) -> None:
        """At train.steps: admit nothing more, let in-flight work finish, checkpoint it all."""
        await self.dispatcher.stop()
        while not await self.dispatcher.wait_idle(0.2):
            self._check_alarm()
        await self._wait_version(self.shipped)
        await self.trainer.stop(self.config.run.shutdown_timeout)
        self._flush_step_records()
        if self.config.eval.enabled and self.policy.value not in self.evaluated:
            self._start_evaluation(self.policy.value)
        pending = set(self.eval_tasks)
        while pending:
            done, pending = await asyncio.wait(pending | {alarm_task}, return_when=asyncio.FIRST_COMPLETED)
            pending.discard(alarm_task)
            self._check_alarm()
        self._final_checkpoint(abandoned=[])

    def _final_checkpoint(self, abandoned: list[Prompt]) -> None:
        complete = [step for step, _ in self.run_dir.complete_checkpoints()
                    if self.first_step - 1 <= step <= self.policy.value]
        if complete:
            self._snapshot(complete[-1], abandoned=abandoned)
            self.checkpoint_step = complete[-1]

    async def _shutdown(self) -> None:
        """Bounded: stop admitting, drain for at most run.shutdown_timeout, checkpoint, exit."""
        deadline = time.monotonic() + self.config.run.shutdown_timeout
        await self.dispatcher.stop()
        await self.dispatcher.wait_idle(max(0.0, deadline - time.monotonic()) * 0.5)
        abandoned = await self.dispatcher.cancel_in_flight()
        self.totals["requeued"] += len(abandoned) * self.config.rollout.group_size
        await self.trainer.stop(max(0.5, deadline - time.monotonic()))
        await self.watcher.stop()
        try:
            await asyncio.wait_for(self.watcher.poll_once(), max(0.5, deadline - time.monotonic()))
        except (asyncio.TimeoutError, OSError, RuntimeError):
            pass
        self._flush_step_records()
        self._final_checkpoint(abandoned=abandoned)

    def _summary(self, status: str, error: Optional[str]) -> dict:
        checkpoint = self.checkpoint_step
        trained_step = checkpoint if checkpoint is not None else self.policy.value
        untrained = sum(len(g) for g in self._untrained(trained_step))
        trained = self._trained_through(trained_step)
        admitted = self._admitted()
        filtered = self._filtered()
        requeued = self._requeued()
        accounted = trained + filtered + self.totals["dropped_stale"] + untrained + requeued
        unsaved = 0
        if checkpoint is None:
            # No checkpoint was written (stopped before the first one): nothing is persisted,
            # and a new run starts these prompts again.
            unsaved, untrained, requeued = untrained + requeued, 0, 0
        last = self.last_step_record
        return {"status": status, "error": error, "reason": self.alarm_reason or self.converged, "steps": trained_step, "version": self.policy.value,
                "admitted": admitted, "trained": trained, "filtered": filtered,
                "dropped_stale": self.totals["dropped_stale"], "regenerated": self.totals["regenerated"],
                "stale_tokens": self.totals["stale_tokens"], "persisted_untrained": untrained,
                "requeued": requeued, "unsaved": unsaved, "lost": admitted - accounted,
                "empty_batches": self._empty_batches(), "short_batches": self.sink.totals.short_batches,
                "checkpoint": str(self.run_dir.checkpoint(checkpoint)) if checkpoint else None,
                "parked_s": round(self.parked_s, 4), "reward_mean_last": last.get("reward_mean"),
                **self._eval_summary(),
                "wall_s": round(time.monotonic() - self.started, 3),
                "loop_s": round(time.monotonic() - self.loop_started, 3)}


    def _eval_summary(self) -> dict:
        first, last = self.eval_sink.first, self.eval_sink.last
        return {"eval_accuracy_first": first["accuracy"] if first else None,
                "eval_accuracy_last": last["accuracy"] if last else None,
                "eval_step_first": first["step"] if first else None,
                "eval_step_last": last["step"] if last else None}


def _regroup(rollouts: list[Rollout]) -> list[list[Rollout]]:
    groups: dict[tuple, list[Rollout]] = {}
    for rollout in rollouts:
        groups.setdefault((rollout.group_id, rollout.attempt), []).append(rollout)
    return list(groups.values())
