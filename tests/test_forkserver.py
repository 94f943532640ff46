"""The fork server starts rlorch's own processes as forks of a warm interpreter, and what the
launcher and trainer see of them behaves like a ``subprocess.Popen``."""

from __future__ import annotations

import os
import signal
import sys

from rlorch import forkserver


def test_forked_command_runs_as_python_m_with_its_env_log_and_status(tmp_path):
    log = tmp_path / "child.log"
    process = forkserver.spawn([sys.executable, "-m", "rlorch.cli", "validate-config", "rollout.batch_size=0"],
                               log_path=str(log), env={**os.environ, "COLUMNS": "200"})
    assert isinstance(process, forkserver.Forked)
    assert process.wait(120) == 2 and process.poll() == 2
    assert "rollout.batch_size" in log.read_text()


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


def test_other_commands_start_the_ordinary_way(tmp_path):
    process = forkserver.spawn([sys.executable, "-c", "print('plain')"], log_path=str(tmp_path / "plain.log"),
                               env=dict(os.environ))
    assert not isinstance(process, forkserver.Forked)
    assert process.wait(60) == 0 and (tmp_path / "plain.log").read_text() == "plain\n"
