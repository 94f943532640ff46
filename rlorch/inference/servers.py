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
import logging
import os
import secrets
import time
from pathlib import Path
from typing import Callable, Optional

from rlorch.backends import inference_backend
from rlorch.config.schema import Config, InferenceBackend
from rlorch.inference.answers import AnswerParsers
from rlorch.inference.client import SGLangEngine
from rlorch.inference.control import ControlHTTP
from rlorch.inference.pool import EnginePool
from rlorch.inference.scale import ScaleFollower
from rlorch.launch.base import LaunchError, Launched, Launcher, exit_reason
from rlorch.launch.placement import server_env
from rlorch.launch.server_command import API_KEY_ENV
from rlorch.lifecycle import cancel_and_wait, off_loop
from rlorch.rundir.layout import RunDir, write_json_atomic
from rlorch.types import PolicyVersion

log = logging.getLogger("rlorch.servers")
READY_POLL_S = 0.05
"""Seconds between readiness probes of a starting server: a probe of a server not yet
listening is a refused connection, cheap to repeat, and every run waits for the first that
succeeds."""
async def start_engines(config, *, log_dir: Path, servers_file: Path, model_path: Path,
                        launcher: Optional[Launcher] = None, scale_file: Optional[Path] = None) -> EnginePool:
    """Launch (through ``launcher``, this machine's by default) or connect to the configured
    servers; return a ready pool (see the module doc). With ``scale_file`` the launched fleet
    follows what ``rlorch scale`` writes there (:class:`rlorch.inference.scale.ScaleFollower`; the
    pool reports a request not yet met)."""
    if launcher is None:
        from rlorch.launch.local import LocalLauncher

        launcher = LocalLauncher()
    log_dir.mkdir(parents=True, exist_ok=True)
    inference = config.inference
    if inference.backend not in (InferenceBackend.cpu, InferenceBackend.sglang):
        raise ValueError(f"inference.backend={inference.backend.value!r} launches no server")

    def launch(index: int, port: Optional[int] = None) -> Launched:
        """Start server ``index`` on ``port`` (a free one when None)."""
        return launcher.start_server(config, index, log_dir=log_dir, model_path=model_path, api_key=api_key,
                                     env=server_env(config, index), port=port)

    if inference.addresses:
        api_key = os.environ.get(API_KEY_ENV) or None
        servers = [Launched("server", i, a, None) for i, a in enumerate(inference.addresses)]
    else:
        api_key = secrets.token_urlsafe(24)
        servers = await off_loop(lambda: [launch(i) for i in range(inference.num_servers)])
    control_http = ControlHTTP(concurrency=inference.control_concurrency)
    parsers = AnswerParsers(inference.parse_workers) if inference.parse_workers else None
    engines = [_client(config, s.address, api_key, control_http, parsers) for s in servers]
    monitor: list[asyncio.Task] = []

    async def shutdown() -> None:
        await cancel_and_wait(*monitor)
        if parsers is not None:
            parsers.close()
        await launcher.stop(servers, timeout=inference.shutdown_timeout)

    async def ready(index: int) -> None:
        """Wait for server ``index``. One that found its port taken (another process bound it
        between ``free_port`` choosing it and the server binding it, seconds later) starts again
        on a new port: the run should not fail for someone else's socket."""
        for attempt in range(1, PORT_ATTEMPTS + 1):
            try:
                return await _wait_ready(launcher, servers[index], engines[index], inference.ready_timeout)
            except LaunchError:
                if attempt == PORT_ATTEMPTS or not lost_its_port(servers[index]):
                    raise
            log.warning("%s: %s was taken before the server bound it; starting it on another port",
                        servers[index].name, servers[index].address)
            await engines[index].close()
            servers[index] = await off_loop(lambda: launch(index))
            engines[index] = _client(config, servers[index].address, api_key, control_http, parsers)

    try:
        await asyncio.gather(*(ready(index) for index in range(len(servers))))
        records = await record_versions(servers, engines, servers_file, inference.expect_version)
    except BaseException:
        await asyncio.gather(*(e.close() for e in engines), return_exceptions=True)
        await shutdown()
        raise
    by_name = {engine.name: server for engine, server in zip(engines, servers)}
    if inference.router:
        from rlorch.inference.routed import RoutedServer

        engines = [RoutedServer(_client(config, inference.router, api_key, control_http, parsers), engines)]
        by_name = {}
    pool = EnginePool(engines, request_timeout=config.rollout.request_timeout,
                      max_retries=config.rollout.max_retries, name=f"{inference.backend.value}-pool", on_close=shutdown,
                      diagnose=lambda name: exit_reason(launcher, by_name[name]) if name in by_name else None,
                      health_interval=inference.health_interval, health_timeout=inference.health_timeout,
                      health_failures=inference.health_failures)

    def restart(server: Launched) -> Launched:
        fresh = launch(server.index, port=int(server.address.rsplit(":", 1)[1]))
        servers[server.index] = fresh
        if server.index in records:
            records[server.index] = {**records[server.index], "address": fresh.address, "pid": server_pid(fresh)}
            write_records(servers_file, records)
        return fresh

    async def add_server() -> None:
        index = len(servers)
        fresh = await off_loop(lambda: launch(index))
        servers.append(fresh)
        engine = _client(config, fresh.address, api_key, control_http, parsers)
        try:
            await _wait_ready(launcher, fresh, engine, inference.ready_timeout)
        except BaseException:
            await engine.close()
            await launcher.stop([fresh], timeout=inference.shutdown_timeout)
            raise
        by_name[engine.name] = fresh
        pool.add(engine)
        records[index] = server_record(fresh, await engine.server_info())
        write_records(servers_file, records)

    async def remove_server(name: str) -> None:
        server = by_name.pop(name)
        await pool.remove(name, timeout=config.rollout.request_timeout)
        await launcher.stop([server], timeout=inference.shutdown_timeout)
        launcher.release(server)
        records.pop(server.index, None)
        write_records(servers_file, records)

    if scale_file is not None and not inference.addresses and not inference.router:
        follower = ScaleFollower(scale_file, by_name, add=add_server, remove=lambda: remove_server(list(by_name)[-1]),
                                 waiting=lambda: launcher.waiting)
        pool.scale_fields = follower.fields
        monitor.append(asyncio.create_task(follower.run(), name="server-scaler"))
    monitor.append(asyncio.create_task(supervise(launcher, by_name, pool, restart=restart,
                                                 hang_timeout=inference.hang_timeout,
                                                 max_restarts=inference.max_restarts), name="server-supervisor"))
    return pool


