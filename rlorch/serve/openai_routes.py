"""``rlorch serve``'s OpenAI-compatible routes: ``/v1/completions`` and ``/v1/chat/completions``.

Parsing and shapes are :mod:`rlorch.openai_api`'s. Generation is the one ``/generate`` runs
(the same :class:`~rlorch.serve.batcher.Batcher`, sampler and behaviour logprobs): a completion's
logprobs are the numbers ``/generate`` reports for the same prompt and sampling.

- A text prompt is encoded as ``/generate`` encodes ``text`` (bos first); chat messages by the
  model directory's chat template (with the request's ``tools`` when a tool-call parser is set).
- ``seed``: each sample draws from its own generator (sample ``i`` seeded ``seed + i``): the same
  request alone on the server answers the same; batched beside others, the same up to
  floating-point differences in the logits.
- ``stream: true`` answers SSE chunks as tokens come (``Sequence.on_token``); text that may yet
  become a stop string is held until it is known not to be, and with a tool-call parser and
  tools a chat choice is sent when it ends (a call is known only then).
- Tool calls are parsed from the finished text by ``--tool-call-parser`` (none: ``tools`` are
  ignored, as SGLang does); ``tool_choice: "none"`` skips parsing; ``required`` or a named
  function is refused (a forced call needs constrained decoding, which this engine does not do).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any, Optional

from aiohttp import web

from rlorch.jsonlines import dumps
from rlorch.openai_api import (SSE_DONE, ApiError, ChatChoice, CompletionChoice, TokenLogprob, chat_completion_body,
                               chat_logprobs, completion_body, completion_logprobs, parse_chat_request,
                               parse_completion_request, parse_tool_calls, sse_data, template_messages)
from rlorch.serve.batcher import GenerationFailed, Sequence
from rlorch.serve.http import json_body
from rlorch.serve.sampling import RequestError, RequestParams
from rlorch.tasks.prompts import ChatTemplateError, encode_prompt, encode_text, require_chat_template

log = logging.getLogger("rlorch.serve")

COMPLETIONS_DEFAULT_MAX_TOKENS = 16
"""``/v1/completions`` without ``max_tokens`` (OpenAI's and SGLang's default); chat: up to the
context length."""


class OpenAIRoutes:
    """The ``/v1`` generation routes of one :class:`~rlorch.serve.server.CpuServer`."""

    def __init__(self, server, *, tool_call_parser: Optional[str] = None):
        self.server = server
        self.tool_call_parser = tool_call_parser

    def routes(self) -> list[web.RouteDef]:
        return [web.post("/v1/completions", self.completions), web.post("/v1/chat/completions", self.chat)]

    # ---- handlers -------------------------------------------------------------------------

    async def chat(self, request: web.Request) -> web.StreamResponse:
        try:
            req = parse_chat_request(await _body(request))
            prompt = await asyncio.to_thread(self._chat_prompt, req.messages, req.tools)
            seqs = self._sequences([prompt], req.n, self._params(req, req.max_tokens), req.seed, req.top_logprobs)
            model = req.model or self.server.model_path
            if req.stream:
                return await self._stream(request, seqs, _ChatStream(self, req, model, len(prompt), seqs))
            await self._run(seqs)
        except ApiError as err:
            return _error(err)
        texts = self.server.texts(seqs)
        choices = [self._chat_choice(i, seq, text, req) for i, (seq, text) in enumerate(zip(seqs, texts))]
        return _json(chat_completion_body(model=model, choices=choices, prompt_tokens=len(prompt),
                                          completion_tokens=sum(len(seq.output_ids) for seq in seqs)))

    async def completions(self, request: web.Request) -> web.StreamResponse:
        try:
            req = parse_completion_request(await _body(request))
            prompts = await asyncio.to_thread(self._completion_prompts, req.prompts)
            max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS if req.max_tokens is None else req.max_tokens
            seqs = self._sequences(prompts, req.n, self._params(req, max_tokens), req.seed, req.logprobs or 0)
            model = req.model or self.server.model_path
            echoed = [self._echo(req.prompts[i // req.n]) if req.echo else "" for i in range(len(seqs))]
            prompt_tokens = sum(len(p) for p in prompts)
            if req.stream:
                return await self._stream(request, seqs, _CompletionStream(self, req, model, prompt_tokens, seqs,
                                                                           echoed))
            await self._run(seqs)
        except ApiError as err:
            return _error(err)
        choices = [CompletionChoice(index=i, text=echo + text, finish_reason=seq.finish["type"],
                                    logprobs=self.logprobs(seq) if req.logprobs is not None else None,
                                    text_offset=len(echo))
                   for i, (seq, text, echo) in enumerate(zip(seqs, self.server.texts(seqs), echoed))]
        return _json(completion_body(model=model, choices=choices, prompt_tokens=prompt_tokens,
                                     completion_tokens=sum(len(seq.output_ids) for seq in seqs)))

    # ---- prompts and parameters -----------------------------------------------------------

    def _chat_prompt(self, messages: list[dict], tools: Optional[list[dict]]) -> list[int]:
        tokenizer = self.server.tokenizer
        try:
            require_chat_template(tokenizer)
            text = tokenizer.apply_chat_template(template_messages(messages), add_generation_prompt=True,
                                                 tokenize=False,
                                                 tools=tools if tools and self.tool_call_parser else None)
        except ChatTemplateError as err:
            raise ApiError(str(err), param="messages") from None
        except Exception as err:  # jinja's errors, raised by the model's own template
            raise ApiError(f"the chat template cannot render these messages: {err}", param="messages") from None
        return self._checked([encode_text(tokenizer, text)], "messages")[0]

    def _completion_prompts(self, prompts: list) -> list[list[int]]:
        if any(isinstance(p, str) and len(p) > self.server.max_text_chars for p in prompts):
            raise ApiError(f"a prompt longer than {self.server.max_text_chars} characters cannot fit the model's "
                           f"context length ({self.server.context_len} tokens)", param="prompt")
        ids = [encode_prompt(self.server.tokenizer, p) if isinstance(p, str) else p for p in prompts]
        return self._checked(ids, "prompt")

    def _checked(self, prompts: list[list[int]], param: str) -> list[list[int]]:
        try:
            return self.server.check_prompts(prompts, param)
        except RequestError as err:
            raise ApiError(str(err), param=param) from None

    def _params(self, req: Any, max_tokens: Optional[int]) -> RequestParams:
        return RequestParams(max_new_tokens=self.server.context_len if max_tokens is None else max_tokens,
                             temperature=1.0 if req.temperature is None else req.temperature,
                             top_p=1.0 if req.top_p is None else req.top_p, stop=list(req.stop), n=req.n,
                             top_k=req.top_k, min_p=req.min_p, ignore_eos=req.ignore_eos)

    def _echo(self, prompt: Any) -> str:
        return prompt if isinstance(prompt, str) else self.server.decode(prompt)

    # ---- generation -----------------------------------------------------------------------

    def _sequences(self, prompts: list[list[int]], n: int, params: RequestParams, seed: Optional[int],
                   top: int) -> list[Sequence]:
        """``n`` samples of each prompt, prompt-major; sample ``i`` of a seeded request draws
        from ``seed + i``."""
        server = self.server
        if server.memory.released and not server.batcher.paused:
            raise ApiError(server.memory.describe(), status=503, type="server_error")
        loop = asyncio.get_running_loop()
        rid = uuid.uuid4().hex
        return [Sequence(rid=f"{rid}_{p}_{i}", prompt=prompt, params=params, done=loop.create_future(),
                         top_logprobs=top, seed=None if seed is None else seed + i)
                for p, prompt in enumerate(prompts) for i in range(n)]

    async def _run(self, seqs: list[Sequence]) -> None:
        try:
            await self.server.run_sequences(seqs)
        except GenerationFailed as err:
            raise ApiError(str(err), status=500, type="server_error") from None

    async def _stream(self, request: web.Request, seqs: list[Sequence], stream: "_Stream") -> web.StreamResponse:
        """Answer SSE chunks as tokens come: each wake-up sends what every woken sequence added
        since (see :class:`_Stream`); a client that goes away aborts the sequences."""
        queue: asyncio.Queue[int] = asyncio.Queue()
        for i, seq in enumerate(seqs):
            seq.on_token = lambda _, i=i: queue.put_nowait(i)
            seq.done.add_done_callback(lambda _, i=i: queue.put_nowait(i))
        try:
            await self.server.batcher.submit(seqs)
        except GenerationFailed as err:
            raise ApiError(str(err), status=500, type="server_error") from None
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        try:
            await response.prepare(request)
            await response.write(sse_data(stream.start()))
            pending = set(range(len(seqs)))
            while pending:
                woken = {await queue.get()}
                while not queue.empty():
                    woken.add(queue.get_nowait())
                events = []
                for i in sorted(woken & pending):
                    if seqs[i].done.done():
                        pending.discard(i)
                        if seqs[i].done.exception() is not None:
                            raise seqs[i].done.exception()
                    events += stream.step(i, seqs[i])
                await response.write(sse_data(events))
            await response.write(sse_data(stream.end()) + SSE_DONE)
        except GenerationFailed as err:
            log.warning("OpenAI stream failed: %s", err)
            error = ApiError(str(err), status=500, type="server_error")
            await response.write(sse_data([error.body()]) + SSE_DONE)
        except (asyncio.CancelledError, ConnectionResetError):
            self.server.batcher.abort_sequences(seqs, "Abort: client disconnected.")
            raise
        return response

    def _chat_choice(self, index: int, seq: Sequence, text: str, req) -> ChatChoice:
        choice = ChatChoice(index=index, text=text, finish_reason=seq.finish["type"],
                            logprobs=self.logprobs(seq) if req.logprobs else None)
        if self.tool_call_parser and req.tools and req.tool_choice != "none":
            choice.content, choice.tool_calls = parse_tool_calls(self.tool_call_parser, text, req.tools)
        return choice

    def logprobs(self, seq: Sequence, start: int = 0) -> list[TokenLogprob]:
        """The logprobs of ``seq``'s tokens from ``start`` on."""
        ids, values = seq.output_ids[start:], seq.logprobs[start:]
        tops = seq.top[start:] or [[] for _ in ids]
        token = self._token_texts(ids + [t for top in tops for t, _ in top])
        return [TokenLogprob(token=token[t], logprob=lp, top=[(token[a], v) for a, v in top])
                for t, lp, top in zip(ids, values, tops)]

    def _token_texts(self, ids: list[int]) -> dict[int, str]:
        distinct = sorted(set(ids))
        return {t: self.server.decode([t], skip_special_tokens=False) for t in distinct}


