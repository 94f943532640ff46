"""The fork server starts rlorch's own processes as forks of a warm interpreter, and what the
launcher and trainer see of them behaves like a ``subprocess.Popen``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

from helpers import wait_answering, wait_until
from rlorch.config.compose import compose
from rlorch.launch import forkserver


def test_forked_command_runs_as_python_m_with_its_env_log_and_status(tmp_path):
    log = tmp_path / "child.log"
    process = forkserver.spawn([sys.executable, "-m", "rlorch.cli", "validate-config", "rollout.batch_size=0"],
                               log_path=str(log), env={**os.environ, "COLUMNS": "200"})
    assert isinstance(process, forkserver.Forked)
    assert process.wait(120) == 2 and process.poll() == 2
    assert "rollout.batch_size" in log.read_text()


def test_a_preloaded_module_runs_once_without_runpys_warning(tmp_path):
    """rlorch.cli is preloaded in the fork server: the child runs the loaded module's main,
    never a second copy through runpy (which warns it was found in sys.modules)."""
    log = tmp_path / "child.log"
    process = forkserver.spawn([sys.executable, "-m", "rlorch.cli", "validate-config", "rollout.batch_size=0"],
                               log_path=str(log), env={**os.environ, "PYTHONWARNINGS": "default"})
    assert process.wait(120) == 2
    text = log.read_text()
    assert "rollout.batch_size" in text and "RuntimeWarning" not in text, text


def test_forked_process_is_a_session_leader_that_signals_reach(tmp_path):
    process = forkserver.spawn([sys.executable, "-m", "rlorch.cli", "serve", "--port", "0",
                                "--parent-pid", str(os.getpid())],
                               log_path=str(tmp_path / "serve.log"), env=dict(os.environ))
    try:
        assert os.getpgid(process.pid) == process.pid
        os.killpg(process.pid, signal.SIGKILL)
        assert process.wait(60) == -signal.SIGKILL
    finally:
        if process.poll() is None:
            os.kill(process.pid, signal.SIGKILL)


@pytest.mark.parametrize("forked", [True, False])
def test_an_engine_that_crashes_in_native_code_leaves_its_python_stack_in_its_log(monkeypatch, tmp_path, model_dir,
                                                                                  forked):
    """A segfault in a launched process (a rank in a collective, say) otherwise shows only as -11
    in its exit status: its log gets every thread's Python stack, whether the fork server
    started it or it was launched the ordinary way (``RLORCH_FORKSERVER=0``)."""
    from rlorch.launch.local import LocalLauncher

    if not forked:
        monkeypatch.setenv("RLORCH_FORKSERVER", "0")
    config = compose([f"model.path={model_dir}", "inference.cpu.threads=1"])
    launched = LocalLauncher().start_server(config, 0, model_path=model_dir, api_key="k", log_dir=tmp_path, env={})
    process = launched.handle
    assert isinstance(process, forkserver.Forked) == forked
    try:
        deadline = time.monotonic() + 60
        while "listening on" not in launched.log.read_text() and time.monotonic() < deadline:
            time.sleep(0.1)
        os.kill(process.pid, signal.SIGSEGV)
        assert process.wait(60) == -signal.SIGSEGV
    finally:
        if process.poll() is None:
            os.kill(process.pid, signal.SIGKILL)
    text = launched.log.read_text()
    assert "Fatal Python error: Segmentation fault" in text and "rlorch/serve/server.py" in text, text[-2000:]


def test_other_commands_start_the_ordinary_way(tmp_path):
    process = forkserver.spawn([sys.executable, "-c", "print('plain')"], log_path=str(tmp_path / "plain.log"),
                               env=dict(os.environ))
    assert not isinstance(process, forkserver.Forked)
    assert process.wait(60) == 0 and (tmp_path / "plain.log").read_text() == "plain\n"


def _memory(pid: int) -> dict[str, int]:
    fields = {}
    for line in open(f"/proc/{pid}/smaps_rollup"):
        name, _, value = line.partition(":")
        if value.strip().endswith("kB"):
            fields[name] = int(value.split()[0])
    return fields


def _greedy(address: str) -> dict:
    payload = {"input_ids": [5, 6, 7, 8], "return_logprob": True,
               "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}}
    request = urllib.request.Request(f"http://{address}/generate", data=json.dumps(payload).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


def test_an_engine_forked_from_the_server_shares_its_imports_and_serves_like_one_in_process(tmp_path, model_dir):
    """The engine's imports are the server's pages, shared rather than copied (a process that
    imported them itself holds them all privately), and what it serves is what the same
    engine answers in this process."""
    from rlorch.launch.local import free_port
    from rlorch.serve.server import CpuServer, ServerThread

    port = free_port()
    process = forkserver.spawn([sys.executable, "-m", "rlorch.cli", "serve", "--port", str(port),
                                "--parent-pid", str(os.getpid()), f"model.path={model_dir}",
                                "inference.cpu.threads=1"],
                               log_path=str(tmp_path / "serve.log"), env=dict(os.environ))
    try:
        wait_answering(f"http://127.0.0.1:{port}/health_generate", process, what="the forked engine")
        memory = _memory(process.pid)
        assert memory["Shared_Dirty"] > 100_000 and memory["Shared_Dirty"] > memory["Private_Dirty"], memory
        forked = _greedy(f"127.0.0.1:{port}")
    finally:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(60)
    local = ServerThread(CpuServer(model_dir, threads=1))
    try:
        here = _greedy(local.address)
    finally:
        local.stop()
    assert forked["output_ids"] == here["output_ids"]
    assert ([round(p, 5) for p, _, _ in forked["meta_info"]["output_token_logprobs"]]
            == [round(p, 5) for p, _, _ in here["meta_info"]["output_token_logprobs"]])


def test_preload_imports_what_a_child_needs_and_freezes_it():
    """In a fresh interpreter (this one has imported most of it already): the default's modules,
    without transformers, and transformers' when asked for too."""
    code = """
import gc, json, sys
from rlorch.launch import forkserver
wanted = ("torch", "aiohttp.web", "hydra.compose", "omegaconf", "rlorch.qwen2", "rlorch.serve.server",
          "rlorch.trainer.fsdp")
before = {"loaded": [m for m in wanted if m in sys.modules], "frozen": gc.get_freeze_count()}
forkserver.preload()
first = {"missing": [m for m in wanted if m not in sys.modules], "transformers": "transformers" in sys.modules,
         "frozen": gc.get_freeze_count()}
forkserver.preload(forkserver.TRANSFORMERS_PRELOAD)
print(json.dumps({"before": before, "first": first, "then": "transformers.modeling_utils" in sys.modules,
                  "frozen": gc.get_freeze_count(), "collecting": gc.isenabled()}))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["before"] == {"loaded": [], "frozen": 0}
    first = seen["first"]
    assert first["missing"] == [] and not first["transformers"] and first["frozen"] > 50_000
    assert seen["then"] and seen["frozen"] > first["frozen"] and seen["collecting"]


def test_modules_asked_for_are_imported_before_the_next_fork(tmp_path):
    """Over the pipe: a preload request is served before the fork asked for after it (the
    server's memory maps sqlite3's extension, which nothing else here imports)."""
    server = forkserver.ForkServer()
    try:
        server.preload(["sqlite3"])
        child = server.spawn([sys.executable, "-m", "rlorch.cli", "--version"], log=str(tmp_path / "log"),
                             env=dict(os.environ), cwd=str(tmp_path))
        assert child.wait(60) == 0
        maps = open(f"/proc/{server.process.pid}/maps").read()
        assert "_sqlite3" in maps
    finally:
        server.close()


def test_a_trainer_and_an_engine_asked_for_early_are_forked_after_their_own_imports(tmp_path):
    """A per-run server forks a trainer as soon as the trainer's own modules are in, then a
    launched engine once its own are, both ahead of a CLI child asked for first, which waits
    for the rest of the preload (Hydra, the CLI)."""
    server = forkserver.ForkServer()
    answered = []

    def ask(name: str, command: list[str]) -> None:
        child = server.spawn(command, log=str(tmp_path / f"{name}.log"), env=dict(os.environ), cwd=str(tmp_path))
        answered.append(name)
        child.wait(60)

    asked = [threading.Thread(target=ask, args=("cli", [sys.executable, "-m", "rlorch.cli", "--version"])),
             threading.Thread(target=ask, args=("engine", [sys.executable, "-m", "rlorch.serve.server", "--help"])),
             threading.Thread(target=ask, args=("trainer", [sys.executable, "-m", "rlorch.trainer.fsdp", "--help"]))]
    try:
        for count, thread in enumerate(asked, 1):
            thread.start()    # the next is asked once this one's request is on its way
            wait_until(lambda: server.spawned == count, 30, f"request {count} sent")
        for thread in asked:
            thread.join(120)
    finally:
        server.close()
    assert answered == ["trainer", "engine", "cli"]
    assert "--run-dir" in (tmp_path / "trainer.log").read_text()
    assert "--model-path" in (tmp_path / "engine.log").read_text()
    assert "rlorch" in (tmp_path / "cli.log").read_text()


def test_a_server_started_for_a_run_that_launches_nothing_is_discarded():
    """``rlorch train`` starts the fork server before composing when the overrides keep the
    default backends; one started for a run that then launches nothing is stopped, and one
    that has forked processes stays (it reports their exits)."""
    code = """
