"""The fault suite: kills, signals, corrupt checkpoints, a shared run directory, a full disk,
hostile requests and non-finite training, on real processes on CPU (see ``tests/faults.py``).

Each case asserts what an operator relies on: no process of the run survives it by more than
10 s, it ends within a stated bound, ``lost`` = 0, no group id is trained twice after a resume,
and data from before the fault is untouched. ``pytest -m faults`` runs the suite alone;
``scripts/fault_report.py`` prints the same cases as a table.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

import faults  # noqa: E402

from rlorch.config.schema import ConfigError  # noqa: E402

pytestmark = pytest.mark.faults


def assert_clean(outcome: faults.Outcome, *, exit_within: float) -> None:
    assert outcome.ok, outcome.notes
    assert outcome.leftovers == 0
    assert outcome.exit_s is not None and outcome.exit_s <= exit_within, outcome
    assert outcome.lost in (0, None) and outcome.duplicates in (0, None)


# ---- every case of faults.CASES ------------------------------------------------------------

EXIT_WITHIN = {
    "kill_orchestrator": faults.LEFTOVER_BOUND_S, "kill_torchrun": 15, "kill_worker": 15, "kill_engine": 30,
    "freeze_engine": 240, "freeze_only_engine": 4 + 20, "sigterm_startup": 30, "sigint_startup": 30,
    "sigint_twice": 30, "sigterm_twice": 30, "corrupt_newest": 30, "corrupt_older": 30, "two_processes": 30,
    "disk_full": 60, "nonfinite_config": 30, "nonfinite_training": 240, "serve_limits": 30}
"""Seconds from the fault to the end of the run (or the refusal, or the 413), per case."""

QUICK = {"corrupt_newest", "corrupt_older", "two_processes", "disk_full", "nonfinite_config"}
"""Cases on the sim backends or refused before anything starts; the rest start real engines
and the FSDP trainer and are marked slow."""


def test_every_case_has_a_bound():
    assert set(EXIT_WITHIN) == set(faults.CASES)


@pytest.mark.parametrize("case", [pytest.param(name, marks=[] if name in QUICK else [pytest.mark.slow])
                                  for name in faults.CASES])
def test_fault_case(tmp_path, case):
    """Each case of the fault suite (``tests/faults.py`` says what each asserts): it ends within
    its bound, leaves no process behind, loses and repeats nothing."""
    assert_clean(faults.CASES[case](tmp_path), exit_within=EXIT_WITHIN[case])


@pytest.mark.slow
def test_the_trainer_skips_non_finite_gradients_and_fails_on_the_third_in_a_row(tmp_path):
    import test_trainer as trainer

    run, config = trainer._make_run(tmp_path / "run", "train.steps=5", "trainer.correction=none",
                                    "rollout.max_staleness=0")
    for step in range(1, 6):
        trainer._write_batch(run, step, [trainer._rollout("123=", "321", 1.0, logprob=-1e30),
                                         trainer._rollout("123=", "999", -1.0, logprob=-1e30)])
    code, output = trainer._finish(trainer._launch(config, run))
    assert code != 0 and "non-finite gradients at steps 1..3" in output, output
    assert [(m["step"], m["skipped_updates"]) for m in trainer._metrics(run)] == [(1, 1), (2, 1)]
    assert [step for step, _ in run.published_weights()] == [1, 2]


# ---- the run directory ----------------------------------------------------------------------

def test_a_truncated_trainer_state_is_named_with_its_exception(tmp_path):
    run_dir = tmp_path / "run"
    faults.sim_run(run_dir, steps=10)
    state = run_dir / "checkpoints" / "step_000010" / "trainer" / "trainer_state.json"
    os.truncate(state, 10)
    digest = faults.tree_digest(run_dir)
    run = faults.Run("resume", f"checkpoint={run_dir}/checkpoints/step_000010")
    assert run.wait(60) == 2
    assert "trainer_state.json: unreadable (JSONDecodeError" in " ".join(run.output.split())
    assert faults.tree_digest(run_dir) == digest


def test_the_run_lock_names_its_holder_and_is_taken_over_after_it(tmp_path):
    from rlorch.launch.runlock import RunLock

    with RunLock(tmp_path) as held:
        assert RunLock(tmp_path).holder() == os.getpid()
        with pytest.raises(ConfigError, match=f"in use by process {os.getpid()}"):
            RunLock(tmp_path).acquire()
        assert held.path.exists()
    assert not (tmp_path / "LOCK").exists() and RunLock(tmp_path).holder() is None
    (tmp_path / "LOCK").write_text("999999999\n")
    with RunLock(tmp_path):
        assert RunLock(tmp_path).holder() == os.getpid()


def test_a_failed_start_does_not_block_a_retry_with_the_same_run_dir(tmp_path):
    run_dir = tmp_path / "retry"
    failed = faults.Run("train", f"run.dir={run_dir}", *faults.SIM, "inference=cpu", "inference.ready_timeout=0.01")
    assert failed.wait(60) == 1 and "not ready after" in failed.output, failed.output
    assert faults.summary(run_dir)["status"] == "failed" and faults.leftovers_after(failed.tag) == 0
    again = faults.Run("train", f"run.dir={run_dir}", *faults.SIM, "train.steps=3")
    assert again.wait(60) == 0, again.output
    assert faults.summary(run_dir)["status"] == "completed"
    assert list(run_dir.glob("failed-start-*/config.yaml"))


def test_bad_input_gets_one_line_naming_the_file_and_line_and_leaves_no_run_dir(tmp_path):
    cases = {"bad.jsonl": (b'{"prompt": "a", "answer": "b"}\n{bad\n', "bad.jsonl:2: not valid JSON"),
             "empty.jsonl": (b"", "empty.jsonl: no examples"),
             "missing.jsonl": (b'{"prompt": "a"}\n', "missing.jsonl:1: missing key(s) 'answer'"),
             "latin.jsonl": (b'{"prompt": "a", "answer": "b"}\n\xff\xfe\n', "latin.jsonl:2: not UTF-8")}
    for name, (content, expected) in cases.items():
        (tmp_path / name).write_bytes(content)
        for command in ("train", "validate-config"):
            run = faults.Run(command, *faults.SIM, f"run.dir={tmp_path / 'run'}", f"data.path={tmp_path / name}")
            assert run.wait(60) == 2, run.output
            assert expected in " ".join(run.output.split()) and "Traceback" not in run.output, run.output
    assert not (tmp_path / "run").exists()
    checks = [(("train", *faults.SIM, "task.name=nope"), "task.name: unknown task 'nope'"),
              (("validate-config", "model.path=/nonexistent"), "model.path: /nonexistent is not an HF model"),
              (("train", *faults.SIM, f"run.dir={tmp_path / 'file' / 'run'}"), "run.dir: cannot create"),
              (("simulate", "--plot", str(tmp_path / "nodir" / "x.png")), "--plot:")]
    (tmp_path / "file").write_text("")
    for args, expected in checks:
        run = faults.Run(*args)
        assert run.wait(60) == 2 and expected in " ".join(run.output.split()), run.output
        assert "Traceback" not in run.output, run.output


def test_serve_on_a_busy_port_says_so_in_one_line(model_dir):
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        run = faults.Run("serve", "--port", str(busy.getsockname()[1]), f"model.path={model_dir}")
        assert run.wait(120) == 2
    assert "cannot serve on 127.0.0.1" in run.output and "Traceback" not in run.output, run.output


# ---- non-finite numbers ---------------------------------------------------------------------

def test_an_engine_whose_generation_loop_fails_answers_500_and_fails_health(model_dir, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    from rlorch.inference.client import SGLangEngine
    from rlorch.inference.pool import EnginePool
    from rlorch.serve.server import CpuServer, ServerThread
    from rlorch.types import SamplingParams

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            param.fill_(float("nan"))
    model.save_pretrained(tmp_path / "nan")
    thread = ServerThread(CpuServer(model_dir, threads=1))

    async def scenario():
        engine = SGLangEngine(thread.address, request_timeout=30)
        pool = EnginePool([engine], request_timeout=2, max_retries=1)
        try:
            await engine.reload(str(tmp_path / "nan"), 1)
            with pytest.raises(Exception) as failure:
                await pool.generate([5, 6, 7], SamplingParams(max_new_tokens=3), "nan")
            return str(failure.value), await engine.healthy(), pool.gauges()["servers_up"]
        finally:
            await pool.close()

    try:
        message, healthy, up = asyncio.run(scenario())
        status = _status(f"http://{thread.address}/health")
    finally:
        thread.stop()
    assert "500" in message and "generation loop failed" in message
    assert not healthy and up == 0 and status == 503


# ---- hostile requests -----------------------------------------------------------------------

def test_serve_refuses_an_oversized_body_and_times_out_slow_and_idle_clients(model_dir):
    from rlorch.serve.server import CpuServer, ServerThread

    thread = ServerThread(CpuServer(model_dir, threads=1, body_timeout=1.0, idle_timeout=2.0))
    port = int(thread.address.rsplit(":", 1)[1])
    try:
        assert faults.post_status(port, "/generate", 50_000_000) == 413
        assert _status(f"http://{thread.address}/health") == 200
        assert faults.slow_and_idle_closed(port, within=10) == []
    finally:
        thread.stop()


def test_serve_checks_sizes_before_reading_or_tokenising(model_dir):
    from rlorch.serve.http import MAX_BODY_BYTES
    from rlorch.serve.server import CpuServer, ServerThread

    server = CpuServer(model_dir, threads=1)
    thread = ServerThread(server)
    base = f"http://{thread.address}"
    try:
        text = json.dumps({"text": "1" * (server.max_text_chars + 1)}).encode()
        too_long = urllib.request.Request(f"{base}/generate", data=text)
        assert _status(too_long) == 400
        declared = urllib.request.Request(f"{base}/generate", data=b"{}",
                                          headers={"Content-Length": str(MAX_BODY_BYTES + 1)})
        assert _status(declared) == 413
        assert _status(f"{base}/health") == 200
    finally:
        thread.stop()


def test_serve_with_an_api_key_refuses_requests_without_it(model_dir):
    from rlorch.inference.client import EngineError, SGLangEngine
    from rlorch.serve.server import CpuServer, ServerThread

    thread = ServerThread(CpuServer(model_dir, threads=1, api_key="k3y"))
    base = f"http://{thread.address}"

    async def with_key(key):
        engine = SGLangEngine(thread.address, api_key=key)
        try:
            return await engine.weight_version()
        finally:
            await engine.close()

    try:
        update = urllib.request.Request(f"{base}/update_weights_from_disk", method="POST",
                                        data=json.dumps({"model_path": "/any/dir", "weight_version": "x"}).encode())
        assert _status(update) == 401
        assert _status(f"{base}/generate") == 401 and _status(f"{base}/health") == 200
        assert asyncio.run(with_key("k3y")) == 0
        with pytest.raises(EngineError, match="401"):
            asyncio.run(with_key("wrong"))
    finally:
        thread.stop()


def test_launched_engines_get_a_fresh_key_kept_out_of_logs_and_ps(model_dir, tmp_path):
    from rlorch.inference.client import EngineError, SGLangEngine
    from rlorch.inference.servers import start_engines
    from test_pool import cpu_config

    async def scenario():
        pool = await start_engines(cpu_config(1), log_dir=tmp_path / "logs", servers_file=tmp_path / "s.json",
                                   model_path=model_dir)
        try:
            engine = pool.engines[0]
            pid = json.loads((tmp_path / "s.json").read_text())[0]["pid"]
            key = engine._headers["Authorization"].removeprefix("Bearer ")
            without = SGLangEngine(engine.url)
            try:
                with pytest.raises(EngineError, match="401"):
                    await without.weight_version()
            finally:
                await without.close()
            return key, Path(f"/proc/{pid}/cmdline").read_bytes(), await engine.weight_version()
        finally:
            await pool.close()

    key, cmdline, version = asyncio.run(scenario())
    assert version == 0 and len(key) >= 24
    assert key.encode() not in cmdline and key not in (tmp_path / "logs" / "server-0.log").read_text()


def test_the_guard_kills_what_its_command_left_behind_orphans_included_and_removes_its_directory(tmp_path):
    """Asked to stop (SIGUSR1, as a run stops its private cluster), the guard stops its command;
    the grandchild the command started in a session of its own, re-parented to the guard (a
    subreaper) once the command is gone, is killed too, and the directory named by --remove is
    gone. (Ray's agents outlive their raylet so.)"""
    from rlorch.lifecycle import ORCHESTRATOR_PID_ENV, process_running

    marker, scratch = tmp_path / "grandchild.pid", tmp_path / "scratch"
    scratch.mkdir()
    (tmp_path / "grandchild.py").write_text(f"import os, time\nopen({str(marker)!r}, 'w').write(str(os.getpid()))\n"
                                            "time.sleep(120)\n")
    command = [sys.executable, "-c", "import subprocess, sys, time; subprocess.Popen([sys.executable, sys.argv[1]], "
               "start_new_session=True); time.sleep(30)", str(tmp_path / "grandchild.py")]
    guard = subprocess.Popen([sys.executable, "-m", "rlorch.launch.guard", "--remove", str(scratch), *command],
                             start_new_session=True, env={**os.environ, ORCHESTRATOR_PID_ENV: str(os.getpid())})
    faults.wait_for(lambda: marker.exists() and marker.read_text(), 30, "the grandchild")
    grandchild = int(marker.read_text())
    os.kill(guard.pid, signal.SIGUSR1)
    assert guard.wait(20) == 0
    faults.wait_for(lambda: not process_running(grandchild), 10, "the grandchild to die with the guard's tree")
    assert not scratch.exists()


def test_a_zombie_orchestrator_is_gone_for_the_processes_that_watch_it():
    from rlorch.lifecycle import process_alive, process_running

    orchestrator = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    assert process_running(orchestrator.pid)
    orchestrator.kill()
    faults.wait_for(lambda: not process_running(orchestrator.pid), 10, "the killed process to be a zombie")
    assert process_alive(orchestrator.pid)    # not reaped yet: it still exists
    orchestrator.wait()


def test_the_guard_takes_a_launched_server_down_with_its_orchestrator(tmp_path):
    """SGLang does not watch its orchestrator: the guard it is launched under kills it once the
    orchestrator is gone, and otherwise passes the server's own exit status through."""
    from rlorch.lifecycle import ORCHESTRATOR_PID_ENV, process_alive

    marker = tmp_path / "server.pid"
    server = [sys.executable, "-c", f"import os, time; open({str(marker)!r}, 'w').write(str(os.getpid())); "
                                    "time.sleep(120)"]
    orchestrator = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    guard = subprocess.Popen([sys.executable, "-m", "rlorch.launch.guard", *server], start_new_session=True,
                             env={**os.environ, ORCHESTRATOR_PID_ENV: str(orchestrator.pid)})
    faults.wait_for(lambda: marker.exists() and marker.read_text(), 30, "the guarded server")
    server_pid = int(marker.read_text())
    orchestrator.kill()
    orchestrator.wait()
    assert guard.wait(10) == -signal.SIGKILL
    faults.wait_for(lambda: not process_alive(server_pid), 10, "the server to die with its orchestrator")

    marker.unlink()
    guard = subprocess.Popen([sys.executable, "-m", "rlorch.launch.guard", *server], start_new_session=True,
                             env={**os.environ, ORCHESTRATOR_PID_ENV: str(os.getpid())})
    faults.wait_for(lambda: marker.exists() and marker.read_text(), 30, "the guarded server")
    os.killpg(guard.pid, signal.SIGTERM)
    assert guard.wait(10) == 128 + signal.SIGTERM


def _status(request) -> int:
    try:
        return urllib.request.urlopen(request, timeout=30).status
    except urllib.error.HTTPError as err:
        return err.code


# ---- step records ---------------------------------------------------------------------------

def test_step_records_wait_for_their_trainer_line_joined_by_step(tmp_path):
    from rlorch.orchestrator.steps import StepRecords
    from rlorch.types import Batch
    from test_components import rollout

    lines = tmp_path / "metrics.jsonl"
    records = StepRecords(lines)
    for step in (1, 2, 3):
        records.shipped(Batch(step=step, rollouts=[rollout(step, 1.0, [[step - 1, 2]])], advantages=[0.0]),
                        admitted_total=1, parked_s=0.0)
    lines.write_text(json.dumps({"step": 1, "loss": 0.5, "grad_norm": 1.0}) + "\n")
    first = records.ready(2)
    assert [r["step"] for r in first] == [1] and first[0]["loss"] == 0.5
    with open(lines, "a") as handle:
        handle.write(json.dumps({"step": 2, "loss": 0.25, "grad_norm": 2.0, "kl": 0.1}) + "\n")
    second = records.ready(3)
    assert [(r["step"], r["loss"], r["kl"]) for r in second] == [(2, 0.25, 0.1)]
    assert [(r["step"], r["loss"]) for r in records.ready(3, final=True)] == [(3, None)]
