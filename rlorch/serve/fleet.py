"""``rlorch fleet``: many simulated engines behind SGLang's native HTTP API, for measuring the
orchestrator at a scale no test machine holds.

Each engine is one port with state of its own: a weight version, a pause flag, ``slots``
requests running at a time (the rest queue), a speed. Answers have SGLang's shape and size:
``output_ids`` and ``output_token_logprobs`` of the drawn length, ``weight_version``,
``finish_reason`` ``length``/``stop``/``abort``; a pause aborts what runs (partial output, as
SGLang's ``/pause_generation`` in abort mode) and holds new requests until
``/continue_generation``. Nothing is computed: a completion's length is drawn log-normally
(capped at its ``max_new_tokens``) and takes ``ttft + length / speed`` seconds, where each
engine's speed is drawn around ``tokens_per_s`` and a share of engines (stragglers) runs
``straggler_slowdown`` times slower. ``tokens_per_s`` 0 makes engines instant.

The engines of one process share its event loop and a bare HTTP/1.1 protocol (keep-alive,
``Content-Length`` bodies, which is what SGLang's clients send), so a thousand engines cost a
thousand listening sockets and a few processes, and the simulator's own CPU stays small beside
the orchestrator's it is there to measure. The completion text is a few random digits, so the
built-in digit tasks see rewards that differ within a group.
"""

from __future__ import annotations

import asyncio
import math
import multiprocessing
import os
import random
import signal
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy

from rlorch.jsonlines import dumps, loads

SEND_BUFFER = 1 << 16
"""SO_SNDBUF of a connection (the kernel doubles it): see :meth:`_Connection.connection_made`.
On one machine the fleet's send queues and the orchestrator's receive buffers (512 KiB each as
the kernel counts them) share the kernel's TCP memory, whose first threshold (tcp_mem) is about
1.1 GB on a machine of 23 GiB: a thousand connections at 512 + 512 KiB come near it, at 128 + 512
they stay well under (a full-size bench run stalled once at the former: docs/benchmarks.md)."""
TOKEN_CAP = 65536
"""The longest completion a fleet answers (its shared answer arrays are this long)."""


@dataclass(frozen=True)
class FleetProfile:
    """How the simulated engines behave (the ``rlorch fleet`` options)."""

    tokens_per_s: float = 0.0
    """Median decode speed of one sequence, tokens/s; 0 = instant engines."""
    speed_spread: float = 0.25
    """Log-normal sigma of the engines' speeds around the median."""
    stragglers: float = 0.0
    """Share of engines that run ``straggler_slowdown`` times slower."""
    straggler_slowdown: float = 5.0
    ttft: float = 0.0
    """Seconds before a request's first token."""
    length_median: float = 256.0
    """Median completion length in tokens (log-normal, capped at the request's max_new_tokens)."""
    length_sigma: float = 1.0
    """Log-normal sigma of completion lengths (1.0: a long tail)."""
    slots: int = 256
    """Requests one engine runs at once (SGLang's max_running_requests); the rest queue."""
    reload_s: float = 0.0
    """Seconds a weight update takes."""
    vocab: int = 32
    """Token ids are drawn below this (the tiny default model's vocabulary)."""
    seed: int = 0
    full_logprobs: bool = False
    """Logprobs as SGLang writes them, a float32's value in full (``-0.12345679104328156``: some
    33 bytes an entry); else to 4 decimals (some 21)."""


class FleetEngine:
    """One simulated engine's state."""

    def __init__(self, index: int, profile: FleetProfile):
        self.index = index
        self.profile = profile
        rng = random.Random(profile.seed * 1_000_003 + index)
        self.rng = rng
        slow = rng.random() < profile.stragglers
        speed = profile.tokens_per_s * math.exp(rng.gauss(0.0, profile.speed_spread)) if profile.tokens_per_s else 0.0
        self.speed = speed / profile.straggler_slowdown if slow and speed else speed
        self.straggler = slow
        self.version = "default"
        self.running_allowed = asyncio.Event()
        self.running_allowed.set()
        self.slots = asyncio.Semaphore(profile.slots)
        self.running: dict[str, asyncio.Future] = {}
        self.generated = 0

    def draw_length(self, max_new_tokens: int) -> int:
        median = self.profile.length_median
        length = int(round(median * math.exp(self.rng.gauss(0.0, self.profile.length_sigma)))) if median else 1
        return max(1, min(max_new_tokens, length, TOKEN_CAP))

    def seconds_for(self, tokens: int) -> float:
        return self.profile.ttft + tokens / self.speed if self.speed else 0.0

    def abort(self, prefix: str) -> int:
        """Abort every running request whose id starts with ``prefix`` (SGLang's prefix match)."""
        hits = [rid for rid in self.running if rid.startswith(prefix)]
        for rid in hits:
            future = self.running.pop(rid)
            if not future.done():
                future.set_result(None)
        return len(hits)

    def pause(self) -> None:
        self.running_allowed.clear()
        self.abort("")

    def resume(self) -> None:
        self.running_allowed.set()


