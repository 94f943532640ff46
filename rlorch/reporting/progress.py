"""What an operator sees while a run runs and when it ends, on stderr.

- Start-up phases are announced as they begin and timed as they end ("starting 2 cpu engines…",
  "engines ready in 6.1 s"); the timings go into ``summary.json`` as ``startup_phases``.
- During the loop, a view of the metrics records (it is one of the metrics loop's loggers): in a
  terminal a live display that stays on screen when the run ends; elsewhere (nohup, a batch job,
  CI) one plain line every ``run.log_every`` steps with the same fields.
- At the end, the report: reward and eval accuracy first -> last, head age, throughput and
  where the time went.

Child processes (engines, trainer) write their own output, progress bars included, to ``logs/``.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Optional

from rich.console import Console

TRUNCATED_WARN = 0.2
"""Above this share of completions cut by the length limit (``truncated_share`` in the step
records and summary) the live line, the plain line and the end report say so, naming
``rollout.max_new_tokens``: the reward then measures the limit more than the task."""


class Phases:
    """Start-up phases: announced, timed, kept for the summary."""

    def __init__(self, console: Console):
        self.console = console
        self.timings: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str, starting: str, ready: str) -> Iterator[None]:
        self.console.print(f"{starting}…", highlight=False)
        started = time.monotonic()
        yield
        self.timings[name] = round(time.monotonic() - started, 2)
        self.console.print(f"{ready} in {self.timings[name]:.1f} s", highlight=False)


class RunView:
    """The fields shown during a run, folded from the metrics records as they are written."""

    def __init__(self, total_steps: int):
        self.total_steps = total_steps
        self.step: Optional[dict] = None
        self.eval: Optional[dict] = None
        self.gauges: dict = {}
        self.start_time: Optional[float] = None
        self.first_step = 0
        self.rollouts = 0
        self.tokens = 0
        self.scale_pending: Optional[dict] = None

    def log(self, record: dict) -> None:
        kind = record.get("kind")
        if kind == "start":
            self.start_time = record["time"]
            self.first_step = record.get("version") or 0
        elif kind == "step":
            self.step = record
            self.rollouts += record.get("rollouts") or 0
            self.tokens += record.get("tokens") or 0
            self.gauges.update({k: record[k] for k in ("in_flight", "out_queue") if k in record})
            self.scale_pending = record.get("scale_pending")
        elif kind == "eval" and record.get("accuracy") is not None:
            self.eval = record
        elif kind == "periodic":
            self.gauges.update({k: record[k] for k in ("in_flight", "out_queue") if k in record})
            if "engines_scale_pending" in record:  # renewed between steps: a slow step hides nothing
                self.scale_pending = record["engines_scale_pending"]

    def fields(self, now: Optional[float] = None) -> dict[str, str]:
        """Name -> text, the same for the live display and the plain lines."""
        step, evaluated = self.step or {}, self.eval
        elapsed = (now if now is not None else step.get("time", 0.0)) - (self.start_time or 0.0)
        rate = (lambda count: f"{count / elapsed:.1f}") if elapsed > 0 else (lambda count: "-")
        fallbacks = step.get("transfer_fallbacks")
        return {
            "step": f"{step.get('step', self.first_step)}/{self.total_steps}",
            "reward": _num(step.get("reward_mean"), ".3f"),
            "eval_acc": f"{evaluated['accuracy']:.1%}@{evaluated['step']}" if evaluated else "-",
            "age_max": _num(step.get("age_max"), "d"),
            "age_p99": _num(step.get("age_p99"), ".1f"),
            "rollouts/s": rate(self.rollouts),
            "tokens/s": rate(self.tokens),
            "in_flight": _num(self.gauges.get("in_flight"), "d"),
            "queue": _num(self.gauges.get("out_queue"), "d"),
            # Only when many completions hit the length limit: the reward then measures the limit.
            **({"truncated": f"{step['truncated_share']:.0%}@rollout.max_new_tokens"}
               if (step.get("truncated_share") or 0) > TRUNCATED_WARN else {}),
            # Only when weights asked to travel over the process group went by disk instead.
            **({"by_disk": str(fallbacks)} if fallbacks else {}),
            # Only while some server is out of rotation: up/suspect/dead.
            **({"servers": f"{step['servers_up']}/{step.get('servers_suspect', 0)}/{step.get('servers_dead', 0)}"}
               if step.get("servers_suspect") or step.get("servers_dead") else {}),
            # Only while an `rlorch scale` request is not met: servers now/requested@seconds waited.
            **({"scale_pending": scale_text(self.scale_pending)} if self.scale_pending else {}),
        }


def scale_text(pending: dict) -> str:
    """A scale request not yet met, for the live line: ``1/3@25s`` (servers now, requested,
    seconds waited)."""
    return f"{pending['servers']}/{pending['requested']}@{pending['waiting_s']:.0f}s"


def _num(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def line(fields: dict[str, str]) -> str:
    return " ".join(f"{key}={value}" for key, value in fields.items())


class PlainProgress:
    """One line every ``every`` steps (and at the last step) for logs that are not a terminal."""

    def __init__(self, console: Console, *, total_steps: int, every: int):
        self.console, self.every = console, every
        self.view = RunView(total_steps)

    def log(self, record: dict) -> None:
        self.view.log(record)
        if record.get("kind") == "step" and (record["step"] % self.every == 0
                                             or record["step"] == self.view.total_steps):
            self.console.print(line(self.view.fields()), highlight=False, markup=False, soft_wrap=True)

    def close(self) -> None:
        pass


class LiveProgress:
    """A rich live display in a terminal; its last state stays on screen when the run ends."""

    def __init__(self, console: Console, *, total_steps: int):
        from rich.live import Live

        self.view = RunView(total_steps)
        self._started = time.monotonic()
        self._console = console
        self._live = Live(console=console, refresh_per_second=4, transient=False,
                          get_renderable=self._render)
        self._live.start()

    def _render(self):
        now = None
        if self.view.start_time is not None and self.view.step is None:
            now = self.view.start_time + time.monotonic() - self._started
        return live_tables(self.view.fields(now), self._console.width)

    def log(self, record: dict) -> None:
        if record.get("kind") == "start":
            self._started = time.monotonic()
        self.view.log(record)

    def close(self) -> None:
        """Stop refreshing, leaving the last state on screen (a second call does nothing)."""
        self._live.stop()


def live_tables(fields: dict[str, str], width: int):
    """The live view's fields as header-over-value columns, as many tables as it takes for each to
    fit ``width``: a narrow terminal gets two rows of columns rather than cut names and values."""
    from rich.console import Group
    from rich.table import Table

    rows: list[list[str]] = [[]]
    used = 0
    for key, value in fields.items():
        column = max(len(key), len(value)) + 4   # the padding: 2 on each side
        if rows[-1] and used + column > width:
            rows.append([])
            used = 0
        rows[-1].append(key)
        used += column
    tables = []
    for keys in rows:
        table = Table(box=None, padding=(0, 2), show_edge=False)
        for key in keys:
            table.add_column(key, justify="right", style="bold" if key == "step" else None, no_wrap=True)
        table.add_row(*(fields[key] for key in keys))
        tables.append(table)
    return Group(*tables)


def progress_logger(config: Any, console: Console) -> Optional[Any]:
    """The view for this console: live in a terminal, plain lines elsewhere, none when
    ``run.progress`` is off."""
    if not config.run.progress:
        return None
    if console.is_terminal:
        return LiveProgress(console, total_steps=config.train.steps)
    return PlainProgress(console, total_steps=config.train.steps, every=config.run.log_every)


def _pct(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.1%}"


def report_lines(summary: dict, phases: Optional[dict] = None) -> list[str]:
    """The end-of-run report, one fact per line (``summary.json`` holds every figure)."""
    s = summary
    startup = f"start-up {s['startup_s']:.1f} s" if s.get("startup_s") is not None else "start-up -"
    if phases:
        startup += " (" + ", ".join(f"{name} {seconds:.1f} s" for name, seconds in phases.items()) + ")"
    lines = [
        f"reward      {_num(s.get('reward_mean_first'), '.3f')} -> {_num(s.get('reward_mean_last'), '.3f')}"
        " (batch mean, first -> last step)",
        f"eval acc    {_pct(s.get('eval_accuracy_first'))} (step {_num(s.get('eval_step_first'), 'd')}) -> "
        f"{_pct(s.get('eval_accuracy_last'))} (step {_num(s.get('eval_step_last'), 'd')})",
        f"head age    max {_num(s.get('age_max'), 'd')}  p99 {_num(s.get('age_p99'), '.1f')}  "
        f"mean {_num(s.get('age_mean'), '.2f')} (policy versions, trained rollouts)",
        f"throughput  {_num(s.get('rollouts_per_s'), '.1f')} rollouts/s  {_num(s.get('tokens_per_s'), '.1f')} "
        "tokens/s (trained, over the loop)",
        f"time        {startup}; loop {_num(s.get('loop_s'), '.1f')} s: trainer waited for a batch "
        f"{_pct(s.get('trainer_idle'))}, engines paused or idle {_pct(s.get('engine_idle'))}",
        f"rollouts    admitted {s['admitted']} trained {s['trained']} filtered {s['filtered']} "
        f"dropped_stale {s['dropped_stale']} untrained {s['persisted_untrained']} lost {s['lost']}",
    ]
    if s.get("status") == "converged" and s.get("reason"):  # why it ended before train.steps
        lines.append(f"converged   {s['reason']}")
    if s.get("servers_suspect") or s.get("servers_dead") or s.get("server_restarts") or s.get("servers_slow"):
        lines.append(f"servers     {s.get('servers_up')} up, {s.get('servers_suspect')} suspect, {s.get('servers_dead')} "
                     f"dead, {s.get('server_restarts')} restarted after hanging, {s.get('servers_suspect_s')} s suspect in all; "
                     "tokens/s per server p10/p50/p90 "
                     f"{s.get('server_tokens_per_s_p10')}/{s.get('server_tokens_per_s_p50')}/"
                     f"{s.get('server_tokens_per_s_p90')}, {s.get('servers_slow')} slow (slowest "
                     f"{s.get('server_slowest')})")
    if s.get("scale_dropped") or s.get("scale_pending"):
        lines.append(scale_report(s))
    if s.get("agent_episodes") is not None:
        lines.append(agents_line(s))
    if (s.get("truncated_share") or 0) > TRUNCATED_WARN:
        lines.append(f"truncated   {s['truncated_share']:.0%} of trained completions ended at the length limit, "
                     "rollout.max_new_tokens: raise it if answers need more tokens")
    if s.get("transfer_fallbacks"):
        loaded = f" of {s['reloads']} loaded" if s.get("reloads") is not None else ""
        lines.append(f"weights     {s['transfer_fallbacks']}{loaded} version(s) went by disk although "
                     "inference.weight_transfer=distributed (see logs/trainer.log for why)")
    return lines


def agents_line(s: dict) -> str:
    """The end report's line on an agent task's episodes, with the last error of a failed one."""
    line = (f"agents      {s['agent_episodes']} episodes, {s.get('agent_calls')} calls, "
            f"{s.get('agent_failures')} failed, {s.get('agent_forks_total')} forked")
    if s.get("agent_failures") and s.get("agent_errors"):
        line += f"; last error: {s['agent_errors'][-1]}"
    return line


def scale_report(s: dict) -> str:
    """The end report's line on ``rlorch scale`` requests that were not met."""
    parts = []
    if s.get("scale_dropped"):
        parts.append(f"{s['scale_dropped']} request(s) dropped, a server not placed within run.placement_timeout "
                     "(the warning names each)")
    if pending := s.get("scale_pending"):
        parts.append(f"inference.num_servers={pending['requested']} still pending at the end after "
                     f"{pending['waiting_s']:.0f} s with {pending['servers']} server(s), waiting for "
                     f"{pending['waiting_for'] or 'a server to start'}")
    return "scale       " + "; ".join(parts)


