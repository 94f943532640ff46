"""Start (or reach) the inference servers of a run and hand them over as one :class:`EnginePool`.

- ``cpu``: ``inference.num_servers`` ``rlorch serve`` subprocesses on free local ports.
- ``sglang``: ``python -m sglang.launch_server`` subprocesses.
- With ``inference.addresses`` (either backend): the servers already running there; nothing is
  launched or stopped.
- With ``inference.router``: generation goes through that sglang-router, control to the servers
  (launched or at ``addresses``) behind it (see :mod:`rlorch.inference.routed`).

Launched servers are placed on GPUs by :mod:`rlorch.launch.placement` (``CUDA_VISIBLE_DEVICES``).

Each launched server logs to ``log_dir/server-<i>.log``. The pool is returned only once every
server answers ``/health_generate``; a server that exits or misses ``inference.ready_timeout``
fails the start with the tail of its log. Every server's ``/get_server_info`` version is
recorded in ``servers.json`` beside ``log_dir`` (and must equal ``inference.expect_version`` when
set: engine and trainer are one unit). ``await pool.close()`` stops launched processes: SIGTERM,
then SIGKILL after ``inference.shutdown_timeout``.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from rlorch.launch import forkserver
from rlorch.backends import inference_backend
from rlorch.config.schema import Config, InferenceBackend
from rlorch.inference.client import SGLangEngine
from rlorch.inference.pool import EnginePool
from rlorch.lifecycle import ORCHESTRATOR_PID_ENV, cancel_and_wait
from rlorch.rundir.layout import RunDir
from rlorch.types import PolicyVersion

LOG_TAIL_LINES = 40
READY_POLL_S = 0.05
"""Seconds between readiness probes of a starting server: a probe of a server not yet
listening is a refused connection, cheap to repeat, and every run waits for the first that
succeeds."""
API_KEY_ENV = "RLORCH_API_KEY"
"""A launched ``rlorch serve`` reads its per-run key here; with ``inference.addresses``, the key
the client sends to servers started elsewhere (optional)."""


class LaunchError(RuntimeError):
    """A server did not become ready (the message carries the tail of its log)."""


@dataclass
class ServerProcess:
    index: int
    address: str
    process: Optional[subprocess.Popen]
    log: Optional[Path]

    def tail(self, lines: int = LOG_TAIL_LINES) -> str:
        if self.log is None or not self.log.exists():
            return "(no log)"
        text = self.log.read_text(errors="replace").splitlines()[-lines:]
        return "\n".join(text) or "(empty log)"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _cpu_command(config, *, model_path: Path, port: int, host: str) -> list[str]:
    """The API key reaches ``rlorch serve`` through its environment (RLORCH_API_KEY), out of ``ps``."""
    inference = config.inference
    return [sys.executable, "-m", "rlorch.cli", "serve", "--host", host, "--port", str(port),
            "--parent-pid", str(os.getpid()),
            f"model.path={model_path}", f"model.dtype={config.model.dtype}",
            f"inference.cpu.threads={inference.cpu.threads}", f"inference.cpu.max_batch={inference.cpu.max_batch}",
            f"run.seed={config.run.seed}", *inference.launch_args]


def _sglang_command(config, *, model_path: Path, port: int, host: str) -> list[str]:
    """SGLang takes its API key only as ``--api-key`` (added by :func:`_spawn`)."""
    return [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model_path),
            "--host", host, "--port", str(port), "--weight-version", "0", "--dtype", config.model.dtype,
            "--random-seed", str(config.run.seed), "--tp-size", str(config.inference.tp_size),
            *config.inference.launch_args]


SERVER_COMMANDS = {InferenceBackend.cpu: _cpu_command, InferenceBackend.sglang: _sglang_command}
"""How each launched backend starts one server."""


def server_command(config, *, model_path: Path, port: int, host: str = "127.0.0.1") -> list[str]:
    """The command line of one launched server."""
    build = SERVER_COMMANDS.get(config.inference.backend)
    if build is None:
        raise ValueError(f"inference.backend={config.inference.backend.value!r} is not launched by rlorch.inference.servers")
    return build(config, model_path=model_path, port=port, host=host)


async def start_engines(config, *, log_dir: Path, servers_file: Path, model_path: Path) -> EnginePool:
    """Launch or connect to the configured servers; return a ready pool (see the module doc)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    inference = config.inference
    if inference.backend not in SERVER_COMMANDS:
        raise ValueError(f"inference.backend={inference.backend.value!r} is not launched by rlorch.inference.servers")
    if inference.addresses:
        api_key = os.environ.get(API_KEY_ENV) or None
        servers = [ServerProcess(i, a, None, None) for i, a in enumerate(inference.addresses)]
    else:
        from rlorch.launch.placement import server_env

        api_key = secrets.token_urlsafe(24)
        servers = [_spawn(config, i, log_dir=log_dir, model_path=model_path, api_key=api_key,
                          env=server_env(config, i))
                   for i in range(inference.num_servers)]
    engines = [SGLangEngine(s.address, request_timeout=config.rollout.request_timeout, api_key=api_key)
               for s in servers]
    monitor: list[asyncio.Task] = []

    async def shutdown() -> None:
        await cancel_and_wait(*monitor)
        await stop_servers(servers, timeout=inference.shutdown_timeout)

    try:
        await asyncio.gather(*(_wait_ready(s, e, inference.ready_timeout) for s, e in zip(servers, engines)))
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
                      diagnose=lambda name: exit_reason(by_name[name]) if name in by_name else None)
    monitor.append(asyncio.create_task(watch_exits(by_name, pool), name="server-exits"))
    return pool


