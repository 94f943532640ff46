"""scripts/bench_stuck.py's verdict per run: what counts as stuck, and the median that counts a run
that never reached 80% as slower than any that did."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import bench_stuck  # noqa: E402

COLLAPSED = ("384 rollouts in a row ... of the last 384 rollouts 336 solved, 48 collapsed: the policy collapsed, "
             "its groups sample one completion")


def _evals(*pairs):
    return [{"step": step, "accuracy": accuracy} for step, accuracy in pairs]


def test_a_failed_run_below_95_percent_is_stuck_with_the_guards_diagnosis():
    row = bench_stuck.judge({"status": "failed", "reason": COLLAPSED, "steps": 403},
                            _evals((0, 0.0), (175, 1.0), (400, 0.91)), batch_size=128)
    assert row["stuck"] and row["diagnosis"] == "collapsed"
    assert (row["step_80"], row["samples_80"], row["last_accuracy"]) == (175, 22400, 0.91)


def test_below_95_percent_and_not_climbing_is_stuck_whatever_the_run_ended_with():
    # The convergence check passes at 90% held-out while the guard's window holds collapsed groups.
    near_end = bench_stuck.judge({"status": "converged", "reason": "of the last 384 rollouts 368 solved, "
                                  "16 collapsed: the task is solved; held-out accuracy 90.7% at step 386."},
                                 _evals((0, 0.0), (250, 0.91), (300, 0.93), (386, 0.907)), 128)
    assert near_end["stuck"] and not near_end["slow"] and near_end["diagnosis"] == "collapsed"
    solved = bench_stuck.judge({"status": "converged", "reason": "of the last 384 rollouts 384 solved: the task "
                                "is solved; held-out accuracy 100.0% at step 300."}, _evals((0, 0.0), (300, 1.0)), 128)
    assert not solved["stuck"] and not solved["slow"] and solved["diagnosis"] == "solved"
    held_out = bench_stuck.judge({"status": "converged", "reason": "held-out accuracy 99.0% at step 200, 100.0% at "
                                  "step 225: 2 evaluations in a row at or above eval.stop_at=0.98"},
                                 _evals((0, 0.0), (200, 0.99), (225, 1.0), (231, 1.0)), 128)
    assert not held_out["stuck"] and held_out["diagnosis"] == "held-out"
    assert not bench_stuck.judge({"status": "completed"}, _evals((0, 0.0), (500, 0.96)), 128)["stuck"]
    flat = bench_stuck.judge({"status": "completed"}, _evals((0, 0.0), (375, 0.48), (425, 0.47), (500, 0.45)), 128)
    assert flat["stuck"] and flat["samples_80"] is None and flat["diagnosis"] == "completed"


def test_a_run_below_95_percent_still_climbing_is_slow_not_stuck():
    evals = _evals((0, 0.0), (350, 0.54), (375, 0.61), (400, 0.58), (450, 0.68), (500, 0.66))
    slow = bench_stuck.judge({"status": "completed"}, evals, 128)
    assert slow["slow"] and not slow["stuck"]
    # Under 5 points over the last 100 steps is not climbing; nor is a run the guard found collapsed.
    assert bench_stuck.judge({"status": "completed"}, _evals((0, 0.0), (400, 0.62), (500, 0.66)), 128)["stuck"]
    collapsed = bench_stuck.judge({"status": "failed", "reason": COLLAPSED}, evals, 128)
    assert collapsed["stuck"] and not collapsed["slow"]


def test_the_median_counts_never_as_slowest():
    assert bench_stuck.median_samples([100, None, 300]) == 300
    assert bench_stuck.median_samples([None, None, 300]) is None


def test_evaluations_are_read_from_the_metrics_in_step_order(tmp_path):
    records = [{"kind": "eval", "step": 25, "accuracy": 0.5}, {"kind": "step", "step": 1},
               {"kind": "eval", "step": 0, "accuracy": 0.0}, {"kind": "eval", "step": 30, "accuracy": None}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert [e["step"] for e in bench_stuck.evaluations(tmp_path)] == [0, 25]
