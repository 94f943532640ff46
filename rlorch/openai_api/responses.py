"""Response bodies of ``/v1/chat/completions`` and ``/v1/completions``, and their SSE chunks.

A streamed answer is made from the finished body (:func:`chat_completion_chunks`,
:func:`completion_chunks`): the chunks reassemble to exactly that body's text and tool calls.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Iterable, Optional


@dataclass
class TokenLogprob:
    token: str
    logprob: float
    top: list[tuple[str, float]] = field(default_factory=list)
    """The most likely tokens of the distribution ``logprob`` is read from, best first."""


@dataclass
class ChatChoice:
    index: int
    text: str
    """The decoded completion (special tokens skipped)."""
    finish_reason: str
    """The engine's ``stop`` | ``length`` | ``abort``; answered ``tool_calls`` when there are any."""
    tool_calls: list[dict] = field(default_factory=list)
    content: Optional[str] = None
    """From :func:`~rlorch.openai_api.parse_tool_calls`; with no tool calls the body says ``text``."""
    logprobs: Optional[list[TokenLogprob]] = None


@dataclass
class CompletionChoice:
    index: int
    text: str
    """The decoded completion (with ``echo``, the prompt's text first)."""
    finish_reason: str
    logprobs: Optional[list[TokenLogprob]] = None
    """One per generated token; None when not asked for."""
    text_offset: int = 0
    """Where the generated text starts in ``text`` (the echoed prompt's length)."""


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _finite(logprob: float) -> float:
    """A logprob JSON can carry: -inf (a banned token) as OpenAI's floor, -9999.0."""
    return logprob if logprob > -9999.0 else -9999.0


def _bytes(token: str) -> list[int]:
    return list(token.encode("utf-8"))


def _chat_logprobs(logprobs: Optional[list[TokenLogprob]]) -> Optional[dict]:
    if logprobs is None:
        return None
    return {"content": [{"token": lp.token, "logprob": _finite(lp.logprob), "bytes": _bytes(lp.token),
                         "top_logprobs": [{"token": t, "logprob": _finite(v), "bytes": _bytes(t)} for t, v in lp.top]}
                        for lp in logprobs]}


def _finish(choice: ChatChoice) -> str:
    return "tool_calls" if choice.tool_calls else choice.finish_reason


def chat_completion_body(*, model: str, choices: list[ChatChoice], prompt_tokens: int, completion_tokens: int,
                         id: Optional[str] = None, created: Optional[int] = None) -> dict:
    """A ``chat.completion`` object; ``message.tool_calls`` only where there are calls."""
    out = []
    for choice in choices:
        message = {"role": "assistant", "content": choice.content if choice.tool_calls else choice.text}
        if choice.tool_calls:
            message["tool_calls"] = choice.tool_calls
        out.append({"index": choice.index, "message": message, "logprobs": _chat_logprobs(choice.logprobs),
                    "finish_reason": _finish(choice)})
    return {"id": id or f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion",
            "created": int(time.time()) if created is None else created, "model": model, "choices": out,
            "usage": _usage(prompt_tokens, completion_tokens)}


def chat_completion_chunks(body: dict, *, include_usage: bool = False) -> list[dict]:
    """``chat.completion.chunk`` objects equivalent to a finished chat ``body``: per choice a
    role delta, a content delta (with the logprobs), one delta per tool call, a finish chunk;
    then, with ``include_usage``, a chunk with no choices and the usage (the others say
    ``usage: null``, as OpenAI streams)."""
    head = {"id": body["id"], "object": "chat.completion.chunk", "created": body["created"], "model": body["model"]}

    def chunk(index: int, delta: dict, *, logprobs: Optional[dict] = None, finish: Optional[str] = None) -> dict:
        out = {**head, "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}
        return {**out, "usage": None} if include_usage else out

    chunks = []
    for choice in body["choices"]:
        index, message = choice["index"], choice["message"]
        chunks.append(chunk(index, {"role": "assistant", "content": ""}))
        if message.get("content") or choice["logprobs"] is not None:
            chunks.append(chunk(index, {"content": message.get("content") or ""}, logprobs=choice["logprobs"]))
        for i, call in enumerate(message.get("tool_calls") or []):
            chunks.append(chunk(index, {"tool_calls": [{"index": i, **call}]}))
        chunks.append(chunk(index, {}, finish=choice["finish_reason"]))
    if include_usage:
        chunks.append({**head, "choices": [], "usage": body["usage"]})
    return chunks


def _completion_logprobs(choice: CompletionChoice) -> Optional[dict]:
    if choice.logprobs is None:
        return None
    offsets, at = [], choice.text_offset
    for lp in choice.logprobs:
        offsets.append(at)
        at += len(lp.token)
    return {"tokens": [lp.token for lp in choice.logprobs],
            "token_logprobs": [_finite(lp.logprob) for lp in choice.logprobs],
            "top_logprobs": [{t: _finite(v) for t, v in lp.top} for lp in choice.logprobs], "text_offset": offsets}


def completion_body(*, model: str, choices: list[CompletionChoice], prompt_tokens: int, completion_tokens: int,
                    id: Optional[str] = None, created: Optional[int] = None) -> dict:
    """A ``text_completion`` object (logprobs in the legacy shape: ``tokens``, ``token_logprobs``,
    ``top_logprobs`` as ``{token: logprob}``, ``text_offset``)."""
    out = [{"index": c.index, "text": c.text, "logprobs": _completion_logprobs(c), "finish_reason": c.finish_reason}
           for c in choices]
    return {"id": id or f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
            "created": int(time.time()) if created is None else created, "model": model, "choices": out,
            "usage": _usage(prompt_tokens, completion_tokens)}


def completion_chunks(body: dict, *, include_usage: bool = False) -> list[dict]:
    """``text_completion`` chunks equivalent to a finished body: per choice its text, then a
    finish chunk; then, with ``include_usage``, a usage chunk with no choices."""
    head = {"id": body["id"], "object": "text_completion", "created": body["created"], "model": body["model"]}
    chunks = []
    for choice in body["choices"]:
        for text, logprobs, finish in ((choice["text"], choice["logprobs"], None), ("", None, choice["finish_reason"])):
            out = {**head, "choices": [{"index": choice["index"], "text": text, "logprobs": logprobs,
                                        "finish_reason": finish}]}
            chunks.append({**out, "usage": None} if include_usage else out)
    if include_usage:
        chunks.append({**head, "choices": [], "usage": body["usage"]})
    return chunks


SSE_DONE = b"data: [DONE]\n\n"


def sse_data(events: Iterable[dict]) -> bytes:
    """Server-sent events, ``data: {json}\\n\\n`` per event (a stream in progress)."""
    return b"".join(f"data: {json.dumps(event, ensure_ascii=False)}\n\n".encode() for event in events)


def sse(events: Iterable[dict]) -> bytes:
    """A whole stream: ``data: {json}\\n\\n`` per event, then ``data: [DONE]\\n\\n``."""
    return sse_data(events) + SSE_DONE


def chat_logprobs(logprobs: Optional[list[TokenLogprob]]) -> Optional[dict]:
    """A chat choice's (or chunk's) ``logprobs``: ``{"content": [...]}``."""
    return _chat_logprobs(logprobs)


def completion_logprobs(logprobs: Optional[list[TokenLogprob]], text_offset: int = 0) -> Optional[dict]:
    """A completion choice's (or chunk's) legacy ``logprobs``, offsets from ``text_offset``."""
    return _completion_logprobs(CompletionChoice(index=0, text="", finish_reason="", logprobs=logprobs,
                                                 text_offset=text_offset))
