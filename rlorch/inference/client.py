"""``SGLangEngine``: the Engine Protocol over one server's SGLang native HTTP API.

The same client drives SGLang, a sglang-router and ``rlorch serve``.

Interruptible generation: a weight update pauses the server, which answers in-flight requests
with their partial output and finish type ``abort``. :meth:`SGLangEngine.generate` resubmits to
the same server with the generated tokens appended to ``input_ids`` and ``max_new_tokens``
reduced, and stamps each segment's tokens with the ``weight_version`` of the response that
carried them (or with its ``weight_versions`` spans when the server reports that a segment itself
spans versions), so one trajectory may span several policy versions and ``Generation.versions``
shows exactly which.

Request ids on the wire: each HTTP /generate carries a fresh id, ``f"{rid}.{suffix}"``, the suffix
32 hex digits: a random half drawn once per process (again in a forked child) and a counter. SGLang
aborts every request whose id *starts with* the given one and refuses an id already in flight
(HTTP 400 "Duplicate request ID"); fresh, equal-length suffixes mean no id in flight is a prefix
of another and no resubmission or retry reuses one, this process's or an earlier life's.
:meth:`SGLangEngine.abort` maps the caller's ``rid`` to the id in flight.

Idle connections: SGLang's server closes idle keep-alive connections after 5 s
(``SGLANG_TIMEOUT_KEEP_ALIVE``); the client keeps them ``KEEPALIVE_SECONDS`` and retries a call
once on a fresh connection when the server drops one, before calling the server unavailable.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import socket
import uuid
import weakref
from array import array
from typing import Any, Awaitable, Callable, Optional, Sequence

import aiohttp

from rlorch.inference.answers import parse_generate, segment
from rlorch.inference.control import KEEPALIVE_SECONDS, ControlHTTP
from rlorch.jsonlines import dumps, loads
from rlorch.lifecycle import gather_all
from rlorch.types import Generation, GroupRequest, SamplingParams, VersionStamps, logprob_array, token_ids

log = logging.getLogger(__name__)

MAX_SEGMENTS = 1000
"""Resubmissions of one request before the client gives up (a guard against abort loops)."""

BATCH_REFUSED = frozenset({400, 404, 405, 422, 501})
"""Answers of a server that does not take the batch form of /generate (a malformed request, no
such route or method, a schema it rejects); any other failure is the request's or the server's."""

DUPLICATE_RID = "Duplicate request ID"
"""SGLang's message for an id already in flight."""


class EngineError(RuntimeError):
    """The server refused a request (HTTP 4xx/5xx with a message); retrying elsewhere won't help."""


class EngineUnavailable(EngineError):
    """The server did not answer (connection refused or reset, timeout).

    ``partial`` holds what the request had generated before the failure, so it can continue on
    another server instead of starting over.
    """

    def __init__(self, message: str, partial: Optional[Generation] = None):
        super().__init__(message)
        self.partial = partial


def parse_weight_version(value: Any) -> int:
    """SGLang reports ``weight_version`` as a string; its start-up default ``"default"`` means the
    initial weights (version 0). Anything else must be an integer."""
    if value is None or value == "default":
        return 0
    try:
        return int(value)
    except (TypeError, ValueError):
        raise EngineError(f"weight_version {value!r} is not an integer policy version") from None


class _WireSuffixes:
    """Equal-length, never repeated suffixes: this process's random half and a counter (a uuid4
    per sample cost the client ten times as much)."""

    def __init__(self) -> None:
        self.renew()
        os.register_at_fork(after_in_child=self.renew)

    def renew(self) -> None:
        self.origin, self.count = uuid.uuid4().hex[:16], itertools.count()

    def next(self) -> str:
        return f"{self.origin}{next(self.count):016x}"


_SUFFIXES = _WireSuffixes()


def wire_rid(rid: str) -> str:
    """A fresh id for one HTTP /generate of request ``rid`` (see the module doc)."""
    return f"{rid}.{_SUFFIXES.next()}"


def normalize_address(address: str) -> str:
    return address.rstrip("/") if "://" in address else f"http://{address.rstrip('/')}"


