"""``rlorch report RUN_DIR``: pictures of a run and a ``report.md``, from its run directory alone.

Everything is read from ``metrics.jsonl`` and ``summary.json``; the files go into
``RUN_DIR/report/``, every PNG ``WIDTH`` x ``HEIGHT`` pixels. Times are seconds on the metrics
loop's clock; a resumed run's lives are laid end to end.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from rlorch.rundir.layout import RunDir

FIGSIZE = (10.0, 4.0)
DPI = 100
WIDTH, HEIGHT = int(FIGSIZE[0] * DPI), int(FIGSIZE[1] * DPI)
IMAGES = {
    "reward_accuracy.png": "Reward (batch mean) and held-out eval accuracy, against step and wall time",
    "age_heatmap.png": "Head age of the trained rollouts per step (share of the batch at each age)",
    "flow.png": "Admissions per step; rollouts in flight and finished rollouts queued, over time",
    "reload.png": "Weight reload latency per version",
    "idle.png": "Trainer waiting for a batch and engines paused or idle, per step",
}
SUMMARY_ROWS = (
    ("status", "status"), ("steps", "steps"), ("reward first -> last", ("reward_mean_first", "reward_mean_last")),
    ("eval accuracy first -> last", ("eval_accuracy_first", "eval_accuracy_last")),
    ("head age max / p99 / mean", ("age_max", "age_p99", "age_mean")),
    ("rollouts/s, tokens/s (trained, loop)", ("rollouts_per_s", "tokens_per_s")),
    ("start-up s / loop s / wall s", ("startup_s", "loop_s", "wall_s")),
    ("trainer idle / engine idle (share of loop)", ("trainer_idle", "engine_idle")),
    ("admitted / trained / filtered / dropped stale / lost", ("admitted", "trained", "filtered", "dropped_stale", "lost")),
)


@dataclass
class RunRecords:
    steps: list[dict] = field(default_factory=list)
    evals: list[dict] = field(default_factory=list)
    periodic: list[dict] = field(default_factory=list)
    summary: dict = field(default_factory=dict)
    lives: int = 0
    """Starts of the run: 1, plus one per resume."""
    unreadable: list[int] = field(default_factory=list)
    """Line numbers (1-based) of ``metrics.jsonl`` that are not JSON objects: skipped, and named
    in the report (a torn line a crash left, or a hand edit)."""


def read_records(run_dir: RunDir) -> RunRecords:
    """The records of every life of the run, with ``time`` made monotonic across resumes."""
    records = RunRecords()
    offset, last = 0.0, 0.0
    if not run_dir.metrics.is_file():
        raise FileNotFoundError(f"{run_dir.metrics}: not a run directory (no metrics.jsonl)")
    for number, text in enumerate(run_dir.metrics.read_text().splitlines(), start=1):
        if not text.strip():
            continue
        try:
            record = json.loads(text)
        except ValueError:
            record = None
        if not isinstance(record, dict):
            records.unreadable.append(number)
            continue
        if record.get("kind") == "start":
            offset = last
            records.lives += 1
        record["time"] = record.get("time", 0.0) + offset
        last = record["time"]
        target = {"step": records.steps, "eval": records.evals, "periodic": records.periodic}.get(record.get("kind"))
        if target is not None:
            target.append(record)
    if run_dir.summary.is_file():
        records.summary = json.loads(run_dir.summary.read_text())
    return records


def _figure(columns: int = 1):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, columns, figsize=FIGSIZE, dpi=DPI, squeeze=False)
    fig.subplots_adjust(left=0.08, right=0.93, bottom=0.13, top=0.91, wspace=0.42)
    return fig, list(axes[0])


def _save(fig, path: Path) -> None:
    """Fixed margins rather than a layout engine: every image is the same size, and measuring
    the text to lay it out would double the time a report takes."""
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=DPI)
    plt.close(fig)


def _series(records: list[dict], x: str, y: str) -> tuple[list, list]:
    pairs = [(r[x], r[y]) for r in records if r.get(x) is not None and r.get(y) is not None]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def _smooth(values: list[float]) -> list[float]:
    """A centred rolling mean over about a fiftieth of the run (at least one step)."""
    import numpy as np

    if not values:
        return []
    window = max(1, len(values) // 50)
    kernel = np.ones(window) / window
    padded = np.pad(np.asarray(values, dtype=float), (window // 2, window - 1 - window // 2), mode="edge")
    return np.convolve(padded, kernel, mode="valid").tolist()


def _empty(ax, text: str = "no data") -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="grey")


def plot_reward_accuracy(records: RunRecords, path: Path) -> None:
    fig, axes = _figure(2)
    for ax, x, label in ((axes[0], "step", "training step"), (axes[1], "time", "wall seconds")):
        xs, ys = _series(records.steps, x, "reward_mean")
        ax.plot(xs, ys, color="tab:blue", linewidth=1.2, label="reward (batch mean)")
        ax.set_xlabel(label)
        ax.set_ylabel("reward", color="tab:blue")
        twin = ax.twinx()
        ex, ey = _series(records.evals, x, "accuracy")
        twin.plot(ex, ey, color="tab:orange", marker="o", markersize=3, linewidth=1.2, label="eval accuracy")
        twin.set_ylim(-0.02, 1.02)
        twin.set_ylabel("eval accuracy", color="tab:orange")
        ax.grid(alpha=0.3)
        if not xs and not ex:
            _empty(ax)
    axes[0].set_title("against step", fontsize=10)
    axes[1].set_title("against wall time", fontsize=10)
    _save(fig, path)


def plot_age_heatmap(records: RunRecords, path: Path) -> None:
    import numpy as np

    fig, (ax,) = _figure(1)
    rows = [r for r in records.steps if r.get("age_counts")]
    if not rows:
        _empty(ax, "no age counts in the step records")
    else:
        top = max(len(r["age_counts"]) for r in rows)
        grid = np.zeros((top, len(rows)))
        for column, record in enumerate(rows):
            counts = np.asarray(record["age_counts"], dtype=float)
            grid[:len(counts), column] = counts / max(counts.sum(), 1.0)
        steps = [r["step"] for r in rows]
        image = ax.imshow(grid, aspect="auto", origin="lower", cmap="viridis", vmin=0, vmax=1,
                          extent=(steps[0] - 0.5, steps[-1] + 0.5, -0.5, top - 0.5), interpolation="nearest")
        fig.colorbar(image, ax=ax, label="share of the batch")
        ax.set_yticks(range(top))
    ax.set_xlabel("training step")
    ax.set_ylabel("head age (policy versions)")
    ax.set_title("Head age of trained rollouts per step", fontsize=10)
    _save(fig, path)


def plot_flow(records: RunRecords, path: Path) -> None:
    _save(flow_figure(records), path)


def flow_figure(records: RunRecords):
    fig, axes = _figure(2)
    xs, ys = _series(records.steps, "step", "admitted")
    axes[0].fill_between(xs, ys, step="mid", color="tab:green", alpha=0.35, linewidth=0)
    axes[0].plot(xs, _smooth(ys), color="tab:green", linewidth=1.4, label="rolling mean")
    axes[0].set_xlabel("training step")
    axes[0].set_ylabel("rollouts admitted")
    axes[0].set_title("Admissions per step", fontsize=10)
    timeline = sorted(records.periodic + records.steps, key=lambda r: r["time"])
    highest = 0
    for key, color, label in (("in_flight", "tab:blue", "in flight"),
                              ("out_queue", "tab:red", "finished, waiting for a batch")):
        tx, ty = _series(timeline, "time", key)
        axes[1].plot(tx, ty, color=color, linewidth=1.1, drawstyle="steps-post", label=label)
        highest = max([highest, *ty])
    axes[1].set_xlabel("wall seconds")
    axes[1].set_ylabel("rollouts")
    axes[1].set_title("In flight and queue depth", fontsize=10)
    # Headroom above the data holds the legend: in flight sits at C for most of a run, right
    # where a legend placed by "best" would go.
    axes[1].set_ylim(0, max(highest, 1) * 1.45)
    axes[1].legend(fontsize=8, loc="upper left", ncol=2, frameon=False)
    for ax in axes:
        ax.grid(alpha=0.3)
    if not xs:
        _empty(axes[0])
    return fig


def plot_reload(records: RunRecords, path: Path) -> None:
    fig, (ax,) = _figure(1)
    xs, ys = _series(records.steps, "version", "reload_s")
    ax.plot(xs, [1000 * y for y in ys], marker=".", linewidth=0.8, color="tab:purple")
    if not xs:
        _empty(ax)
    ax.set_ylim(bottom=0)
    ax.set_xlabel("policy version")
    ax.set_ylabel("milliseconds")
    ax.set_title("Weight reload latency (newest version found -> live in every engine)", fontsize=10)
    ax.grid(alpha=0.3)
    _save(fig, path)


def plot_idle(records: RunRecords, path: Path) -> None:
    fig, (ax,) = _figure(1)
    for key, label, color in (("trainer_idle", "trainer waiting for a batch", "tab:blue"),
                              ("engine_idle", "engines paused or idle", "tab:red")):
        xs, ys = _series(records.steps, "step", key)
        ax.plot(xs, ys, linewidth=0.6, color=color, alpha=0.3)
        ax.plot(xs, _smooth(ys), linewidth=1.6, color=color, label=f"{label} (rolling mean)")
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("training step")
    ax.set_ylabel("share of the step's wall time")
    ax.set_title("Where the time went", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    _save(fig, path)


PLOTS = {"reward_accuracy.png": plot_reward_accuracy, "age_heatmap.png": plot_age_heatmap,
         "flow.png": plot_flow, "reload.png": plot_reload, "idle.png": plot_idle}


PER_LIFE = ("rollouts/s, tokens/s (trained, loop)", "start-up s / loop s / wall s",
            "trainer idle / engine idle (share of loop)")
"""Rows whose figures are of the last life of a resumed run (the summary's own)."""
PERCENT = ("eval_accuracy_first", "eval_accuracy_last", "trainer_idle", "engine_idle")
"""Shares, written as percentages."""


def _cell(summary: dict, keys: Any) -> str:
    keys = keys if isinstance(keys, tuple) else (keys,)
    separator = " -> " if len(keys) == 2 and keys[0].endswith("_first") else " / "
    return separator.join(_format(summary.get(key), percent=key in PERCENT) for key in keys)


def _format(value: Optional[Any], percent: bool = False) -> str:
    if value is None:
        return "-"
    if percent:
        return f"{value:.1%}"
    if isinstance(value, float):
        # Four significant figures, never in exponent form for a rate in the thousands.
        return f"{value:,.0f}" if abs(value) >= 999.95 else f"{value:.4g}"
    return f"{value:,}" if isinstance(value, int) and not isinstance(value, bool) else str(value)


def whole_run(records: RunRecords) -> dict:
    """The summary with the figures that ``summary.json`` keeps per life of the run (it is
    rewritten by each resume) taken from every life's records instead, as the plots are: reward
    and eval accuracy first -> last, the head-age statistics and the step count."""
    import numpy as np

    summary = dict(records.summary)
    steps = [r for r in records.steps if r.get("reward_mean") is not None]
    if steps:
        summary["reward_mean_first"], summary["reward_mean_last"] = steps[0]["reward_mean"], steps[-1]["reward_mean"]
        summary["steps"] = max(r["step"] for r in records.steps)
    evals = [r for r in records.evals if r.get("accuracy") is not None]
    if evals:
        first, last = min(evals, key=lambda r: r["step"]), max(evals, key=lambda r: r["step"])
        summary["eval_accuracy_first"], summary["eval_accuracy_last"] = first["accuracy"], last["accuracy"]
    counts = [r["age_counts"] for r in records.steps if r.get("age_counts")]
    if counts:
        total = np.zeros(max(len(c) for c in counts))
        for c in counts:
            total[:len(c)] += c
        ages = np.repeat(np.arange(len(total)), total.astype(int))
        summary["age_max"] = int(ages.max())
        summary["age_p99"] = float(np.percentile(ages, 99))
        summary["age_mean"] = round(float(ages.mean()), 4)
    return summary


def markdown(records: RunRecords, run_dir: RunDir) -> str:
    summary = whole_run(records)
    lines = [f"# Run report: {run_dir.root.name}", "", "| | |", "|---|---|"]
    for label, keys in SUMMARY_ROWS:
        if records.lives > 1 and label in PER_LIFE:
            label += f" (last of {records.lives} lives)"
        lines.append(f"| {label} | {_cell(summary, keys)} |")
    if records.summary.get("reason"):
        lines.append(f"| stop reason | {records.summary['reason']} |")
    if records.unreadable:
        lines.append(f"| lines of metrics.jsonl not read | {unreadable_lines(records)} |")
    if summary.get("agent_episodes") is not None:
        lines.append(f"| agent episodes / calls / failed / forked | "
                     f"{_cell(summary, ('agent_episodes', 'agent_calls', 'agent_failures', 'agent_forks_total'))} |")
    lines.append("")
    for name, caption in IMAGES.items():
        lines += [f"## {caption}", "", f"![{caption}]({name})", ""]
    return "\n".join(lines)


def unreadable_lines(records: RunRecords) -> str:
    shown = ", ".join(map(str, records.unreadable[:5])) + (", ..." if len(records.unreadable) > 5 else "")
    return f"{len(records.unreadable)} (line {shown}: not JSON objects, skipped)"


def write_report(run_dir: RunDir, records: Optional[RunRecords] = None) -> Path:
    """Write the PNGs and ``report.md`` into ``RUN_DIR/report/``; return the markdown's path."""
    records = read_records(run_dir) if records is None else records
    out = run_dir.root / "report"
    out.mkdir(exist_ok=True)
    for name, plot in PLOTS.items():
        plot(records, out / name)
    target = out / "report.md"
    target.write_text(markdown(records, run_dir))
    return target
