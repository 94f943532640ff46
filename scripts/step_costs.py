"""Where a run's step time goes, read from its run directory after the fact.

For a finished (or interrupted) ``rlorch train`` run, prints from ``metrics.jsonl`` and
``config.yaml``:

- the step interval (seconds between consecutive step records) as median and mean, over steps
  past the first ``--skip`` (start-up transients);
- the trainer's own compute per step (``step_s``: read, forward, backward, optimizer step, on a
  machine it shares with the engines) and the share of the loop it waited for a batch
  (``trainer_idle``), and the engines' paused-or-idle share (``engine_idle``);
- what a resumable checkpoint costs: the extra interval of the two steps after each
  ``trainer.checkpoint_every``-th step against the steps near neither a checkpoint nor an
  evaluation, per checkpoint and spread over every step;
- what an evaluation costs the loop, the same way for the three steps after each evaluation.

The attribution is by difference of medians, so it is an estimate: on a machine whose cores are
all busy, work moved off the critical path still shows up as slower steps around it.

Usage: python scripts/step_costs.py RUN_DIR [--skip 20]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from omegaconf import OmegaConf

AFTER_CHECKPOINT, AFTER_EVAL = 2, 3
"""Steps after a checkpoint (its save, then the next batch's wait) and after an evaluation
(the engines decode the held-out prompts beside generation) whose intervals carry its cost."""


def _median_ms(values: list[float]) -> float:
    return 1000 * statistics.median(values) if values else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--skip", type=int, default=20, help="leave out the first steps (start-up transients)")
    args = parser.parse_args()
    missing = [name for name in ("config.yaml", "metrics.jsonl") if not (args.run_dir / name).is_file()]
    if missing:
        raise SystemExit(f"{args.run_dir}: not a run directory (no {' or '.join(missing)})")
    config = OmegaConf.load(args.run_dir / "config.yaml")
    records = [json.loads(line) for line in (args.run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps, life, lives = {}, 0, {}
    for record in records:    # each resume starts a life, its clock from 0: no interval spans two
        life += record.get("kind") == "start"
        if record.get("kind") == "step":
            steps[record["step"]], lives[record["step"]] = record, life
    eval_steps = {r["step"] for r in records if r.get("kind") == "eval"}
    every = config.trainer.checkpoint_every
    interval = {k: steps[k]["time"] - steps[k - 1]["time"] for k in steps
                if k - 1 in steps and k > args.skip and lives[k] == lives[k - 1]}
    if not interval:
        raise SystemExit(f"{args.run_dir}: fewer than {args.skip + 2} steps recorded")

    def near(k: int, marks, span: int) -> bool:
        return any(k - span <= m < k for m in marks)

    checkpoints = {k for k in steps if k % every == 0}
    after_checkpoint = [v for k, v in interval.items() if near(k, checkpoints, AFTER_CHECKPOINT)
                        and not near(k, eval_steps, AFTER_EVAL)]
    after_eval = [v for k, v in interval.items() if near(k, eval_steps, AFTER_EVAL)
                  and not near(k, checkpoints, AFTER_CHECKPOINT)]
    plain = [v for k, v in interval.items() if not near(k, checkpoints, AFTER_CHECKPOINT)
             and not near(k, eval_steps, AFTER_EVAL)]
    values = list(interval.values())
    compute = [steps[k]["step_s"] for k in interval if steps[k].get("step_s") is not None]
    trainer_idle = [steps[k]["trainer_idle"] for k in interval if steps[k].get("trainer_idle") is not None]
    engine_idle = [steps[k]["engine_idle"] for k in interval if steps[k].get("engine_idle") is not None]
    base = _median_ms(plain)
    checkpoint_ms = (_median_ms(after_checkpoint) - base) * AFTER_CHECKPOINT
    eval_ms = (_median_ms(after_eval) - base) * AFTER_EVAL
    eval_every = config.eval.every or 0
    print(f"{args.run_dir}: {len(values)} step intervals (steps {min(interval)}-{max(interval)}), "
          f"inference.num_servers={config.inference.num_servers}, rollout.batch_size={config.rollout.batch_size}, "
          f"trainer.minibatches={config.trainer.minibatches}")
    print(f"step interval        median {_median_ms(values):7.1f} ms   mean {1000 * statistics.mean(values):7.1f} ms")
    print(f"  steps near neither median {base:7.1f} ms")
    print(f"trainer compute      median {_median_ms(compute):7.1f} ms (step_s)")
    if trainer_idle:
        print(f"trainer waited       {statistics.mean(trainer_idle):7.1%} of the loop; engines paused or idle "
              f"{statistics.mean(engine_idle):.1%}")
    print(f"checkpoint           {checkpoint_ms:7.1f} ms each (trainer.checkpoint_every={every}): "
          f"{checkpoint_ms / every:5.1f} ms a step")
    if eval_every:
        print(f"evaluation           {eval_ms:7.1f} ms each (eval.every={eval_every}): "
              f"{eval_ms / eval_every:5.1f} ms a step")


if __name__ == "__main__":
    main()
