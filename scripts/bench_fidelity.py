"""Does asynchrony cost accuracy? Sync (S=0) against async S x correction on the default task.

Every configuration trains on at most the same number of samples (train.steps x B; a run stops
early once it converges) from the same seeds; each run is a separate `rlorch train` process.
Prints one row per configuration: final held-out accuracy (mean +- sd over seeds), held-out
accuracy at equal samples (at the first configuration's mean samples to 80%; a run that converged
before that point counts its last evaluation), samples to 50% and 80% accuracy (mean over the
seeds that got there, with how many did), loop wall time and its ratio to the first; writes a PNG
of accuracy against samples and against wall seconds. `none` and `recompute` run off-policy only
with trainer.allow_uncorrected, which the grid sets for them.

`--families` adds one learning check per trainer option family, each at the default staleness
and correction: dr_grpo, rloo, cosine (with warm-up), kl (trainer.kl_coef > 0), bf16
(model.dtype=bfloat16) and lora (adapters, with their own learning rate); dr_grpo and rloo
run with the entropy bonus scaled down with their unscaled advantages. `--staleness ""` leaves
the async grid out; `--no-sync` leaves the sync run out (the default run is then the reference
of the wall-time column); `--jobs N` runs N trainings at a time (their loop times then include
the contention; accuracies do not depend on it).

`--first-seed N` starts the seeds at N (to add seeds to an earlier invocation's); `--tabulate DIR`
trains nothing and reports the runs that `--keep DIR` kept, the seeds of several invocations
together.

Usage: python scripts/bench_fidelity.py [--seeds 3] [--staleness 1,2,4]
       [--corrections decoupled,tis,none,recompute] [--families dr_grpo,rloo,cosine,kl,bf16,lora]
       [--no-sync] [--jobs 1] [--plot outputs/fidelity.png] [--keep DIR] [key=value ...]
       python scripts/bench_fidelity.py --tabulate DIR [--plot FILE.png]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Run:
    name: str
    seed: int
    batch_size: int
    evals: list[tuple[int, float, float]] = field(default_factory=list)
    """(step, accuracy, seconds since the loop started) per evaluation."""
    loop_s: float = 0.0
    status: str = ""

    def final(self) -> float:
        return self.evals[-1][1]

    def samples_to(self, accuracy: float) -> int | None:
        return next((step * self.batch_size for step, acc, _ in self.evals if acc >= accuracy), None)

    def accuracy_at(self, samples: float) -> float:
        """Held-out accuracy of the last evaluation at or before ``samples`` trained samples (a
        run that stopped earlier, converged, keeps its last)."""
        return ([acc for step, acc, _ in self.evals if step * self.batch_size <= samples] or [0.0])[-1]


def run_dir_name(name: str, seed: int) -> str:
    return f"{name.replace(' ', '_').replace('=', '')}-seed{seed}"


def train(root: Path, name: str, seed: int, overrides: list[str]) -> Run:
    run_dir = root / run_dir_name(name, seed)
    command = [sys.executable, "-m", "rlorch.cli", "train", f"run.dir={run_dir}", f"run.seed={seed}",
               "run.progress=false", *overrides]
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    if not (run_dir / "summary.json").exists():
        raise SystemExit(f"{name} seed {seed} failed before writing a summary:\n{done.stderr[-2000:]}")
    return load(run_dir, name, seed)


def load(run_dir: Path, name: str, seed: int) -> Run:
    """A finished run's evaluations, status and loop time, read from its run directory."""
    summary = json.loads((run_dir / "summary.json").read_text())
    config = (run_dir / "config.yaml").read_text()
    batch_size = int(next(line.split(":")[1] for line in config.splitlines() if line.strip().startswith("batch_size:")))
    run = Run(name, seed, batch_size, loop_s=summary["loop_s"], status=summary["status"])
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record["kind"] == "eval" and record["accuracy"] is not None:
            run.evals.append((record["step"], record["accuracy"], record["time"]))
    run.evals.sort()
    if not run.evals:
        raise SystemExit(f"{name} seed {seed}: no eval records in {run_dir}")
    return run


