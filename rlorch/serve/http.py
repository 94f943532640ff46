"""Reading request bodies for ``rlorch serve``'s routes: bounded in size and in time."""

from __future__ import annotations

import asyncio
import json

from aiohttp import web

from rlorch.jsonlines import loads
from rlorch.serve.sampling import RequestError

MAX_BODY_BYTES = 16 * 1024 * 1024
"""The largest request body accepted (413 above it, before reading it)."""
BODY_TIMEOUT_S = 10.0
"""By default a request body must arrive within this many seconds (408 otherwise): a slow or
stalled client cannot hold a connection and its buffer."""
IDLE_TIMEOUT_S = 75.0
"""By default a connection with no request for this long is closed (longer than the client's
own 60 s keep-alive, so the client closes first and never reuses a connection being closed)."""
BODY_TIMEOUT_KEY = web.AppKey("body_timeout", float)


async def json_body(request: web.Request, *, empty_ok: bool = False) -> dict:
    """The request's JSON object; a body over MAX_BODY_BYTES or slower than BODY_TIMEOUT_S
    raises the aiohttp error that answers it (413, 408), and a large one is parsed off the
    event loop."""
    if (request.content_length or 0) > MAX_BODY_BYTES:
        raise web.HTTPRequestEntityTooLarge(MAX_BODY_BYTES, request.content_length)
    timeout = request.app.get(BODY_TIMEOUT_KEY, BODY_TIMEOUT_S)
    try:
        raw = await asyncio.wait_for(request.read(), timeout)
    except asyncio.TimeoutError:
        raise web.HTTPRequestTimeout(text=f"request body not received within {timeout:g}s",
                                     headers={"Connection": "close"}) from None
    if not raw.strip() and empty_ok:
        return {}
    try:
        body = loads(raw) if len(raw) < 1 << 20 else await asyncio.to_thread(loads, raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise RequestError(f"invalid JSON body: {err}") from err
    if not isinstance(body, dict):
        raise RequestError(f"the request body must be a JSON object, got {type(body).__name__}")
    return body
