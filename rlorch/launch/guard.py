"""``python -m rlorch.launch.guard [--remove DIR] COMMAND...``: run a process that cannot watch the orchestrator
itself (an SGLang server, a run's private Ray cluster), and take it and everything it started
down with its orchestrator.

``rlorch serve`` watches the orchestrator's pid on its own (``--parent-pid``); a third-party
server does not, and once the orchestrator is killed (-9) it would hold its GPUs and port for
good. The guard runs the command in its own process group (the group the launcher signals),
watches the orchestrator named by ``RLORCH_ORCHESTRATOR_PID``, and when that is gone kills every
process it started, then the whole group.

"Every process it started" is its process tree, and the tree is complete: the guard is a child
subreaper (``PR_SET_CHILD_SUBREAPER``), so a process whose parent died (Ray's dashboard and
runtime-env agents once their raylet is gone; a worker that left its group with ``setpgid``) is
re-parented to the guard, not to init, and is still found. The tree is read before anything is
killed and read again until it is empty, so a process forked meanwhile is not missed.

- Signals sent to the group reach the command directly; the guard ignores SIGINT and SIGTERM
  and exits with the command's status once it has exited, so the launcher's stop sees the
  command's end. Whatever the command left running when it exited is killed then: nothing the
  guard started outlives it.
- ``--remove DIR``: the directory is removed once the tree is ended, whichever way (the private
  cluster's temp dir: Ray's session files and sockets are the cluster's, and go with it).
- SIGUSR1 to the guard stops the command (SIGTERM; ``ray start --block`` stops the processes
  it started), waits for it at most :data:`STOP_GRACE_S`, kills what is left of its tree and
  exits 0: how a run stops its private Ray cluster, whose agents outlive ``ray start`` (see
  :mod:`rlorch.launch.private_cluster`).
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from rlorch.lifecycle import orchestrator_pid, watch_parents

STOP_GRACE_S = 5.0
"""Seconds the command has to exit on SIGTERM when the guard is asked to stop (SIGUSR1) before
its tree is killed."""
UNKILLABLE_S = 10.0
"""Seconds past the grace after which :func:`end_tree` stops waiting for a process SIGKILL has
not ended (one in uninterruptible sleep): the guard must not hang on it."""
PR_SET_CHILD_SUBREAPER = 36
"""prctl(2)'s option number (linux/prctl.h)."""


def main(argv: list[str]) -> int:
    remove = None
    if argv[:1] == ["--remove"] and len(argv) > 1:
        remove, argv = argv[1], argv[2:]
    if not argv:
        print("usage: python -m rlorch.launch.guard [--remove DIR] COMMAND [ARG ...]", file=sys.stderr)
        return 2

    def end(grace: float) -> None:
        end_tree(grace)
        if remove is not None:
            shutil.rmtree(remove, ignore_errors=True)
    become_subreaper()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    command: list[subprocess.Popen] = []

    def asked_to_stop(signum, frame) -> None:
        if command:
            command[0].terminate()
            try:
                command[0].wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                pass
        end(grace=0.0)
        os._exit(0)

    signal.signal(signal.SIGUSR1, asked_to_stop)
    command.append(subprocess.Popen(argv, preexec_fn=_default_signals))
    stopping = threading.Event()

    def gone(reason: str) -> None:
        stopping.set()
        print(f"rlorch guard: {reason}; stopping {argv[0]} (pid {command[0].pid}) and what it started",
              file=sys.stderr, flush=True)
        end(grace=0.0)
        os.killpg(os.getpgid(0), signal.SIGKILL)

    watch_parents(orchestrator=orchestrator_pid(), on_gone=gone, interval=0.5)
    status = command[0].wait()
    if stopping.is_set():  # the watcher ends the group, this process with it
        threading.Event().wait()
    end(grace=0.0)
    return status if status >= 0 else 128 - status  # killed by signal N: 128 + N, as a shell says


def become_subreaper() -> bool:
    """Make this process the reaper of its orphaned descendants (Linux); False where it cannot."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def descendants(root: int) -> list[int]:
    """The live (not zombie) processes below ``root`` in the process tree, read from ``/proc``."""
    children: dict[int, list[int]] = {}
    zombies = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(entry.name))
        if fields[0] == "Z":
            zombies.add(int(entry.name))
    found, todo = [], list(children.get(root, []))
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, []))
    return [pid for pid in found if pid not in zombies]


def end_tree(grace: float, root: int = 0) -> None:
    """End every descendant of ``root`` (this process by default): SIGTERM and up to ``grace``
    seconds to exit, then SIGKILL until none is left. Zombies among this process's children
    are reaped as it goes."""
    root = root or os.getpid()
    deadline = time.monotonic() + grace
    sig = signal.SIGTERM if grace > 0 else signal.SIGKILL
    signalled: set[int] = set()
    while (pids := descendants(root)) and time.monotonic() < deadline + UNKILLABLE_S:
        if sig == signal.SIGTERM and time.monotonic() >= deadline:
            sig, signalled = signal.SIGKILL, set()
        for pid in pids:
            if pid not in signalled:
                _signal(pid, sig)
                signalled.add(pid)
        time.sleep(0.05)
        _reap()
    _reap()


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _reap() -> None:
    """Collect every exited child of this process (orphans handed to the subreaper included)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _default_signals() -> None:
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_DFL)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
