"""One lifecycle for long-lived components: ``start()`` runs background work until
``stop(timeout)``, and a stop is bounded. :func:`cancel_and_wait` is the one way a background
task is stopped; :func:`interrupted_within` tells a start that a Ctrl-C ended it."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from pathlib import Path
from typing import Awaitable, Callable, Optional, TypeVar

T = TypeVar("T")


def interrupted_within(err: Optional[BaseException]) -> bool:
    """Whether a Ctrl-C is what ``err`` came of: OmegaConf re-raises an exception inside a
    structured config's checks or a config node's access as its own error, keeping the
    KeyboardInterrupt only as the context."""
    seen = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, KeyboardInterrupt):
            return True
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return False


async def cancel_and_wait(*tasks: Optional[asyncio.Task], timeout: Optional[float] = None) -> None:
    """Cancel ``tasks`` and wait until they have finished, at most ``timeout`` seconds.

    Their exceptions are not re-raised: whoever owns a task reads its outcome before stopping it.
    ``None`` entries are skipped, so an optional task needs no check of its own.
    """
    live = [task for task in tasks if task is not None and not task.done()]
    for task in live:
        task.cancel()
    if live:
        await asyncio.wait(live, timeout=timeout)


def off_loop(call: Callable[[], "T"]) -> "asyncio.Future[T]":
    """``call()`` started at once in a daemon thread; await the future for its result. A blocking
    start (a spawn that waits seconds for the fork server's imports, a tokenizer's imports) then
    leaves the event loop free, so a signal meanwhile is handled at once; and an interrupted run
    abandons the call rather than wait for it at exit, as the default executor would (what a
    spawn starts watches this process and exits with it)."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future = loop.create_future()

    def settle(result, error) -> None:
        if not future.done():
            future.set_exception(error) if error is not None else future.set_result(result)

    def run() -> None:
        try:
            result, error = call(), None
        except BaseException as failure:
            result, error = None, failure
        try:
            loop.call_soon_threadsafe(settle, result, error)
        except RuntimeError:
            pass    # the loop has closed: nobody waits for this any more

    threading.Thread(target=run, name="rlorch-off-loop", daemon=True).start()
    return future


async def gather_all(*awaitables: Awaitable) -> list:
    """The results of ``awaitables`` run side by side, in order. Unlike ``asyncio.gather``, the
    first failure cancels the others and waits for them before it propagates: no sibling keeps a
    request running on an engine, or holds its request id, after the call that started it failed."""
    tasks = [asyncio.ensure_future(awaitable) for awaitable in awaitables]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        await cancel_and_wait(*tasks)
        raise


ORCHESTRATOR_PID_ENV = "RLORCH_ORCHESTRATOR_PID"
"""The environment variable that names the orchestrator to the processes it starts."""


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (a zombie still counts until it is reaped)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def process_running(pid: int) -> bool:
    """Whether process ``pid`` exists and has not exited: a zombie (killed, not yet reaped by its
    parent) is gone here, as it is for every purpose of the processes watching it."""
    if not process_alive(pid):
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True  # no /proc to read (not Linux): existence is all there is to go on


def watch_parents(*, orchestrator: Optional[int], parent: Optional[int] = None,
                  on_gone: Callable[[str], None], interval: float = 1.0) -> threading.Thread:
    """A daemon thread that calls ``on_gone(reason)`` once the orchestrator ``orchestrator``
    is gone or this process's parent is no longer ``parent`` (re-parented to init or a
    subreaper: the process that launched it died). Nothing of a run may outlive its
    orchestrator: a process it started calls this first thing."""

    def gone() -> Optional[str]:
        if orchestrator is not None and not process_running(orchestrator):
            return f"orchestrator (pid {orchestrator}) is gone"
        if parent is not None and os.getppid() != parent:
            return f"parent process (pid {parent}) is gone"
        return None

    def watch() -> None:
        while True:
            reason = gone()
            if reason is not None:
                on_gone(reason)
                return
            time.sleep(interval)

    thread = threading.Thread(target=watch, name="rlorch-parent-watch", daemon=True)
    thread.start()
    return thread


def orchestrator_pid() -> Optional[int]:
    """The orchestrator's pid from the environment, if this process was started by one."""
    value = os.environ.get(ORCHESTRATOR_PID_ENV)
    return int(value) if value and value.isdigit() else None


def kill_group(pid: int, sig: int) -> bool:
    """Signal process group ``pid`` (a process started in its own session leads one); False
    when it is gone."""
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        return False
    return True
