"""Parsing ``/v1/chat/completions`` and ``/v1/completions`` request bodies.

Every refusal is an :class:`ApiError` naming the parameter at fault (``param``), answered 400.
Unknown keys are ignored (as SGLang does; clients send vendor extras); known parameters the
engines do not implement are accepted only at their defaults. Of SGLang's extra sampling
parameters, ``top_k``, ``min_p`` and ``ignore_eos`` are taken.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Optional

MAX_N = 128
MAX_TOP_LOGPROBS = 20
MAX_STOPS = 4

_UNSUPPORTED_DEFAULTS: dict[str, Any] = {
    "frequency_penalty": 0, "presence_penalty": 0, "logit_bias": None, "suffix": None,
    "response_format": None, "parallel_tool_calls": True,
}
"""Parameters accepted only at these values (or null); anything else names the parameter."""
_TEXT_FORMAT = {"type": "text"}


class ApiError(Exception):
    """A request refused in OpenAI's error shape (``body()``), with HTTP ``status``."""

    def __init__(self, message: str, *, param: Optional[str] = None, status: int = 400,
                 type: str = "invalid_request_error", code: Optional[str] = None):
        super().__init__(message)
        self.message, self.param, self.status, self.type, self.code = message, param, status, type, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass
class ChatRequest:
    model: str
    messages: list[dict]
    """As sent, each with a ``role``; list-of-text-parts contents joined into one string."""
    tools: Optional[list[dict]]
    tool_choice: Any
    n: int
    max_tokens: Optional[int]
    """``max_completion_tokens`` when given, else ``max_tokens``; None: up to the context length."""
    temperature: Optional[float]
    top_p: Optional[float]
    stop: list[str]
    seed: Optional[int]
    logprobs: bool
    top_logprobs: int
    stream: bool
    include_usage: bool
    """``stream_options.include_usage``: a last chunk carries the usage."""
    top_k: int = -1
    """SGLang's extra sampling parameters (-1: the whole vocabulary)."""
    min_p: float = 0.0
    ignore_eos: bool = False


@dataclass
class CompletionRequest:
    model: str
    prompts: list  # list[str | list[int]]
    n: int
    max_tokens: Optional[int]
    temperature: Optional[float]
    top_p: Optional[float]
    stop: list[str]
    seed: Optional[int]
    logprobs: Optional[int]
    """How many top alternatives per token (0: the sampled token's logprob alone); None: none."""
    echo: bool
    stream: bool
    include_usage: bool
    top_k: int = -1
    min_p: float = 0.0
    ignore_eos: bool = False


def parse_chat_request(body: Any) -> ChatRequest:
    body = _object(body)
    _unsupported(body)
    logprobs = _bool(body, "logprobs")
    top = _int(body, "top_logprobs", 0, MAX_TOP_LOGPROBS)
    if top and not logprobs:
        raise ApiError("top_logprobs requires logprobs to be true", param="top_logprobs")
    tools = _tools(body.get("tools"))
    max_tokens = _int(body, "max_completion_tokens", 1, None)
    stream = _bool(body, "stream")
    return ChatRequest(model=_model(body), messages=_messages(body.get("messages")), tools=tools,
                       tool_choice=_tool_choice(body.get("tool_choice"), tools), n=_n(body),
                       max_tokens=max_tokens if max_tokens is not None else _int(body, "max_tokens", 1, None),
                       temperature=_number(body, "temperature", 0.0, 2.0), top_p=_top_p(body), stop=_stop(body),
                       seed=_int(body, "seed", None, None), logprobs=logprobs, top_logprobs=top or 0,
                       stream=stream, include_usage=_include_usage(body, stream), **_extras(body))


def parse_completion_request(body: Any) -> CompletionRequest:
    body = _object(body)
    _unsupported(body)
    best_of = body.get("best_of")
    n = _n(body)
    if best_of is not None and best_of != n:
        raise ApiError("best_of other than n is not supported", param="best_of")
    stream = _bool(body, "stream")
    return CompletionRequest(model=_model(body), prompts=_prompts(body.get("prompt")), n=n,
                             max_tokens=_int(body, "max_tokens", 0, None),
                             temperature=_number(body, "temperature", 0.0, 2.0), top_p=_top_p(body),
                             stop=_stop(body), seed=_int(body, "seed", None, None),
                             logprobs=_int(body, "logprobs", 0, MAX_TOP_LOGPROBS), echo=_bool(body, "echo"),
                             stream=stream, include_usage=_include_usage(body, stream), **_extras(body))


def template_messages(messages: list[dict]) -> list[dict]:
    """Messages as a chat template renders them: a null content as ``""``, and each tool call's
    ``arguments`` JSON string as the object it encodes (templates write it with ``tojson``)."""
    rendered = []
    for message in messages:
        message = {**message, "content": message.get("content") or ""}
        if message.get("tool_calls"):
            message["tool_calls"] = [_call_for_template(call) for call in message["tool_calls"]]
        rendered.append(message)
    return rendered


def _call_for_template(call: Any) -> Any:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except ValueError:
        return call
    return {**call, "function": {**function, "arguments": arguments}}


# ---- fields ---------------------------------------------------------------------------------

def _object(body: Any) -> dict:
    if not isinstance(body, dict):
        raise ApiError(f"the request body must be a JSON object, got {type(body).__name__}")
    return body


def _unsupported(body: dict) -> None:
    for key, default in _UNSUPPORTED_DEFAULTS.items():
        value = body.get(key)
        if value is None or value == default or (key == "response_format" and value == _TEXT_FORMAT):
            continue
        raise ApiError(f"{key}={json.dumps(value)} is not supported", param=key)


