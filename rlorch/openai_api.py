"""Interim: replaced by the full module from the openai-routes branch."""
from __future__ import annotations

import json
import re
import secrets
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional


class ApiError(Exception):
    def __init__(self, message: str, *, param: Optional[str] = None, status: int = 400,
                 type: str = "invalid_request_error", code: Optional[str] = None):
        super().__init__(message)
        self.message, self.param, self.status, self.type, self.code = message, param, status, type, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass
class ChatRequest:
    model: str
    messages: list
    tools: Optional[list]
    tool_choice: Any
    n: int
    max_tokens: Optional[int]
    temperature: Optional[float]
    top_p: Optional[float]
    stop: list
    seed: Optional[int]
    logprobs: bool
    top_logprobs: int
    stream: bool
    include_usage: bool


def parse_chat_request(body: Any) -> ChatRequest:
    if not isinstance(body, dict):
        raise ApiError("the body must be a JSON object")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError("messages must be a non-empty list", param="messages")
    stop = body.get("stop") or []
    stop = [stop] if isinstance(stop, str) else list(stop)
    return ChatRequest(body.get("model", ""), messages, body.get("tools"), body.get("tool_choice"), int(body.get("n", 1) or 1),
                       body.get("max_completion_tokens") or body.get("max_tokens"), body.get("temperature"),
                       body.get("top_p"), stop, body.get("seed"), bool(body.get("logprobs")),
                       int(body.get("top_logprobs") or 0), bool(body.get("stream")),
                       bool((body.get("stream_options") or {}).get("include_usage")))


TOOL_PARSERS = {"pipe": None, "qwen25": None, "hermes": None}


def _first_property(tool: dict) -> str:
    params = (tool.get("function") or {}).get("parameters") or {}
    required = params.get("required") or []
    return required[0] if required else next(iter(params.get("properties") or {"input": None}))


def parse_tool_calls(parser: str, text: str, tools: list) -> tuple[Optional[str], list]:
    names = {(t.get("function") or {}).get("name"): t for t in tools or []}
    if parser == "pipe":
        if "|" not in text:
            return text, []
        head = text.split("|", 1)[0]
        name, _, argument = head.partition(":")
        if not argument:
            if len(names) != 1:
                return text, []
            name, argument = next(iter(names)), head
        if name not in names:
            return text, []
        return None, [{"id": "call_" + secrets.token_hex(12), "type": "function",
                       "function": {"name": name, "arguments": json.dumps({_first_property(names[name]): argument})}}]
    calls = []
    for block in re.findall(r"<tool_call>\s*(.*?)\s*</tool_call>", text, re.S):
        try:
            data = json.loads(block)
        except ValueError:
            return text, []
        if data.get("name") not in names:
            return text, []
        calls.append({"id": "call_" + secrets.token_hex(12), "type": "function",
                      "function": {"name": data["name"], "arguments": json.dumps(data.get("arguments", {}))}})
    if not calls:
        return text, []
    content = text.split("<tool_call>", 1)[0].strip() or None
    return content, calls


@dataclass
class TokenLogprob:
    token: str
    logprob: float
    top: list = field(default_factory=list)


@dataclass
class ChatChoice:
    index: int
    text: str
    finish_reason: str
    tool_calls: list = field(default_factory=list)
    content: Optional[str] = None
    logprobs: Optional[list] = None


def chat_completion_body(*, model: str, choices: list, prompt_tokens: int, completion_tokens: int,
                         id: Optional[str] = None, created: Optional[int] = None) -> dict:
    out = []
    for c in choices:
        message = {"role": "assistant", "content": c.content if c.tool_calls else c.text}
        if c.tool_calls:
            message["tool_calls"] = c.tool_calls
        entry = {"index": c.index, "message": message,
                 "finish_reason": "tool_calls" if c.tool_calls else c.finish_reason, "logprobs": None}
        if c.logprobs is not None:
            entry["logprobs"] = {"content": [{"token": t.token, "logprob": t.logprob, "bytes": list(t.token.encode()),
                                              "top_logprobs": [{"token": a, "logprob": b, "bytes": list(a.encode())} for a, b in t.top]}
                                             for t in c.logprobs]}
        out.append(entry)
    return {"id": id or f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": created or int(time.time()),
            "model": model, "choices": out, "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                                                      "total_tokens": prompt_tokens + completion_tokens}}


def chat_completion_chunks(body: dict, *, include_usage: bool = False) -> list:
    base = {"id": body["id"], "object": "chat.completion.chunk", "created": body["created"], "model": body["model"]}
    chunks = []
    for c in body["choices"]:
        m = c["message"]
        chunks.append({**base, "choices": [{"index": c["index"], "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]})
        if m.get("content"):
            chunks.append({**base, "choices": [{"index": c["index"], "delta": {"content": m["content"]}, "finish_reason": None}]})
        if m.get("tool_calls"):
            chunks.append({**base, "choices": [{"index": c["index"], "delta": {"tool_calls": [
                {"index": i, **t} for i, t in enumerate(m["tool_calls"])]}, "finish_reason": None}]})
        chunks.append({**base, "choices": [{"index": c["index"], "delta": {}, "finish_reason": c["finish_reason"]}]})
    if include_usage:
        chunks.append({**base, "choices": [], "usage": body["usage"]})
    return chunks


def sse(events: Iterable[dict]) -> bytes:
    return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"