class Fleet:
    """The engines of one process, each listening on its own port (see the module doc)."""

    def __init__(self, indices: list[int], port_base: int, profile: FleetProfile, host: str = "127.0.0.1"):
        self.profile = profile
        self.host = host
        self.port_base = port_base
        self.engines = {i: FleetEngine(i, profile) for i in indices}
        self.addresses: dict[int, str] = {}
        """Each engine's host:port once listening (port_base 0: ports the system chose)."""
        rng = random.Random(profile.seed)
        self._ids = [rng.randrange(3, max(4, profile.vocab)) for _ in range(TOKEN_CAP)]
        drawn = [-rng.expovariate(2.0) for _ in self._ids]
        logprobs = numpy.float32(drawn).tolist() if profile.full_logprobs else [round(lp, 4) for lp in drawn]
        self._entries = [[lp, token, None] for lp, token in zip(logprobs, self._ids)]
        self._servers: list[asyncio.AbstractServer] = []

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        for index, engine in self.engines.items():
            server = await loop.create_server(lambda engine=engine: _Connection(self, engine), self.host,
                                              self.port_base + index if self.port_base else 0, backlog=1024,
                                              reuse_address=True)
            self._servers.append(server)
            self.addresses[index] = f"{self.host}:{server.sockets[0].getsockname()[1]}"

    async def stop(self) -> None:
        for server in self._servers:
            server.close()

    def route(self, engine: FleetEngine, method: str, path: str, body: bytes):
        """(status, JSON bytes) at once, or a coroutine that returns them."""
        if path == "/generate":
            return self.generate(engine, loads(body))
        if path in ("/health", "/health_generate", "/flush_cache"):
            return 200, b""
        if path in ("/model_info", "/get_model_info"):
            return 200, dumps({"model_path": "fleet", "weight_version": engine.version, "is_generation": True})
        if path in ("/server_info", "/get_server_info"):
            return 200, dumps({"version": "fleet", "tp_size": 1, "weight_version": engine.version,
                               "max_running_requests": self.profile.slots, "model_path": "fleet",
                               "straggler": engine.straggler, "tokens_per_s": engine.speed})
        if path == "/pause_generation":
            engine.pause()
            return 200, b'{"success": true}'
        if path == "/continue_generation":
            engine.resume()
            return 200, b'{"success": true}'
        if path == "/update_weights_from_disk":
            return self.update_weights(engine, loads(body))
        if path == "/abort_request":
            request = loads(body)
            engine.abort("" if request.get("abort_all") else str(request.get("rid") or ""))
            return 200, b""
        return 404, dumps({"error": {"message": f"no route {method} {path}"}})

    async def update_weights(self, engine: FleetEngine, body: dict) -> tuple[int, bytes]:
        if self.profile.reload_s:
            await asyncio.sleep(self.profile.reload_s)
        engine.version = str(body.get("weight_version") or engine.version)
        return 200, dumps({"success": True, "message": f"loaded {body.get('model_path')}"})

    async def generate(self, engine: FleetEngine, body: dict) -> tuple[int, bytes]:
        batch = isinstance(body.get("rid"), list)
        rids = body["rid"] if batch else [body["rid"]]
        inputs = body["input_ids"] if batch else [body["input_ids"]]
        params = body["sampling_params"] if batch else [body["sampling_params"]]
        if batch and isinstance(params, dict):
            params = [params] * len(rids)
        answers = await asyncio.gather(*(self._sample(engine, rid, len(ids), int(p.get("max_new_tokens") or 128))
                                         for rid, ids, p in zip(rids, inputs, params)))
        return 200, dumps(answers if batch else answers[0])

    async def _sample(self, engine: FleetEngine, rid: str, prompt_tokens: int, max_new_tokens: int) -> dict:
        started = time.monotonic()
        length = engine.draw_length(max_new_tokens)
        async with engine.slots:
            await engine.running_allowed.wait()
            began = time.monotonic()
            seconds = engine.seconds_for(length)
            aborted = False
            if seconds > 0:
                future = asyncio.get_running_loop().create_future()
                engine.running[rid] = future
                try:
                    await asyncio.wait_for(future, seconds)
                    aborted = True
                except asyncio.TimeoutError:
                    pass
                finally:
                    engine.running.pop(rid, None)
            if aborted:
                done = int((time.monotonic() - began - engine.profile.ttft) * engine.speed)
                length = max(0, min(length - 1, done))
        engine.generated += length
        if aborted:
            reason = {"type": "abort", "message": "Abort before prefill" if not length else "Abort in waiting queue"}
        elif length == max_new_tokens:
            reason = {"type": "length", "length": length}
        else:
            reason = {"type": "stop", "matched": 2}
        start = engine.rng.randrange(0, TOKEN_CAP - length + 1)
        text = "".join(engine.rng.choice("0123456789") for _ in range(min(length, engine.rng.randint(1, 4))))
        return {"text": text, "output_ids": self._ids[start:start + length],
                "meta_info": {"id": rid, "finish_reason": reason, "prompt_tokens": prompt_tokens,
                              "completion_tokens": length, "cached_tokens": 0,
                              "output_token_logprobs": self._entries[start:start + length],
                              "weight_version": engine.version, "e2e_latency": time.monotonic() - started}}