def _client(config, address: str, api_key: Optional[str], control_http: ControlHTTP,
            parsers: Optional[AnswerParsers]) -> SGLangEngine:
    inference = config.inference
    return SGLangEngine(address, request_timeout=config.rollout.request_timeout, api_key=api_key,
                        control_timeout=inference.control_timeout, reload_timeout=inference.reload_timeout,
                        control_http=control_http, parse=None if parsers is None else parsers.parse)


async def supervise(launcher: Launcher, servers: dict[str, Launched], pool: EnginePool, *,
                    restart: Callable[[Launched], Launched], hang_timeout: float, max_restarts: int,
                    interval: float = 0.5) -> None:
    """Launched servers, watched every ``interval`` seconds, even with no request in flight:

    - one whose process exits (or, with Ray, whose actor dies) is dead at once, and started
      again on its address (in its placement group) up to ``max_restarts`` times; it rejoins
      through the pool's probe once it answers and holds the current weights;
    - one the pool has held suspect for longer than ``hang_timeout`` (alive but answering
      nothing: a hung GPU, a stuck collective, a swapping host) is killed and started again on
      its address, up to ``max_restarts`` times; it rejoins through the pool's probe once it
      answers and holds the current weights. Past that it is dead, and the run goes on with the
      others (with none left, a request fails naming every server).
    """
    restarts: dict[str, int] = {}
    gone: set[str] = set()
    pool.restartable = lambda name: (name in servers and servers[name].handle is not None and name not in gone
                                     and restarts.get(name, 0) < max_restarts)
    while True:
        for name, server in list(servers.items()):
            if name in gone or server.handle is None:
                continue
            restarts.setdefault(name, 0)
            reason = exit_reason(launcher, server)
            hung = pool.down_for(name) if reason is None else None
            if reason is None and (hung is None or hung <= hang_timeout):
                continue
            # Released memory (a swap step) leaves no room for a restart: the step fails instead.
            if reason is not None and restarts[name] < max_restarts and not pool.released:
                pool.mark_dead(name, reason)
                await launcher.stop([server], timeout=2.0)
                restarts[name] += 1
                log.warning("%s; restart %d of %d (inference.max_restarts)", reason.splitlines()[0],
                            restarts[name], max_restarts)
                servers[name] = await off_loop(lambda: restart(server))
                pool.restarted(name)
                continue
            if reason is None:
                await launcher.stop([server], timeout=2.0)
                if restarts[name] < max_restarts:
                    restarts[name] += 1
                    log.warning("%s hung for %.0fs (inference.hang_timeout=%g): killed, restart %d of %d",
                                server.name, hung, hang_timeout, restarts[name], max_restarts)
                    servers[name] = await off_loop(lambda: restart(server))
                    pool.restarted(name)
                    continue
                reason = (f"{server.name} hung: suspect for {hung:.0f}s (inference.hang_timeout={hang_timeout:g}), "
                          f"killed; no restart left (inference.max_restarts={max_restarts}); log {server.log} "
                          f"ends:\n{server.tail(10)}")
            gone.add(name)
            pool.mark_dead(name, reason)
        await asyncio.sleep(interval)


