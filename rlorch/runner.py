"""The single-process runner behind ``rlorch train`` and ``rlorch resume``.

It makes the run directory, writes the resolved config, starts the engines and the trainer,
builds the orchestrator, installs the signal handlers; what the operator sees (phases, progress,
the end-of-run report) is :mod:`rlorch.reporting.progress`.
"""

from __future__ import annotations

import asyncio
import gc
import time
from pathlib import Path
from typing import Any, Optional

from rich.console import Console

from rlorch.config.schema import Colocate, Config, ConfigError
from rlorch.launch.placement import colocation_note, layout_choice, resolve_layout
from rlorch.launch.runlock import RunLock, holds_nothing, set_aside_unresumable
from rlorch.launch.signals import SignalRelay, startup_summary
from rlorch.launch.startup import StartupClock
from rlorch.lifecycle import interrupted_within
from rlorch.reporting.progress import Phases, print_report, progress_logger
from rlorch.rundir.layout import RunDir, load_config, parse_step, save_config, write_json_atomic
from rlorch.types import PolicyVersion

EXIT_INTERRUPTED = {"SIGINT": 130, "SIGTERM": 143}
console = Console(stderr=True, soft_wrap=True)


def new_run_dir(config: Config) -> RunDir:
    if config.run.dir:
        root = Path(config.run.dir)
        holder = RunLock(root).holder() if root.is_dir() else None
        if holder is not None:
            raise ConfigError("run.dir", f"{root} is in use by process {holder}; one process per run directory")
        holds_something = root.exists() and not holds_nothing(root)
        if holds_something and not RunDir(root).is_run:
            raise ConfigError("run.dir", f"{root} is not empty and is not an rlorch run (no config.yaml); "
                                         "pick an empty or a new run.dir")
        if holds_something and not set_aside_unresumable(root):
            raise ConfigError("run.dir", f"{root} already holds a run; continue it with "
                                         f"`rlorch resume checkpoint={root}` or pick another run.dir")
    else:
        root = Path("outputs") / f"{config.run.name}-{time.strftime('%Y%m%d-%H%M%S')}"
        suffix = 1
        while root.exists():
            root = root.with_name(f"{root.name.split('.')[0]}.{suffix}")
            suffix += 1
    # Absolute: processes forked by a shared fork server work in that server's directory.
    return RunDir(root.absolute()).make()


def _create_built_in_model(config: Config) -> None:
    """A built-in model named in ``model.path`` is created here, once, before the trainer and
    the engines start (each would otherwise create it for itself)."""
    from rlorch.model import BUILT_IN_MODELS, resolve_model_path

    if config.model.path in BUILT_IN_MODELS:
        resolve_model_path(config.model.path)


def run_training(config: Config, overrides: list[str]) -> int:
    from rlorch.config.preflight import preflight

    run_dir: Optional[RunDir] = None
    try:
        try:
            preflight(config)
            _create_built_in_model(config)
            unresolved, config = config, resolve_layout(config)
            run_dir = new_run_dir(config)
            lock = RunLock(run_dir.root).acquire()
        except ConfigError as err:
            console.print(f"[bold red]invalid config[/] {err}", highlight=False)
            return 2
        except OSError as err:
            console.print(f"[bold red]invalid config[/] run.dir: cannot create {config.run.dir or 'outputs/'}: "
                          f"{err.strerror or err}", highlight=False)
            return 2
        with lock:
            config.run.dir = str(run_dir.root)
            save_config(config, run_dir.config)
            _warm_up(config)
            console.print(f"run directory: [bold]{run_dir.root}[/]", highlight=False)
            for line in (layout_choice(unresolved, config), colocation_note(unresolved)):
                if line:
                    console.print(line, highlight=False)
            from rlorch.config.preflight import run_warnings

            for warning in run_warnings(config):
                console.print(f"[yellow]warning[/] {warning}", highlight=False)
            return asyncio.run(_run(config, run_dir, checkpoint=None))
    except (KeyboardInterrupt, Exception) as err:
        # Only before _run's signal handlers are in: from there a Ctrl-C stops the run in order.
        # A config read it cut short raises OmegaConf's own error, the Ctrl-C as its context.
        if not interrupted_within(err):
            raise
        where = (f"{run_dir.root} holds no step, and a new start can use the same run.dir"
                 if run_dir is not None else "no run directory was made")
        console.print(f"interrupted before the run started: {where}", highlight=False)
        return EXIT_INTERRUPTED["SIGINT"]


