"""How often does a configuration get stuck? N seeds of ``rlorch train`` in one invocation.

    python scripts/bench_stuck.py --seeds 8 rollout.temperature=1.0
    python scripts/bench_stuck.py --seeds 8 --first-seed 100 --keep stuck-runs trainer.flat_advantage=batch

Extra arguments are Hydra overrides for every run. Runs go one after another (each is a whole
asynchronous run: engines and trainer on this machine's cores), seed ``--first-seed`` on.

**Stuck** (what this counts): the run did not end ``converged`` and its last held-out
evaluation is below 95% (``STUCK_BELOW``). On the default task that is the failure the empty-batch
guard diagnoses as a collapse: some prompts' groups all sample one wrong answer, GRPO gives them
advantage 0, and nothing moves them; the diagnosis (``collapsed``, ``constant``, or the status
when the guard did not stop it) is printed beside each stuck seed.

Printed per seed: stuck or not, how the run ended, its last held-out accuracy, steps and samples
to the first evaluation at >= 80%; then the totals, and as the last line one JSON object with
``seeds``, ``stuck``, ``stuck_seeds``, ``median_samples_to_80`` (a run that never got there counts
as slower than any that did; null when that is the median), ``samples_to_80`` (per seed) and
``overrides``. ``--keep DIR`` keeps every stuck run's directory (checkpoints included) under
``DIR/seed-N``, so a rescue can resume it (``rlorch train --resume DIR/seed-N ...``); the
others are deleted unless ``--keep-all``. ``--source DIR`` runs another checkout of rlorch
(e.g. a ``git worktree`` of an earlier revision) with the same overrides.
"""

from __future__ import annotations

import argparse
import json
import os
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
"""A run that did not converge and ends below this held-out accuracy is stuck."""
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
    for verdict, words in (("collapsed", "policy collapsed"), ("constant", "score the same"),
                           ("solved", "task is solved")):
        if words in reason:
            return verdict
    return summary.get("status", "no summary")


def judge(summary: dict, evals: list[dict], batch_size: int) -> dict:
    """One run's row: stuck, how it ended, last accuracy, steps and samples to 80%."""
    last = evals[-1]["accuracy"] if evals else None
    hit = next((e for e in evals if e["accuracy"] >= TARGET - 1e-9), None)
    status = summary.get("status", "no summary")
    return {"stuck": status != "converged" and (last is None or last < STUCK_BELOW), "status": status,
            "diagnosis": diagnosis(summary), "last_accuracy": last, "steps": summary.get("steps"),
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
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=8)
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--keep", type=Path, help="keep the stuck runs' directories (checkpoints included) here")
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
            print(f"seed {seed:>4} {'STUCK' if row['stuck'] else 'ok   '} {row['status']:<10} "
                  f"{row['diagnosis']:<10} last {row['last_accuracy']} at step {row['steps']}; "
                  f"80% at step {row['step_80']} ({row['samples_80']} samples); {row['wall_s']} s", flush=True)
            if args.keep and not row["stuck"] and not args.keep_all:
                shutil.rmtree(run_dir, ignore_errors=True)
    stuck = [seed for seed, row in rows.items() if row["stuck"]]
    samples = [row["samples_80"] for row in rows.values()]
    median = median_samples(samples)
    print(f"\n{len(stuck)} of {len(rows)} seeds stuck (not converged, last held-out < {STUCK_BELOW:.0%})"
          f"{': ' + ', '.join(map(str, stuck)) if stuck else ''}; median samples to 80%: {median}; "
          f"reached 80%: {sum(s is not None for s in samples)} of {len(rows)}"
          + (f"; stuck runs kept in {args.keep}" if args.keep and stuck else ""))
    print(json.dumps({"seeds": len(rows), "stuck": len(stuck), "stuck_seeds": stuck, "median_samples_to_80": median,
                      "samples_to_80": {str(seed): row["samples_80"] for seed, row in rows.items()},
                      "last_accuracy": {str(seed): row["last_accuracy"] for seed, row in rows.items()},
                      "overrides": args.overrides}))


if __name__ == "__main__":
    main()
