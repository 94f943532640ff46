"""A chat-format task from a data file, scored by the built-in math reward, on the tiny model.

Writes single-digit sums as chat messages (``[{"role": "user", "content": "3+4="}]``, answer
``7``) to a JSONL file, holds out a fixed fifth of them (``data.eval_fraction``), trains the CPU
default on the rest and prints held-out greedy accuracy first -> last, the steps and the wall
time. The same code paths as the GPU recipe: messages, the chat template, a data file, the math
reward. Beside ``math`` (weight 1), partial credit for a number near the answer
(:func:`closeness`, weight 0.5) and a format penalty (:func:`digits_only`, weight 0.2, at most 0)
shape the randomly initialised model's search, as TRL's GSM8K examples add format rewards; a
held-out answer counts as right only at the maximum reward (1.5): the math reward 1, the
number exact, digits only. The run is stopped (SIGINT: drained, checkpointed) after ``--minutes`` (default 10).

Usage: python scripts/bench_chat.py [--minutes 10] [key=value ...]
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import tempfile
import time
from pathlib import Path

from rlorch.config.compose import compose
from rlorch.runner import run_training

TWO_CORES = ["inference.num_servers=1", "inference.cpu.max_batch=128", "rollout.pack_samples=128"]


def digits_only(prompts, completions, **columns) -> list[float]:
    """Minus the share of an answer's characters that are not digits (-1 for an empty one)."""
    texts = [c if isinstance(c, str) else c[0]["content"] for c in completions]
    return [-sum(not ch.isdigit() for ch in text) / len(text) if text else -1.0 for text in texts]


def closeness(prompts, completions, answer, **columns) -> list[float]:
    """Partial credit for a number near the answer: 1 - |got - answer| / 10, at least 0."""
    texts = [c if isinstance(c, str) else c[0]["content"] for c in completions]
    return [max(0.0, 1 - abs(int(text) - int(a)) / 10) if text.isdigit() else 0.0 for text, a in zip(texts, answer)]


def write_sums(path: Path) -> Path:
    with open(path, "w") as handle:
        for a in range(10):
            for b in range(10):
                row = {"messages": [{"role": "user", "content": f"{a}+{b}="}], "answer": str(a + b)}
                handle.write(json.dumps(row) + "\n")
    return path


def main() -> None:
    args = sys.argv[1:]
    minutes = 10.0
    if "--minutes" in args:
        at = args.index("--minutes")
        minutes = float(args[at + 1])
        del args[at:at + 2]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        data = write_sums(root / "sums.jsonl")
        overrides = [f"run.dir={root / 'run'}", "run.progress=false", f"data.path={data}",
                     "data.messages_key=messages", "task.reward=[math,__main__:closeness,__main__:digits_only]",
                     "task.reward_weights=[1.0,0.5,0.2]", "data.eval_fraction=0.2", "rollout.max_new_tokens=2",
                     "train.steps=1000", "eval.every=10", *TWO_CORES, *args]
        started = time.monotonic()
        deadline = threading.Timer(minutes * 60, os.kill, (os.getpid(), signal.SIGINT))
        deadline.daemon = True
        deadline.start()
        code = run_training(compose(overrides), [])
        deadline.cancel()
        wall = time.monotonic() - started
        summary = json.loads((root / "run" / "summary.json").read_text())
        evals = [json.loads(line) for line in (root / "run" / "metrics.jsonl").read_text().splitlines()]
        evals = [r for r in evals if r["kind"] == "eval"]
    first, last = summary.get("eval_accuracy_first"), summary.get("eval_accuracy_last")
    print(f"status {summary['status']} (exit {code}), {summary['steps']} steps in {wall:.0f} s")
    print("held-out accuracy by step: " + ", ".join(f"{r['step']}:{r['accuracy']:.0%}" for r in evals))
    if first is not None and last is not None:
        print(f"held-out accuracy {first:.1%} -> {last:.1%} ({100 * (last - first):+.1f} points, "
              f"{evals[-1]['prompts']} held-out prompts)")


if __name__ == "__main__":
    main()
