"""The orchestrator end to end on the sim backends (inference=sim, trainer=sim)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import helpers
from helpers import read_run, step_count, trained, wait_until
from rlorch.config.compose import compose
from rlorch.runner import resume_training, run_training


def train(tmp_path: Path, name: str, *overrides: str) -> tuple[int, dict, list[dict]]:
    return helpers.train(tmp_path / name, *overrides)


@pytest.mark.parametrize("staleness", [0, 1, 2, 4])
def test_uniform_latency_stays_within_the_bound_and_uses_it(tmp_path, staleness):
    """Real sleeps on a shared machine: the bound S is never passed; the exact figure (max age
    == S) is the deterministic ``simulate`` tests' (test_simulate.py)."""
    code, summary, steps = train(tmp_path, f"s{staleness}", f"rollout.max_staleness={staleness}",
                                 "inference.sim.latency=[0.01,0.01]", "trainer.sim.step_time=0.03",
                                 "rollout.max_concurrent=64", "train.steps=12")
    assert code == 0 and summary["status"] == "completed"
    assert max(r["age_max"] for r in steps) <= staleness
    if staleness:
        assert max(r["age_max"] for r in steps) >= 1, "the run never used its staleness budget"
    assert summary["lost"] == 0 and summary["trained"] == 12 * 8


def test_jittered_latency_strict_drops_what_admission_would_train_over_the_bound(tmp_path):
    """How far admission overshoots is the deterministic simulate tests' figure
    (test_simulate.py); on real sleeps only the bounds are asserted."""
    jitter = ["rollout.max_staleness=1", "inference.sim.latency=[0.001,0.25]", "trainer.sim.step_time=0.02",
              "rollout.max_concurrent=64", "train.steps=30"]
    _, loose, loose_steps = train(tmp_path, "admission", *jitter, "rollout.enforce=admission")
    assert loose["dropped_stale"] == 0 and loose["lost"] == 0
    # Whether a run's jitter makes a rollout stale at all is up to timing (a loaded machine
    # slows every part alike): up to three strict runs, each within the bound, one must drop.
    for attempt in range(3):
        _, strict, strict_steps = train(tmp_path, f"strict-{attempt}", *jitter, "rollout.enforce=strict")
        assert max(r["age_max"] for r in strict_steps) <= 1 and strict["lost"] == 0
        if strict["dropped_stale"] > 0:
            break
    assert strict["dropped_stale"] > 0 and strict["stale_tokens"] > 0


def test_ship_mode_parks_batches_until_the_trainer_catches_up(tmp_path):
    code, summary, steps = train(tmp_path, "ship", "rollout.enforce=ship", "rollout.max_staleness=0",
                                 "inference.sim.latency=[0.001,0.001]", "trainer.sim.step_time=0.03", "train.steps=8")
    assert code == 0 and summary["lost"] == 0
    assert summary["parked_s"] > 0 and any(r["parked_s"] > 0 for r in steps)


@pytest.mark.parametrize("filter_groups", ["true", "false"])
def test_constant_reward_stops_on_the_empty_batch_guard(tmp_path, filter_groups):
    """The sim engine samples one fixed completion: a flat reward short of the maximum is a
    collapsed policy, and the guard says so, whether flat groups are filtered or kept."""
    code, summary, _ = train(tmp_path, "flat", "inference.sim.reward=constant", "train.max_empty_batches=3",
                             f"rollout.filter_groups={filter_groups}")
    assert code != 0 and summary["status"] == "failed"
    assert "24 rollouts in a row (3 batches' worth) finished with no reward spread to learn from" in summary["error"]
    assert "24 collapsed" in summary["error"] and "policy collapsed" in summary["error"]
    assert summary["stop"] == "empty_batches"
    assert summary["empty_batches"] == 3 and summary["lost"] == 0


def test_a_solved_task_without_evaluation_converges_and_has_nothing_to_resume(tmp_path, capsys):
    code, summary, steps = train(tmp_path, "solved", "inference.sim.reward=solved", "rollout.group_size=4",
                                 "rollout.batch_size=8", "train.max_empty_batches=3", "train.steps=50",
                                 "eval.enabled=false")
    assert code == 0 and summary["status"] == "converged", summary
    assert "the task is solved" in summary["reason"] and summary["lost"] == 0
    # Every group is solved from the first: nothing is trainable, no step is taken, no checkpoint.
    assert summary["steps"] == 0 and summary["trained"] == 0 and summary["checkpoint"] is None, summary
    capsys.readouterr()
    assert resume_training(str(tmp_path / "solved"), ["train.steps=60"]) == 2
    captured = capsys.readouterr()
    assert "holds no complete checkpoint yet" in captured.out + captured.err


