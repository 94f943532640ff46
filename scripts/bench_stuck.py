"""How often does a configuration get stuck? N seeds of ``rlorch train`` in one invocation.

    python scripts/bench_stuck.py --seeds 8 rollout.temperature=1.0
    python scripts/bench_stuck.py --seeds 8 --first-seed 100 --keep stuck-runs trainer.flat_advantage=batch

Extra arguments are Hydra overrides for every run. Runs go one after another (each is a whole
asynchronous run: engines and trainer on this machine's cores), seed ``--first-seed`` on.

**Stuck** (what this counts): the run's last held-out evaluation is below 95% (``STUCK_BELOW``)
and it is not learning any more: the empty-batch guard's last window held groups that sampled one
wrong answer (``collapsed``) or scored one reward (``constant``), or its held-out accuracy gained
less than 5 points (``CLIMBING``) over its last 100 steps (``RECENT_STEPS``). On the default task
that is a collapse: some prompts' groups all sample one wrong answer, GRPO gives them advantage 0,
and nothing moves them. Such a run may end ``failed`` (the guard's collapse), ``completed`` (the
step limit) or ``converged``: held-out accuracy of 90-95% passes the convergence check (90%) while
the guard's window holds a few collapsed groups. **Slow** is a run below 95% that is still
climbing: more steps, not a fix, is what it needs. Both are printed beside each seed with the
diagnosis (``collapsed``, ``constant``, ``solved``, ``held-out`` where eval.stop_at ended it, or the
status when neither stopped it).

Printed per seed: stuck, slow or ok, how the run ended, its last held-out accuracy, steps and
samples to the first evaluation at >= 80%; then the totals, and as the last line one JSON object
with ``seeds``, ``stuck``, ``stuck_seeds``, ``slow``, ``slow_seeds``, ``median_samples_to_80`` (a
run that never got there counts as slower than any that did; null when that is the median),
``samples_to_80`` and ``last_accuracy`` (per seed) and ``overrides``. ``--keep DIR`` keeps every
stuck or slow run's directory (checkpoints included) under ``DIR/seed-N``, so a rescue can resume
it (``rlorch resume DIR/seed-N train.steps=1000 ...``); the
others are deleted unless ``--keep-all``. ``--source DIR`` runs another checkout of rlorch
(e.g. a ``git worktree`` of an earlier revision) with the same overrides.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[1]
STUCK_BELOW = 0.95
"""A run that ends below this held-out accuracy is stuck, or slow where it is still climbing."""
RECENT_STEPS = 100
CLIMBING = 0.05
"""Still learning: the best held-out accuracy of the last RECENT_STEPS steps beats the best before
them by at least this much (5 points: about 5 of the 97 held-out prompts)."""
TARGET = 0.8


def evaluations(run_dir: Path) -> list[dict]:
    """The run's held-out evaluations, in order (``metrics.jsonl`` records of kind eval)."""
    metrics = run_dir / "metrics.jsonl"
    if not metrics.exists():
        return []
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return sorted((r for r in records if r.get("kind") == "eval" and r.get("accuracy") is not None),
                  key=lambda r: r["step"])


def diagnosis(summary: dict) -> str:
    """What ended the run: the guard's verdict where it stopped it, else the status."""
    reason = summary.get("reason") or ""
    for verdict, words in (("collapsed", "policy collapsed"), ("constant", "score the same")):
        if words in reason:
            return verdict
    if re.search(r"\b\d+ collapsed\b", reason):
        return "collapsed"
    if "task is solved" in reason:
        return "solved"
    if "eval.stop_at" in reason:
        return "held-out"
    return summary.get("status", "no summary")


def climbing(evals: list[dict]) -> bool:
    """Whether held-out accuracy still rose over the last RECENT_STEPS steps (see CLIMBING)."""
    if not evals:
        return False
    since = evals[-1]["step"] - RECENT_STEPS
    before = [e["accuracy"] for e in evals if e["step"] <= since]
    recent = [e["accuracy"] for e in evals if e["step"] > since]
    return bool(before) and max(recent) >= max(before) + CLIMBING


