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


def test_converged_or_at_least_95_percent_is_not_stuck():
    assert not bench_stuck.judge({"status": "converged", "reason": "the task is solved"},
                                 _evals((0, 0.0), (300, 0.92)), 128)["stuck"]
    assert not bench_stuck.judge({"status": "completed"}, _evals((0, 0.0), (500, 0.96)), 128)["stuck"]
    never = bench_stuck.judge({"status": "completed"}, _evals((0, 0.0), (500, 0.3)), 128)
    assert never["stuck"] and never["samples_80"] is None and never["diagnosis"] == "completed"


def test_the_median_counts_never_as_slowest():
    assert bench_stuck.median_samples([100, None, 300]) == 300
    assert bench_stuck.median_samples([None, None, 300]) is None


def test_evaluations_are_read_from_the_metrics_in_step_order(tmp_path):
    records = [{"kind": "eval", "step": 25, "accuracy": 0.5}, {"kind": "step", "step": 1},
               {"kind": "eval", "step": 0, "accuracy": 0.0}, {"kind": "eval", "step": 30, "accuracy": None}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert [e["step"] for e in bench_stuck.evaluations(tmp_path)] == [0, 25]
