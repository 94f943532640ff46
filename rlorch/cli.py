"""The ``rlorch`` command line. Heavy imports (hydra, torch, numpy) are deferred into commands
so ``rlorch --help`` answers fast."""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import sys
from typing import List, NoReturn, Optional


EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a command Ctrl-C ended


def _interrupted_at_start(signum, frame) -> None:
    sys.stderr.write("interrupted while rlorch was starting: nothing was done\n")
    raise SystemExit(EXIT_INTERRUPTED)


# Ctrl-C during the CLI's own imports says so (Python would exit without a word); the commands
# restore Python's handler as they start. Only for the command line itself, not an importer.
if (__name__ == "__main__" or sys.argv[0].endswith("rlorch")) and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
    signal.signal(signal.SIGINT, _interrupted_at_start)

import typer  # noqa: E402

app = typer.Typer(
    name="rlorch",
    help="Asynchronous RL post-training control loop: inference engines, an FSDP2 trainer, "
         "and a bound on how off-policy the data gets.",
    rich_markup_mode="rich",
    no_args_is_help=False,
    add_completion=False,
    pretty_exceptions_enable=False,
)

def _version(value: bool) -> None:
    if value:
        from importlib.metadata import PackageNotFoundError, version

        try:
            typer.echo(f"rlorch {version('rlorch')}")
        except PackageNotFoundError:
            typer.echo("rlorch (not installed: version unknown)")
        raise typer.Exit()


@app.callback()
def _main(show_version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                            help="Print the version and exit.")) -> None:
    """Asynchronous RL post-training control loop."""
    if signal.getsignal(signal.SIGINT) is _interrupted_at_start:
        signal.signal(signal.SIGINT, signal.default_int_handler)


@contextlib.contextmanager
def _interruptible():
    """Ctrl-C before a run installs its own handlers (composing the config, starting the fork
    server) ends the command with a word and status 130, not silently."""
    try:
        yield
    except (Exception, KeyboardInterrupt) as err:
        from rlorch.lifecycle import interrupted_within

        if not interrupted_within(err):
            raise
        typer.echo("interrupted before the run started: no run directory was made", err=True)
        raise typer.Exit(EXIT_INTERRUPTED)


OVERRIDES_HELP = ("Hydra overrides, key=value (e.g. rollout.max_staleness=4 inference=sim); "
                  "conf=NAME picks a preset from conf/ or a YAML file.")


def _config_or_exit(overrides: list[str]):
    from rich.console import Console
    from rich.markup import escape

    from rlorch.config.compose import compose
    from rlorch.config.schema import ConfigError

    try:
        return compose(overrides)
    except ConfigError as err:
        from rlorch.lifecycle import interrupted_within

        if interrupted_within(err):
            raise KeyboardInterrupt from err
        _refuse(err)


def _refuse(err) -> NoReturn:
    """Name the key at fault on stderr and exit 2: no traceback for a config a check refused."""
    from rich.console import Console
    from rich.markup import escape

    Console(stderr=True, soft_wrap=True).print(f"[bold red]invalid config[/] [bold]{escape(err.key)}[/]: "
                                               f"{escape(str(err).split(': ', 1)[-1])}", highlight=False)
    raise typer.Exit(2)


def _checked_layout_or_exit(config):
    """The config past the checks that need more than its keys, with its processes placed (GPUs,
    colocation); a refusal names its key and exits 2."""
    from rlorch.config.schema import ConfigError
    from rlorch.config.preflight import preflight
    from rlorch.launch.placement import resolve_layout

    try:
        preflight(config)
        return resolve_layout(config)
    except ConfigError as err:
        _refuse(err)


@app.command()
def train(overrides: Optional[List[str]] = typer.Argument(None, help=OVERRIDES_HELP),
          dry_run: bool = typer.Option(False, "--dry-run", help="Print the launch plan, one JSON line per "
                                                                  "process, and start nothing.")) -> None:
    """Run an RL job: engines, trainer and the orchestrator, into a new run directory."""
    with _interruptible():
        if not dry_run:  # first: the runner's own imports take a fifth of a second
            from rlorch.launch.forkserver import warm_up_early

            warm_up_early(overrides or [])
        from rlorch.runner import run_training

        config = _config_or_exit(overrides or [])
    if dry_run:
        from rlorch.config.preflight import preflight
        from rlorch.config.schema import ConfigError
        from rlorch.launch.plan import print_plan

        try:
            preflight(config)    # the plan of a run that would be refused at its start is no plan
            print_plan(config)
        except ConfigError as err:
            _refuse(err)
        raise typer.Exit(0)
    raise typer.Exit(run_training(config, overrides=overrides or []))