class SGLangEngine:
    """One SGLang-compatible server. Keeps one keep-alive ``aiohttp.ClientSession``."""

    def __init__(self, address: str, *, request_timeout: float = 300.0, control_timeout: float = 600.0,
                 reload_timeout: Optional[float] = None, extra_params: Optional[dict] = None,
                 name: Optional[str] = None, api_key: Optional[str] = None,
                 control_http: Optional[ControlHTTP] = None,
                 parse: Optional[Callable[[bytes | bytearray], Awaitable[Any]]] = None):
        """``request_timeout`` bounds each /generate call; ``control_timeout`` bounds pause, continue,
        abort and the other control calls; ``reload_timeout`` (default ``control_timeout``) bounds a
        weight update, from disk or over the group. ``extra_params`` are added to every request's sampling_params
        (e.g. ``{"ignore_eos": True}``). ``api_key`` goes out as ``Authorization: Bearer`` (SGLang's
        ``--api-key``). ``control_http`` carries the control calls (one shared by a pool's
        clients; by default one of the client's own); an ``https`` server gets them over aiohttp.
        ``parse`` reads a /generate answer's body (:meth:`AnswerParsers.parse`, a pool's workers);
        by default :func:`parse_generate`, in the event loop."""
        self.url = normalize_address(address)
        plain = self.url.startswith("http://") and "/" not in self.url[len("http://"):]
        host, _, port = self.url[len("http://"):].rpartition(":")
        self._host, self._port = host.strip("[]"), int(port) if port.isdigit() else 80
        self._control_http = (control_http or ControlHTTP()) if plain and port.isdigit() else None
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.name = name or self.url.split("://", 1)[1]
        self.request_timeout = request_timeout
        self.control_timeout = control_timeout
        self.reload_timeout = control_timeout if reload_timeout is None else reload_timeout
        self.extra_params = dict(extra_params or {})
        self._parse = parse
        self._session: Optional[aiohttp.ClientSession] = None
        self._cancelled: set[str] = set()
        self._on_wire: dict[str, str] = {}
        self.version: Optional[int] = None
        """The policy version this server holds as far as the client knows (set by
        :meth:`reload` and :meth:`weight_version`); stamps responses that carry none."""
        self.batch_form = True
        """Whether the server takes SGLang's batch /generate (cleared once it refused one)."""
        self.tp_size = 1
        """The server's tensor parallelism (from ``/server_info``): it joins the weight group once
        per TP rank."""
        self.requests = 0
        self.resubmits = 0
        self.server_seconds = 0.0

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_SECONDS,
                                             socket_factory=bounded_receive_socket)
            self._session = aiohttp.ClientSession(connector=connector)
        return self._session

    async def _request(self, method: str, path: str, *, timeout: float, payload: Any = None,
                       partial: Optional[Generation] = None) -> tuple[int, Any]:
        """One HTTP call; returns (status, parsed JSON or text). A connection the server dropped
        is retried once on a fresh one; other transport failures raise :class:`EngineUnavailable`.
        Control calls go through the fleet's :class:`ControlHTTP`, generation through aiohttp."""
        try:
            if self._control_http is not None and path != "/generate":
                data = None if payload is None else dumps(payload)
                headers = self._headers if data is None else {**self._headers, "Content-Type": "application/json"}
                status, body = await self._control_http.request(self._host, self._port, method, path, body=data,
                                                                headers=headers, timeout=timeout)
            else:
                try:
                    status, body = await self._send(self._client(), method, path, timeout, payload)
                except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError):
                    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as fresh:
                        status, body = await self._send(fresh, method, path, timeout, payload)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as err:
            reason = f"{type(err).__name__}: {err}" if str(err) else type(err).__name__
            raise EngineUnavailable(f"{self.name} {method} {path} failed: {reason}", partial) from err
        if not body:
            return status, None
        try:  # answers hold no integer past 64 bits: orjson reads them as written
            if path == "/generate" and status == 200:
                return status, parse_generate(body) if self._parse is None else await self._parse(body)
            return status, loads(body, exact=False)
        except ValueError:
            return status, body.decode(errors="replace")

    async def _send(self, session: aiohttp.ClientSession, method: str, path: str, timeout: float,
                    payload: Any) -> tuple[int, bytes]:
        data = None if payload is None else dumps(payload)
        headers = self._headers if data is None else {**self._headers, "Content-Type": "application/json"}
        async with session.request(method, self.url + path, data=data, headers=headers,
                                   timeout=aiohttp.ClientTimeout(total=timeout)) as response:
            if path != "/generate":
                return response.status, await response.read()
            async with _body_reads():
                return response.status, await _read_body(response)

    @staticmethod
    def _message(body: Any) -> str:
        if isinstance(body, dict):
            error = body.get("error")
            if isinstance(error, dict) and "message" in error:
                return str(error["message"])
            if "message" in body:
                return str(body["message"])
            if "detail" in body:
                return str(body["detail"])
        return str(body)

    # ---- generation -----------------------------------------------------------------------

    async def generate(self, input_ids: list[int], params: SamplingParams, rid: str, *,
                       prefix: Optional[Generation] = None) -> Generation:
        """Generate until stop or length, resubmitting after pause-aborts (see the module doc).

        ``prefix`` continues a generation started elsewhere (its tokens are already part of the
        trajectory and count against ``max_new_tokens``).
        """
        done = copy_generation(prefix) if prefix is not None else empty_generation()
        self.requests += 1
        for _ in range(MAX_SEGMENTS):
            remaining = params.max_new_tokens - len(done.output_ids)
            if remaining <= 0:
                done.finish_reason = "length"
                return done
            answer = await self._generate_once(wire_ids(input_ids, done), params, remaining, rid, done)
            await self._append(done, answer)
            if self._ends_here(rid, done):
                return done
            self.resubmits += 1
        raise EngineError(f"{self.name}: request {rid} aborted {MAX_SEGMENTS} times in a row")

    def _ends_here(self, rid: str, done: Generation) -> bool:
        """Whether request ``rid`` ends with the segment just added: it finished, or it was
        aborted through :meth:`abort` (only a pause's abort is resubmitted)."""
        if done.finish_reason != "abort":
            return True
        if rid in self._cancelled:
            self._cancelled.discard(rid)
            return True
        return False

    async def _append(self, done: Generation, answer: dict) -> None:
        """Add one response's segment (tokens, logprobs, version stamps, text, finish reason)."""
        meta = answer["meta_info"]
        self.server_seconds += float(meta.get("e2e_latency") or 0.0)
        reason = meta.get("finish_reason") or {}
        done.finish_reason = reason.get("type", "stop") if isinstance(reason, dict) else str(reason)
        ids, logprobs = _segment(answer, aborted=done.finish_reason == "abort")
        done.output_ids += ids
        done.logprobs += logprobs
        for version, count in await self._stamps(meta, len(ids)):
            done.versions.extend(version, count)
        done.text += answer.get("text") or ""

    async def _stamps(self, meta: dict, count: int) -> list[tuple[int, int]]:
        """(version, tokens) runs for a segment of ``count`` tokens: its ``weight_versions`` spans
        when they cover it, else its ``weight_version``, else (0.5.5 sends none) the version the
        client knows this server holds, read from the server if unknown — never a guess."""
        spans = meta.get("weight_versions")
        if spans and sum(int(s["end"]) - int(s["start"]) for s in spans) == count:
            return [(parse_weight_version(s["version"]), int(s["end"]) - int(s["start"])) for s in spans]
        if meta.get("weight_version") is not None:
            return [(parse_weight_version(meta["weight_version"]), count)]
        if count == 0:
            return []
        if self.version is None:
            await self.weight_version()
        return [(self.version, count)]

    async def generate_group(self, input_ids: list[int], params: SamplingParams, n: int,
                             rid: str) -> list[Generation]:
        """``n`` independent samples (request ids ``f"{rid}-{i}"``), sent together so the server
        batches them; each one is interruptible on its own."""
        return await gather_all(*(self.generate(input_ids, params, f"{rid}-{i}") for i in range(n)))

    async def generate_batch(self, requests: Sequence[GroupRequest]) -> list[list[Generation]]:
        """Every sample of every request in one batch /generate (SGLang's batch form:
        ``input_ids`` a list of lists, ``sampling_params`` and ``rid`` lists of the same length,
        answered as a list in the same order; request ids ``f"{rid}-{i}"``). The samples a pause
        cut short go on together, in one batch /generate per pause, each from where it stopped
        as :meth:`generate` would continue it. A server that refuses the batch form (HTTP 4xx
        other than a duplicate id) gets separate requests instead, and once they succeed, from
        then on."""
        if not self.batch_form:
            return await self._generate_each(requests)
        samples = [(request, f"{request.rid}-{i}") for request in requests for i in range(request.n)]
        body = await self._generate_batch_once([rid for _, rid in samples], [r.input_ids for r, _ in samples],
                                               [self._sampling(r.params, r.params.max_new_tokens) for r, _ in samples])
        if body is None:
            answers = await self._generate_each(requests)
            self.batch_form = False
            log.warning("%s refuses the batch form of /generate: sending one request per sample from now on",
                        self.name)
            return answers
        self.requests += len(samples)
        done = [empty_generation() for _ in samples]
        going_on = list(range(len(samples)))
        for attempt in range(MAX_SEGMENTS):
            if attempt:
                self.resubmits += len(going_on)
                body = await self._generate_batch_once(
                    [samples[index][1] for index in going_on],
                    [wire_ids(samples[index][0].input_ids, done[index]) for index in going_on],
                    [self._sampling(samples[index][0].params, self._remaining(samples[index][0], done[index]))
                     for index in going_on], refusable=False)
            for index, answer in zip(going_on, body):
                await self._append(done[index], answer)
            going_on = [index for index in going_on if not self._ends_here(samples[index][1], done[index])]
            for index in [index for index in going_on if self._remaining(samples[index][0], done[index]) <= 0]:
                done[index].finish_reason = "length"
                going_on.remove(index)
            if not going_on:
                break
        else:
            raise EngineError(f"{self.name}: batch requests {', '.join(samples[i][1] for i in going_on[:3])} "
                              f"aborted {MAX_SEGMENTS} times in a row")
        answers, at = [], 0
        for request in requests:
            answers.append(done[at:at + request.n])
            at += request.n
        return answers

    @staticmethod
    def _remaining(request: GroupRequest, done: Generation) -> int:
        return request.params.max_new_tokens - len(done.output_ids)

    def _sampling(self, params: SamplingParams, max_new_tokens: int) -> dict:
        return {**params.to_json(), **self.extra_params, "max_new_tokens": max_new_tokens}

    async def _generate_each(self, requests: Sequence[GroupRequest]) -> list[list[Generation]]:
        return await gather_all(*(self.generate_group(r.input_ids, r.params, r.n, r.rid) for r in requests))

    async def _generate_batch_once(self, rids: list[str], inputs: list[list[int]], params: list[dict], *,
                                   refusable: bool = True) -> Optional[list]:
        """One batch /generate under fresh wire ids; None when the server refuses the batch form
        and ``refusable`` (a continuation is sent where the batch form was taken: any refusal
        there is about its content, and raises with the server's message)."""
        status, body = await self._post_generate(
            rids, lambda sent: {"input_ids": inputs, "sampling_params": params, "return_logprob": True, "rid": sent})
        if refusable and status in BATCH_REFUSED:
            return None
        if status != 200 or not isinstance(body, list) or len(body) != len(rids):
            raise EngineError(f"{self.name} batch /generate of {len(rids)} answered {status}: "
                              f"{self._message(body)[:200]}")
        return body

    async def _post_generate(self, rids: list[str], payload: Callable[[list[str]], dict],
                             partial: Optional[Generation] = None) -> tuple[int, Any]:
        """POST one /generate for requests ``rids`` under fresh wire ids (``payload`` builds the
        body from them); ids refused as duplicates are sent again under others (a duplicate is
        never the request's fault). A server error raises :class:`EngineUnavailable`."""
        for _ in range(3):
            sent = [wire_rid(rid) for rid in rids]
            self._on_wire.update(zip(rids, sent))
            try:
                status, body = await self._request("POST", "/generate", timeout=self.request_timeout,
                                                   payload=payload(sent), partial=partial)
            finally:
                for rid in rids:
                    self._on_wire.pop(rid, None)
            if not (status == 400 and DUPLICATE_RID in self._message(body)):
                break
        if status >= 500 and status != 501:
            raise EngineUnavailable(f"{self.name} /generate answered {status}: {self._message(body)}", partial)
        return status, body

    def wire_rid(self, rid: str) -> Optional[str]:
        """The id request ``rid`` carries on the wire right now (None between segments)."""
        return self._on_wire.get(rid)

    async def _generate_once(self, input_ids: list[int], params: SamplingParams, remaining: int,
                             rid: str, partial: Generation) -> dict:
        """One single-request /generate (see :meth:`_post_generate`)."""
        sampling = self._sampling(params, remaining)
        status, body = await self._post_generate(
            [rid], lambda sent: {"input_ids": input_ids, "sampling_params": sampling, "return_logprob": True,
                                 "rid": sent[0]}, partial)
        if status != 200 or not isinstance(body, dict):
            raise EngineError(f"{self.name} /generate answered {status}: {self._message(body)}")
        return body

    async def abort(self, rid: str) -> None:
        """Abort a request; its ``generate`` returns what it has with finish_reason ``abort``."""
        self._cancelled.add(rid)
        sent = self._on_wire.get(rid)
        if sent is not None:
            await self._control("POST", "/abort_request", {"rid": sent, "abort_all": False}, expect_json=False)

    # ---- control --------------------------------------------------------------------------

    async def _control(self, method: str, path: str, payload: Any = None, *, expect_json: bool = True) -> Any:
        status, body = await self._request(method, path, timeout=self.control_timeout, payload=payload)
        if status != 200:
            raise EngineError(f"{self.name} {path} answered {status}: {self._message(body)}")
        if expect_json and not isinstance(body, dict):
            raise EngineError(f"{self.name} {path} answered {body!r}, expected a JSON object")
        return body

    async def pause(self) -> None:
        """Pause generation: in-flight requests come back as aborts and are resubmitted by their
        ``generate`` calls, which the server holds until :meth:`resume`."""
        await self._control("POST", "/pause_generation", {})

    async def resume(self) -> None:
        await self._control("POST", "/continue_generation", {})

    async def flush_cache(self) -> bool:
        """Whether ``/flush_cache`` flushed (SGLang answers 400 while requests run or wait)."""
        status, _ = await self._request("POST", "/flush_cache", timeout=self.control_timeout)
        return status == 200

    async def release_memory_occupation(self, tags: list[str]) -> None:
        """Release ``tags`` of the server's GPU memory (SGLang: 200 ``null``; the caller must have
        paused generation and flushed the cache, or SGLang's scheduler dies)."""
        await self._control("POST", "/release_memory_occupation", {"tags": tags}, expect_json=False)

    async def resume_memory_occupation(self, tags: list[str]) -> None:
        """Take back ``tags``, each released before (SGLang's scheduler dies on any other)."""
        await self._control("POST", "/resume_memory_occupation", {"tags": tags}, expect_json=False)

    async def reload(self, path: str, version: int) -> None:
        """Load the HF checkpoint at ``path`` as policy ``version``; raise with the server's message."""
        payload = {"model_path": str(path), "load_format": None, "abort_all_requests": False,
                   "weight_version": str(version)}
        status, body = await self._request("POST", "/update_weights_from_disk", timeout=self.reload_timeout,
                                           payload=payload)
        if status != 200 or not isinstance(body, dict) or not body.get("success", False):
            raise EngineError(f"{self.name} could not load {path}: {self._message(body)}")
        self.version = version

    async def init_weights_update_group(self, spec: dict) -> None:
        """Join the trainer's weight-transfer group (SGLang's InitWeightsUpdateGroupReqInput fields).
        A weight-update session an earlier orchestrator left open (it died mid-update) is closed
        first, best effort, or every later ``/begin_weight_update`` would be refused."""
        await self._request("POST", "/end_weight_update", timeout=self.control_timeout, payload={})
        await self._weights_call("/init_weights_update_group", spec, "could not join the weight group",
                                 timeout=self.reload_timeout)

    async def begin_weight_update(self) -> None:
        await self._weights_call("/begin_weight_update", {}, "could not open a weight-update session")

    async def end_weight_update(self) -> None:
        await self._weights_call("/end_weight_update", {}, "could not close the weight-update session")

    async def update_weights_from_distributed(self, offer: dict, version: int) -> None:
        """Receive ``offer`` (names, dtypes, shapes, group_name) over the group as policy ``version``.
        SGLang takes it only inside a weight-update session (:meth:`begin_weight_update` ...
        :meth:`end_weight_update`)."""
        payload = {**offer, "flush_cache": True, "abort_all_requests": False, "weight_version": str(version)}
        await self._weights_call("/update_weights_from_distributed", payload, f"could not receive version {version}",
                                 timeout=self.reload_timeout)

    async def destroy_weights_update_group(self, group_name: str) -> None:
        await self._weights_call("/destroy_weights_update_group", {"group_name": group_name},
                                 f"could not leave weight group {group_name}")

    async def _weights_call(self, path: str, payload: dict, failure: str, *, timeout: Optional[float] = None) -> None:
        timeout = self.control_timeout if timeout is None else timeout
        status, body = await self._request("POST", path, timeout=timeout, payload=payload)
        if status != 200 or not isinstance(body, dict) or not body.get("success", False):
            raise EngineError(f"{self.name} {failure}: {self._message(body)}")

    async def healthy(self, timeout: Optional[float] = None) -> bool:
        """Whether ``/health_generate`` (one generated token) answers 200 within ``timeout``
        (default: the control deadline, at most 30 s)."""
        timeout = min(30.0, self.control_timeout) if timeout is None else timeout
        try:
            status, _ = await self._request("GET", "/health_generate", timeout=timeout)
        except EngineUnavailable:
            return False
        return status == 200

    async def model_info(self) -> dict:
        return await self._info("/model_info", "/get_model_info")

    async def server_info(self) -> dict:
        """The server's arguments and state; ``tp_size`` is remembered (the weight group's ranks)."""
        info = await self._info("/server_info", "/get_server_info")
        self.tp_size = int(info.get("tp_size") or 1)
        return info

    async def _info(self, path: str, deprecated: str) -> dict:
        """``path`` (SGLang 0.5.23 logs a deprecation warning on every call of the old name), or
        ``deprecated`` from a server that does not know it."""
        status, body = await self._request("GET", path, timeout=self.control_timeout)
        if status == 404:
            return await self._control("GET", deprecated)
        if status != 200 or not isinstance(body, dict):
            raise EngineError(f"{self.name} {path} answered {status}: {self._message(body)}")
        return body

    async def weight_version(self) -> int:
        """The version the server holds: ``/model_info`` (0.5.23), else ``/get_model_info``,
        else ``/get_weight_version`` (older servers); the first that exists and reports one."""
        for path in ("/model_info", "/get_model_info", "/get_weight_version"):
            status, body = await self._request("GET", path, timeout=self.control_timeout)
            if status == 404 or (status == 200 and isinstance(body, dict) and "weight_version" not in body):
                continue
            if status != 200 or not isinstance(body, dict):
                raise EngineError(f"{self.name} {path} answered {status}: {self._message(body)}")
            self.version = parse_weight_version(body["weight_version"])
            return self.version
        raise EngineError(f"{self.name} reports no weight_version (/model_info, /get_model_info, "
                          "/get_weight_version)")

    def health(self) -> dict:
        """One server on its own has no fleet to report (a pool of servers does)."""
        return {}

    def gauges(self) -> dict:
        """Requests started, resubmissions after pause-aborts, and the server-side seconds
        (sum of ``e2e_latency``) they took."""
        return {"requests": self.requests, "resubmits": self.resubmits, "server_seconds": self.server_seconds}

    async def close(self) -> None:
        if self._control_http is not None:
            self._control_http.forget(self._host, self._port)
        if self._session is not None and not self._session.closed:
            await self._session.close()
        self._session = None


