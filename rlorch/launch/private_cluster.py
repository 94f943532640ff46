"""A run's private Ray cluster: the one ``run.launcher=ray`` starts on this machine when no
``run.ray_address`` is given. The cluster is the run's own, so nothing of it outlives the run.

- It is ``ray start --head --block`` run under the guard (:mod:`rlorch.launch.guard`) in a
  session of its own, not a cluster ``ray.init`` starts inside the orchestrator: Ray's fate
  sharing ends the GCS and the raylet with their driver, but the raylet's dashboard and
  runtime-env agents outlive it (seen after a kill -9 of the orchestrator). The guard is a
  subreaper, so every process of the cluster stays in its tree (workers, the agents, what
  actors start), and when the orchestrator is gone it kills the tree within a second.
- :meth:`PrivateCluster.stop` (a normal exit, an error, a signal the run handles) asks the guard
  to end the tree: SIGTERM to ``ray start``, SIGKILL to what is left after
  :data:`rlorch.launch.guard.STOP_GRACE_S`. Either way the guard removes the cluster's temp dir.
- Its temp dir is its own (``rlorch-ray-*`` in the system's temp dir), not ``/tmp/ray`` that
  other clusters of the machine share: its session directory (logs, sockets) is this run's
  alone. ``ray start``'s own output goes to ``logs/ray.log`` in the run directory.
- Token authentication with a token of its own, handed to the cluster and to the driver
  through Ray's environment variables: nobody else's token is needed, none is written to disk.
- Its size is logical CPUs (:func:`private_cpus`): the cores this process may use, at least what
  the run's placement groups ask for at start, or ``run.ray_cpus``.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

from rlorch.launch.base import LOG_TAIL_LINES, LaunchError
from rlorch.lifecycle import ORCHESTRATOR_PID_ENV

START_TIMEOUT_S = 120.0
"""Seconds ``ray start`` and the driver's connection may take (Ray alone gives its raylet 30 s to
register, which a loaded 2-core machine can miss once; the connection is tried again)."""
CONNECT_RETRY_S = 0.5
"""Seconds between attempts to connect to a cluster still starting."""
AUTH_ENV = {"mode": "RAY_AUTH_MODE", "token": "RAY_AUTH_TOKEN"}
"""Ray's environment variables for token authentication."""


def private_cpus(config, asked: int) -> int:
    """The logical CPUs of a private cluster: ``run.ray_cpus`` when set, else the cores this
    process may use (:func:`rlorch.launch.placement.usable_cores`), and never fewer than
    ``asked`` (the CPUs the run's placement groups ask for at start), so a run that fits on
    the machine by count starts."""
    from rlorch.launch.placement import usable_cores

    if config is not None and config.run.ray_cpus is not None:
        return config.run.ray_cpus
    return max(usable_cores(), asked)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def _reread_ray_auth() -> None:
    """Have this process's Ray read its authentication settings again. It reads them once, when
    imported; a run imports Ray first in :class:`rlorch.launch.ray.RayLauncher`, after the
    environment is set, but a process that imported it earlier (a test) needs this, done the
    way Ray's own token set-up does it."""
    from ray._private.authentication.authentication_token_setup import _enable_token_auth
    from ray._raylet import AuthenticationTokenLoader

    _enable_token_auth()
    AuthenticationTokenLoader.instance().reset_cache()


class PrivateCluster:
    """One private cluster: its guard process, its address and its temp dir."""

    def __init__(self, *, num_cpus: int, log: Path):
        self.log = log
        self.temp_dir = Path(tempfile.mkdtemp(prefix="rlorch-ray-"))
        self.port = _free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.auth = {AUTH_ENV["mode"]: "token", AUTH_ENV["token"]: secrets.token_hex(32)}
        command = [sys.executable, "-m", "rlorch.launch.guard", "--remove", str(self.temp_dir), sys.executable, "-m", "ray.scripts.scripts", "start",
                   "--head", "--block", f"--port={self.port}", f"--num-cpus={num_cpus}",
                   f"--temp-dir={self.temp_dir}", "--include-dashboard=false", "--disable-usage-stats",
                   f"--dashboard-agent-listen-port={_free_port()}"]
        env = {**os.environ, **self.auth, ORCHESTRATOR_PID_ENV: str(os.getpid()), "PYTHONUNBUFFERED": "1"}
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as handle:
            handle.write(f"$ {' '.join(command)}\n".encode())
            self.guard = subprocess.Popen(command, stdout=handle, stderr=subprocess.STDOUT, env=env,
                                          stdin=subprocess.DEVNULL, start_new_session=True)

    def connect(self, **init_options) -> None:
        """``ray.init`` this process to the cluster as its driver, trying again while the
        cluster starts; a cluster that exits or is not up after :data:`START_TIMEOUT_S` is a
        :class:`LaunchError` with the tail of ``ray start``'s log."""
        already_imported = "ray" in sys.modules
        os.environ.update(self.auth)
        import ray

        if already_imported:
            _reread_ray_auth()
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if self.guard.poll() is not None:
                raise LaunchError(f"the run's private Ray cluster exited with status {self.guard.returncode} while "
                                  f"starting; log {self.log} ends:\n{self.tail()}")
            try:
                ray.init(address=self.address, **init_options)
                return
            except (ConnectionError, RuntimeError) as err:
                ray.shutdown()
                if time.monotonic() > deadline:
                    raise LaunchError(f"the run's private Ray cluster at {self.address} did not answer within "
                                      f"{START_TIMEOUT_S:g}s ({err}); log {self.log} ends:\n{self.tail()}") from err
            time.sleep(CONNECT_RETRY_S)

    def session_dir(self) -> Optional[Path]:
        """The cluster's session directory (Ray's ``session_latest`` in its temp dir), None before
        Ray made it."""
        latest = self.temp_dir / "session_latest"
        return latest.resolve() if latest.exists() else None

    def tail(self) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:])
        except OSError:
            return "(no log)"

    def stop(self, timeout: float = 30.0) -> None:
        """End every process of the cluster (the guard's SIGUSR1: SIGTERM, then SIGKILL), wait
        for the guard at most ``timeout`` s (past it, kill its group), remove the temp dir."""
        if self.guard.poll() is None:
            try:
                os.kill(self.guard.pid, signal.SIGUSR1)
                self.guard.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.guard.pid, signal.SIGKILL)
                self.guard.wait()
            except ProcessLookupError:
                pass
        shutil.rmtree(self.temp_dir, ignore_errors=True)