@pytest.mark.parametrize("filter_groups", ["true", "false"])
def test_solved_training_groups_do_not_converge_while_held_out_accuracy_disagrees(tmp_path, filter_groups):
    """The sim engine's solved reward puts every training group at the maximum, while its fixed
    tokens answer no held-out prompt: not converged; with nothing left to train (kept solved
    groups carry nothing to learn) the run fails saying so."""
    code, summary, _ = train(tmp_path, "disagree", "inference.sim.reward=solved", "rollout.group_size=4",
                             "rollout.batch_size=8", "train.steps=50", f"rollout.filter_groups={filter_groups}")
    assert summary["status"] == "failed" and summary["stop"] == "empty_batches", summary
    assert "held-out accuracy 0.0% at step 0 says it is not" in summary["error"]


CUSTOM = ["task=custom", "task.name=tests.mostly_solved:MostlySolved", "inference.sim.reward=task",
          "+task.params.every=20", "rollout.group_size=4", "rollout.batch_size=16", "rollout.max_concurrent=32", "eval.every=5",
          "trainer.checkpoint_every=5"]


def test_a_mostly_solved_task_stops_converged_only_when_held_out_accuracy_agrees(tmp_path):
    code, summary, steps = train(tmp_path, "agree", *CUSTOM, "train.steps=100")
    assert code == 0 and summary["status"] == "converged", summary
    assert "held-out accuracy 100.0%" in summary["reason"]
    # Kept, the solved groups train (advantage 0) beside the hard ones and still end the run.
    code, summary, steps = train(tmp_path, "kept", *CUSTOM, "train.steps=100", "rollout.filter_groups=false")
    assert code == 0 and summary["status"] == "converged", summary
    assert any(s["trainable"] < s["rollouts"] for s in steps), steps
    assert "held-out accuracy 100.0%" in summary["reason"]
    code, summary, steps = train(tmp_path, "disagree", *CUSTOM, "train.steps=30", "+task.params.held_out_correct=false")
    assert code == 0 and summary["status"] == "completed" and summary["steps"] == 30, summary


def test_a_policy_collapsed_on_training_prompts_converges_only_when_held_out_accuracy_agrees(tmp_path):
    """One prompt in five scores 0.5 on its one sampled completion: the guard finds the policy
    collapsed (80% solved, under the solved share). Held-out accuracy of the same weights at 100%
    ends the run converged, naming the collapse; at 0% it fails, as a collapse always did."""
    collapsed = [*CUSTOM, "train.steps=100", "+task.params.every=5", "+task.params.hard_score=0.5"]
    collapsed.remove("+task.params.every=20")
    code, summary, _ = train(tmp_path, "agree", *collapsed)
    assert code == 0 and summary["status"] == "converged", summary
    assert "policy collapsed" in summary["reason"] and "held-out accuracy 100.0%" in summary["reason"], summary
    code, summary, _ = train(tmp_path, "disagree", *collapsed, "+task.params.held_out_correct=false")
    assert code != 0 and summary["status"] == "failed" and summary["stop"] == "empty_batches", summary
    assert "policy collapsed" in summary["error"] and "held-out" not in summary["error"], summary


def test_a_resume_with_more_steps_continues_a_converged_run(tmp_path):
    code, summary, _ = train(tmp_path, "run", *CUSTOM, "train.steps=100", "+task.params.warm=60")
    assert summary["status"] == "converged" and 5 <= summary["steps"] < 90, summary
    run_dir, ended = tmp_path / "run", summary["steps"]
    assert resume_training(str(run_dir), [f"train.steps={ended + 10}"]) == 0
    summary, _ = read_run(run_dir)
    assert summary["steps"] == ended + 10 and summary["status"] == "completed", summary