BODY_READS = 2
"""/generate answers read at once, per event loop. An answer is ~27 bytes a generated token (a
batch of 64 samples of 4,096 tokens: 7 MB); when a fleet answers together, reading them all at
once would hold every body in memory before any is parsed into arrays (~9 bytes a token). The
others wait in their sockets (aiohttp stops reading a connection whose buffer is full); two,
so that one slow sender does not hold up the rest."""

RECEIVE_BUFFER = 1 << 18
"""SO_RCVBUF of a /generate connection (the kernel doubles it for its bookkeeping, within
``net.core.rmem_max``). The answers not being read (:data:`BODY_READS`) wait in their sockets;
left to itself, Linux grows each receive buffer towards ``net.ipv4.tcp_rmem``'s maximum (32 MB
on common distributions), and a thousand engines' waiting answers pass the kernel's limit on
all TCP buffers (``tcp_mem``, about 1.5 GB on a 24 GB machine): it then drops segments and each
connection waits out a retransmission timeout that doubles. At 1,000 simulated engines and
20,000 answers of 4,096 tokens in flight that stalled ingest for minutes (6 min 8 s against
53 s bounded). 512 KiB a connection, a thousand of them half a gigabyte, still carries several
times the bandwidth-delay product the ingest needs (it reads about 80 MB/s)."""