FAMILIES = {
    # Their advantages are not divided by the group's std (0.1-0.2 on this task's partial
    # credit): the entropy bonus is scaled down with them to keep the default's balance.
    "dr_grpo": ["trainer.advantage=dr_grpo", "trainer.entropy_coef=0.01"],
    "rloo": ["trainer.advantage=rloo", "trainer.entropy_coef=0.01"],
    "cosine": ["trainer.lr_schedule=cosine", "trainer.warmup_steps=20", "trainer.min_lr_ratio=0.1"],
    "kl": ["trainer.kl_coef=0.05"],
    "bf16": ["model.dtype=bfloat16"],
    # The tiny model is random: its tied embedding and norms train in full beside the adapters.
    "lora": ["model.lora.rank=64", "model.lora.alpha=64", "model.lora.modules_to_save=[embed_tokens,norm]",
             "trainer.lr=2e-3"],
}
"""One learning check per trainer option family, on top of the default run."""


def configurations(staleness: list[int], corrections: list[str], families: list[str] = (),
                   sync: bool = True) -> dict[str, list[str]]:
    configs = {"sync S=0": ["conf=sync"]} if sync else {}
    if families:  # the families' baseline: the default run, every option at its default
        configs["default"] = []
    configs.update({f"family {name}": FAMILIES[name] for name in families})
    for s in staleness:
        for correction in corrections:
            extra = ["trainer.allow_uncorrected=true"] if correction in ("none", "recompute") else []
            configs[f"S={s} {correction}"] = [f"rollout.max_staleness={s}", f"trainer.correction={correction}",
                                              *extra]
    return configs


def _mean_sd(values: list[float]) -> str:
    if not values:
        return "-"
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.3f} +- {sd:.3f}"


def _reached(runs: list[Run], accuracy: float) -> str:
    hits = [n for n in (r.samples_to(accuracy) for r in runs) if n is not None]
    return f"{statistics.mean(hits):8.0f} ({len(hits)}/{len(runs)})" if hits else f"{'never':>8s} (0/{len(runs)})"


def equal_samples_point(runs: list[Run]) -> float:
    """Where the configurations are compared at equal samples: the reference's mean samples to
    80% (every run there has trained as much data), or its mean final sample count if no
    reference run got to 80%."""
    reached = [n for n in (r.samples_to(0.8) for r in runs) if n is not None]
    return statistics.mean(reached) if reached else statistics.mean(r.evals[-1][0] * r.batch_size for r in runs)


def report(results: dict[str, list[Run]]) -> None:
    """One row per configuration; wall time, and the equal-samples column, are relative to the
    first configuration (sync, or the default run)."""
    reference = next(iter(results))
    reference_wall = statistics.mean(r.loop_s for r in results[reference])
    at = equal_samples_point(results[reference])
    at_header = f"acc at {at / 1000:.1f}k"
    print(f"\n{'config':16s} {'final accuracy':>16s} {at_header:>16s} {'samples to 50%':>18s} "
          f"{'samples to 80%':>18s} {'loop s':>8s} {'vs ' + reference.split()[0]:>8s}  status")
    for name, runs in results.items():
        wall = statistics.mean(r.loop_s for r in runs)
        statuses = ",".join(sorted({r.status for r in runs}))
        print(f"{name:16s} {_mean_sd([r.final() for r in runs]):>16s} {_mean_sd([r.accuracy_at(at) for r in runs]):>16s} "
              f"{_reached(runs, 0.5):>18s} {_reached(runs, 0.8):>18s} {wall:8.1f} {wall / reference_wall:8.2f}  {statuses}")


LINE_STYLES = {"sync": "-", "none": "--", "tis": ":", "recompute": (0, (5, 1, 1, 1, 1, 1))}
"""Line style by the word in a configuration's name; decoupled and the families are dash-dotted."""