def test_convergence_waits_for_an_evaluation_of_the_same_weights():
    from rlorch.orchestrator.stops import Convergence, Outcome

    check = Convergence(stop_on_converged=True, evaluating=True, share=0.9)
    assert check.outcome(7, {"step": 5, "accuracy": 1.0}, idle=False) is Outcome.evaluate
    assert check.outcome(7, {"step": 7, "accuracy": 0.85}, idle=False) is Outcome.train_on
    assert check.outcome(7, {"step": 7, "accuracy": 0.85}, idle=True) is Outcome.train_on
    assert check.outcome(7, {"step": 7, "accuracy": 0.85}, idle=True) is Outcome.stalled
    assert check.outcome(8, {"step": 8, "accuracy": 0.95}, idle=False) is Outcome.converged
    keep_going = Convergence(stop_on_converged=False, evaluating=False, share=0.9)
    assert keep_going.outcome(3, None, idle=False) is Outcome.train_on
    assert check.after_collapse(9, {"step": 8, "accuracy": 1.0}) is Outcome.evaluate
    assert check.after_collapse(9, {"step": 9, "accuracy": 0.95}) is Outcome.converged
    # Trained on meanwhile (flat groups a flat advantage trains), the next trip reads the
    # evaluation its predecessor asked for instead of asking behind a moving version forever;
    # the trip after that asks about its own version again.
    assert check.after_collapse(12, {"step": 9, "accuracy": 0.5}) is Outcome.evaluate
    assert check.after_collapse(15, {"step": 12, "accuracy": 0.95}) is Outcome.converged
    assert check.outcome(20, {"step": 12, "accuracy": 0.95}, idle=False) is Outcome.evaluate
    assert check.outcome(24, {"step": 20, "accuracy": 0.95}, idle=False) is Outcome.converged
    assert check.after_collapse(9, {"step": 9, "accuracy": 0.85}) is None
    assert keep_going.after_collapse(3, None) is None     # no evaluation to agree: a collapse fails the run


def test_a_window_with_pushed_collapsed_groups_converges_only_at_the_higher_bar_and_never_fails():
    """Collapsed wrong groups under the unlikelihood push (``pushing``): a solved window ends the
    run only at PUSHED_SHARE held-out, and a collapsed one trains on rather than failing."""
    from rlorch.orchestrator.stops import PUSHED_SHARE, Convergence, Outcome

    assert PUSHED_SHARE > 0.9
    check = Convergence(stop_on_converged=True, evaluating=True, share=0.9)
    between = {"step": 7, "accuracy": (0.9 + PUSHED_SHARE) / 2}
    assert check.outcome(7, between, idle=False) is Outcome.converged
    assert check.outcome(7, between, idle=False, pushing=True) is Outcome.train_on
    assert check.outcome(7, {"step": 7, "accuracy": PUSHED_SHARE}, idle=False, pushing=True) is Outcome.converged
    assert check.after_collapse(7, between) is Outcome.converged
    assert check.after_collapse(7, between, pushing=True) is Outcome.train_on
    assert check.after_collapse(7, {"step": 7, "accuracy": 0.5}, pushing=True) is Outcome.train_on
    assert check.after_collapse(7, {"step": 7, "accuracy": 1.0}, pushing=True) is Outcome.converged
    assert check.after_collapse(9, {"step": 7, "accuracy": 1.0}, pushing=True) is Outcome.evaluate
    keep_going = Convergence(stop_on_converged=False, evaluating=True, share=0.9)
    assert keep_going.after_collapse(3, {"step": 3, "accuracy": 0.5}, pushing=True) is Outcome.train_on


def test_held_out_accuracy_at_stop_at_on_stop_after_evaluations_in_a_row_ends_the_run():
    from rlorch.orchestrator.stops import Convergence

    def evals(*accuracies):
        return [{"step": 25 * i, "accuracy": a} for i, a in enumerate(accuracies)]

    check = Convergence(stop_on_converged=True, evaluating=True, share=0.9, stop_at=0.98, stop_after=2)
    assert check.held_out_solved(evals(0.0, 1.0)) is None       # the step-0 evaluation breaks the run of two
    assert check.held_out_solved(evals(0.0, 0.99, 0.97, 1.0)) is None
    why = check.held_out_solved(evals(0.0, 0.5, 0.98, 1.0))
    assert why is not None and "98.0% at step 50, 100.0% at step 75" in why and "eval.stop_at=0.98" in why
    late_first = evals(0.0, 0.5, 0.99, 1.0)[::-1]                # evaluations may finish out of order
    assert check.held_out_solved(late_first) is not None
    assert check.held_out_solved(late_first[1:]) is None          # 0.5 at 25, 0.99 at 50: not yet
    for off in (Convergence(stop_on_converged=True, evaluating=True, share=0.9),
                Convergence(stop_on_converged=False, evaluating=True, share=0.9, stop_at=0.98),
                Convergence(stop_on_converged=True, evaluating=False, share=0.9, stop_at=0.98)):
        assert off.held_out_solved(evals(1.0, 1.0, 1.0)) is None
    once = Convergence(stop_on_converged=True, evaluating=True, share=0.9, stop_at=1.0, stop_after=1)
    assert once.held_out_solved(evals(0.0, 1.0)) is not None and once.held_out_solved(evals(0.0, 0.99)) is None