async def _body(request: web.Request) -> Any:
    try:
        return await json_body(request)
    except RequestError as err:
        raise ApiError(str(err)) from None


def _error(err: ApiError) -> web.Response:
    if err.status >= 500:
        log.warning("OpenAI route failed: %s", err.message)
    return web.Response(body=dumps(err.body()), status=err.status, content_type="application/json")


def _json(body: dict) -> web.Response:
    # orjson, as /generate answers (a non-finite float goes out as null).
    return web.Response(body=dumps(body), content_type="application/json")


def held_back(text: str, stops: list[str]) -> str:
    """What of an unfinished sequence's ``text`` can be sent: not a trailing partial character
    (decoded as U+FFFD), nor a tail that may yet grow into a stop string (cut when it does), so
    that what was sent stays a prefix of the final text."""
    text = text.rstrip("\ufffd")
    hold = 0
    for stop in stops:
        hold = max(hold, next((k for k in range(min(len(stop) - 1, len(text)), 0, -1)
                               if text.endswith(stop[:k])), 0))
    return text[:len(text) - hold]


class _Stream:
    """One streamed answer's chunks: ``start`` before any token, ``step(i, seq)`` when sequence
    ``i`` has new tokens or has finished, ``end`` after all have. Per choice it tracks how much
    text and how many tokens' logprobs were sent."""

    def __init__(self, routes: OpenAIRoutes, req: Any, model: str, prompt_tokens: int, seqs: list[Sequence],
                 obj: str):
        self.routes, self.req, self.seqs, self.prompt_tokens = routes, req, seqs, prompt_tokens
        self.head = {"id": f"{'chatcmpl' if obj.startswith('chat') else 'cmpl'}-{uuid.uuid4().hex}", "object": obj,
                     "created": int(time.time()), "model": model}
        self.sent_text = [0] * len(seqs)
        self.sent_tokens = [0] * len(seqs)

    def chunk(self, choice: dict) -> dict:
        out = {**self.head, "choices": [choice]}
        return {**out, "usage": None} if self.req.include_usage else out

    def new_text(self, i: int, seq: Sequence) -> str:
        text = self.routes.server.texts([seq])[0]
        if seq.finish is None:
            text = held_back(text, self.req.stop)
        new, self.sent_text[i] = text[self.sent_text[i]:], max(self.sent_text[i], len(text))
        return new

    def new_logprobs(self, i: int, seq: Sequence) -> list[TokenLogprob]:
        start, self.sent_tokens[i] = self.sent_tokens[i], len(seq.output_ids)
        return self.routes.logprobs(seq, start)

    def start(self) -> list[dict]:
        return []

    def step(self, i: int, seq: Sequence) -> list[dict]:
        raise NotImplementedError

    def end(self) -> list[dict]:
        if not self.req.include_usage:
            return []
        completion = sum(len(seq.output_ids) for seq in self.seqs)
        return [{**self.head, "choices": [], "usage": {"prompt_tokens": self.prompt_tokens, "completion_tokens":
                                                       completion, "total_tokens": self.prompt_tokens + completion}}]