from rlorch.launch import forkserver
from rlorch.config.compose import compose
from rlorch.runner import _warm_up
from rlorch.launch.forkserver import warm_up_early
seen = []
for overrides in (["inference=sim"], ["trainer=sim"], ["conf=sim"], ["inference.backend=sim"]):
    warm_up_early(overrides)
    seen.append(forkserver.running())
warm_up_early(["train.steps=3"])
seen.append(forkserver.running())
_warm_up(compose(["inference=sim", "trainer=sim"]))
seen.append(forkserver.running())
warm_up_early([])
_warm_up(compose([]))
seen.append(forkserver.running())
print(*seen)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["False"] * 4 + ["True", "False", "True"]
    forkserver.spawn([sys.executable, "-m", "rlorch.cli", "--version"], log_path=os.devnull,
                     env=dict(os.environ)).wait(120)
    forkserver.discard()
    assert forkserver.running()


def test_rlorch_forkserver_0_launches_the_ordinary_way(monkeypatch, tmp_path):
    """README: RLORCH_FORKSERVER=0 launches a forkable command as a plain subprocess (through a
    fork server, warm or not, spawn returns a ``Forked``)."""
    from rlorch.launch import forkserver

    monkeypatch.setenv("RLORCH_FORKSERVER", "0")
    command = [sys.executable, "-m", sorted(forkserver.FORKABLE)[0], "--help"]
    process = forkserver.spawn(command, log_path=str(tmp_path / "log"), env=dict(os.environ))
    process.wait(120)
    assert isinstance(process, subprocess.Popen) and process.returncode == 0