class _Connection(asyncio.Protocol):
    """One client connection to one engine: HTTP/1.1 requests with ``Content-Length`` bodies,
    answered in order, kept alive."""

    def __init__(self, fleet: Fleet, engine: FleetEngine):
        self.fleet, self.engine = fleet, engine
        self.buffer = bytearray()
        self.busy = False
        self.transport: Optional[asyncio.Transport] = None

    def connection_made(self, transport) -> None:
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None:
            # The fleet shares the orchestrator's kernel, whose TCP buffers are limited as a whole
            # (tcp_mem): an answer not yet read waits in this process (the transport's buffer), as
            # it would on an engine's own machine, not in the kernel's send queue.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER)

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        if not self.busy:
            self._next()

    def _next(self) -> None:
        end = self.buffer.find(b"\r\n\r\n")
        if end < 0:
            return
        lines = bytes(self.buffer[:end]).decode("latin-1").split("\r\n")
        method, path = lines[0].split(" ", 2)[:2]
        length = 0
        for line in lines[1:]:
            name, _, value = line.partition(":")
            if name.strip().lower() == "content-length":
                length = int(value)
        if len(self.buffer) < end + 4 + length:
            return
        body = bytes(self.buffer[end + 4:end + 4 + length])
        del self.buffer[:end + 4 + length]
        answer = self.fleet.route(self.engine, method, path.split("?", 1)[0], body)
        if isinstance(answer, tuple):
            self._write(*answer)
        else:
            self.busy = True
            asyncio.ensure_future(answer).add_done_callback(self._answered)

    def _answered(self, task: asyncio.Future) -> None:
        self.busy = False
        if task.cancelled():
            return
        error = task.exception()
        self._write(*((500, dumps({"error": {"message": repr(error)}})) if error else task.result()))

    def _write(self, status: int, payload: bytes) -> None:
        if self.transport is None or self.transport.is_closing():
            return
        self.transport.write(b"HTTP/1.1 %d %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
                             % (status, b"OK" if status == 200 else b"ERROR", len(payload)) + payload)
        self._next()

    def connection_lost(self, exc) -> None:
        self.transport = None


def _serve_slice(indices: list[int], port_base: int, profile: FleetProfile, host: str, ready) -> None:
    async def main() -> None:
        fleet = Fleet(indices, port_base, profile, host)
        await fleet.start()
        ready.send(fleet.addresses)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stop.set)
        await stop.wait()
        await fleet.stop()

    asyncio.run(main())


def serve_fleet(engines: int, port_base: int, *, processes: int, profile: FleetProfile,
                host: str = "127.0.0.1", fleet_file: Optional[Path] = None) -> None:
    """Serve ``engines`` endpoints on ports ``port_base ...`` (0: ports the system chooses) from
    ``processes`` processes until SIGTERM/SIGINT; once every one listens, write their
    ``host:port`` lines to ``fleet_file``."""
    processes = max(1, min(processes, engines))
    context = multiprocessing.get_context("spawn")
    children, pipes = [], []
    for p in range(processes):
        parent_end, child_end = context.Pipe(duplex=False)
        child = context.Process(target=_serve_slice, name=f"fleet-{p}", daemon=True,
                                args=(list(range(p, engines, processes)), port_base, profile, host, child_end))
        child.start()
        children.append(child)
        pipes.append(parent_end)
    stop = {"now": False}

    def _stop(signum, frame) -> None:
        stop["now"] = True

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    listening: dict[int, str] = {}
    try:
        for child, pipe in zip(children, pipes):
            while not pipe.poll(0.2):
                if not child.is_alive() or stop["now"]:
                    raise SystemExit(f"fleet process {child.name} exited before it was ready "
                                     f"(ports {port_base}..{port_base + engines - 1} free?)")
            listening.update(pipe.recv())
        addresses = [listening[i] for i in range(engines)]
        if fleet_file is not None:
            temporary = Path(f"{fleet_file}.tmp")
            temporary.write_text("\n".join(addresses) + "\n")
            os.replace(temporary, fleet_file)
        print(f"fleet: {engines} engines on {addresses[0]}..{addresses[-1]} from {processes} processes", flush=True)
        while not stop["now"] and all(child.is_alive() for child in children):
            time.sleep(0.2)
    finally:
        for child in children:
            if child.is_alive():
                child.terminate()
        for child in children:
            child.join(5)
            if child.is_alive():
                child.kill()