def test_a_sim_run_ends_converged_on_held_out_accuracy_before_its_steps(tmp_path):
    """The custom task solved from the start: eval.stop_at ends the run on its second evaluation
    at 100%, long before train.steps and without the guard."""
    code, summary, _ = train(tmp_path, "run", *CUSTOM, "train.steps=100", "eval.every=5", "eval.stop_at=1.0",
                             "train.max_empty_batches=1000")
    assert code == 0 and summary["status"] == "converged" and summary["steps"] < 20, summary
    assert "eval.stop_at=1" in summary["reason"], summary


def test_resume_at_a_late_step_keeps_the_bound_and_loses_nothing(tmp_path):
    common = ["rollout.max_staleness=2", "inference.sim.latency=[0.005,0.005]", "trainer.sim.step_time=0.02",
              "rollout.max_concurrent=1000", "trainer.checkpoint_every=5"]
    code, first, _ = train(tmp_path, "run", *common, "train.steps=40")
    assert code == 0 and first["lost"] == 0
    run_dir = tmp_path / "run"
    code = resume_training(str(run_dir / "checkpoints" / "step_000040"), ["train.steps=60"])
    assert code == 0
    summary, steps = read_run(run_dir)
    resumed = [r for r in steps if r["step"] > 40]
    assert resumed[0]["admitted"] <= 3 * 8
    assert max(r["age_max"] for r in resumed) <= 2
    assert summary["lost"] == 0 and summary["trained"] == 60 * 8


