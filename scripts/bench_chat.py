"""A chat-format task from a data file, scored by the built-in math reward, on the tiny model.

The task: single-digit sums ``a+b`` (digits a, b with a + b <= 9: 55 facts), each written in four
phrasings as chat messages, the answer the sum (``7``)::

    [{"role": "user", "content": "3+4="}]
    [{"role": "user", "content": "add:3,4"}]
    [{"role": "user", "content": "whatis3+4"}]
    [{"role": "system", "content": "sum"}, {"role": "user", "content": "3|4"}]

What is held out: for every fact, one of its four phrasings (a fixed shuffle of the facts, dealt
round robin, so each phrasing is held out for 13 or 14 facts). The 165 other rows are written to
``train.jsonl`` and trained on; the 55 held-out rows to ``heldout.jsonl`` (``data.eval_path``)
and never trained on. A held-out row is a prompt the model has never seen: it has trained the
fact in the three other phrasings and the phrasing with the other facts, and must put the two
together. No unseen fact is asked: a randomly initialised model of this size does not infer
addition facts it never saw (holding out a fifth of the 100 facts a+b, a, b in 0..9, stayed at
0% for 10 minutes). Held-out accuracy is greedy exact match (the math reward at 1), printed
first -> last with the steps, the wall time, the load average (the machine may be shared) and
what the best prompt-independent answer would score (``9``: 10 of the 55 held-out rows).

The reward is the built-in ``math`` alone; the answer is one token (``rollout.max_new_tokens=1``,
so every completion ends at the length limit and the run says so), ``trainer.lr=2e-3``. The
run is stopped (SIGINT: drained, checkpointed) after ``--minutes`` (default 10).

Usage: python scripts/bench_chat.py [--minutes 10] [--run-dir DIR] [key=value ...]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import tempfile
import threading
import time
from pathlib import Path

from rlorch.config.compose import compose
from rlorch.runner import run_training

TWO_CORES = ["inference.num_servers=1", "inference.cpu.max_batch=128", "rollout.pack_samples=128"]
PHRASINGS = (
    lambda a, b: [{"role": "user", "content": f"{a}+{b}="}],
    lambda a, b: [{"role": "user", "content": f"add:{a},{b}"}],
    lambda a, b: [{"role": "user", "content": f"whatis{a}+{b}"}],
    lambda a, b: [{"role": "system", "content": "sum"}, {"role": "user", "content": f"{a}|{b}"}],
)


def write_sums(root: Path) -> tuple[Path, Path]:
    """``train.jsonl`` (165 rows) and ``heldout.jsonl`` (55 rows: one phrasing of each fact)."""
    facts = [(a, b) for a in range(10) for b in range(10) if a + b <= 9]
    random.Random("bench_chat").shuffle(facts)
    held = {fact: i % len(PHRASINGS) for i, fact in enumerate(facts)}
    train, heldout = root / "train.jsonl", root / "heldout.jsonl"
    with open(train, "w") as t, open(heldout, "w") as h:
        for a, b in sorted(facts):
            for form, phrase in enumerate(PHRASINGS):
                row = json.dumps({"messages": phrase(a, b), "answer": str(a + b)}) + "\n"
                (h if held[a, b] == form else t).write(row)
    return train, heldout


def load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3]) if Path("/proc/loadavg").exists() else "n/a"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("--minutes", type=float, default=10.0, help="stop the run (Ctrl-C) after this long (10)")
    parser.add_argument("--run-dir", default="", help="keep the data and the run here (default: a temporary folder)")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="overrides after the bench's own")
    options = parser.parse_args(argv)
    args, minutes = options.overrides, options.minutes
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(options.run_dir or tmp)
        root.mkdir(parents=True, exist_ok=True)
        train, heldout = write_sums(root)
        overrides = [f"run.dir={root / 'run'}", "run.progress=false", f"data.path={train}",
                     f"data.eval_path={heldout}", "data.messages_key=messages", "task.reward=math",
                     "rollout.max_new_tokens=1", "trainer.lr=2e-3", "train.steps=2000", "eval.every=25",
                     *TWO_CORES, *args]
        load_before = load()
        started = time.monotonic()
        deadline = threading.Timer(minutes * 60, os.kill, (os.getpid(), signal.SIGINT))
        deadline.daemon = True
        deadline.start()
        code = run_training(compose(overrides), [])
        deadline.cancel()
        if code not in (0, 130):    # 130: stopped by the deadline's Ctrl-C, as planned
            raise SystemExit(f"the run did not start or failed (exit {code}); see {root / 'run'}")
        wall = time.monotonic() - started
        summary = json.loads((root / "run" / "summary.json").read_text())
        records = [json.loads(line) for line in (root / "run" / "metrics.jsonl").read_text().splitlines()]
        evals = [r for r in records if r["kind"] == "eval"]
        answers = [json.loads(line)["answer"] for line in heldout.read_text().splitlines()]
    first, last = summary.get("eval_accuracy_first"), summary.get("eval_accuracy_last")
    print(f"status {summary['status']} (exit {code}), {summary['steps']} steps in {wall:.0f} s; "
          f"load average {load_before} before, {load()} after")
    print("held-out accuracy by step: " + ", ".join(f"{r['step']}:{r['accuracy']:.0%}" for r in evals))
    if first is not None and last is not None:
        print(f"held-out accuracy {first:.1%} -> {last:.1%} ({100 * (last - first):+.1f} points, "
              f"{evals[-1]['prompts']} held-out prompts)")
    common = max(set(answers), key=answers.count)
    print(f"one answer whatever the prompt ({common}) would score {answers.count(common) / len(answers):.1%}")


if __name__ == "__main__":
    main()
