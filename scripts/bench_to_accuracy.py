"""Race ``rlorch train`` (the default preset, nothing switched off) against TRL's GRPOTrainer on
the figure a user feels: seconds from pressing enter to a model that solves the task.

Both sides train the tiny default model (created locally) on the default task (3-digit reversal,
partial-credit reward with format weight 0.2) with the hyperparameters of rlorch's composed
default config (read when TRL starts, so they follow the defaults): prompts x samples per step,
new tokens, temperature, learning rate, entropy bonus, no KL term, and ``trainer.minibatches``
optimizer steps per generated batch (TRL's ``steps_per_generation``). Held-out accuracy is greedy,
on the task's 97 held-out prompts, every ``eval.every`` steps (and before the first), as rlorch's
default evaluation does it. A step is one generated batch on both sides. Samples to 80% are the
steps to 80% times the batch size. ``--variant NAME:OVERRIDES`` races this checkout with changed
settings too, and says on how many seeds each reached 80% in fewer samples than the default.

What is measured, per run: seconds from the command's launch to the first evaluation at >= 80%
held-out accuracy and to the first at 100%, and the step that evaluation was of. The seconds to
80% are split into the start (launch to the evaluation before the first step) and the time a
step (the rest over the steps to 80%), so a race's ratio reads as steps times step plus start. Evaluation time
is *counted on both sides*: rlorch evaluates on its engines beside training, TRL inside its
training loop (its seconds spent evaluating are printed too, so they can be subtracted by
hand). A run is stopped once it has evaluated at 100% (rlorch by SIGINT, TRL from its callback),
or after ``--max-steps`` (by default the default config's ``train.steps``, the cap a user's run
has: a run that collapses early needs several hundred steps more to get out).

Contenders run alternately, seed by seed (the order rotates each seed): this checkout's rlorch,
optionally an earlier revision of it (``--baseline REF``, checked out into a temporary worktree
and run from there), and TRL when ``--trl-python`` names an interpreter that has it. Every run's
directory and console output go to a temporary folder, removed at the end, or to ``--keep DIR``,
where they stay; a run that missed 100% names its own, and a failed TRL run ends the bench with
the end of its error output.

TRL is an optional extra, never installed in CI:
    python3 -m venv --system-site-packages .venv-trl && .venv-trl/bin/pip install -e ".[trl]"

Usage: python scripts/bench_to_accuracy.py [--trl-python PYTHON] [--baseline REF]
       [--variant NAME:OVERRIDES ...] [--seeds 8] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[1]
TARGETS = (0.8, 1.0)
POLL_S = 0.05


def first_at(evals: list[dict], target: float) -> Optional[dict]:
    return next((e for e in evals if e["accuracy"] >= target - 1e-9), None)


def run_rlorch(source: Path, root: Path, seed: int, max_steps: int, overrides: tuple[str, ...] = ()) -> dict:
    """``rlorch train`` from ``source`` (a checkout) with ``overrides``; each eval is timed as its
    record appears."""
    run_dir = root / f"rlorch-{time.monotonic_ns()}"
    command = [sys.executable, "-m", "rlorch.cli", "train", f"run.dir={run_dir}", f"run.seed={seed}",
               "run.progress=false", f"train.steps={max_steps}", *overrides]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(source), os.environ.get("PYTHONPATH", "")])}
    started = time.time()
    output = open(run_dir.with_suffix(".out"), "wb")
    process = subprocess.Popen(command, cwd=source, env=env, stdout=output, stderr=subprocess.STDOUT)
    evals: list[dict] = []
    metrics, offset = run_dir / "metrics.jsonl", 0
    while process.poll() is None:
        time.sleep(POLL_S)
        if not metrics.exists():
            continue
        with open(metrics, "rb") as handle:
            handle.seek(offset)
            chunk = handle.read()
        complete = chunk[:chunk.rfind(b"\n") + 1]
        offset += len(complete)
        for line in complete.decode().splitlines():
            record = json.loads(line)
            if record.get("kind") == "eval":
                evals.append({"step": record["step"], "accuracy": record["accuracy"], "at_s": time.time() - started})
        if first_at(evals, 1.0) is not None:
            process.send_signal(signal.SIGINT)
            process.wait(120)
    output.close()
    summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").exists() else {}
    from omegaconf import OmegaConf

    saved = run_dir / "config.yaml"
    batch_size = OmegaConf.load(saved).rollout.batch_size if saved.exists() else None
    return {"evals": evals, "wall_s": time.time() - started, "eval_s": None, "batch_size": batch_size,
            "ended": f"{summary.get('status', 'no summary')} (exit {process.returncode}, {summary.get('steps')} steps, "
                     f"see {run_dir} and {output.name})"}


def run_trl(python: str, root: Path, seed: int, max_steps: int) -> dict:
    started = time.time()
    errors = root / f"trl-{time.monotonic_ns()}.err"
    with open(errors, "w") as stderr:
        result = subprocess.run([python, __file__, "--trl-worker", "--seed", str(seed), "--max-steps", str(max_steps)],
                                stdout=subprocess.PIPE, stderr=stderr, text=True, cwd=REPO,
                                env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "2"})
    if result.returncode:
        tail = "\n".join(errors.read_text(errors="replace").splitlines()[-20:])
        raise SystemExit(f"the TRL run of seed {seed} exited with {result.returncode} ({errors}):\n{tail}")
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    for record in figures["evals"]:
        record["at_s"] = record.pop("epoch") - started
    return {**figures, "wall_s": time.time() - started}


def trl_worker(seed: int, max_steps: int) -> None:
    """Runs inside TRL's environment: GRPOTrainer on the same model, prompts, reward and eval."""
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rlorch.config.compose import compose
    from rlorch.model import ensure_default_model
    from rlorch.tasks.registry import make_environment

    config = compose([f"run.seed={seed}"])
    rollout, trainer_config = config.rollout, config.trainer
    prompts_per_step = rollout.batch_size // rollout.group_size
    env = make_environment(config)
    path = ensure_default_model()
    tokenizer = AutoTokenizer.from_pretrained(path)
    rows = [dict(zip(("prompt", "answer"), env.make_prompt(i, seed))) for i in range(max_steps * prompts_per_step)]
    held_out = env.eval_prompts(100)

    def reward(completions, answer, **_):
        return [float(env.score(c, a)) for c, a in zip(completions, answer)]

    evals: list[dict] = []
    spent = [0.0]

    def evaluate(model, step: int) -> float:
        began = time.monotonic()
        was_training = model.training
        model.eval()
        tokenizer.padding_side = "left"
        batch = tokenizer([p for p, _ in held_out], return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            out = model.generate(**batch, max_new_tokens=rollout.max_new_tokens, do_sample=False,
                                 pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
        texts = tokenizer.batch_decode(out[:, batch["input_ids"].shape[1]:], skip_special_tokens=True)
        accuracy = sum(env.is_correct(t, a) for t, (_, a) in zip(texts, held_out)) / len(held_out)
        model.train(was_training)
        spent[0] += time.monotonic() - began
        evals.append({"step": step, "accuracy": round(accuracy, 6), "epoch": time.time()})
        return accuracy

    class Evaluate(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kwargs):
            evaluate(model, 0)

        def on_step_end(self, args, state, control, model=None, **kwargs):
            # TRL counts optimizer steps; a step here is one generated batch, as in rlorch.
            if (state.global_step % (config.eval.every * minibatches) == 0
                    and evaluate(model, state.global_step // minibatches) >= 1.0):
                control.should_training_stop = True

    # rlorch's trainer.minibatches optimizer steps per batch are TRL's steps_per_generation, each
    # on batch_size / minibatches of the batch's rollouts.
    minibatches = trainer_config.minibatches
    args = GRPOConfig(output_dir=tempfile.mkdtemp(prefix="trl-"),
                      per_device_train_batch_size=rollout.batch_size // minibatches, steps_per_generation=minibatches,
                      num_generations=rollout.group_size, max_completion_length=rollout.max_new_tokens,
                      temperature=rollout.temperature, learning_rate=trainer_config.lr,
                      lr_scheduler_type="constant", gradient_checkpointing=False, beta=0.0,
                      entropy_coef=trainer_config.entropy_coef, max_steps=max_steps * minibatches,
                      logging_steps=10 ** 6,
                      save_strategy="no", report_to=[], use_cpu=True, bf16=False, seed=seed,
                      shuffle_dataset=False, disable_tqdm=True)
    trainer = GRPOTrainer(model=str(path), reward_funcs=[reward], args=args,
                          train_dataset=Dataset.from_list(rows), processing_class=tokenizer, callbacks=[Evaluate()])
    trainer.train()
    print(json.dumps({"evals": evals, "eval_s": spent[0], "batch_size": rollout.batch_size}))


def summarise(run: dict) -> dict:
    row = {"wall_s": run["wall_s"], "eval_s": run.get("eval_s"), "ended": run.get("ended"),
           "last_evals": [(e["step"], e["accuracy"]) for e in run["evals"][-3:]]}
    for target in TARGETS:
        hit = first_at(run["evals"], target)
        row[f"s_{target:.0%}"] = hit["at_s"] if hit else None
        row[f"step_{target:.0%}"] = hit["step"] if hit else None
    row["samples_80%"] = (row["step_80%"] * run["batch_size"]
                          if row["step_80%"] is not None and run.get("batch_size") else None)
    # The seconds to 80% as start plus steps times the step: the evaluation before the first
    # step marks where training began, on both sides.
    first = run["evals"][0] if run["evals"] and run["evals"][0]["step"] == 0 else None
    row["start_s"] = first["at_s"] if first else None
    row["step_ms"] = (1000 * (row["s_80%"] - first["at_s"]) / row["step_80%"]
                      if first and row["step_80%"] else None)
    return row


def _median(values: list) -> Optional[float]:
    """The median, a run that never got there counting as slower than any that did (None when
    that is the median)."""
    middle = statistics.median([float("inf") if v is None else v for v in values]) if values else None
    return None if middle is None or middle == float("inf") else middle


def _fewer(mine: Optional[int], theirs: Optional[int]) -> bool:
    """Whether ``mine`` got to the target on fewer samples (never getting there is more than any)."""
    return mine is not None and (theirs is None or mine < theirs)


def _fmt(value, width: int = 7, digits: int = 1) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:>{width}.{digits}f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("--trl-python", help="an interpreter with trl installed (TRL is left out without it)")
    parser.add_argument("--baseline", help="a git revision of rlorch to race as well (e.g. the last release)")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME:OVERRIDES",
                        help="also race this checkout with Hydra overrides, space-separated "
                             "(e.g. 'lr2e-3:trainer.lr=2e-3'); repeatable")
    parser.add_argument("--seeds", type=int, default=8)
    parser.add_argument("--max-steps", type=int,
                        help="steps a run may take (default: the default config's train.steps)")
    parser.add_argument("--keep", type=Path, help="keep every run's directory and output here")
    parser.add_argument("--trl-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.max_steps is None:
        from rlorch.config.compose import compose

        args.max_steps = compose([]).train.steps
    if args.trl_worker:
        trl_worker(args.seed, args.max_steps)
        return
    with tempfile.TemporaryDirectory(prefix="bench-to-accuracy-") as tmp:
        root = args.keep or Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        contenders = {"rlorch (this checkout)": lambda seed: run_rlorch(REPO, root, seed, args.max_steps)}
        for variant in args.variant:
            label, _, overrides = variant.partition(":")
            contenders[f"rlorch {label}"] = (lambda seed, overrides=tuple(overrides.split()):
                                             run_rlorch(REPO, root, seed, args.max_steps, overrides))
        if args.baseline:
            tree = Path(tmp) / "baseline"
            subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(tree), args.baseline],
                           check=True, capture_output=True)
            label = f"rlorch {args.baseline}"
            contenders = {label: lambda seed: run_rlorch(tree, root, seed, args.max_steps), **contenders}
        if args.trl_python:
            contenders["TRL GRPO"] = lambda seed: run_trl(args.trl_python, root, seed, args.max_steps)
        rows: dict[str, list[dict]] = {name: [] for name in contenders}
        names = list(contenders)
        try:
            for seed in range(args.seeds):
                order = names[seed % len(names):] + names[:seed % len(names)]
                for name in order:
                    row = summarise(contenders[name](seed))
                    rows[name].append(row)
                    print(f"seed {seed} {name:<24} to 80% {_fmt(row['s_80%'])} s (step {row['step_80%']}, "
                          f"{row['samples_80%']} samples), "
                          f"to 100% {_fmt(row['s_100%'])} s (step {row['step_100%']}), wall {row['wall_s']:.1f} s"
                          + (f", of which eval {row['eval_s']:.1f} s" if row["eval_s"] is not None else "")
                          + ("" if row["s_100%"] is not None
                             else f"; ended {row['ended']}, last evals {row['last_evals']}"),
                          flush=True)
        finally:
            if args.baseline:
                subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(Path(tmp) / "baseline")],
                               capture_output=True)
    print(f"\nmachine: {platform.machine()} {os.cpu_count()} CPUs, python {platform.python_version()}, "
          f"load average {os.getloadavg()[0]:.2f}; evaluation time counted on both sides")
    print(f"{'system':<26}{'seeds':>6}{'median s to 80%':>17}{'median s to 100%':>18}{'median steps to 80%':>21}"
          f"{'median samples to 80%':>23}{'seeds at 100%':>15}{'median start s':>16}{'median ms a step':>18}")
    medians = {}
    for name, runs in rows.items():
        medians[name] = _median([r["s_80%"] for r in runs])
        print(f"{name:<26}{len(runs):>6}{_fmt(medians[name], 17)}{_fmt(_median([r['s_100%'] for r in runs]), 18)}"
              f"{_fmt(_median([r['step_80%'] for r in runs]), 21, 0)}"
              f"{_fmt(_median([r['samples_80%'] for r in runs]), 23, 0)}"
              f"{sum(r['s_100%'] is not None for r in runs):>15}"
              f"{_fmt(_median([r['start_s'] for r in runs]), 16)}{_fmt(_median([r['step_ms'] for r in runs]), 18)}")
    default = rows["rlorch (this checkout)"]
    for name, runs in rows.items():
        if name.startswith("rlorch ") and runs is not default:
            fewer = sum(_fewer(mine["samples_80%"], theirs["samples_80%"]) for mine, theirs in zip(runs, default))
            print(f"{name}: fewer samples to 80% than this checkout's default on {fewer} of {len(runs)} seeds")
    if "TRL GRPO" in medians and medians["TRL GRPO"]:
        for name in names[:-1]:
            if medians[name] is not None:
                print(f"{name} / TRL, median seconds to 80%: {medians[name] / medians['TRL GRPO']:.2f}")


if __name__ == "__main__":
    main()