@app.command()
def resume(overrides: Optional[List[str]] = typer.Argument(
        None, help="RUN_DIR or checkpoint=RUN_DIR (its newest complete checkpoint), or "
                   "RUN_DIR/checkpoints/step_N, then overrides as for train.")) -> None:
    """Continue a run from a full checkpoint: model, optimizer, data position, version, untrained rollouts."""
    from rlorch.runner import resume_training

    items = list(overrides or [])
    # A bare first argument (no '=') is the checkpoint, as `rlorch report RUN_DIR` takes its run.
    if items and "=" not in items[0]:
        items[0] = f"checkpoint={items[0]}"
    checkpoint = [o.split("=", 1)[1] for o in items if o.startswith("checkpoint=")]
    rest = [o for o in items if not o.startswith("checkpoint=")]
    if not checkpoint:
        typer.echo("resume needs RUN_DIR, checkpoint=RUN_DIR or checkpoint=RUN_DIR/checkpoints/step_N", err=True)
        raise typer.Exit(2)
    raise typer.Exit(resume_training(checkpoint[-1], rest))


SIMULATE_HELP = ("Overrides of rollout.max_staleness, rollout.batch_size, rollout.max_concurrent and sim.* only, "
                 "key=value; comma lists sweep (e.g. rollout.max_staleness=0,1,2,4 rollout.max_concurrent=640 "
                 "sim.latency=[1,6]).")


@app.command()
def simulate(
    overrides: Optional[List[str]] = typer.Argument(None, help=SIMULATE_HELP),
    json_lines: bool = typer.Option(False, "--json", help="One JSON object per run, one per line."),
    plot: Optional[str] = typer.Option(None, "--plot", help="Write the age distribution per run to this PNG."),
) -> None:
    """Sweep the real capacity gate through the discrete-tick model: observed staleness before GPU hours."""
    from rlorch.simulate import simulate_command

    raise typer.Exit(simulate_command(overrides or [], json_lines=json_lines, plot=plot))


@app.command("validate-config")
def validate_config(
    overrides: Optional[List[str]] = typer.Argument(None, help=OVERRIDES_HELP),
    show: bool = typer.Option(False, "--show", help="Print the whole resolved config as YAML."),
) -> None:
    """Compose and check a config; print the resolved summary, or name the key at fault."""
    from rich.console import Console

    from rlorch.config.preflight import run_warnings
    from rlorch.config.summary import config_summary

    from rlorch.launch.placement import colocation_note, layout_choice

    unresolved = _config_or_exit(overrides or [])
    config = _checked_layout_or_exit(unresolved)
    console = Console()
    if show:
        from omegaconf import OmegaConf

        typer.echo(OmegaConf.to_yaml(OmegaConf.structured(config)), nl=False)
    else:
        console.print(config_summary(config))
        for line in (layout_choice(unresolved, config), colocation_note(unresolved)):
            if line:
                console.print(line, highlight=False)
    for warning in run_warnings(config):
        console.print(f"[yellow]warning[/] {warning}", highlight=False)


@app.command()
def report(run_dir: str = typer.Argument(..., help="A run directory (holds metrics.jsonl).")) -> None:
    """Write a run's pictures (PNGs) and report.md into RUN_DIR/report/."""
    from pathlib import Path

    from rlorch.reporting.report import read_records, unreadable_lines, write_report
    from rlorch.rundir.layout import RunDir

    try:
        records = read_records(RunDir(Path(run_dir)))
    except FileNotFoundError as err:
        typer.echo(f"cannot report: {err}", err=True)
        raise typer.Exit(2)
    if records.unreadable:
        typer.echo(f"warning: {Path(run_dir) / 'metrics.jsonl'}: {unreadable_lines(records)}", err=True)
    typer.echo(str(write_report(RunDir(Path(run_dir)), records)))


@app.command()
def scale(run_dir: str = typer.Argument(..., help="The running run's directory."),
          setting: str = typer.Argument(..., help="inference.num_servers=N")) -> None:
    """Grow or shrink a running run's launched servers: new ones load the current weights and
    join; removed ones finish or hand on their requests, then stop."""
    from pathlib import Path

    from rlorch.launch.runlock import RunLock
    from rlorch.rundir.layout import RunDir, write_json_atomic

    key, _, value = setting.partition("=")
    if key != "inference.num_servers" or not value.isdigit() or int(value) < 1:
        typer.echo(f"cannot scale: expected inference.num_servers=N with N >= 1 (got {setting!r})", err=True)
        raise typer.Exit(2)
    run = RunDir(Path(run_dir))
    if not run.is_run:
        typer.echo(f"cannot scale: {run_dir} is not a run directory", err=True)
        raise typer.Exit(2)
    if RunLock(run.root).holder() is None:   # a request no run reads would wait for the next resume
        typer.echo(f"cannot scale: no process is running {run_dir}; to resume it at that size: "
                   f"rlorch resume {run_dir} inference.num_servers={value}", err=True)
        raise typer.Exit(2)
    write_json_atomic(run.scale_file, {"num_servers": int(value)})
    typer.echo(f"asked {run_dir} for {value} server(s) (the step records' `servers` shows the fleet)")