def judge(summary: dict, evals: list[dict], batch_size: int) -> dict:
    """One run's row: stuck or slow, how it ended, last accuracy, steps and samples to 80%."""
    last = evals[-1]["accuracy"] if evals else None
    hit = next((e for e in evals if e["accuracy"] >= TARGET - 1e-9), None)
    status = summary.get("status", "no summary")
    verdict = diagnosis(summary)
    below = last is None or last < STUCK_BELOW
    learning = verdict not in ("collapsed", "constant") and climbing(evals)
    return {"stuck": below and not learning, "slow": below and learning, "status": status,
            "diagnosis": verdict, "last_accuracy": last, "steps": summary.get("steps"),
            "step_80": hit["step"] if hit else None, "samples_80": hit["step"] * batch_size if hit else None}


def run(source: Path, run_dir: Path, seed: int, overrides: list[str]) -> dict:
    command = [sys.executable, "-m", "rlorch.cli", "train", f"run.dir={run_dir}", f"run.seed={seed}",
               "run.progress=false", *overrides]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(source), os.environ.get("PYTHONPATH", "")])}
    started = time.time()
    with open(run_dir.with_suffix(".out"), "wb") as output:
        code = subprocess.run(command, cwd=source, env=env, stdout=output, stderr=subprocess.STDOUT).returncode
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    from omegaconf import OmegaConf

    saved = run_dir / "config.yaml"
    batch_size = OmegaConf.load(saved).rollout.batch_size if saved.exists() else 0
    return {**judge(summary, evaluations(run_dir), batch_size), "exit": code, "wall_s": round(time.time() - started, 1)}


def median_samples(values: list[Optional[int]]) -> Optional[float]:
    """Median, a run that never reached 80% counting as slower than any that did."""
    if not values:
        return None
    middle = statistics.median([float("inf") if v is None else v for v in values])
    return None if middle == float("inf") else middle


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("--seeds", type=int, default=8)
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--keep", type=Path, help="keep the stuck and slow runs' directories (checkpoints included) here")
    parser.add_argument("--keep-all", action="store_true", help="keep every run's directory under --keep")
    parser.add_argument("--source", type=Path, default=REPO, help="the rlorch checkout to run (default: this one)")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for every run")
    args = parser.parse_args()
    rows = {}
    with tempfile.TemporaryDirectory(prefix="bench-stuck-") as tmp:
        root = args.keep or Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        for seed in range(args.first_seed, args.first_seed + args.seeds):
            run_dir = root / f"seed-{seed}"
            shutil.rmtree(run_dir, ignore_errors=True)
            row = rows[seed] = run(args.source.resolve(), run_dir, seed, args.overrides)
            mark = "STUCK" if row["stuck"] else "SLOW " if row["slow"] else "ok   "
            print(f"seed {seed:>4} {mark} {row['status']:<10} "
                  f"{row['diagnosis']:<10} last {row['last_accuracy']} at step {row['steps']}; "
                  f"80% at step {row['step_80']} ({row['samples_80']} samples); {row['wall_s']} s", flush=True)
            if args.keep and not (row["stuck"] or row["slow"]) and not args.keep_all:
                shutil.rmtree(run_dir, ignore_errors=True)
    stuck = [seed for seed, row in rows.items() if row["stuck"]]
    slow = [seed for seed, row in rows.items() if row["slow"]]
    samples = [row["samples_80"] for row in rows.values()]
    median = median_samples(samples)
    print(f"\n{len(stuck)} of {len(rows)} seeds stuck (last held-out < {STUCK_BELOW:.0%}, not climbing)"
          f"{': ' + ', '.join(map(str, stuck)) if stuck else ''}; {len(slow)} slow (below, still climbing)"
          f"{': ' + ', '.join(map(str, slow)) if slow else ''}; median samples to 80%: {median}; "
          f"reached 80%: {sum(s is not None for s in samples)} of {len(rows)}"
          + (f"; stuck and slow runs kept in {args.keep}" if args.keep and (stuck or slow) else ""))
    print(json.dumps({"seeds": len(rows), "stuck": len(stuck), "stuck_seeds": stuck, "slow": len(slow),
                      "slow_seeds": slow, "median_samples_to_80": median,
                      "samples_to_80": {str(seed): row["samples_80"] for seed, row in rows.items()},
                      "last_accuracy": {str(seed): row["last_accuracy"] for seed, row in rows.items()},
                      "overrides": args.overrides}))


if __name__ == "__main__":
    main()
