"""Real runs on CPU: `rlorch serve` engines, the FSDP2 trainer under torchrun, the tiny model."""

from __future__ import annotations

import itertools
import json
import re
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from faults import tree_digest
from helpers import free_port, of_kind, read_metrics, step_count, trained, wait_answering, wait_until

# Admission-side gating bounds what is admitted; observed age may overshoot S when completion
# times vary. Tests that assert the age bound on real runs use strict mode, which never trains
# a token older than S.
STRICT = "rollout.enforce=strict"
SMALL = ["rollout.batch_size=16", "rollout.group_size=4", "rollout.max_concurrent=48", "run.progress=false",
         "inference.num_servers=1"]


@pytest.fixture
def env() -> dict:
    return {**os.environ, "PYTHONUNBUFFERED": "1"}


def rlorch(env: dict, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rlorch.cli", *args], env=env, capture_output=True,
                          text=True, timeout=timeout)


def records(run_dir: Path) -> tuple[dict, list[dict]]:
    """The summary and every record (of all kinds) of a finished run."""
    return json.loads((run_dir / "summary.json").read_text()), read_metrics(run_dir)


@pytest.mark.slow
def test_train_then_resume_continues_from_the_checkpoint(env, tmp_path):
    """A 4-step run resumes from its step-4 checkpoint with the age bound held. A resume from the
    step-2 checkpoint with a truncated DCP shard, or truncated HF weights, is refused naming the
    file and leaves the run directory byte-identical."""
    run_dir = tmp_path / "real"
    done = rlorch(env, "train", f"run.dir={run_dir}", "train.steps=4", "trainer.checkpoint_every=2", STRICT, *SMALL)
    assert done.returncode == 0, done.stderr
    summary, lines = records(run_dir)
    assert summary["lost"] == 0 and summary["steps"] == 4
    step_lines = of_kind(lines, "step")
    assert all(r["loss"] is not None and r["grad_norm"] is not None for r in step_lines)
    assert (run_dir / "config.yaml").exists() and (run_dir / "rollouts" / "step_000004.safetensors").exists()

    from transformers import AutoModelForCausalLM

    published = sorted((run_dir / "weights").glob("step_*"))
    assert published and (published[-1] / "PUBLISHED").exists()
    AutoModelForCausalLM.from_pretrained(published[-1])

    older = run_dir / "checkpoints" / "step_000002"
    # A single CPU rank's trainer state is one safetensors file (several ranks write DCP shards).
    for damaged in (older / "trainer" / "state.safetensors", max((older / "weights").glob("*.safetensors"))):
        intact = damaged.read_bytes()
        damaged.write_bytes(intact[: len(intact) // 2])
        digest = tree_digest(run_dir)
        refused = rlorch(env, "resume", f"checkpoint={older}", "train.steps=6")
        assert refused.returncode == 2 and str(damaged) in refused.stderr + refused.stdout, refused.stderr
        assert tree_digest(run_dir) == digest
        damaged.write_bytes(intact)

    again = rlorch(env, "resume", f"checkpoint={run_dir / 'checkpoints' / 'step_000004'}", "train.steps=6")
    assert again.returncode == 0, again.stderr
    summary, lines = records(run_dir)
    resumed = [r for r in of_kind(lines, "step") if r["step"] > 4]
    assert [r["step"] for r in resumed] == [5, 6]
    assert resumed[0]["admitted"] <= 3 * 16 and max(r["age_max"] for r in resumed) <= 2
    assert summary["lost"] == 0 and summary["steps"] == 6


@pytest.mark.slow
def test_a_checkpoint_holding_a_nan_fails_its_resume_at_load_and_the_next_resume_takes_the_one_before(env, tmp_path):
    """Values damaged on disk pass every size check; the trainer finds them when it loads the
    checkpoint, before a step, and marks it: `rlorch resume RUN` then takes the newest one before."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    run_dir = tmp_path / "nan"
    done = rlorch(env, "train", f"run.dir={run_dir}", "train.steps=4", "trainer.checkpoint_every=2", *SMALL)
    assert done.returncode == 0, done.stderr
    state = run_dir / "checkpoints" / "step_000004" / "trainer" / "state.safetensors"
    with safe_open(str(state), "pt") as source:
        tensors, metadata = {key: source.get_tensor(key) for key in source.keys()}, source.metadata()
    damaged = next(key for key, tensor in tensors.items() if tensor.is_floating_point() and tensor.dim() == 2)
    tensors[damaged][0, 0] = float("nan")
    save_file(tensors, str(state), metadata=metadata)

    failed = rlorch(env, "resume", str(run_dir), "train.steps=6")
    said = " ".join((failed.stdout + failed.stderr).split())
    assert failed.returncode != 0 and "hold non-finite values" in said and "step_000004" in said, said
    marker = state.parent / "NONFINITE"
    assert marker.exists() and "non-finite" in marker.read_text()
    again = rlorch(env, "resume", str(run_dir), "train.steps=6")
    assert again.returncode == 0, again.stderr
    assert "at step 3" in again.stdout + again.stderr
    summary, lines = records(run_dir)
    assert summary["steps"] == 6 and summary["lost"] == 0
    assert [r["step"] for r in of_kind(lines, "step")] == [1, 2, 3, 4, 5, 6]


@pytest.mark.slow
def test_sync_preset_trains_on_policy_at_every_step(env, tmp_path):
    run_dir = tmp_path / "sync"
    done = rlorch(env, "train", "conf=sync", f"run.dir={run_dir}", "train.steps=4", *SMALL)
    assert done.returncode == 0, done.stderr
    _, lines = records(run_dir)
    steps = of_kind(lines, "step")
    assert [r["age_max"] for r in steps] == [0, 0, 0, 0]
    # S=0: every token was sampled from the weights the trainer holds, so the engine's and the
    # trainer's logprobs of it must agree.
    assert all(r["mismatch_tokens"] > 0 and r["mismatch_kl"] < 1e-3 for r in steps), steps


@pytest.mark.slow
def test_mismatch_kl_exposes_an_engine_serving_other_weights(env, tmp_path, perturbed_dir):
    """The engine starts on perturbed weights but claims version 0: step 1's tokens are stamped
    with the trainer's version yet were sampled elsewhere. Once the engine loads the trainer's
    version 1, the mismatch disappears."""
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "rlorch.cli", "serve", f"model.path={perturbed_dir}",
                               "--port", str(port)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    try:
        run_dir = tmp_path / "mismatch"
        done = rlorch(env, "train", "conf=sync", f"run.dir={run_dir}", "train.steps=2",
                      f"inference.addresses=[127.0.0.1:{port}]", *SMALL)
        assert done.returncode == 0, done.stderr
    finally:
        server.terminate()
        server.communicate(timeout=30)
    first, second = of_kind(records(run_dir)[1], "step")
    assert first["mismatch_kl"] > 0.05 and first["mismatch_max"] > 0.5, first
    assert second["mismatch_kl"] < 1e-3, second


@pytest.mark.slow
def test_interrupted_real_run_resumes_without_losing_rollouts(env, tmp_path):
    run_dir = tmp_path / "interrupted"
    command = [sys.executable, "-m", "rlorch.cli", "train", f"run.dir={run_dir}", "train.steps=200",
               "trainer.checkpoint_every=50", "run.shutdown_timeout=20", STRICT, *SMALL]
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wait_until(lambda: process.poll() is not None or step_count(run_dir) >= 3, 180, "three step records")
    process.send_signal(signal.SIGTERM)
    output, _ = process.communicate(timeout=60)
    assert process.returncode == 143, output
    summary, _ = records(run_dir)
    assert summary["status"] == "interrupted" and summary["lost"] == 0 and summary["checkpoint"]
    stopped_at = summary["steps"]
    again = rlorch(env, "resume", f"checkpoint={summary['checkpoint']}", f"train.steps={stopped_at + 2}")
    assert again.returncode == 0, again.stderr
    summary, lines = records(run_dir)
    assert summary["lost"] == 0 and summary["steps"] == stopped_at + 2
    assert max(r["age_max"] for r in of_kind(lines, "step") if r["step"] > stopped_at) <= 2


@pytest.mark.slow
def test_the_default_run_learns(env, tmp_path):
    """`rlorch train` with no arguments: the product's main job, on the embedded CPU default.

    Exact match on held-out prompts under greedy decoding: a model that only learned the
    answer's format (three digits) scores about 0.1% on it, so the gain is the task itself.
    A few runs in a hundred end below 80% (a collapse the default's unlikelihood push is still
    undoing at the step limit: scripts/bench_stuck.py counts them; docs/learning.md). Under the push a
    collapse trains on rather than failing the run; a run the guard does end `failed` on one
    names it in its reason. Such a run has still learned, which is what this asserts of it."""
    run_dir = tmp_path / "default"
    done = rlorch(env, "train", f"run.dir={run_dir}", "run.progress=false", timeout=600)
    summary, lines = records(run_dir)
    stuck = summary["status"] == "failed" and summary["stop"] == "empty_batches" and "policy collapsed" in summary["reason"]
    assert done.returncode == (1 if stuck else 0), done.stderr
    evals = [r for r in lines if r["kind"] == "eval"]
    assert evals[0]["step"] == 0 and evals[0]["prompts"] >= 90
    assert summary["eval_accuracy_first"] <= 0.1 and summary["eval_accuracy_last"] >= 0.8, evals
    assert (stuck or summary["status"] in ("completed", "converged")) and summary["lost"] == 0, summary
    measured = [r["mismatch_kl"] for r in of_kind(lines, "step") if r["mismatch_kl"] is not None]
    assert measured and max(measured) < 1e-3
    answer = served_answer(env, run_dir, "407=")
    assert answer == "704" or stuck and len(answer) == 3 and answer.isdigit(), answer


def served_answer(env: dict, run_dir: Path, text: str) -> str:
    """`rlorch serve model.path=RUN_DIR` (the run's newest weights) asked for ``text`` as text,
    greedy, with the run's length limit (3: the model never learned to stop by itself): the text
    request is tokenized as training tokenized the prompt."""
    import urllib.request

    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "rlorch.cli", "serve", f"model.path={run_dir}",
                               "--port", str(port)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        # A loaded machine may take a minute to import and load.
        wait_answering(f"http://127.0.0.1:{port}/health", server, 300, what="rlorch serve",
                       output=lambda: server.stderr.read().decode())
        body = json.dumps({"text": text, "sampling_params": {"max_new_tokens": 3, "temperature": 0}}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{port}/generate", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=30) as response:
            return json.loads(response.read())["text"]
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=30)


@pytest.mark.slow
def test_a_tool_using_environment_runs_its_episodes_end_to_end(env, tmp_path):
    """calculator: model turn (the call), the tool's result (untrained), model turn (the answer);
    every model token carries the version of the weights that produced it."""
    from rlorch.model import build_tokenizer
    from rlorch.tasks.calculator import calculate

    run_dir = tmp_path / "tool"
    done = rlorch(env, "train", "task=calculator", f"run.dir={run_dir}", "train.steps=3", *SMALL)
    assert done.returncode == 0, done.stderr
    summary, _ = records(run_dir)
    assert summary["lost"] == 0 and summary["steps"] == 3
    tokenizer = build_tokenizer()
    bar = tokenizer.convert_tokens_to_ids("|")
    for number in (1, 3):
        for rollout in trained(run_dir, number):
            tokens, mask, prompt_len = rollout["tokens"], rollout["loss_mask"], rollout["prompt_len"]
            runs = [(m, len(list(g))) for m, g in itertools.groupby(mask[prompt_len:])]
            assert [m for m, _ in runs] == [1, 0, 1], runs  # call, tool result, answer
            call_len, result_len = runs[0][1], runs[1][1]
            result = tokenizer.decode(tokens[prompt_len + call_len:prompt_len + call_len + result_len])
            assert result.startswith("=") and result.endswith("|"), result
            call = tokenizer.decode(tokens[prompt_len:prompt_len + call_len], skip_special_tokens=True)
            assert result == f"={calculate(call)}|"
            assert tokens[prompt_len + call_len - 1] in (bar, tokenizer.eos_token_id) or call_len == 8
            assert all(lp == 0.0 for lp, m in zip(rollout["logprobs"], mask) if not m)
            assert sum(count for _, count in rollout["versions"]) == sum(mask)
            assert all(0 <= version <= number - 1 for version, _ in rollout["versions"])


@pytest.mark.slow
def test_the_sync_preset_trains_only_age_0_tokens_for_400_steps_past_convergence(env, tmp_path):
    """S=0 means every trained token was sampled by the weights being trained, through the
    filtered groups, regenerated groups and short batches of a run that has learned the task
    (filtering on: kept, zero-variance groups make neither)."""
    run_dir = tmp_path / "sync400"
    done = rlorch(env, "train", "conf=sync", f"run.dir={run_dir}", "train.steps=400", "train.stop_on_converged=false",
                  "rollout.filter_groups=true", "trainer.flat_advantage=zero",
                  "run.report=false", "run.progress=false", "inference.num_servers=1", "inference.cpu.max_batch=128",
                  "rollout.pack_samples=128", timeout=600)
    summary, lines = records(run_dir)
    steps = of_kind(lines, "step")
    # Filtering needs flat_advantage=zero, which leaves about 1 run in 25 collapsed on a wrong
    # answer (docs/learning.md); the guard then fails it. The age bound is still this test's question.
    collapsed = summary["status"] == "failed" and "collapsed" in summary["reason"]
    assert done.returncode == 0 or collapsed, done.stderr
    if not collapsed:
        solved_at = min(r["step"] for r in lines if r["kind"] == "eval" and r["accuracy"] == 1.0)
        assert len(steps) >= solved_at + 25, (solved_at, len(steps), summary)
    assert summary["lost"] == 0 and len(steps) >= 200, summary
    assert any(r["rollouts"] < 128 for r in steps), "no short batch: the run never reached the filtered regime"
    assert [r["step"] for r in steps if r["age_max"] != 0] == []


def test_the_sync_preset_is_strict():
    """Admission alone lets a short batch's leftovers train one version old."""
    from rlorch.config.compose import compose
    from rlorch.config.schema import Enforce

    config = compose(["conf=sync"])
    assert config.rollout.max_staleness == 0 and config.rollout.enforce is Enforce.strict


@pytest.mark.slow
def test_an_interrupt_in_start_up_ends_at_once_says_what_to_do_and_leaves_no_stop_file(env, tmp_path):
    """Start-up blocks on nothing the signal waits for: the run ends within seconds, says it was
    interrupted before anything was trained (in start-up, or before the first step when the
    start was quicker than the signal; not a report of dashes), shows the command that starts
    it again, and leaves no STOP request behind."""
    run_dir = tmp_path / "early"
    process = subprocess.Popen([sys.executable, "-m", "rlorch.cli", "train", f"run.dir={run_dir}"], env=env,
                               stderr=subprocess.PIPE, text=True,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    # A process's log file is made by the launcher inside the run's start-up, after its signal
    # handlers are in; the run directory itself comes earlier, before the config is resolved.
    deadline = time.monotonic() + 60
    while not (run_dir.joinpath("logs").exists() and any(run_dir.joinpath("logs").iterdir())):
        assert time.monotonic() < deadline, "no process was launched within 60 s"
        time.sleep(0.02)
    sent = time.time()
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=60)
    assert process.returncode == 130, err
    # The run ends within seconds of its start (the signal came as its first process launched),
    # not after a start-up of 9 s quiet, 20 s loaded; the processes it started then stop, which
    # a loaded machine makes slower, within a looser bound.
    ended = re.search(r"interrupted steps=0 wall=([\d.]+)s", err)
    assert ended and float(ended[1]) < 6, err
    assert time.time() - sent < 20, err
    assert ("interrupted in start-up: nothing was admitted or trained" in err
            or re.search(r"interrupted before the first step: nothing was trained \(\d+ rollouts admitted\)", err)), err
    assert "- -> -" not in err, err
    assert f"start again with: rlorch train run.dir={run_dir}" in err, err
    assert not (run_dir / "STOP").exists()
