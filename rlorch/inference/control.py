"""Keep-alive HTTP/1.1 for the control plane of a fleet: pause, continue, weight updates,
version and health checks.

A weight version goes to every server as three calls (pause, update, continue), and the health
loop probes every server each ``inference.health_interval``: with a thousand servers these calls
are the orchestrator's fan-out, and each one through a general HTTP client costs about half a
millisecond of the one core the loop runs on. This client writes the request line and headers
itself and reads the answer by its ``Content-Length`` (chunked and read-to-close answers are read
too), about a sixth of that. Generation, whose bodies are large and whose calls are few per
rollout, stays on aiohttp.

One :class:`ControlHTTP` is shared by all the clients of a pool: idle connections are kept per
server (at most ``KEEPALIVE_SECONDS`` idle, under SGLang's 5 s) and at most ``concurrency``
calls are on the wire at once, across the fleet. A call whose connection the server closed before
any answer arrived (a kept connection it had closed for idleness) is sent once more on a fresh
connection; every control call is idempotent (pausing twice, loading the same version twice).
"""

from __future__ import annotations

import asyncio
import time
from typing import Optional

KEEPALIVE_SECONDS = 2.0
"""Idle lifetime of a kept connection, shorter than SGLang's 5 s keep-alive."""

MAX_HEADER_LINES = 100


class ClosedBeforeAnswer(ConnectionResetError):
    """The server closed the connection before the answer's status line."""


class ControlHTTP:
    """Keep-alive HTTP/1.1 connections to many servers, shared (see the module doc)."""

    def __init__(self, *, concurrency: int = 256, keepalive: float = KEEPALIVE_SECONDS):
        self.concurrency = concurrency
        self.keepalive = keepalive
        self._idle: dict[tuple[str, int], list[tuple[asyncio.StreamReader, asyncio.StreamWriter, float]]] = {}
        self._limit: Optional[asyncio.Semaphore] = None

    async def request(self, host: str, port: int, method: str, path: str, *, body: Optional[bytes] = None,
                      headers: Optional[dict] = None, timeout: float) -> tuple[int, bytes]:
        """One call; returns (status, body). Transport failures raise ``OSError`` (a closed
        connection as ``ConnectionResetError``) or ``asyncio.TimeoutError`` after ``timeout``."""
        if self._limit is None:
            self._limit = asyncio.Semaphore(self.concurrency)
        head = [f"{method} {path} HTTP/1.1", f"Host: {host}:{port}", f"Content-Length: {len(body or b'')}"]
        for name, value in (headers or {}).items():
            head.append(f"{name}: {value}")
        message = ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + (body or b"")
        async with self._limit:
            return await asyncio.wait_for(self._exchange(host, port, message), timeout)

    async def _exchange(self, host: str, port: int, message: bytes) -> tuple[int, bytes]:
        connection = self._take(host, port) or await asyncio.open_connection(host, port)
        try:
            return await self._once(host, port, *connection, message)
        except ClosedBeforeAnswer:
            reader, writer = await asyncio.open_connection(host, port)
            return await self._once(host, port, reader, writer, message)

    def _take(self, host: str, port: int):
        idle = self._idle.get((host, port))
        now = time.monotonic()
        while idle:
            reader, writer, since = idle.pop()
            if now - since < self.keepalive and not reader.at_eof() and not writer.is_closing():
                return reader, writer
            writer.close()
        return None

    async def _once(self, host: str, port: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                    message: bytes) -> tuple[int, bytes]:
        keep = False
        try:
            writer.write(message)
            await writer.drain()
            status_line = await reader.readline()
            if not status_line:
                raise ClosedBeforeAnswer(f"{host}:{port} closed the connection")
            parts = status_line.split(None, 2)
            if len(parts) < 2 or not parts[0].startswith(b"HTTP/1."):
                raise ConnectionResetError(f"{host}:{port} answered {status_line[:80]!r}, not HTTP/1.x")
            status = int(parts[1])
            length, chunked, close = None, False, parts[0] == b"HTTP/1.0"
            for _ in range(MAX_HEADER_LINES):
                line = await reader.readline()
                if line in (b"\r\n", b"\n", b""):
                    break
                name, _, value = line.partition(b":")
                name = name.strip().lower()
                if name == b"content-length":
                    length = int(value)
                elif name == b"transfer-encoding":
                    chunked = b"chunked" in value.lower()
                elif name == b"connection":
                    close = value.strip().lower() == b"close"
            else:
                raise ConnectionResetError(f"{host}:{port} sent more than {MAX_HEADER_LINES} header lines")
            if chunked:
                data = await _read_chunked(reader)
            elif length is not None:
                data = await reader.readexactly(length)
            else:
                data, close = await reader.read(), True
            keep = not close
            return status, data
        except asyncio.IncompleteReadError as err:
            raise ConnectionResetError(f"{host}:{port} closed the connection mid-answer") from err
        finally:
            if keep:
                self._idle.setdefault((host, port), []).append((reader, writer, time.monotonic()))
            else:
                writer.close()

    def forget(self, host: str, port: int) -> None:
        """Close the idle connections to one server."""
        for _, writer, _ in self._idle.pop((host, port), []):
            writer.close()

    def close(self) -> None:
        for key in list(self._idle):
            self.forget(*key)


async def _read_chunked(reader: asyncio.StreamReader) -> bytes:
    data = bytearray()
    while True:
        size = int((await reader.readline()).split(b";", 1)[0].strip() or b"0", 16)
        if size == 0:
            while (await reader.readline()) not in (b"\r\n", b"\n", b""):
                pass
            return bytes(data)
        data += await reader.readexactly(size)
        await reader.readexactly(2)
