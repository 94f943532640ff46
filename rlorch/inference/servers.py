"""The ``cpu`` and ``sglang`` inference backends: servers started through a launcher (or reached
at ``inference.addresses``), handed over as one :class:`EnginePool`.

- ``cpu``: ``inference.num_servers`` ``rlorch serve`` processes; ``sglang``: ``python -m
  sglang.launch_server`` processes (command lines: :mod:`rlorch.launch.server_command`).
- With ``inference.addresses`` (either backend): the servers already running there; nothing is
  launched or stopped.
- With ``inference.router``: generation goes through that sglang-router, control to the servers
  (launched or at ``addresses``) behind it (see :mod:`rlorch.inference.routed`).

Each launched server logs to ``log_dir/server-<i>.log``. The pool is returned only once every
server answers ``/health_generate``; a server that exits or misses ``inference.ready_timeout``
fails the start with the tail of its log. Every server's ``/server_info`` version is recorded in
``servers.json`` beside ``log_dir`` (and must equal ``inference.expect_version`` when set: engine
and trainer are one unit). ``await pool.close()`` stops launched processes: SIGTERM, then SIGKILL
after ``inference.shutdown_timeout``.
"""


from __future__ import annotations

import asyncio
import json
import os
import secrets
import time
from pathlib import Path
from typing import Optional

from rlorch.backends import inference_backend
from rlorch.config.schema import Config, InferenceBackend
from rlorch.inference.client import SGLangEngine
from rlorch.inference.pool import EnginePool
from rlorch.launch.base import LaunchError, Launched, Launcher, exit_reason
from rlorch.launch.server_command import API_KEY_ENV
from rlorch.lifecycle import cancel_and_wait, off_loop
from rlorch.rundir.layout import RunDir
from rlorch.types import PolicyVersion

READY_POLL_S = 0.05
"""Seconds between readiness probes of a starting server: a probe of a server not yet
listening is a refused connection, cheap to repeat, and every run waits for the first that
succeeds."""
async def start_engines(config, *, log_dir: Path, servers_file: Path, model_path: Path,
                        launcher: Optional[Launcher] = None) -> EnginePool:
    """Launch (through ``launcher``, this machine's by default) or connect to the configured
    servers; return a ready pool (see the module doc)."""
    if launcher is None:
        from rlorch.launch.local import LocalLauncher

        launcher = LocalLauncher()
    log_dir.mkdir(parents=True, exist_ok=True)
    inference = config.inference
    if inference.backend not in (InferenceBackend.cpu, InferenceBackend.sglang):
        raise ValueError(f"inference.backend={inference.backend.value!r} launches no server")
    if inference.addresses:
        api_key = os.environ.get(API_KEY_ENV) or None
        servers = [Launched("server", i, a, None) for i, a in enumerate(inference.addresses)]
    else:
        from rlorch.launch.placement import server_env

        api_key = secrets.token_urlsafe(24)
        servers = await off_loop(lambda: [launcher.start_server(config, i, log_dir=log_dir, model_path=model_path,
                                                                api_key=api_key, env=server_env(config, i))
                                          for i in range(inference.num_servers)])
    engines = [SGLangEngine(s.address, request_timeout=config.rollout.request_timeout, api_key=api_key)
               for s in servers]
    monitor: list[asyncio.Task] = []

    async def shutdown() -> None:
        await cancel_and_wait(*monitor)
        await launcher.stop(servers, timeout=inference.shutdown_timeout)

    try:
        await asyncio.gather(*(_wait_ready(launcher, s, e, inference.ready_timeout) for s, e in zip(servers, engines)))
        await record_versions(servers, engines, servers_file, inference.expect_version)
    except BaseException:
        await asyncio.gather(*(e.close() for e in engines), return_exceptions=True)
        await shutdown()
        raise
    by_name = {engine.name: server for engine, server in zip(engines, servers)}
    if inference.router:
        from rlorch.inference.routed import RoutedServer

        router = SGLangEngine(inference.router, request_timeout=config.rollout.request_timeout, api_key=api_key)
        engines = [RoutedServer(router, engines)]
        by_name = {}
    pool = EnginePool(engines, request_timeout=config.rollout.request_timeout,
                      max_retries=config.rollout.max_retries, name=f"{inference.backend.value}-pool", on_close=shutdown,
                      diagnose=lambda name: exit_reason(launcher, by_name[name]) if name in by_name else None)
    monitor.append(asyncio.create_task(watch_exits(launcher, by_name, pool), name="server-exits"))
    return pool