def _extras(body: dict) -> dict:
    """SGLang's sampling parameters beyond OpenAI's: ``top_k``, ``min_p``, ``ignore_eos``."""
    top_k = _int(body, "top_k", -1, None)
    if top_k == 0:
        raise ApiError("top_k must be -1 (the whole vocabulary) or >= 1", param="top_k")
    min_p = _number(body, "min_p", 0.0, 1.0)
    return {"top_k": -1 if top_k is None else top_k, "min_p": min_p or 0.0, "ignore_eos": _bool(body, "ignore_eos")}


def _model(body: dict) -> str:
    model = body.get("model", "")
    if not isinstance(model, str):
        raise ApiError("model must be a string", param="model")
    return model


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int(body: dict, name: str, lo: Optional[int], hi: Optional[int]) -> Optional[int]:
    value = body.get(name)
    if value is None:
        return None
    if not _is_int(value):
        raise ApiError(f"{name} must be an integer, got {json.dumps(value)}", param=name)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        bound = f">= {lo}" if hi is None else f"between {lo} and {hi}"
        raise ApiError(f"{name} must be {bound}, got {value}", param=name)
    return value


def _number(body: dict, name: str, lo: float, hi: float) -> Optional[float]:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ApiError(f"{name} must be a number, got {json.dumps(value)}", param=name)
    if not lo <= value <= hi:
        raise ApiError(f"{name} must be between {lo:g} and {hi:g}, got {value}", param=name)
    return float(value)


def _top_p(body: dict) -> Optional[float]:
    top_p = _number(body, "top_p", 0.0, 1.0)
    if top_p == 0:
        raise ApiError("top_p must be in (0, 1]", param="top_p")
    return top_p


def _bool(body: dict, name: str) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ApiError(f"{name} must be a boolean, got {json.dumps(value)}", param=name)
    return value


def _n(body: dict) -> int:
    n = _int(body, "n", 1, MAX_N)
    return 1 if n is None else n


def _stop(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > MAX_STOPS:
        raise ApiError(f"stop must be a non-empty string or a list of at most {MAX_STOPS} of them", param="stop")
    return list(stops)


def _include_usage(body: dict, stream: bool) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not stream:
        raise ApiError("stream_options is only allowed when stream is true", param="stream_options")
    if not isinstance(options, dict):
        raise ApiError("stream_options must be an object", param="stream_options")
    return _bool(options, "include_usage")


def _messages(messages: Any) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise ApiError("messages must be a non-empty list of messages", param="messages")
    return [_message(message, f"messages[{i}]") for i, message in enumerate(messages)]


ROLES = ("system", "developer", "user", "assistant", "tool", "function")
"""The roles SGLang's chat route takes (case-insensitive there too); a user message needs content."""


def _message(message: Any, where: str) -> dict:
    if not isinstance(message, dict):
        raise ApiError(f"{where} must be an object", param=where)
    role = message.get("role")
    if not isinstance(role, str) or role.lower() not in ROLES:
        raise ApiError(f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}", param=f"{where}.role")
    if role != role.lower():
        message = {**message, "role": role.lower()}
    content = message.get("content")
    if content is None and message["role"] == "user":
        raise ApiError(f"{where}.content is required for a user message", param=f"{where}.content")
    if isinstance(content, list):
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                   for p in content):
            raise ApiError(f"{where}.content: only text parts are supported", param=f"{where}.content")
        return {**message, "content": "".join(p["text"] for p in content)}
    if content is not None and not isinstance(content, str):
        raise ApiError(f"{where}.content must be a string, a list of text parts or null", param=f"{where}.content")
    return message


def _tools(tools: Any) -> Optional[list[dict]]:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise ApiError("tools must be a list", param="tools")
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(function, dict):
            raise ApiError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{...}}}}", param=f"tools[{i}]")
        if not isinstance(function.get("name"), str) or not function["name"]:
            raise ApiError(f"tools[{i}].function.name must be a non-empty string", param=f"tools[{i}].function.name")
        if not isinstance(function.get("parameters", {}), (dict, type(None))):
            raise ApiError(f"tools[{i}].function.parameters must be an object",
                           param=f"tools[{i}].function.parameters")
    return tools or None


def _tool_choice(choice: Any, tools: Optional[list[dict]]) -> Any:
    """``none`` (never parse a call) or ``auto``; a forced call (``required``, a named function)
    would need constrained decoding, which the engines here do not do, so it is refused rather
    than answered with a reply that may not call."""
    if choice is None or choice in ("none", "auto"):
        return choice
    forced = choice == "required" or (isinstance(choice, dict) and isinstance(choice.get("function"), dict))
    if not forced:
        raise ApiError("tool_choice must be 'none', 'auto', 'required' or "
                       "{\"type\": \"function\", \"function\": {\"name\": ...}}", param="tool_choice")
    name = "required" if choice == "required" else choice["function"].get("name")
    if not tools:
        raise ApiError(f"tool_choice {name!r} needs tools", param="tool_choice")
    if choice != "required" and name not in {tool["function"]["name"] for tool in tools}:
        raise ApiError(f"tool_choice names {name!r}, which is not among the tools", param="tool_choice")
    raise ApiError(f"tool_choice {name!r} forces a call, which needs constrained decoding this server does not "
                   "do; send 'auto' (the model may call) or 'none' (no call is parsed)", param="tool_choice")


def _prompts(prompt: Any) -> list:
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return list(prompt)
        if all(_is_int(t) for t in prompt):
            return [list(prompt)]
        if all(isinstance(p, list) and p and all(_is_int(t) for t in p) for p in prompt):
            return [list(p) for p in prompt]
    raise ApiError("prompt must be a string, a list of strings, a list of token ids or a list of such lists "
                   "(none empty)", param="prompt")