def print_report(console: Console, summary: dict, *, summary_path: Any, report_path: Any = None,
                 phases: Optional[dict] = None) -> None:
    status = summary["status"]
    style = {"completed": "green", "converged": "green", "interrupted": "yellow"}.get(status, "red")
    console.print(f"[bold {style}]{status}[/] steps={summary['steps']} wall={summary['wall_s']}s "
                  f"-> {summary_path}", highlight=False)
    if summary.get("steps"):
        for text in report_lines(summary, phases):
            console.print(f"  {text}", highlight=False, markup=False, soft_wrap=True)
    elif summary.get("admitted"):  # the figures of a report would all be dashes
        console.print(f"  {status} before the first step: nothing was trained ({summary['admitted']} rollouts "
                      f"admitted)", highlight=False, markup=False)
        if summary.get("agent_episodes") is not None:
            console.print(f"  {agents_line(summary)}", highlight=False, markup=False, soft_wrap=True)
    else:
        console.print(f"  {status} in start-up: nothing was admitted or trained", highlight=False, markup=False)
    if report_path is not None:
        console.print(f"  report      {report_path}", highlight=False, markup=False, soft_wrap=True)
    if summary.get("error"):
        console.print(f"[bold red]error[/] {summary['error']}", highlight=False)
    if status in ("interrupted", "failed"):
        console.print(f"  next        {next_command(summary, Path(summary_path).parent)}", highlight=False,
                      markup=False, soft_wrap=True)


def next_command(summary: dict, run_dir: Path) -> str:
    """The exact command that continues an interrupted or failed run, or starts it again."""
    if summary.get("checkpoint"):
        return f"rlorch resume {run_dir}"
    return (f"nothing was checkpointed; start again with: rlorch train run.dir={run_dir} (and your overrides; "
            "what the run wrote moves aside inside it)")