def resume_training(checkpoint: str, overrides: list[str]) -> int:
    try:
        return _resume(checkpoint, overrides)
    except (KeyboardInterrupt, Exception) as err:
        # Only before _run's signal handlers are in: from there a Ctrl-C stops the run in order.
        if not interrupted_within(err):
            raise
        console.print(f"interrupted before the resume started: nothing was trained; `rlorch resume {checkpoint}` "
                      "starts it again", highlight=False)
        return EXIT_INTERRUPTED["SIGINT"]


def _resume(checkpoint: str, overrides: list[str]) -> int:
    from rlorch.rundir import resume
    from rlorch.config.keys import check_overrides
    from rlorch.rundir.targets import continues_converged, finished_run, locate_checkpoint, run_root

    # Absolute, as a new run's directory is (processes forked by a shared fork server work in
    # that server's directory).
    checkpoint = str(Path(checkpoint).absolute())
    try:
        check_overrides(overrides)
        # The lock first: a run still going prunes its checkpoints, so nothing of it is read
        # before this process alone holds the directory.
        lock = RunLock(run_root(Path(checkpoint))).acquire()
    except ConfigError as err:
        console.print(f"[bold red]cannot resume[/] {err}", highlight=False)
        return 2
    with lock:
        try:
            path = locate_checkpoint(Path(checkpoint))
            config, run_dir = resume.resume_target(path, overrides)
            carried = resume.carried_age_warning(path, load_config(run_dir.config), config)
            config = resolve_layout(config)
            _create_built_in_model(config)
        except ConfigError as err:
            console.print(f"[bold red]cannot resume[/] {err}", highlight=False)
            return 2
        done = finished_run(path, config, overrides)
        if done:
            console.print(done, highlight=False, soft_wrap=True)
            return 0
        if continues_converged(path, overrides):
            config.train.stop_on_converged = False
            console.print("continuing a run that converged: train.stop_on_converged=false for this resume "
                          "(set it to stop again once solved)", highlight=False)
        step = resume.step_of(path)
        if carried:
            console.print(f"[yellow]warning[/] {carried}", highlight=False, soft_wrap=True)
        resume.prepare(run_dir, step, config, overrides)
        _warm_up(config)
        console.print(f"resuming {run_dir.root} at step {step + 1}", highlight=False)
        return asyncio.run(_run(config, run_dir, checkpoint=path))


def _warm_up(config: Config) -> None:
    """Start the fork server early when rlorch processes will be launched (rlorch.launch.forkserver);
    stop one ``forkserver.warm_up_early`` started for a run that launches none."""
    from rlorch.launch import forkserver
    from rlorch.config.schema import InferenceBackend, TrainerBackend

    local = config.run.launcher == "local"  # the Ray launcher's actors start processes on their nodes
    if local and (config.inference.backend == InferenceBackend.cpu or config.trainer.backend == TrainerBackend.fsdp):
        forkserver.warm_up()
        forkserver.preload_for(_heavy_modules(config))
    else:
        forkserver.discard()


def _heavy_modules(config: Config) -> list[str]:
    """What the launched children need beyond the fork server's own imports: transformers where
    an engine or the trainer runs its model (``model.implementation``), FSDP2 for a sharded
    trainer. Decided from the model's ``config.json`` (the default model, not created yet, is
    rlorch's own Qwen2)."""
    from rlorch.config.schema import InferenceBackend, TrainerBackend
    from rlorch.launch import forkserver
    from rlorch.launch.placement import has_gpu_driver
    from rlorch.model import model_directory, uses_native

    path = model_directory(config.model.path)
    implementation, trainer = config.model.implementation, config.trainer.backend == TrainerBackend.fsdp
    device = config.trainer.fsdp.device
    trainer_device = "cuda" if device == "cuda" or (device == "auto" and has_gpu_driver()) else "cpu"

    def native(lora: bool = False, device: str = "cpu") -> bool:
        if not (path / "config.json").is_file():  # not created yet: the default model, a Qwen2 native runs
            return implementation == "native" or (implementation == "auto" and not lora and device == "cpu")
        return uses_native(implementation, path, lora=lora, device=device)

    try:
        transformers = ((config.inference.backend == InferenceBackend.cpu and not native(device=config.inference.cpu.device))
                        or (trainer and not native(lora=bool(config.model.lora.rank), device=trainer_device)))
    except (ConfigError, OSError, ValueError):
        return []  # the child that loads the model reports it
    sharded = trainer and ((config.trainer.fsdp.nproc or 1) > 1 or config.model.dtype != "float32")
    return [*(forkserver.TRANSFORMERS_PRELOAD if transformers else ()),
            *(forkserver.SHARDING_PRELOAD if sharded else ())]


