"""The :class:`Launcher` protocol: what starts, watches and stops the processes of a run.

A launcher owns processes, not their meaning. The inference backend asks it for servers and
turns their addresses into engine clients; the trainer backend asks it for the trainer's agents
and decides from the run directory whether an exit was a clean one. Adding a way to place
processes (another machine, a cluster) is one module implementing this protocol.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Protocol

LOG_TAIL_LINES = 40


class LaunchError(RuntimeError):
    """A process did not start or did not become ready (the message carries the tail of its log)."""


@dataclass
class Launched:
    """One process a launcher started (or, with ``handle`` None, a server running elsewhere)."""

    role: str
    """``server`` or ``trainer``."""
    index: int
    """The server's index in the pool, or the trainer node's rank."""
    address: Optional[str]
    """``host:port`` a server answers on; None for the trainer."""
    log: Optional[Path]
    handle: Any = None
    """The launcher's own handle (a local process, an actor, ...); None: not launched here."""
    extra: dict = field(default_factory=dict)
    """What the launcher needs to stop it for good (e.g. where the trainer records its ranks)."""

    @property
    def name(self) -> str:
        return f"{self.role} {self.index}" + (f" ({self.address})" if self.address else "")

    def tail(self, lines: int = LOG_TAIL_LINES) -> str:
        if self.log is None or not self.log.exists():
            return "(no log)"
        text = self.log.read_text(errors="replace").splitlines()[-lines:]
        return "\n".join(text) or "(empty log)"


class Launcher(Protocol):
    """Start the servers and the trainer of a plan, report their addresses and exits, stop them."""

    name: str
    waiting: Optional[str]
    """What a start in progress waits for, as the launcher sees it (a placement not yet met and
    the resources free for it), for a scale request to show; None when nothing waits."""

    def start_server(self, config: Any, index: int, *, model_path: Path, api_key: str, log_dir: Path,
                     env: dict[str, str], port: Optional[int] = None) -> Launched:
        """Start launched server ``index`` on ``port`` (a free one by default: a restart reuses its
        address); its address is in the result."""
        ...

    def start_trainer(self, command: list[str], *, env: dict[str, str], log: Path, workers: Path) -> Launched:
        """Start the trainer's agent; ``workers`` is where its ranks record their pids."""
        ...

    def returncode(self, process: Launched) -> Optional[int]:
        """The exit status, or None while it runs (always None for a process not launched here)."""
        ...

    async def stop(self, processes: list[Launched], *, timeout: float) -> None:
        """Terminate, then kill after ``timeout`` seconds, everything of these processes."""
        ...

    def release(self, process: Launched) -> None:
        """Free what ``process`` held for good (a server ``rlorch scale`` removed), after its stop."""
        ...

    def close(self) -> None:
        """Release what the launcher holds for the run (placement groups, a cluster it started);
        called once, last, after every stop."""
        ...


def exit_reason(launcher: Launcher, process: Launched, lines: int = 10) -> Optional[str]:
    """Why a launched process is gone for good (its status and the tail of its log), or None
    while it runs or when it was not launched here."""
    code = launcher.returncode(process)
    if code is None:
        return None
    return f"{process.name} exited with status {code}; log {process.log} ends:\n{process.tail(lines)}"