PORT_ATTEMPTS = 3
"""Starts of one server on fresh ports before a port taken at bind time fails the run."""


def lost_its_port(server: Launched) -> bool:
    """Whether ``server`` exited because its port was taken (uvicorn's bind error, which both
    SGLang's server and ``rlorch serve`` print)."""
    return "address already in use" in server.tail().lower()


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
                          expect: Optional[str]) -> dict[int, dict]:
    """Write ``servers.json`` (each server's address, pid, log and reported versions) and return
    its records by server index."""
    infos = await asyncio.gather(*(e.server_info() for e in engines))
    records = {s.index: server_record(s, info) for s, info in zip(servers, infos)}
    write_records(path, records)
    if expect is not None:
        wrong = [r for r in records.values() if str(r["version"]) != str(expect)]
        if wrong:
            raise LaunchError("inference.expect_version is " + repr(expect) + " but " + ", ".join(
                f"{r['address']} runs {r['version']!r}" for r in wrong))
    return records


def server_record(server: Launched, info: dict) -> dict:
    return {"index": server.index, "address": server.address, "version": info.get("version"),
            "pid": server_pid(server), "log": str(server.log) if server.log is not None else None,
            "model_path": info.get("model_path"), "weight_version": info.get("weight_version")}


def server_pid(server: Launched) -> Optional[int]:
    return server.extra.get("pid", getattr(server.handle, "pid", None))


def write_records(path: Path, records: dict[int, dict]) -> None:
    """``servers.json`` as the fleet is now: rewritten when a server restarts, joins or leaves."""
    write_json_atomic(path, [records[index] for index in sorted(records)])


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
                                   model_path=model_path, launcher=launcher, scale_file=run_dir.scale_file)
    except BaseException:
        await cancel_and_wait(tokenizer)
        raise
    return pool, await tokenizer


def _load_tokenizer(path: Path):
    """The model's tokenizer (:func:`rlorch.tokenizer.load_tokenizer`). The garbage collector is
    off meanwhile: importing transformers, where it is needed, builds what the process keeps, so
    its collections (a sixth of the import's CPU, taken from the fork server's imports on a
    small machine) would find nothing to free."""
    import gc

    from rlorch.tokenizer import load_tokenizer

    enabled = gc.isenabled()
    gc.disable()
    try:
        return load_tokenizer(path)
    finally:
        if enabled:
            gc.enable()
