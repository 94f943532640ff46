"""The agents' OpenAI-compatible front: one session per episode, forwarded to the run's engines.

An episode's agent gets ``base_url = http://host:port/s/{session}/v1`` and a key of that session
alone. ``POST .../chat/completions`` turns the messages into the call's prompt ids
(:class:`~rlorch.agents.trajectory.Trajectory`), samples through the run's ``Engine`` (which stamps
every token's policy version and carries a call across a weight update) and answers as OpenAI's
API does, tool calls parsed from the sampled text. Unknown sessions and wrong keys are refused
(401), closed sessions too (409); errors are in OpenAI's shape.

The run's sampling parameters are enforced (temperature, top_p, top_k), so the behaviour
logprobs are those of the policy being trained; the agent's ``max_tokens`` and ``stop`` strings
are kept (they end a turn, they do not change what its tokens are drawn from). A retried request (the client's ``x-stainless-retry-count``
header, the same body) is answered from the record of the first, waiting for it if it is still
running: the SDK's retries never sample again.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import secrets
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any, Optional

import orjson
from aiohttp import web

from rlorch.agents.trajectory import Trajectory
from rlorch.lifecycle import cancel_and_wait
from rlorch.openai_api import (ApiError, ChatChoice, TokenLogprob, chat_completion_body, chat_completion_chunks,
                               parse_chat_request, parse_tool_calls, sse)
from rlorch.types import Engine, SamplingParams, list_of

RETRY_HEADER = "x-stainless-retry-count"


class CallLimit(ApiError):
    """An episode asked for more calls than ``task.max_calls``."""


@dataclass
class Session:
    """One episode's session: its key, its sampling, its trajectory and its calls' answers."""

    id: str
    key: str
    params: SamplingParams
    rid: str
    trajectory: Trajectory
    base_url: str
    calls: int = 0
    closed: bool = False
    answers: dict[bytes, asyncio.Task] = field(default_factory=dict)
    """Each call's answer by the digest of its body (retries are answered from here)."""
    errors: list[str] = field(default_factory=list)
    """What the gateway refused or failed in this session, for the episode's report."""