async def watch_exits(launcher: Launcher, servers: dict[str, Launched], pool: EnginePool,
                      interval: float = 0.5) -> None:
    """A launched server that exits is out of the pool within ``interval`` seconds, even with no
    request in flight to notice it (a launched process never comes back)."""
    reported: set[str] = set()
    while len(reported) < sum(s.handle is not None for s in servers.values()):
        for name, server in servers.items():
            reason = exit_reason(launcher, server) if name not in reported else None
            if reason is not None:
                reported.add(name)
                pool.mark_dead(name, reason)
        await asyncio.sleep(interval)


async def _wait_ready(launcher: Launcher, server: Launched, engine: SGLangEngine, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        code = launcher.returncode(server)
        if code is not None:
            raise LaunchError(f"{server.name} exited with status {code} before it was ready; "
                              f"log {server.log} ends:\n{server.tail()}")
        if await engine.healthy():
            return
        await asyncio.sleep(READY_POLL_S)
    raise LaunchError(f"{server.name} not ready after {timeout:.0f}s; log {server.log} ends:\n{server.tail()}")


async def record_versions(servers: list[Launched], engines: list[SGLangEngine], path: Path,
                          expect: Optional[str]) -> None:
    infos = await asyncio.gather(*(e.server_info() for e in engines))
    record = [{"index": s.index, "address": s.address, "version": info.get("version"),
               "pid": getattr(s.handle, "pid", None), "log": str(s.log) if s.log is not None else None,
               "model_path": info.get("model_path"), "weight_version": info.get("weight_version")}
              for s, info in zip(servers, infos)]
    path.write_text(json.dumps(record, indent=1))
    if expect is not None:
        wrong = [r for r in record if str(r["version"]) != str(expect)]
        if wrong:
            raise LaunchError("inference.expect_version is " + repr(expect) + " but " + ", ".join(
                f"{r['address']} runs {r['version']!r}" for r in wrong))


@inference_backend(InferenceBackend.cpu, InferenceBackend.sglang)
async def start_servers(config: Config, run_dir: RunDir, policy: PolicyVersion,
                        launcher: Launcher) -> tuple[EnginePool, object]:
    """Launched (or reached) servers as one pool, and the model's tokenizer (loaded on a thread
    while the servers start: importing transformers takes seconds)."""
    from rlorch.model import resolve_model_path

    # Off the loop: on a fresh machine this creates the default model (torch's imports, seconds).
    model_path = await off_loop(lambda: resolve_model_path(config.model.path))
    # Started at once (a task would first wait for the loop): the tokenizer's imports run on the
    # other core while the servers launch.
    tokenizer = off_loop(lambda: _load_tokenizer(model_path))
    try:
        pool = await start_engines(config, log_dir=run_dir.logs, servers_file=run_dir.servers,
                                   model_path=model_path, launcher=launcher)
    except BaseException:
        await cancel_and_wait(tokenizer)
        raise
    return pool, await tokenizer


def _load_tokenizer(path: Path):
    """The model's tokenizer. The garbage collector is off meanwhile: importing transformers
    builds what the process keeps, so its collections (a sixth of the import's CPU, taken from
    the fork server's imports on a small machine) would find nothing to free."""
    import gc

    enabled = gc.isenabled()
    gc.disable()
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path)
    finally:
        if enabled:
            gc.enable()