def exit_reason(server: ServerProcess) -> Optional[str]:
    """Why a launched server is gone for good (its exit status and the tail of its log), or
    None while its process runs (or when it was not launched here)."""
    if server.process is None or server.process.poll() is None:
        return None
    return (f"server {server.index} ({server.address}) exited with status {server.process.returncode}; "
            f"log {server.log} ends:\n{server.tail(10)}")


async def watch_exits(servers: dict[str, ServerProcess], pool: EnginePool, interval: float = 0.5) -> None:
    """A launched server that exits is out of the pool within ``interval`` seconds, even with no
    request in flight to notice it (a launched process never comes back)."""
    reported: set[str] = set()
    while len(reported) < sum(s.process is not None for s in servers.values()):
        for name, server in servers.items():
            reason = exit_reason(server) if name not in reported else None
            if reason is not None:
                reported.add(name)
                pool.mark_dead(name, reason)
        await asyncio.sleep(interval)


def _spawn(config, index: int, *, log_dir: Path, model_path: Path, api_key: str,
           env: dict[str, str]) -> ServerProcess:
    port = free_port()
    log = log_dir / f"server-{index}.log"
    command = server_command(config, model_path=model_path, port=port)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **env, API_KEY_ENV: api_key}
    shown = list(command)
    if config.inference.backend is InferenceBackend.sglang:
        # SGLang does not watch its orchestrator: the guard takes it down with it.
        env[ORCHESTRATOR_PID_ENV] = str(os.getpid())
        command = [sys.executable, "-m", "rlorch.launch.guard", *command, "--api-key", api_key]
        shown += ["--api-key", "***"]
    with open(log, "ab") as handle:
        handle.write(f"$ {' '.join(shown)}\n".encode())
    process = forkserver.spawn(command, log_path=str(log), env=env)
    return ServerProcess(index, f"127.0.0.1:{port}", process, log)


async def _wait_ready(server: ServerProcess, engine: SGLangEngine, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.process is not None and server.process.poll() is not None:
            raise LaunchError(f"server {server.index} ({server.address}) exited with status "
                              f"{server.process.returncode} before it was ready; log {server.log} ends:\n"
                              f"{server.tail()}")
        if await engine.healthy():
            return
        await asyncio.sleep(READY_POLL_S)
    raise LaunchError(f"server {server.index} ({server.address}) not ready after {timeout:.0f}s; "
                      f"log {server.log} ends:\n{server.tail()}")


async def record_versions(servers: list[ServerProcess], engines: list[SGLangEngine], path: Path,
                           expect: Optional[str]) -> None:
    infos = await asyncio.gather(*(e.server_info() for e in engines))
    record = [{"index": s.index, "address": s.address, "version": info.get("version"),
               "pid": s.process.pid if s.process is not None else None,
               "log": str(s.log) if s.log is not None else None,
               "model_path": info.get("model_path"), "weight_version": info.get("weight_version")}
              for s, info in zip(servers, infos)]
    path.write_text(json.dumps(record, indent=1))
    if expect is not None:
        wrong = [r for r in record if str(r["version"]) != str(expect)]
        if wrong:
            raise LaunchError("inference.expect_version is " + repr(expect) + " but " + ", ".join(
                f"{r['address']} runs {r['version']!r}" for r in wrong))


async def stop_servers(servers: list[ServerProcess], *, timeout: float) -> None:
    """SIGTERM every launched server, SIGKILL those still running after ``timeout`` seconds."""
    running = [s.process for s in servers if s.process is not None and s.process.poll() is None]
    for process in running:
        _signal(process, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while any(p.poll() is None for p in running) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    for process in running:
        if process.poll() is None:
            _signal(process, signal.SIGKILL)
            process.wait()


def _signal(process: subprocess.Popen, sig: int) -> None:
    """Signal the server's whole process group (SGLang runs scheduler subprocesses)."""
    try:
        os.killpg(process.pid, sig)
    except (ProcessLookupError, PermissionError):
        try:
            process.send_signal(sig)
        except ProcessLookupError:
            pass


@inference_backend(InferenceBackend.cpu, InferenceBackend.sglang)
async def start_servers(config: Config, run_dir: RunDir, policy: PolicyVersion) -> tuple[EnginePool, object]:
    """Launched (or reached) servers as one pool, and the model's tokenizer (loaded on a thread
    while the servers start: importing transformers takes seconds)."""
    from rlorch.model import resolve_model_path

    model_path = resolve_model_path(config.model.path)
    # Submitted to the executor at once (a task would first wait for the loop): launching
    # blocks the loop until the fork server is warm, and the tokenizer's imports run on the
    # other core meanwhile.
    tokenizer = asyncio.get_running_loop().run_in_executor(None, _load_tokenizer, model_path)
    try:
        pool = await start_engines(config, log_dir=run_dir.logs, servers_file=run_dir.servers,
                                   model_path=model_path)
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