def bounded_receive_socket(address: tuple) -> socket.socket:
    """aiohttp's ``socket_factory``: a socket of ``address``'s family with :data:`RECEIVE_BUFFER`
    set before it connects (the window it offers is sized then)."""
    family, kind, proto = address[:3]
    sock = socket.socket(family=family, type=kind, proto=proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RECEIVE_BUFFER)
    return sock


_BODY_GATES: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore]" = weakref.WeakKeyDictionary()


def _body_reads() -> asyncio.Semaphore:
    loop = asyncio.get_running_loop()
    gate = _BODY_GATES.get(loop)
    if gate is None:
        gate = _BODY_GATES[loop] = asyncio.Semaphore(BODY_READS)
    return gate


async def _read_body(response: aiohttp.ClientResponse) -> bytes | bytearray:
    """The whole body, into one buffer of its ``Content-Length`` (``read()`` would hold its
    chunks and their join: twice the body)."""
    length = response.content_length
    if length is None or response.headers.get("Content-Encoding"):
        return await response.read()
    body, at = bytearray(length), 0
    while at < length:
        chunk = await response.content.readany()
        if not chunk:
            break
        if at + len(chunk) > length:
            return bytes(body[:at]) + chunk + await response.read()
        body[at:at + len(chunk)] = chunk
        at += len(chunk)
    return body if at == length else body[:at]