def test_a_shared_server_forks_for_every_run_and_tells_each_only_of_its_own_exits(tmp_path):
    """``--listen PATH``: two clients (two runs) fork through one warm server; each hears of the
    exits of its own processes, and one closing its connection stops nothing."""
    import tempfile

    path = os.path.join(tempfile.mkdtemp(prefix="rlorch-fs-"), "socket")
    server = subprocess.Popen([sys.executable, "-m", "rlorch.launch.forkserver", "--listen", path,
                               "--parent-pid", str(os.getpid())], start_new_session=True, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not os.path.exists(path):
            assert server.poll() is None and time.monotonic() < deadline
            time.sleep(0.02)
        first, second = forkserver.ForkServer(path), forkserver.ForkServer(path)
        command = [sys.executable, "-m", "rlorch.cli", "validate-config"]
        failing = first.spawn([*command, "rollout.batch_size=0"], log=str(tmp_path / "a.log"), env=dict(os.environ),
                              cwd=str(tmp_path))
        passing = second.spawn(command, log=str(tmp_path / "b.log"), env=dict(os.environ), cwd=str(tmp_path))
        assert failing.wait(120) == 2 and passing.wait(120) == 0
        assert failing.pid not in second.exits and passing.pid not in first.exits
        assert "rollout.batch_size" in (tmp_path / "a.log").read_text()
        serving = second.spawn([sys.executable, "-m", "rlorch.cli", "serve", "--port", "0",
                                "--parent-pid", str(os.getpid())], log=str(tmp_path / "s.log"),
                               env=dict(os.environ), cwd=str(tmp_path))
        second.close()
        # Once the server has forked and reaped a later request, it has read the closed connection
        # too (each pass of its loop reads every connection that is ready): had it stopped that
        # client's child, the child would be gone by then.
        again = first.spawn(command, log=str(tmp_path / "c.log"), env=dict(os.environ), cwd=str(tmp_path))
        assert again.wait(120) == 0 and server.poll() is None  # a client gone is not the server's end
        assert serving.poll() is None and os.path.exists(f"/proc/{serving.pid}")
        os.kill(serving.pid, signal.SIGKILL)
    finally:
        server.terminate()
        assert server.wait(30) == 0
    assert not os.path.exists(path)


def test_a_named_shared_server_that_is_not_there_is_a_clear_error(monkeypatch, tmp_path):
    import pytest

    monkeypatch.setenv("RLORCH_FORKSERVER", str(tmp_path / "absent"))
    with pytest.raises(RuntimeError, match="RLORCH_FORKSERVER=.*absent: no fork server answers there"):
        forkserver.ForkServer(forkserver.shared_address())
