"""``rlorch serve``'s OpenAI-compatible routes: ``/v1/completions`` and ``/v1/chat/completions``.

Parsing and shapes are :mod:`rlorch.openai_api`'s. Generation is the one ``/generate`` runs
(the same :class:`~rlorch.serve.batcher.Batcher`, sampler and behaviour logprobs): a completion's
logprobs are the numbers ``/generate`` reports for the same prompt and sampling.

- A text prompt is encoded as ``/generate`` encodes ``text`` (bos first); chat messages by the
  model directory's chat template (with the request's ``tools`` when a tool-call parser is set).
- ``seed``: each sample draws from its own generator (sample ``i`` seeded ``seed + i``): the same
  request alone on the server answers the same; batched beside others, the same up to
  floating-point differences in the logits.
- ``stream: true`` is answered once generation finishes, as the SSE chunks of the whole answer
  (the batcher hands no tokens over before a sequence ends).
- Tool calls are parsed from the finished text by ``--tool-call-parser`` (none: ``tools`` are
  ignored, as SGLang does); ``tool_choice: "none"`` skips parsing.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Any, Optional

from aiohttp import web

from rlorch.jsonlines import dumps
from rlorch.openai_api import (ApiError, ChatChoice, CompletionChoice, TokenLogprob, chat_completion_body,
                               chat_completion_chunks, completion_body, completion_chunks, parse_chat_request,
                               parse_completion_request, parse_tool_calls, sse, template_messages)
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
            params = self._params(req, req.max_tokens)
            seqs = await self._generate([prompt], req.n, params, req.seed, req.top_logprobs)
        except ApiError as err:
            return _error(err)
        texts = self.server.texts(seqs)
        choices = [self._chat_choice(i, seq, text, req) for i, (seq, text) in enumerate(zip(seqs, texts))]
        body = chat_completion_body(model=req.model or self.server.model_path, choices=choices,
                                    prompt_tokens=len(prompt),
                                    completion_tokens=sum(len(seq.output_ids) for seq in seqs))
        if req.stream:
            return _stream(chat_completion_chunks(body, include_usage=req.include_usage))
        return _json(body)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        try:
            req = parse_completion_request(await _body(request))
            prompts = await asyncio.to_thread(self._completion_prompts, req.prompts)
            max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS if req.max_tokens is None else req.max_tokens
            seqs = await self._generate(prompts, req.n, self._params(req, max_tokens), req.seed, req.logprobs or 0)
        except ApiError as err:
            return _error(err)
        texts = self.server.texts(seqs)
        choices = []
        for i, (seq, text) in enumerate(zip(seqs, texts)):
            echoed = self._echo(req.prompts[i // req.n]) if req.echo else ""
            choices.append(CompletionChoice(index=i, text=echoed + text, finish_reason=seq.finish["type"],
                                            logprobs=self._logprobs(seq) if req.logprobs is not None else None,
                                            text_offset=len(echoed)))
        body = completion_body(model=req.model or self.server.model_path, choices=choices,
                               prompt_tokens=sum(len(p) for p in prompts),
                               completion_tokens=sum(len(seq.output_ids) for seq in seqs))
        if req.stream:
            return _stream(completion_chunks(body, include_usage=req.include_usage))
        return _json(body)

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
                             top_p=1.0 if req.top_p is None else req.top_p, stop=list(req.stop), n=req.n)

    def _echo(self, prompt: Any) -> str:
        return prompt if isinstance(prompt, str) else self.server.decode(prompt)

    # ---- generation -----------------------------------------------------------------------

    async def _generate(self, prompts: list[list[int]], n: int, params: RequestParams, seed: Optional[int],
                        top: int) -> list[Sequence]:
        """``n`` samples of each prompt, prompt-major; sample ``i`` of a seeded request draws
        from ``seed + i``."""
        server = self.server
        if server.memory.released and not server.batcher.paused:
            raise ApiError(server.memory.describe(), status=503, type="server_error")
        loop = asyncio.get_running_loop()
        rid = uuid.uuid4().hex
        seqs = [Sequence(rid=f"{rid}_{p}_{i}", prompt=prompt, params=params,
                         done=loop.create_future(), top_logprobs=top, seed=None if seed is None else seed + i)
                for p, prompt in enumerate(prompts) for i in range(n)]
        try:
            await server.run_sequences(seqs)
        except GenerationFailed as err:
            raise ApiError(str(err), status=500, type="server_error") from None
        return seqs

    def _chat_choice(self, index: int, seq: Sequence, text: str, req) -> ChatChoice:
        choice = ChatChoice(index=index, text=text, finish_reason=seq.finish["type"],
                            logprobs=self._logprobs(seq) if req.logprobs else None)
        if self.tool_call_parser and req.tools and req.tool_choice != "none":
            choice.content, choice.tool_calls = parse_tool_calls(self.tool_call_parser, text, req.tools)
        return choice

    def _logprobs(self, seq: Sequence) -> list[TokenLogprob]:
        token = self._token_texts(seq.output_ids + [t for top in seq.top for t, _ in top])
        tops = seq.top or [[] for _ in seq.output_ids]
        return [TokenLogprob(token=token[t], logprob=lp, top=[(token[a], v) for a, v in top])
                for t, lp, top in zip(seq.output_ids, seq.logprobs, tops)]

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


def _stream(chunks: list[dict]) -> web.Response:
    return web.Response(body=sse(chunks), content_type="text/event-stream", headers={"Cache-Control": "no-cache"})