def test_sigterm_mid_run_checkpoints_within_the_window_and_resume_trains_the_rest(tmp_path):
    run_dir = tmp_path / "term"
    command = [sys.executable, "-m", "rlorch.cli", "train", "conf=sim", f"run.dir={run_dir}", "run.progress=false",
               "train.steps=400", "trainer.sim.step_time=0.02", "inference.sim.latency=[0.01,0.2]",
               "run.shutdown_timeout=5"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        wait_until(lambda: step_count(run_dir) >= 15, 60, "15 step records")
    except TimeoutError:
        process.kill()
        raise
    sent = time.monotonic()
    process.send_signal(signal.SIGTERM)
    process.wait(timeout=30)
    assert time.monotonic() - sent < 5 + 10, "the shutdown overran run.shutdown_timeout (5 s) by 10 s"
    assert process.returncode == 143
    said = process.stdout.read().decode()
    assert f"next        rlorch resume {run_dir}" in said
    assert "SIGTERM: stopping in order (a run past its start checkpoints its last step), within " \
           "run.shutdown_timeout=5 s" in said, "the stop is said as it begins"
    summary, _ = read_run(run_dir)
    assert summary["status"] == "interrupted" and summary["lost"] == 0
    assert summary["checkpoint"] and summary["persisted_untrained"] + summary["requeued"] > 0
    checkpoint = Path(summary["checkpoint"])
    assert (checkpoint / "orchestrator.json").exists()
    code = resume_training(str(checkpoint), [f"train.steps={summary['steps'] + 10}", "run.progress=false"])
    assert code == 0
    resumed, steps = read_run(run_dir)
    assert resumed["lost"] == 0 and resumed["trained"] == (summary["steps"] + 10) * 8


def test_async_overlaps_generation_and_training(tmp_path):
    """Overlap shows in the rollouts, not the clock: with S=1 batches are generated while the
    trainer trains (rollouts of the previous version reach a batch), with S=0 never. The speed-up
    itself is a figure for scripts/ and the deterministic simulate tests."""
    timing = ["inference.sim.latency=[0.1,0.1]", "trainer.sim.step_time=0.1", "train.steps=15",
              "rollout.max_concurrent=64", "eval.enabled=false"]
    *_, sync_steps = train(tmp_path, "sync", *timing, "rollout.max_staleness=0", "trainer.correction=none")
    *_, steps = train(tmp_path, "async", *timing, "rollout.max_staleness=1")
    assert max(r["age_max"] for r in sync_steps) == 0
    assert sum(r["age_max"] >= 1 for r in steps) >= len(steps) // 2, [r["age_max"] for r in steps]


def test_train_refuses_a_run_dir_that_holds_a_run(tmp_path):
    code, _, _ = train(tmp_path, "once", "train.steps=2")
    assert code == 0
    config = compose(["conf=sim", f"run.dir={tmp_path / 'once'}", "run.progress=false"])
    assert run_training(config, []) == 2


def test_metrics_carry_the_step_keys_and_periodic_gauges_and_eval_records(tmp_path):
    code, summary, steps = train(tmp_path, "metrics", "train.steps=10", "eval.every=5", "eval.prompts=4",
                                 "metrics.interval=0.05")
    assert code == 0
    for key in ("step", "version", "admitted", "age_max", "age_p99", "age_mean", "trainable", "out_queue",
                "in_flight", "parked_s", "reload_s", "reward_mean", "loss", "grad_norm"):
        assert key in steps[-1], key
    assert [r["step"] for r in steps] == list(range(1, 11))
    records = [json.loads(line) for line in (tmp_path / "metrics" / "metrics.jsonl").read_text().splitlines()]
    assert any(r["kind"] == "periodic" and "in_flight" in r for r in records)
    evals = [r for r in records if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [0, 5, 10] and all(r["prompts"] == 4 for r in evals)
    assert summary["eval_step_first"] == 0 and summary["eval_step_last"] == 10
    assert len(trained(tmp_path / "metrics", 3)) == 8
    assert (tmp_path / "metrics" / "report" / "report.md").exists()      # run.report defaults to true


def test_resume_alarm_fails_the_run_when_the_gate_is_not_recovered(tmp_path, monkeypatch):
    common = ["rollout.max_staleness=1", "inference.sim.latency=[0.002,0.002]", "trainer.sim.step_time=0.05",
              "rollout.max_concurrent=10000"]
    code, _, _ = train(tmp_path, "run", *common, "train.steps=20")
    assert code == 0
    from rlorch.orchestrator.gate import CapacityGate

    monkeypatch.setattr(CapacityGate, "on_version_recovered", lambda self, version, buffered=0: None)
    code = resume_training(str(tmp_path / "run" / "checkpoints" / "step_000020"), ["train.steps=40"])
    summary, _ = read_run(tmp_path / "run")
    assert code != 0 and "resume alarm" in summary["error"]


def test_resume_from_a_checkpoint_the_watcher_skipped_past_trains_every_step(tmp_path):
    code, _, _ = train(tmp_path, "skip", "train.steps=20", "trainer.publish_every=3", "trainer.checkpoint_every=10")
    assert code == 0
    run_dir = tmp_path / "skip"
    older = (run_dir / "checkpoints" / "step_000010" / "orchestrator.json").read_text()
    assert resume_training(str(run_dir / "checkpoints" / "step_000010"), ["train.steps=25"]) == 0
    summary, steps = read_run(run_dir)
    assert summary["lost"] == 0 and summary["trained"] == 25 * 8
    trained_groups = sorted(record["group_id"] for step in range(1, 26) for record in trained(run_dir, step))
    assert trained_groups == list(range(len(trained_groups)))
    assert (run_dir / "checkpoints" / "step_000010" / "orchestrator.json").read_text() == older
    assert list((run_dir / "checkpoints").glob("superseded-*/step_000020"))
    # README: the first life's batches past step 10 and the config the override replaced are kept.
    (superseded,) = (run_dir / "rollouts").glob("superseded-*")
    assert sorted(p.name for p in superseded.glob("step_*")) == [f"step_{s:06d}.safetensors" for s in range(11, 21)]
    (before,) = run_dir.glob("config.before-resume-*.yaml")
    assert "steps: 20" in before.read_text() and "steps: 25" in (run_dir / "config.yaml").read_text()


@pytest.mark.parametrize("staleness", [0, 1, 2])
def test_ship_mode_bounds_age_by_two_s_plus_two_and_generates_while_a_batch_is_parked(tmp_path, staleness):
    code, summary, steps = train(tmp_path, "shipbound", "rollout.enforce=ship", f"rollout.max_staleness={staleness}",
                                 "inference.sim.latency=[0.001,0.001]", "trainer.sim.step_time=0.05", "train.steps=15")
    assert code == 0 and summary["lost"] == 0
    assert max(r["age_max"] for r in steps) <= 2 * staleness + 2
    assert any(r["parked_s"] > 0 for r in steps)
    if staleness:
        # Admission is gated on the shipped step, not the live version: while batch k waits,
        # parked, for the trainer, rollouts of batches k+1..k+S are already admitted.
        admitted = 0
        ahead = []
        for r in steps:
            admitted += r["admitted"]
            ahead.append(admitted - r["step"] * 8 if r["parked_s"] > 0 else 0)
        assert max(ahead) > 0, ahead


def test_a_group_that_fails_every_retry_stops_the_run_and_keeps_its_prompt(tmp_path, monkeypatch):
    from rlorch.inference.sim import SimEngine

    original = SimEngine.generate_batch

    async def fails_for_group_30(self, requests):
        if any(request.rid.startswith("g30-") for request in requests):
            raise ConnectionError("engine died")
        return await original(self, requests)

    monkeypatch.setattr(SimEngine, "generate_batch", fails_for_group_30)
    code, summary, _ = train(tmp_path, "failing", "train.steps=50", "trainer.checkpoint_every=2")
    assert code != 0 and summary["status"] == "failed" and "failed 3 times" in summary["error"]
    assert re.search(r"groups? [\d, ]*\b30\b", summary["error"])
    assert summary["lost"] == 0
    state = json.loads((Path(summary["checkpoint"]) / "orchestrator.json").read_text())
    assert 30 in [p["group_id"] for p in state["pending_prompts"]]


def test_a_prompt_that_cannot_be_made_fails_the_run_instead_of_hanging(tmp_path, monkeypatch):
    from rlorch.tasks.episode import PromptSource

    original = PromptSource.make

    def broken_row(self, index, *, is_eval=False):
        if index == 30:
            raise ValueError("bad prompt row 30")
        return original(self, index, is_eval=is_eval)

    monkeypatch.setattr(PromptSource, "make", broken_row)
    code, summary, _ = train(tmp_path, "badrow", "train.steps=50", "rollout.queue_size=8")
    assert code != 0 and "bad prompt row 30" in summary["error"] and summary["lost"] == 0


def test_multi_turn_episodes_keep_replies_unmasked_and_stamp_every_model_turn(tmp_path):
    code, summary, _ = train(tmp_path, "turns", "task=reverse_retry", "task.params.max_turns=3", "train.steps=3",
                             "inference.sim.tokens=3")
    assert code == 0 and summary["lost"] == 0
    rollout = trained(tmp_path / "turns", 1)[0]
    mask, prompt_len = rollout["loss_mask"], rollout["prompt_len"]
    reply = len("no=")
    assert mask == [0] * prompt_len + ([1] * 3 + [0] * reply) * 2 + [1] * 3
    assert sum(count for _, count in rollout["versions"]) == sum(mask) == 9
    assert rollout["episode_id"].count("-") == 2 and rollout["attempt"] == 0


def test_a_flat_reward_on_a_data_set_stops_only_after_one_pass_over_its_prompts(tmp_path):
    """Hard prompts of a real data set may all score 0 for a while: the guard waits one pass
    over the prompts (here 40 prompts, 2 per batch: 20 batch-worths) before it calls the reward flat."""
    data = tmp_path / "qa.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"q{i}=", "answer": f"a{i}"}) + "\n" for i in range(40)))
    code, summary, _ = train(tmp_path, "data", f"data.path={data}", "inference.sim.reward=task",
                             "rollout.group_size=4", "rollout.batch_size=8", "train.max_empty_batches=3")
    assert summary["status"] == "failed" and summary["stop"] == "empty_batches", summary
    assert summary["empty_batches"] == 20, summary
    assert "scaled to one pass over the data set: 20" in summary["error"]


def test_the_failure_window_is_one_pass_over_the_data_between_the_setting_and_its_cap():
    from rlorch.orchestrator.sinks import FAILURE_WINDOW_CAP, failure_window

    assert failure_window(3, None, 16) == 3
    assert failure_window(3, 20, 16) == 3
    assert failure_window(3, 160, 16) == 10
    assert failure_window(3, 10**6, 16) == 3 * FAILURE_WINDOW_CAP
    # Flat groups below the maximum train with an advantage of their own (trainer.flat_advantage):
    # a collapse is given the longest window to move.
    assert failure_window(3, None, 16, flat_signal=True) == 3 * FAILURE_WINDOW_CAP


def _children(pid: int) -> list[int]:
    try:
        return [int(child) for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except FileNotFoundError:
        return []


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_a_ctrl_c_that_omegaconf_reraised_as_its_own_error_after_the_run_dir_is_made_says_interrupted(
        tmp_path, monkeypatch, capsys):
    """A Ctrl-C inside a config read between the run directory and the run's own handlers comes
    out of OmegaConf as its own error, the KeyboardInterrupt as its context: the run says it was
    interrupted (status 130), as for a bare Ctrl-C; any other error still propagates."""
    from omegaconf.errors import ConfigKeyError

    import rlorch.runner as runner

    def cut_short(config) -> None:
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt:
            raise ConfigKeyError("full_key: inference.sim")  # as OmegaConf re-raises it

    monkeypatch.setattr(runner, "_warm_up", cut_short)
    assert run_training(compose([f"run.dir={tmp_path / 'run'}", "inference=sim", "trainer=sim"]), overrides=[]) == 130
    assert "interrupted before the run started" in capsys.readouterr().err and (tmp_path / "run").is_dir()

    def fails(config) -> None:
        raise RuntimeError("not an interrupt")

    monkeypatch.setattr(runner, "_warm_up", fails)
    with pytest.raises(RuntimeError, match="not an interrupt"):
        run_training(compose([f"run.dir={tmp_path / 'again'}", "inference=sim", "trainer=sim"]), overrides=[])


@pytest.mark.parametrize("moment", ["fork_server_started", "run_dir_made"])
def test_ctrl_c_before_the_run_started_says_so_and_leaves_nothing_running(tmp_path, moment):
    """The default ``rlorch train`` starts its fork server first, then composes the config, makes
    the run directory and only then installs the run's own handlers. A Ctrl-C at either moment
    (seen from outside, not guessed by a sleep) ends the command with a word and status 130, and
    the fork server goes with it."""
    run_dir = tmp_path / "run"
    own_fork_server = {**os.environ, "RLORCH_FORKSERVER": "1"}  # not the tests' shared one: its own child
    process = subprocess.Popen([sys.executable, "-m", "rlorch.cli", "train", f"run.dir={run_dir}",
                                "run.progress=false"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               stdin=subprocess.DEVNULL, text=True, env=own_fork_server,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        fork_server = wait_until(lambda: _children(process.pid), 60, "the fork server", interval=0.01)
        if moment == "run_dir_made":
            wait_until(run_dir.exists, 60, "the run directory", interval=0.01)
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=60)
    finally:
        process.kill()
    assert process.returncode == 130 and "interrupted" in err, (moment, process.returncode, err, out)
    wait_until(lambda: all(_gone(pid) for pid in fork_server), 10, "the fork server to exit")


@pytest.mark.parametrize("command", ["caught_by_the_command", "caught_and_ended_with_130"])
def test_a_ctrl_c_that_passed_through_exec_still_ends_the_command_with_its_status(command, tmp_path):
    """CPython marks a KeyboardInterrupt that passed through exec() of source text (dataclasses
    build their methods that way at import) as unhandled for the whole process, and ends it by
    SIGINT (-2) even after the command caught it: the command's own status must still come out.
    Run as a module (``python -m``, as the tests run rlorch) since that is where CPython checks."""
    (tmp_path / "interrupted_in_exec.py").write_text(f"""
import sys
import typer
from rlorch import cli

@cli.app.command()
def caught_by_the_command():
    with cli._interruptible():
        exec("raise KeyboardInterrupt")

@cli.app.command()
def caught_and_ended_with_130():
    try:
        exec("raise KeyboardInterrupt")
    except KeyboardInterrupt:
        print("handled", file=sys.stderr)
    raise typer.Exit(130)

sys.argv = ["rlorch", "{command.replace('_', '-')}"]
cli.main()
""")
    source_root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [source_root, os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-m", "interrupted_in_exec"], capture_output=True, text=True,
                          timeout=60, cwd=tmp_path, env=env)
    assert done.returncode == 130, (done.returncode, done.stderr)
    assert ("interrupted before the run started" if command == "caught_by_the_command" else "handled") in done.stderr


def test_a_ctrl_c_after_the_run_dir_is_made_says_so_and_the_same_run_dir_starts_again(tmp_path, monkeypatch, capsys):
    """Between making the run directory and the run's own signal handlers a Ctrl-C ends the
    command with a word and 130, and leaves nothing that blocks a retry in the same run.dir."""
    import rlorch.runner

    def interrupted(config):
        raise KeyboardInterrupt

    run_dir = tmp_path / "run"
    monkeypatch.setattr(rlorch.runner, "_warm_up", interrupted)
    assert run_training(compose(["conf=sim", f"run.dir={run_dir}", "train.steps=2"]), []) == 130
    assert f"interrupted before the run started: {run_dir} holds no step" in " ".join(capsys.readouterr().err.split())
    monkeypatch.undo()
    code, summary, _ = helpers.train(run_dir, "train.steps=2")
    assert code == 0 and summary["status"] == "completed"


def test_a_run_dir_left_with_only_the_empty_layout_is_taken_as_empty_and_one_with_a_file_is_refused(tmp_path):
    """A start stopped (killed) after making the layout but before config.yaml leaves only empty
    subdirectories and maybe its lock file: that is nothing to keep. A file anywhere is something."""
    from rlorch.rundir.layout import RunDir

    bare = RunDir(tmp_path / "bare").make()
    (bare.root / "LOCK").write_text("999999999\n")
    code, summary, _ = helpers.train(bare.root, "train.steps=2")
    assert code == 0 and summary["status"] == "completed"
    kept = RunDir(tmp_path / "kept").make()
    (kept.logs / "notes.txt").write_text("mine")
    assert run_training(compose(["conf=sim", f"run.dir={kept.root}"]), []) == 2
    assert (kept.logs / "notes.txt").read_text() == "mine" and not kept.config.exists()


def test_a_ctrl_c_that_omegaconf_rewrapped_still_ends_with_the_interrupted_word(capsys):
    """OmegaConf re-raises what interrupts a structured config's checks as a ValidationError whose
    context is the KeyboardInterrupt: the command still ends with status 130 and the word."""
    import typer
    from omegaconf.errors import ValidationError

    from rlorch.cli import _interruptible

    with pytest.raises(typer.Exit) as ended:
        with _interruptible():
            try:
                raise KeyboardInterrupt
            except KeyboardInterrupt:
                raise ValidationError("full_key: run object_type=RunConfig")
    assert ended.value.exit_code == 130 and "interrupted" in capsys.readouterr().err
    with pytest.raises(ValidationError):
        with _interruptible():
            raise ValidationError("a real config error stays one")


def test_filter_budget_ships_short_batches_in_a_run_where_most_groups_are_filtered(tmp_path):
    """Two in three groups score the same on every sample (filtered). With a budget of one
    batch's worth of filtered rollouts each batch ships short once it is spent (a group in
    flight may overshoot it); with no budget every batch waits to fill."""
    mostly_filtered = ["task=custom", "task.name=tests.mostly_solved:MostlySolved", "inference.sim.reward=task",
                       "+task.params.every=3", "rollout.group_size=4", "rollout.batch_size=16", "train.steps=6",
                       "train.stop_on_converged=false"]
    code, summary, steps = train(tmp_path, "budget", *mostly_filtered, "rollout.filter_budget=1")
    assert code == 0 and summary["short_batches"] == 6, summary
    assert all(s["rollouts"] < 16 and s["filtered"] <= 16 + 2 * 4 for s in steps), steps
    code, summary, steps = train(tmp_path, "unbounded", *mostly_filtered, "rollout.filter_budget=0")
    assert code == 0 and summary["short_batches"] == 0 and all(s["rollouts"] == 16 for s in steps), summary


def test_a_resume_clears_every_later_weight_version_a_killed_one_without_its_marker_too(tmp_path):
    """A version killed between its rename and its PUBLISHED marker is still in the way of the
    same step published again: superseding a trajectory removes it with the marked ones."""
    from rlorch.rundir.layout import PUBLISHED, RunDir
    from rlorch.rundir.resume import supersede

    run_dir = RunDir(tmp_path / "run")
    for step, marked in ((5, True), (12, True), (13, False)):
        version = run_dir.weights / f"step_{step:06d}"
        version.mkdir(parents=True)
        (version / "model.safetensors").write_bytes(b"x")
        if marked:
            (version / PUBLISHED).touch()
    supersede(run_dir, 10, "now")
    assert sorted(path.name for path in run_dir.weights.iterdir()) == ["step_000005"]