def empty_generation() -> Generation:
    return Generation(token_ids(), logprob_array(), VersionStamps(), "abort")


def copy_generation(generation: Generation) -> Generation:
    return Generation(token_ids(generation.output_ids), logprob_array(generation.logprobs),
                      VersionStamps([list(run) for run in generation.versions.runs]),
                      generation.finish_reason, generation.text)


def wire_ids(input_ids, done: Generation) -> list[int]:
    """The ids a (re)submission sends: the prompt (a list, or an array in a conversation) and
    what earlier segments generated, as a JSON list."""
    prompt = input_ids.tolist() if isinstance(input_ids, array) else input_ids
    return prompt + done.output_ids.tolist() if done.output_ids else prompt


def _segment(answer: dict, *, aborted: bool) -> tuple[array, array]:
    """Token ids (int32) and behaviour logprobs (float32) of one response: the compact arrays
    :func:`parse_generate` made of its ``output_token_logprobs`` (entries ``[logprob, token_id,
    text]``), or its parsed entries read one by one. A request aborted while still queued
    (SGLang 0.5.3 answers it without logprobs and with ``completion_tokens`` 0) generated nothing."""
    meta = answer["meta_info"]
    entries = meta.get("output_token_logprobs")
    if entries is None and aborted and not meta.get("completion_tokens"):
        return token_ids(), logprob_array()
    if entries is None:
        raise EngineError("response has no meta_info.output_token_logprobs (return_logprob ignored?)")
    try:
        return segment(entries)
    except ValueError as err:
        # SGLang writes a non-finite float as null: a sampled token's logprob never is one
        # unless the weights are broken.
        raise EngineError(f"response {meta.get('id')!r} carries a non-finite behaviour logprob: "
                          f"{[e[0] for e in entries]}") from err