def _say_stopping(config: Config, name: str, first: bool) -> None:
    limit = f"run.shutdown_timeout={config.run.shutdown_timeout:g} s"
    console.print(f"{name}: stopping in order (a run past its start checkpoints its last step), within {limit}"
                  if first else f"{name} again: already stopping, within {limit} of the first", highlight=False)


async def _run(config: Config, run_dir: RunDir, checkpoint: Optional[Path]) -> int:
    clock = StartupClock()
    started = clock.origin
    signals = SignalRelay(say=lambda name, first: _say_stopping(config, name, first))
    from rlorch.backends import make_launcher, make_trainer
    from rlorch.tasks.episode import PromptSource, make_work, reward_override
    from rlorch.tasks.replay import ReplayQueue
    from rlorch.types import max_reward
    from rlorch.inference.weight_transfer import join_weight_group
    from rlorch.orchestrator.loop import Orchestrator
    from rlorch.rundir.resume import step_of
    from rlorch.tasks.registry import make_environment

    phases = Phases(console)
    policy = PolicyVersion(0)
    engines, tokenizer, trainer, orchestrator, view, launcher = None, None, None, None, None, None
    gateway, agents = None, None
    try:
        env = make_environment(config)
        launcher = make_launcher(config.run.launcher, config)
        trainer = make_trainer(config, run_dir, checkpoint, step_of(checkpoint) if checkpoint else 0, launcher)
        launched, trainer_started = await _start_concurrently(config, run_dir, policy, trainer, launcher, clock,
                                                              phases)
        if not isinstance(launched, BaseException):
            engines, tokenizer = launched
        for outcome in (launched, trainer_started):
            if isinstance(outcome, BaseException):
                raise outcome
        prompts = PromptSource(env, tokenizer=tokenizer, seed=config.run.seed,
                               replay=ReplayQueue(config.rollout.replay_share, max_reward=max_reward(env)))
        _note_eval_size(config, prompts)
        _cap_steps_at_epochs(config, env)
        resume = None
        if checkpoint is not None:
            from rlorch.rundir.resume import read_state, weights_of

            resume = read_state(checkpoint, prompts.make, prompts.replay.load_state_dict)
            prompts.position = resume.prompt_position
            await engines.reload(str(weights_of(checkpoint, run_dir, resume.step)), resume.step)
        await join_weight_group(config, run_dir, engines, trainer.error)
        clock.mark("ready")
        if config.task.agent:
            gateway, agents = await _start_agents(config, engines, tokenizer, env)
        work = make_work(config, engine=engines, tokenizer=tokenizer, env=env,
                         override=reward_override(config, config.run.seed), agents=agents)
        orchestrator = Orchestrator(config, run_dir=run_dir, policy=policy, engines=engines, trainer=trainer,
                                    work=work, prompts=prompts, resume=resume, startup=clock)
        signals.forward_to(orchestrator.request_shutdown)
        # The loop allocates a few small objects per rollout and may hold 10^5 in flight: freeze
        # what start-up built and collect the young generation less often, so collection cost
        # stays flat as the number in flight grows.
        gc.freeze()
        gc.set_threshold(50_000, 20, 20)
        view = progress_logger(config, console)
        if view is not None:
            orchestrator.metrics.add_logger(view)
        summary = await orchestrator.run()
    except asyncio.CancelledError:
        if signals.received is None:
            raise
        asyncio.current_task().uncancel()
        summary = startup_summary(run_dir, status="interrupted", reason=signals.received, error=None,
                                  step=_start_step(checkpoint), wall_s=time.monotonic() - started)
    except Exception as err:
        console.print(f"[bold red]run failed[/] {err}", highlight=False)
        if orchestrator is None:
            startup_summary(run_dir, status="failed", reason=None, error=str(err), step=_start_step(checkpoint),
                            wall_s=time.monotonic() - started)
        return 1
    finally:
        if view is not None:
            view.close()
        if gateway is not None:
            await gateway.stop()
        if trainer is not None:
            # Interrupted in start-up, the trainer has nothing to checkpoint: no need to wait.
            await trainer.stop(config.run.shutdown_timeout if orchestrator is not None else 2.0)
        if engines is not None:
            await engines.close()
        if launcher is not None:
            launcher.close()
    return _report(summary, run_dir, config, phases.timings)


async def _start_agents(config: Config, engines: Any, tokenizer: Any, env: Any) -> tuple[Any, Any]:
    """``task.agent``: the agents' gateway, serving, and the episodes that call the agent."""
    from rlorch.agents.episodes import AgentEpisodes
    from rlorch.agents.gateway import AgentGateway
    from rlorch.config.preflight import load_agent

    task = config.task
    agent = load_agent(task.agent)
    gateway = AgentGateway(engine=engines, tokenizer=tokenizer, model_name=config.model.path or "rlorch-policy",
                           tool_parser=task.tool_call_parser, max_calls=task.max_calls, bridge=task.agent_bridge,
                           client_sampling=task.agent_sampling)
    await gateway.start()
    return gateway, AgentEpisodes(gateway=gateway, agent=agent, env=env, timeout=task.agent_timeout)