class AgentGateway:
    """The HTTP server agents call during a run (see the module's docstring)."""

    def __init__(self, *, engine: Engine, tokenizer: Any, model_name: str, tool_parser: Optional[str],
                 max_calls: int, bridge: bool = True, client_sampling: bool = False, host: str = "127.0.0.1",
                 port: int = 0):
        self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name
        self.tool_parser, self.max_calls, self.bridge = tool_parser, max_calls, bridge
        self.client_sampling, self.host, self.port = client_sampling, host, port
        self.sessions: dict[str, Session] = {}
        self.closed_sessions: set[str] = set()
        self.url = ""
        self._runner: Optional[web.AppRunner] = None

    # lifecycle --------------------------------------------------------------------------------
    async def start(self) -> str:
        """Serve; returns the base URL (``http://host:port``)."""
        app = web.Application(client_max_size=64 << 20)
        app.add_routes([web.post("/s/{session}/v1/chat/completions", self._chat),
                        web.get("/s/{session}/v1/models", self._models)])
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        self.url = f"http://{self.host}:{port}"
        return self.url

    async def stop(self) -> None:
        for session in list(self.sessions.values()):
            await self.close(session)
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # sessions ---------------------------------------------------------------------------------
    def open(self, *, params: SamplingParams, rid: str) -> Session:
        """A new episode's session (``rid``: the engine request id its calls are numbered from)."""
        session_id = uuid.uuid4().hex
        session = Session(session_id, "sk-rlorch-" + secrets.token_urlsafe(24), params, rid,
                          Trajectory(self.tokenizer, bridge=self.bridge), f"{self.url}/s/{session_id}/v1")
        self.sessions[session_id] = session
        return session

    async def close(self, session: Session) -> Trajectory:
        """End a session: later calls are refused, calls still running are cancelled (their
        answers would reach no one), and the trajectory is final."""
        session.closed = True
        self.sessions.pop(session.id, None)
        self.closed_sessions.add(session.id)
        running = [task for task in session.answers.values() if not task.done()]
        for task in running:
            await cancel_and_wait(task)
        return session.trajectory

    def _session(self, request: web.Request) -> Session:
        session_id = request.match_info["session"]
        session = self.sessions.get(session_id)
        if session is None:
            if session_id in self.closed_sessions:
                raise ApiError(f"session {session_id} is closed (its episode ended)", status=409,
                               type="invalid_request_error", code="session_closed")
            raise ApiError("unknown session", status=401, type="authentication_error", code="invalid_session")
        given = request.headers.get("Authorization", "").removeprefix("Bearer ").strip()
        if not hmac.compare_digest(given.encode(), session.key.encode()):
            raise ApiError("wrong API key for this session", status=401, type="authentication_error",
                           code="invalid_api_key")
        return session

    # routes -----------------------------------------------------------------------------------
    async def _models(self, request: web.Request) -> web.Response:
        try:
            self._session(request)
        except ApiError as err:
            return _error(err)
        return web.json_response({"object": "list", "data": [
            {"id": self.model_name, "object": "model", "created": 0, "owned_by": "rlorch"}]})

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        try:
            session = self._session(request)
            raw = await request.read()
            digest = hashlib.sha256(raw).digest()
            answer = session.answers.get(digest)
            retried = _retry_count(request) > 0
            if answer is None or not retried:
                try:
                    body = orjson.loads(raw)
                except orjson.JSONDecodeError as err:
                    raise ApiError(f"the body is not JSON: {err}") from err
                chat = parse_chat_request(body)
                answer = asyncio.ensure_future(self._call(session, chat))
                session.answers[digest] = answer
            result = await asyncio.shield(answer)
        except ApiError as err:
            return _error(err)
        if not result.get("stream"):
            return web.json_response(result["body"])
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        await response.write(sse(chat_completion_chunks(result["body"], include_usage=result["include_usage"])))
        await response.write_eof()
        return response

    async def _call(self, session: Session, chat) -> dict:
        if session.closed:
            raise ApiError(f"session {session.id} is closed", status=409, code="session_closed")
        if chat.n != 1:
            raise ApiError("an agent's call samples one answer (n=1): each sample is an episode of its own",
                           param="n")
        if session.calls >= self.max_calls:
            message = f"the episode made {session.calls} calls, the most task.max_calls allows"
            session.errors.append(message)
            raise CallLimit(message, param="messages", status=429, type="rate_limit_error", code="max_calls")
        session.calls += 1
        number = session.calls
        params = self._params(session.params, chat)
        plan = session.trajectory.plan(chat.messages, chat.tools)
        try:
            generation = await self.engine.generate(plan.prompt_ids, params, f"{session.rid}-c{number}")
        except asyncio.CancelledError:
            raise
        except Exception as err:  # an engine failure is the agent's error answer, not the gateway's end
            session.errors.append(f"call {number}: the engine failed: {err}")
            raise ApiError(f"the engine failed: {err}", status=503, type="server_error", code="engine_failed") from err
        output = list_of(generation.output_ids)
        text = self.tokenizer.decode(output, skip_special_tokens=True) if self.tokenizer else generation.text
        last_turn = self.tokenizer.decode(output, skip_special_tokens=False) if self.tokenizer else generation.text
        content, tool_calls = text, []
        if self.tool_parser and chat.tools and chat.tool_choice != "none":
            content, tool_calls = parse_tool_calls(self.tool_parser, text, chat.tools)
        reply = {"role": "assistant", "content": content}
        if tool_calls:
            reply["tool_calls"] = tool_calls
        session.trajectory.record(plan, generation, reply, last_turn, agent_limit=chat.max_tokens is not None)
        logprobs = None
        if chat.logprobs:
            logprobs = [TokenLogprob(self._token(t), float(p)) for t, p in zip(output, list_of(generation.logprobs))]
        choice = ChatChoice(0, text, generation.finish_reason, tool_calls, content, logprobs)
        body = chat_completion_body(model=chat.model or self.model_name, choices=[choice],
                                    prompt_tokens=len(plan.prompt_ids), completion_tokens=len(output),
                                    id=f"chatcmpl-{session.id[:8]}{number}", created=int(time.time()))
        return {"body": body, "stream": chat.stream, "include_usage": chat.include_usage}

    def _params(self, run: SamplingParams, chat) -> SamplingParams:
        """The run's sampling with the agent's length limit (``max_tokens``, else
        ``rollout.max_new_tokens``) and stop strings, which end a turn without changing the
        distribution its tokens are drawn from (``client_sampling``: the agent's temperature
        and top_p too)."""
        params = replace(run, max_new_tokens=chat.max_tokens or run.max_new_tokens, stop=[*run.stop, *chat.stop])
        if self.client_sampling:
            params = replace(params, temperature=run.temperature if chat.temperature is None else chat.temperature,
                             top_p=run.top_p if chat.top_p is None else chat.top_p)
        return params

    def _token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False) if self.tokenizer else str(token_id)


def _retry_count(request: web.Request) -> int:
    try:
        return int(request.headers.get(RETRY_HEADER, "0"))
    except ValueError:
        return 0


def _error(err: ApiError) -> web.Response:
    return web.json_response(err.body(), status=err.status)
