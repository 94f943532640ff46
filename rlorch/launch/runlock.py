"""One process per run directory.

``LOCK`` in the run directory holds an exclusive ``flock`` for as long as its process lives, and
the holder's pid for the refusal message. The kernel drops the lock when the holder dies (even
by SIGKILL), so a dead holder's lock is taken over without any staleness guess; the file is
removed on a clean exit.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import Optional

from rlorch.config.schema import ConfigError

LOCK_NAME = "LOCK"


class RunLock:
    def __init__(self, root: Path):
        self.path = Path(root) / LOCK_NAME
        self._fd: Optional[int] = None

    def holder(self) -> Optional[int]:
        """The pid holding the lock now, or None when nobody does."""
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return _read_pid(fd)
        finally:
            os.close(fd)
        return None

    def acquire(self) -> "RunLock":
        """Take the lock or raise a ConfigError naming the holder's pid."""
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                pid = _read_pid(fd)
                os.close(fd)
                raise ConfigError("run.dir", f"{self.path.parent} is in use by process {pid} "
                                             f"(lock {self.path}); one process per run directory") from None
            if _same_file(fd, self.path):
                break
            os.close(fd)  # the holder removed the file between our open and our lock: retry
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is None:
            return
        self.path.unlink(missing_ok=True)
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> "RunLock":
        return self if self._fd is not None else self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def holds_nothing(root: Path) -> bool:
    """Nothing in ``root`` but what a start stopped before config.yaml leaves (a Ctrl-C or a kill
    at that moment): the empty subdirectories of :meth:`RunDir.make` and an unheld lock file."""
    from rlorch.rundir.layout import RunDir

    skeleton = set(RunDir(root).skeleton)
    for entry in root.iterdir():
        if entry.name == LOCK_NAME and entry.is_file():
            continue
        if entry not in skeleton or not entry.is_dir() or any(entry.iterdir()):
            return False
    return True


SET_ASIDE = ("failed-start-", "no-checkpoint-")
"""Prefixes of what :func:`set_aside_unresumable` moves a run into: a start-up that failed before
any batch, and a run that trained but ended before its first complete checkpoint."""


def set_aside_unresumable(root: Path) -> bool:
    """A run directory with nothing to resume (no complete checkpoint: a failed or interrupted
    start-up, or a run killed before its first checkpoint) does not block a new run with the
    same ``run.dir``: its files move into ``failed-start-<stamp>/`` (nothing trained) or
    ``no-checkpoint-<stamp>/`` inside it, kept for reading. False (nothing moved) when it holds
    a resumable checkpoint, is in use, or has no config.yaml."""
    import shutil
    import time

    from rlorch.rundir.layout import RunDir

    run = RunDir(root)
    if (any(run.resumable_checkpoints()) or RunLock(root).holder() is not None
            or not run.config.exists()):
        return False
    trained = any(run.rollouts.glob("step_*")) or any(run.checkpoints.glob("step_*"))
    aside = root / f"{SET_ASIDE[trained]}{time.strftime('%Y%m%d-%H%M%S')}"
    aside.mkdir()
    for entry in list(root.iterdir()):
        if entry != aside and not entry.name.startswith(SET_ASIDE) and entry.name != LOCK_NAME:
            shutil.move(str(entry), aside / entry.name)
    return True


def _read_pid(fd: int) -> Optional[int]:
    text = os.pread(fd, 32, 0).decode(errors="replace").strip()
    return int(text) if text.isdigit() else None


def _same_file(fd: int, path: Path) -> bool:
    try:
        return os.stat(path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        return False