def _cap_steps_at_epochs(config: Config, env: Any) -> None:
    """``data.epochs``: end the run once that many passes' worth of prompts have been batched."""
    rows = getattr(env, "prompt_count", None)
    if not config.data.epochs or not rows:
        return
    steps = max(1, config.data.epochs * rows // config.rollout.prompts_per_batch)
    if steps < config.train.steps:
        console.print(f"data.epochs={config.data.epochs}: {rows} training rows, "
                      f"{config.rollout.prompts_per_batch} prompts per batch: the run ends at step {steps} "
                      f"(train.steps={config.train.steps})", highlight=False)
        config.train.steps = steps


def _note_eval_size(config: Config, prompts: Any) -> None:
    """Say so when the task holds out fewer prompts than ``eval.prompts`` asks for."""
    if not config.eval.enabled:
        return
    held_out = len(prompts.eval_set(config.eval.prompts))
    if held_out < config.eval.prompts:
        # A data file with no split evaluates on its training rows (run_warnings says why that matters).
        if config.data.path and not (config.data.eval_path or config.data.eval_fraction):
            console.print(f"evaluation: {held_out} training rows, none held out (eval.prompts="
                          f"{config.eval.prompts})", highlight=False)
        else:
            console.print(f"evaluation: {held_out} held-out prompts (eval.prompts={config.eval.prompts}; the task "
                          f"holds out {held_out})", highlight=False)


async def _start_concurrently(config: Config, run_dir: RunDir, policy: PolicyVersion, trainer: Any, launcher: Any,
                              clock: StartupClock, phases: Phases) -> tuple[Any, Any]:
    """Start the engines and the trainer at once (each is seconds of imports and model loading,
    independent of the other); return each outcome, an exception for a start that failed, so
    the caller can stop whatever did start.

    Colocated, one after the other, so each side sizes itself on what the other left: resident,
    the engines first (SGLang's static share is of the memory free when it starts), then the
    trainer; swap, the trainer first (it builds, moves its state to the host, then reports
    ready), then the engines."""
    from rlorch.backends import start_inference

    inference = config.inference
    count = len(inference.addresses) or inference.num_servers

    async def engines():
        with phases.phase("engines", f"starting {count} {inference.backend.value} engine{'s' * (count > 1)}",
                          "engines ready"):
            async with clock.part("engines"):
                return await start_inference(config, run_dir, policy, launcher)

    async def trainer_start():
        with phases.phase("trainer", f"starting the {config.trainer.backend.value} trainer", "trainer ready"):
            async with clock.part("trainer"):
                await trainer.start()

    colocate = config.run.colocate
    if not colocate.shares:
        launched, started = await asyncio.gather(engines(), trainer_start(), return_exceptions=True)
        return launched, started
    first, second = (trainer_start, engines) if colocate is Colocate.swap else (engines, trainer_start)
    outcomes = await asyncio.gather(first(), return_exceptions=True)
    if not isinstance(outcomes[0], BaseException):
        outcomes += await asyncio.gather(second(), return_exceptions=True)
    else:
        outcomes.append(RuntimeError(f"not started: the {first.__name__.removesuffix('_start')} failed to start"))
    return tuple(outcomes) if first is engines else (outcomes[1], outcomes[0])


def _start_step(checkpoint: Optional[Path]) -> int:
    return (parse_step(checkpoint.name) or 0) if checkpoint is not None else 0


def _report(summary: dict, run_dir: RunDir, config: Config, phases: dict) -> int:
    summary["startup_phases"] = phases
    try:
        write_json_atomic(run_dir.summary, summary)
    except OSError as err:
        console.print(f"[bold red]summary not saved[/] {run_dir.summary}: {err}", highlight=False)
    report = None
    if config.run.report and summary.get("admitted"):
        from rlorch.reporting.report import write_report

        try:
            report = write_report(run_dir)
        except Exception as err:
            console.print(f"[yellow]report failed[/] {err!r}", highlight=False)
    print_report(console, summary, summary_path=run_dir.summary, report_path=report, phases=phases)
    status = summary["status"]
    if status == "interrupted":
        return EXIT_INTERRUPTED.get(summary.get("reason") or "", 130)
    return 0 if status in ("completed", "converged") else 1
