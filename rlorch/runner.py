"""The single-process runner behind ``rlorch train`` and ``rlorch resume``.

It makes the run directory, writes the resolved config, starts the engines and the trainer,
builds the orchestrator, installs the signal handlers and shows live progress.
"""

from __future__ import annotations

import asyncio
import gc
import signal
import sys
import time
from pathlib import Path
from typing import Any, Optional

from rich.console import Console

from rlorch.config import Config, ConfigError
from rlorch.lifecycle import cancel_and_wait
from rlorch.rundir import RunDir, save_config
from rlorch.startup import StartupClock
from rlorch.types import PolicyVersion

EXIT_INTERRUPTED = {"SIGINT": 130, "SIGTERM": 143}
console = Console(stderr=True)


def new_run_dir(config: Config) -> RunDir:
    if config.run.dir:
        root = Path(config.run.dir)
        if root.exists() and any(root.iterdir()):
            raise ConfigError("run.dir", f"{root} already holds a run; continue it with "
                                         f"`rlorch resume checkpoint={root}/checkpoints/step_N` or pick another run.dir")
    else:
        root = Path("outputs") / f"{config.run.name}-{time.strftime('%Y%m%d-%H%M%S')}"
        suffix = 1
        while root.exists():
            root = root.with_name(f"{root.name.split('.')[0]}.{suffix}")
            suffix += 1
    return RunDir(root).make()


def run_training(config: Config, overrides: list[str]) -> int:
    _warm_up(config)
    try:
        run_dir = new_run_dir(config)
    except ConfigError as err:
        console.print(f"[bold red]invalid config[/] {err}", highlight=False)
        return 2
    config.run.dir = str(run_dir.root)
    save_config(config, run_dir.config)
    console.print(f"run directory: [bold]{run_dir.root}[/]", highlight=False)
    return asyncio.run(_run(config, run_dir, checkpoint=None))


def resume_training(checkpoint: str, overrides: list[str]) -> int:
    from rlorch import resume

    path = Path(checkpoint)
    try:
        config, run_dir = resume.resume_target(path, overrides)
    except ConfigError as err:
        console.print(f"[bold red]cannot resume[/] {err}", highlight=False)
        return 2
    step = resume.step_of(path)
    resume.prepare(run_dir, step, config, overrides)
    _warm_up(config)
    console.print(f"resuming {run_dir.root} at step {step + 1}", highlight=False)
    return asyncio.run(_run(config, run_dir, checkpoint=path))


def _warm_up(config: Config) -> None:
    """Start the fork server early when rlorch processes will be launched (rlorch.forkserver)."""
    from rlorch.config import InferenceBackend, TrainerBackend

    if config.inference.backend == InferenceBackend.cpu or config.trainer.backend == TrainerBackend.fsdp:
        from rlorch import forkserver

        forkserver.warm_up()


async def _run(config: Config, run_dir: RunDir, checkpoint: Optional[Path]) -> int:
    from rlorch.backends import make_trainer
    from rlorch.episode import PromptSource, make_work, reward_override
    from rlorch.inference.weight_transfer import join_weight_group
    from rlorch.orchestrator.loop import Orchestrator
    from rlorch.tasks import make_environment

    clock = StartupClock()
    started = clock.origin
    policy = PolicyVersion(0)
    env = make_environment(config)
    engines, tokenizer, trainer = None, None, None
    try:
        from rlorch.resume import step_of

        trainer = make_trainer(config, run_dir, checkpoint, step_of(checkpoint) if checkpoint else 0)
        launched, trainer_started = await _start_concurrently(config, run_dir, policy, trainer, clock)
        if not isinstance(launched, BaseException):
            engines, tokenizer = launched
        for outcome in (launched, trainer_started):
            if isinstance(outcome, BaseException):
                raise outcome
        prompts = PromptSource(env, tokenizer=tokenizer, seed=config.run.seed)
        resume = None
        if checkpoint is not None:
            from rlorch.resume import read_state, weights_of

            resume = read_state(checkpoint, prompts.make)
            prompts.position = resume.prompt_position
            await engines.reload(str(weights_of(checkpoint, run_dir, resume.step)), resume.step)
        await join_weight_group(config, run_dir, engines)
        clock.mark("ready")
        work = make_work(config, engine=engines, tokenizer=tokenizer, env=env,
                         override=reward_override(config, config.run.seed))
        orchestrator = Orchestrator(config, run_dir=run_dir, policy=policy, engines=engines, trainer=trainer,
                                    work=work, prompts=prompts, resume=resume, started=started)
        orchestrator.startup = clock
        _install_signals(orchestrator)
        # The loop allocates a few small objects per rollout and may hold 10^5 in flight: freeze
        # what start-up built and collect the young generation less often, so collection cost
        # stays flat as the number in flight grows.
        gc.freeze()
        gc.set_threshold(50_000, 20, 20)
        progress = _progress(config, orchestrator)
        try:
            summary = await orchestrator.run()
        finally:
            await cancel_and_wait(progress)
    except Exception as err:
        console.print(f"[bold red]run failed[/] {err}", highlight=False)
        return 1
    finally:
        if trainer is not None:
            await trainer.stop(config.run.shutdown_timeout)
        if engines is not None:
            await engines.close()
    return _report(summary, run_dir)