@app.command()
def serve(
    overrides: Optional[List[str]] = typer.Argument(None, help="model.path=DIR and other overrides."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to bind."),
    port: int = typer.Option(30000, "--port", help="Port to bind."),
    weight_version: Optional[str] = typer.Option(None, "--weight-version",
                                                 help="Version reported for the initial weights (default: a run "
                                                      "directory's step, else 0)."),
    parent_pid: Optional[int] = typer.Option(None, "--parent-pid", help="Exit when this process is gone."),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="RLORCH_API_KEY", show_envvar=True,
                                          help="Require 'Authorization: Bearer KEY' on every endpoint but /health*."),
    min_step_time: float = typer.Option(0.0, "--min-step-time",
                                        help="Seconds each decoding step takes at least: a slow server, for tests."),
    device: Optional[str] = typer.Option(None, "--device",
                                         help="cpu or cuda (default: inference.cpu.device); on cuda the model runs in "
                                              "model.dtype on the GPU."),
    tool_call_parser: Optional[str] = typer.Option(None, "--tool-call-parser",
                                                   help="How /v1/chat/completions reads tool calls: qwen25 (alias "
                                                        "hermes) or pipe (the tiny default model's); default none: "
                                                        "tools are ignored."),
) -> None:
    """Run rlorch's inference engine: a real HTTP server speaking SGLang's native API, on the CPU
    or a GPU."""
    from rlorch.serve.server import serve_command

    config = _config_or_exit(list(overrides or []) + ([f"inference.cpu.device={device}"] if device else []))
    raise typer.Exit(serve_command(config, host=host, port=port, weight_version=weight_version,
                                   parent=parent_pid, api_key=api_key, min_step_time=min_step_time,
                                   tool_call_parser=tool_call_parser))


@app.command()
def fleet(
    engines: int = typer.Option(100, "--engines", min=1, help="Simulated engines, one port each."),
    port_base: int = typer.Option(20000, "--port-base", help="The first engine's port; the rest follow (keep below the ephemeral range, 32768)."),
    processes: int = typer.Option(2, "--processes", min=1, help="Processes serving the engines between them."),
    fleet_file: Optional[str] = typer.Option(None, "--fleet-file",
                                             help="Write the engines' host:port here, one a line, once all listen."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to bind."),
    tokens_per_s: float = typer.Option(0.0, "--tokens-per-s", help="Median decode speed per sequence; 0 = instant."),
    speed_spread: float = typer.Option(0.25, "--speed-spread", help="Log-normal sigma of engine speeds."),
    stragglers: float = typer.Option(0.0, "--stragglers", help="Share of engines running 5x slower."),
    ttft: float = typer.Option(0.0, "--ttft", help="Seconds to a request's first token."),
    length_median: float = typer.Option(256.0, "--length-median", help="Median completion tokens (log-normal)."),
    length_sigma: float = typer.Option(1.0, "--length-sigma", help="Log-normal sigma of completion lengths."),
    slots: int = typer.Option(256, "--slots", min=1, help="Requests one engine runs at once; the rest queue."),
    reload_s: float = typer.Option(0.0, "--reload-s", help="Seconds a weight update takes."),
    vocab: int = typer.Option(32, "--vocab", help="Token ids are drawn below this."),
    seed: int = typer.Option(0, "--seed", help="Seed of speeds, lengths and tokens."),
    full_logprobs: bool = typer.Option(False, "--full-logprobs",
                                       help="Logprobs written as SGLang writes them (a float32's value in full, "
                                            "some 20 characters), not to 4 decimals."),
) -> None:
    """Serve many simulated engines behind SGLang's native HTTP API (for scale benchmarks)."""
    from pathlib import Path

    from rlorch.serve.fleet import FleetProfile, serve_fleet

    profile = FleetProfile(tokens_per_s=tokens_per_s, speed_spread=speed_spread, stragglers=stragglers, ttft=ttft,
                           length_median=length_median, length_sigma=length_sigma, slots=slots, reload_s=reload_s,
                           vocab=vocab, seed=seed, full_logprobs=full_logprobs)
    serve_fleet(engines, port_base, processes=processes, profile=profile, host=host,
                fleet_file=Path(fleet_file) if fleet_file else None)


def main() -> None:
    # Registered before anything a command registers, so it runs after all of their exit handlers.
    atexit.register(_exit_with_the_status_chosen)
    try:
        app()
    except SystemExit as done:
        from rlorch.lifecycle import interrupted_within

        if isinstance(done.code, int) and (done.code == EXIT_INTERRUPTED or interrupted_within(done)):
            _status_after_an_interrupt.append(done.code)
        raise


_status_after_an_interrupt: list[int] = []


def _exit_with_the_status_chosen() -> None:
    """Keep the status a command chose after a Ctrl-C (130, or any it chose handling one). CPython marks a
    KeyboardInterrupt that passed through ``exec`` of source text as unhandled for the whole
    process, even once caught, and then ends the process by SIGINT instead (status -2 to a
    parent). Dataclasses build their methods that way at import, so a Ctrl-C early in start-up
    often lands there. The last exit handler, this leaves by ``os._exit`` with the chosen status."""
    if _status_after_an_interrupt:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_status_after_an_interrupt[0])


if __name__ == "__main__":
    main()
