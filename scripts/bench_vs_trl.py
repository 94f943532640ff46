"""Benchmark rlorch (asynchronous: a CPU engine and the FSDP trainer) against TRL's GRPOTrainer
(synchronous, one process) on the same model, prompts, reward and batch shape, and print both.

Both train the tiny default model (created locally) on the default task (3-digit reversal,
partial-credit reward from the environment's own ``score``): 16 prompts x 8 samples per step,
3 new tokens, temperature 1.2, learning rate 1e-3, no KL term, ``--steps`` steps. TRL saves no
checkpoint (``save_strategy="no"``); rlorch saves only its final one. rlorch runs one engine
beside its trainer (``RLORCH_LAYOUT``), a process per core on a 2-core machine, and sends it a
step's samples per call, which its batch holds whole (3-token generations all end together, so
smaller packs gain nothing; the CPU default's two engines suit machines with cores to spare).
The runs alternate (rlorch, TRL, rlorch, ...) for ``--pairs`` pairs; the script prints each
side's median wall time of the whole command (start-up included) and its steady samples/s
(trained samples per second between the 10th step and the last), and the machine it ran on.

TRL is an optional extra, never installed in CI: install it into its own environment and pass
its interpreter, e.g.
    python3 -m venv --system-site-packages .venv-trl && .venv-trl/bin/pip install -e ".[trl]"
    python scripts/bench_vs_trl.py --trl-python .venv-trl/bin/python

Usage: python scripts/bench_vs_trl.py --trl-python PYTHON [--pairs 3] [--steps 60]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROMPTS_PER_STEP, GROUP, NEW_TOKENS, TEMPERATURE, LR = 16, 8, 3, 1.2, 1e-3
STEADY_FROM = 10
RLORCH_LAYOUT = ["inference.num_servers=1", f"inference.cpu.max_batch={PROMPTS_PER_STEP * GROUP}",
                 f"rollout.pack_samples={PROMPTS_PER_STEP * GROUP}"]
"""rlorch's deployment for this machine class (see the module doc). Besides, ``trainer.checkpoint_every``
is the run's steps: its final checkpoint is its only one."""


def run_rlorch(root: Path, steps: int) -> dict:
    run_dir = root / f"rlorch-{time.monotonic_ns()}"
    command = [sys.executable, "-m", "rlorch.cli", "train", f"train.steps={steps}", f"run.dir={run_dir}",
               "run.progress=false", "eval.enabled=false", f"rollout.batch_size={PROMPTS_PER_STEP * GROUP}",
               f"rollout.group_size={GROUP}", f"rollout.max_new_tokens={NEW_TOKENS}",
               f"rollout.temperature={TEMPERATURE}", f"trainer.lr={LR}", f"trainer.checkpoint_every={steps}",
               *RLORCH_LAYOUT]
    started = time.monotonic()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall = time.monotonic() - started
    steps_seen = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
                  if '"kind": "step"' in line]
    at = {record["step"]: record["wall_s"] for record in steps_seen}
    last = max(at)
    steady = (last - STEADY_FROM) * PROMPTS_PER_STEP * GROUP / (at[last] - at[STEADY_FROM])
    return {"wall_s": wall, "steady_samples_s": steady}


def run_trl(python: str, steps: int, threads: int) -> dict:
    started = time.monotonic()
    result = subprocess.run([python, __file__, "--trl-worker", "--steps", str(steps)], check=True,
                            capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": str(threads)})
    wall = time.monotonic() - started
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    return {"wall_s": wall, **figures}


def trl_worker(steps: int) -> None:
    """Runs inside TRL's environment: GRPOTrainer on the same model, prompts and reward."""
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rlorch.config.compose import compose
    from rlorch.model import ensure_default_model
    from rlorch.tasks.registry import make_environment

    env = make_environment(compose([]))
    path = ensure_default_model()
    tokenizer = AutoTokenizer.from_pretrained(path)
    rows = [dict(zip(("prompt", "answer"), env.make_prompt(i, 0))) for i in range(steps * PROMPTS_PER_STEP)]

    def reward(completions, answer, **_):
        return [float(env.score(c, a)) for c, a in zip(completions, answer)]

    ends: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            ends.append(time.monotonic())

    args = GRPOConfig(output_dir=tempfile.mkdtemp(prefix="trl-"), per_device_train_batch_size=PROMPTS_PER_STEP * GROUP,
                      num_generations=GROUP, max_completion_length=NEW_TOKENS, temperature=TEMPERATURE,
                      learning_rate=LR, lr_scheduler_type="constant", gradient_checkpointing=False,
                      beta=0.0, max_steps=steps, logging_steps=10, save_strategy="no",
                      report_to=[], use_cpu=True, bf16=False, seed=0, shuffle_dataset=False)
    trainer = GRPOTrainer(model=str(path), reward_funcs=[reward], args=args,
                          train_dataset=Dataset.from_list(rows), processing_class=tokenizer, callbacks=[Clock()])
    trainer.train()
    steady = (len(ends) - STEADY_FROM) * PROMPTS_PER_STEP * GROUP / (ends[-1] - ends[STEADY_FROM - 1])
    print(json.dumps({"steady_samples_s": steady}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("--trl-python", help="an interpreter with trl installed")
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--trl-threads", type=int, default=1,
                        help="torch threads for TRL (each rlorch process uses one; more oversubscribes a busy machine)")
    parser.add_argument("--trl-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trl_worker:
        trl_worker(args.steps)
        return
    if not args.trl_python:
        raise SystemExit("--trl-python PYTHON is required (TRL is not a dependency of rlorch; see the module doc)")
    results: dict[str, list[dict]] = {"rlorch": [], "trl": []}
    with tempfile.TemporaryDirectory(prefix="bench-vs-trl-") as root:
        for _ in range(args.pairs):
            results["rlorch"].append(run_rlorch(Path(root), args.steps))
            results["trl"].append(run_trl(args.trl_python, args.steps, args.trl_threads))
    print(f"machine: {platform.machine()} {os.cpu_count()} CPUs, {platform.platform()}, "
          f"python {platform.python_version()}, load average {os.getloadavg()[0]:.2f}")
    print(f"rlorch layout: {' '.join(RLORCH_LAYOUT)} trainer.checkpoint_every={args.steps}")
    for name, runs in results.items():
        wall = statistics.median(r["wall_s"] for r in runs)
        steady = statistics.median(r["steady_samples_s"] for r in runs)
        each = ", ".join(f"{r['wall_s']:.1f}" for r in runs)
        print(f"{name:>6}: wall {wall:6.1f}s (runs {each}), "
              f"steady {steady:6.0f} samples/s ({args.steps} steps x {PROMPTS_PER_STEP * GROUP} samples)")
    ours, theirs = (statistics.median(r["steady_samples_s"] for r in results[k]) for k in ("rlorch", "trl"))
    print(f"rlorch / TRL steady samples/s: {ours / theirs:.2f}x")


if __name__ == "__main__":
    main()