async def _start_concurrently(config: Config, run_dir: RunDir, policy: PolicyVersion, trainer: Any,
                              clock: StartupClock) -> tuple[Any, Any]:
    """Start the engines and the trainer at once (each is seconds of imports and model loading,
    independent of the other); return each outcome, an exception for a start that failed, so
    the caller can stop whatever did start."""
    from rlorch.backends import start_inference

    async def engines():
        async with clock.part("engines"):
            return await start_inference(config, run_dir, policy)

    async def trainer_start():
        async with clock.part("trainer"):
            await trainer.start()

    launched, started = await asyncio.gather(engines(), trainer_start(), return_exceptions=True)
    return launched, started


def _install_signals(orchestrator: Any) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, orchestrator.request_shutdown, sig.name)


def _report(summary: dict, run_dir: RunDir) -> int:
    status = summary["status"]
    style = {"completed": "green", "converged": "green", "interrupted": "yellow"}.get(status, "red")
    first, last = summary.get("eval_accuracy_first"), summary.get("eval_accuracy_last")
    accuracy = (f"eval_accuracy={first:.1%}(step {summary['eval_step_first']})->{last:.1%}"
                f"(step {summary['eval_step_last']}) " if first is not None and last is not None else "")
    reward = summary.get("reward_mean_last")
    console.print(f"[bold {style}]{status}[/] steps={summary['steps']} {accuracy}"
                  + (f"reward_last={reward:.3f} " if reward is not None else "")
                  + f"admitted={summary['admitted']} "
                  f"trained={summary['trained']} filtered={summary['filtered']} "
                  f"dropped_stale={summary['dropped_stale']} untrained={summary['persisted_untrained']} "
                  f"lost={summary['lost']} wall={summary['wall_s']}s -> {run_dir.summary}", highlight=False)
    if summary.get("error"):
        console.print(f"[bold red]error[/] {summary['error']}", highlight=False)
    if status == "interrupted":
        return EXIT_INTERRUPTED.get(summary.get("reason") or "", 130)
    return 0 if status in ("completed", "converged") else 1


def _progress(config: Config, orchestrator: Any) -> Optional[asyncio.Task]:
    if not (config.run.progress and sys.stderr.isatty()):
        return None

    async def show() -> None:
        from rich.live import Live
        from rich.table import Table

        with Live(console=console, refresh_per_second=4, transient=True) as live:
            while True:
                gauges = orchestrator.metrics.snapshot()
                last = orchestrator.last_step_record
                elapsed = max(time.monotonic() - orchestrator.started, 1e-9)
                trained = gauges["version"] * config.rollout.batch_size
                table = Table.grid(padding=(0, 2))
                evaluated = orchestrator.evaluations.sink.last
                table.add_row(f"step {gauges['version']}/{config.train.steps}",
                              f"reward {last['reward_mean']:.3f}" if last else "reward -",
                              f"eval acc {evaluated['accuracy']:.1%} @{evaluated['step']}"
                              if evaluated and evaluated["accuracy"] is not None else "eval acc -",
                              f"head age max {last['age_max']}" if last else "head age -",
                              f"in flight {gauges['in_flight']}", f"out queue {gauges['out_queue']}",
                              f"buffered {gauges['buffered']}", f"{trained / elapsed:.1f} rollouts/s")
                live.update(table)
                await asyncio.sleep(0.5)

    return asyncio.get_running_loop().create_task(show())