def plot(results: dict[str, list[Run]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (by_samples, by_wall) = plt.subplots(1, 2, figsize=(13, 5))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for index, (name, runs) in enumerate(results.items()):
        colour = colours[index % len(colours)]
        style = next((style for word, style in LINE_STYLES.items() if word in name), "-.")
        for n, run in enumerate(runs):
            label = name if n == 0 else None
            width = 2.5 if name.startswith("sync") else 1.3
            by_samples.plot([s * run.batch_size for s, _, _ in run.evals], [a for _, a, _ in run.evals],
                            linestyle=style, color=colour, label=label, linewidth=width, alpha=0.8)
            by_wall.plot([t for _, _, t in run.evals], [a for _, a, _ in run.evals],
                         linestyle=style, color=colour, label=label, linewidth=width, alpha=0.8)
    by_samples.set(xlabel="training samples", ylabel="held-out exact-match accuracy (greedy)",
                   title="accuracy vs samples")
    by_wall.set(xlabel="loop wall seconds", ylabel="held-out exact-match accuracy (greedy)",
                title="accuracy vs wall time")
    for axis in (by_samples, by_wall):
        axis.grid(alpha=0.3)
        axis.set_ylim(-0.02, 1.02)
    by_samples.legend(fontsize=8, loc="upper left")
    figure.suptitle("rlorch fidelity: sync vs async (one line per seed)")
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def tabulated(root: Path) -> dict[str, list[Run]]:
    """The runs kept under ``root`` by ``--keep``, one configuration per run-directory prefix,
    sync first (the reference of the relative columns)."""
    results: dict[str, list[Run]] = {}
    for run_dir in sorted(root.glob("*-seed*"), key=lambda path: (not path.name.startswith("sync"), path.name)):
        prefix, _, seed = run_dir.name.rpartition("-seed")
        if (run_dir / "summary.json").exists() and seed.isdigit():
            name = re.sub(r"\bS(\d+)\b", r"S=\1", prefix.replace("_", " "))    # run_dir_name undone
            results.setdefault(name, []).append(load(run_dir, name, int(seed)))
    if not results:
        raise SystemExit(f"--tabulate: no finished runs (NAME-seedN with a summary.json) under {root}")
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--staleness", default="1,2,4")
    parser.add_argument("--corrections", default="decoupled,tis,none,recompute")
    parser.add_argument("--families", default="", help=f"comma-separated, of {','.join(FAMILIES)}")
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--no-sync", action="store_true", help="leave the sync run out (with --families: "
                        "the default run is the reference)")
    parser.add_argument("--jobs", type=int, default=1, help="runs at a time (loop times then include the "
                        "contention between them; accuracies do not depend on it)")
    parser.add_argument("--plot", type=Path, default=Path("outputs/fidelity.png"),
                        help="where the figure goes (its folder is created)")
    parser.add_argument("--keep", type=Path, default=None, help="keep the run directories here")
    parser.add_argument("--tabulate", type=Path, default=None, help="train nothing: report the runs kept "
                        "under this --keep folder (several invocations' seeds together)")
    parser.add_argument("overrides", nargs="*", help="key=value overrides for every run")
    args = parser.parse_args()
    if args.tabulate:
        results = tabulated(args.tabulate)
        report(results)
        args.plot.parent.mkdir(parents=True, exist_ok=True)
        plot(results, args.plot)
        print(f"plot: {args.plot}")
        return
    families = [name for name in args.families.split(",") if name]
    unknown = sorted(set(families) - set(FAMILIES))
    if unknown:
        parser.error(f"--families: unknown {unknown}; known: {','.join(FAMILIES)}")
    configs = configurations([int(s) for s in args.staleness.split(",") if s], args.corrections.split(","), families,
                             sync=not args.no_sync)
    if not configs:
        parser.error("nothing to run: --no-sync without --families or --staleness")
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, python {platform.python_version()}; "
          f"{len(configs)} configurations x {args.seeds} seeds")
    results: dict[str, list[Run]] = {name: [] for name in configs}
    with tempfile.TemporaryDirectory() as tmp:
        root = args.keep or Path(tmp)
        root.mkdir(parents=True, exist_ok=True)

        def one(seed: int, name: str) -> Run:
            started = time.monotonic()
            run = train(root, name, seed, [*configs[name], *args.overrides])
            run.name = name
            print(f"{name:16s} seed {seed}: accuracy {run.evals[0][1]:.2f} -> {run.final():.2f} at step "
                  f"{run.evals[-1][0]} ({run.status}), loop {run.loop_s:.1f} s, "
                  f"process {time.monotonic() - started:.1f} s", flush=True)
            return run

        order = [(seed, name) for seed in range(args.first_seed, args.first_seed + args.seeds) for name in configs]
        with ThreadPoolExecutor(max(args.jobs, 1)) as pool:  # each run is its own process
            for (seed, name), run in zip(order, pool.map(lambda job: one(*job), order)):
                results[name].append(run)
    report(results)
    args.plot.parent.mkdir(parents=True, exist_ok=True)
    plot(results, args.plot)
    print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
