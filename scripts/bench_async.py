"""The CPU default run, synchronous (conf=sync) against asynchronous (the default), same steps.

Prints each run's wall-clock time, the ratio, the reward over the first and last 10% of steps,
and reward gained per wall-clock second. Extra arguments are overrides for both runs.

Usage: python scripts/bench_async.py [train.steps=40] [...]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from rlorch.config.compose import compose
from rlorch.runner import run_training


def run(root: Path, name: str, overrides: list[str]) -> dict:
    config = compose([f"run.dir={root / name}", "run.progress=false", *overrides])
    if run_training(config, []) != 0:
        raise SystemExit(f"{name} run failed; see {root / name}")
    summary = json.loads((root / name / "summary.json").read_text())
    lines = [json.loads(line) for line in (root / name / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["reward_mean"] for r in lines if r["kind"] == "step"]
    tenth = max(1, len(rewards) // 10)
    first, last = sum(rewards[:tenth]) / tenth, sum(rewards[-tenth:]) / tenth
    return {"wall_s": summary["wall_s"], "first": first, "last": last,
            "gain_per_s": (last - first) / summary["wall_s"],
            "age_max": max(r["age_max"] or 0 for r in lines if r["kind"] == "step")}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="overrides for both runs")
    overrides = parser.parse_args(argv).overrides
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        results = {"sync": run(root, "sync", ["conf=sync", *overrides]),
                   "async": run(root, "async", overrides)}
    for name, r in results.items():
        print(f"{name:5s}: wall {r['wall_s']:7.1f} s | reward {r['first']:.3f} -> {r['last']:.3f} | "
              f"gain {r['gain_per_s'] * 60:.3f} reward/min | max head age {r['age_max']}")
    print(f"async / sync wall-clock: {results['async']['wall_s'] / results['sync']['wall_s']:.2f}")


if __name__ == "__main__":
    main()