class _ChatStream(_Stream):
    """Content streams as it comes; with a tool-call parser and tools, a choice is held until it
    ends (whether its text is a call is known only then)."""

    def __init__(self, routes: OpenAIRoutes, req: Any, model: str, prompt_tokens: int, seqs: list[Sequence]):
        super().__init__(routes, req, model, prompt_tokens, seqs, "chat.completion.chunk")
        self.parse = bool(routes.tool_call_parser and req.tools and req.tool_choice != "none")

    def start(self) -> list[dict]:
        return [self.chunk({"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                            "finish_reason": None}) for i in range(len(self.seqs))]

    def step(self, i: int, seq: Sequence) -> list[dict]:
        if seq.finish is None and self.parse:
            return []
        text = self.new_text(i, seq)
        logprobs = chat_logprobs(self.new_logprobs(i, seq)) if self.req.logprobs else None
        calls: list[dict] = []
        if seq.finish is not None and self.parse:
            text, calls = parse_tool_calls(self.routes.tool_call_parser, text, self.req.tools)
        events = []
        if text or logprobs:
            events.append(self.chunk({"index": i, "delta": {"content": text or ""}, "logprobs": logprobs,
                                      "finish_reason": None}))
        events += [self.chunk({"index": i, "delta": {"tool_calls": [{"index": k, **call}]}, "logprobs": None,
                               "finish_reason": None}) for k, call in enumerate(calls)]
        if seq.finish is not None:
            finish = "tool_calls" if calls else seq.finish["type"]
            events.append(self.chunk({"index": i, "delta": {}, "logprobs": None, "finish_reason": finish}))
        return events


class _CompletionStream(_Stream):
    def __init__(self, routes: OpenAIRoutes, req: Any, model: str, prompt_tokens: int, seqs: list[Sequence],
                 echoed: list[str]):
        super().__init__(routes, req, model, prompt_tokens, seqs, "text_completion")
        self.echoed = echoed

    def start(self) -> list[dict]:
        return [self.chunk({"index": i, "text": echo, "logprobs": None, "finish_reason": None})
                for i, echo in enumerate(self.echoed) if echo]

    def step(self, i: int, seq: Sequence) -> list[dict]:
        offset = len(self.echoed[i]) + self.sent_text[i]
        text = self.new_text(i, seq)
        logprobs = None
        if self.req.logprobs is not None:
            logprobs = completion_logprobs(self.new_logprobs(i, seq), offset)
        finish = None if seq.finish is None else seq.finish["type"]
        if not text and finish is None and logprobs is None:
            return []
        return [self.chunk({"index": i, "text": text, "logprobs": logprobs, "finish_reason": finish})]
