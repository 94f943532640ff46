"""``python -m rlorch.launch.guard COMMAND...``: run a launched server that cannot watch the
orchestrator itself (SGLang), and take it down with its orchestrator.

``rlorch serve`` watches the orchestrator's pid on its own (``--parent-pid``); a third-party
server does not, and once the orchestrator is killed (-9) it would hold its GPUs and port for
good. The guard runs the command in its own process group (the group the launcher signals),
watches the orchestrator named by ``RLORCH_ORCHESTRATOR_PID``, and when that is gone kills the
whole group. Signals sent to the group reach the server directly; the guard ignores them and
exits with the server's status once it has exited, so the launcher's stop sees the server's end.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from rlorch.lifecycle import orchestrator_pid, watch_parents


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: python -m rlorch.launch.guard COMMAND [ARG ...]", file=sys.stderr)
        return 2
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    server = subprocess.Popen(argv, preexec_fn=_default_signals)

    def gone(reason: str) -> None:
        print(f"rlorch guard: {reason}; stopping {argv[0]} (pid {server.pid})", file=sys.stderr, flush=True)
        os.killpg(os.getpgid(0), signal.SIGKILL)

    watch_parents(orchestrator=orchestrator_pid(), on_gone=gone, interval=0.5)
    status = server.wait()
    return status if status >= 0 else 128 - status  # killed by signal N: 128 + N, as a shell says


def _default_signals() -> None:
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
