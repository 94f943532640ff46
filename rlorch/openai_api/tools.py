"""Tool calls parsed out of a finished completion's text (``--tool-call-parser``).

A parser never raises on model output: text that does not parse stays content, with no tool
calls, and a call naming a tool the request did not offer is not a call.

- ``qwen25`` (alias ``hermes``): ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``
  blocks as Qwen2.5 writes them (SGLang's ``qwen25`` detector). Content is the text before the
  first block (None when only whitespace). One block that does not parse, or names an unknown
  tool, makes the whole text content.
- ``pipe``: the tiny default model's format (its vocabulary has no braces or quotes). The text
  up to the first ``|`` is one call, ``name:argument`` or, when exactly one tool is offered, just
  ``argument``; its arguments are ``{"<the tool's first parameter>": argument}`` (the first of
  ``parameters.properties``, else of ``parameters.required``; ``{}`` for a tool with neither).
  Text after the ``|`` is ignored; text with no ``|`` is content.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any, Callable, Optional

ParseResult = tuple[Optional[str], list[dict]]
_QWEN_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _call(name: str, arguments: dict) -> dict:
    return {"id": new_call_id(), "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}


def _names(tools: list[dict]) -> list[str]:
    return [tool["function"]["name"] for tool in tools or []]


def parse_qwen25(text: str, tools: list[dict]) -> ParseResult:
    start = text.find("<tool_call>")
    if start < 0:
        return text, []
    known = set(_names(tools))
    calls = []
    for block in _QWEN_BLOCK.findall(text[start:]):
        try:
            value = json.loads(block)
        except ValueError:
            return text, []
        if not isinstance(value, dict) or value.get("name") not in known:
            return text, []
        arguments = value.get("arguments", value.get("parameters", {}))
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                return text, []
        if not isinstance(arguments, dict):
            return text, []
        calls.append(_call(value["name"], arguments))
    if not calls:
        return text, []
    content = text[:start].strip()
    return content or None, calls


def _first_parameter(tool: dict) -> Optional[str]:
    parameters = tool["function"].get("parameters") or {}
    properties = parameters.get("properties") or {}
    if isinstance(properties, dict) and properties:
        return next(iter(properties))
    required = parameters.get("required") or []
    return required[0] if isinstance(required, list) and required and isinstance(required[0], str) else None


def parse_pipe(text: str, tools: list[dict]) -> ParseResult:
    end = text.find("|")
    if end < 0 or not tools:
        return text, []
    call = text[:end]
    by_name = {tool["function"]["name"]: tool for tool in tools}
    name, sep, argument = call.partition(":")
    if sep and name in by_name:
        tool = by_name[name]
    elif len(tools) == 1:
        tool, argument = tools[0], call
    else:
        return text, []
    key = _first_parameter(tool)
    return None, [_call(tool["function"]["name"], {} if key is None else {key: argument})]


TOOL_PARSERS: dict[str, Callable[[str, list[dict]], ParseResult]] = {
    "qwen25": parse_qwen25, "hermes": parse_qwen25, "pipe": parse_pipe}


def parse_tool_calls(parser: str, text: str, tools: Any) -> ParseResult:
    """``(content, tool_calls)`` of a completion's ``text``; tool calls in OpenAI's shape
    ``{"id": "call_<24 hex>", "type": "function", "function": {"name", "arguments": <JSON string>}}``.
    An unknown ``parser`` raises ValueError (a configuration error, never model output)."""
    if parser not in TOOL_PARSERS:
        raise ValueError(f"unknown tool-call parser {parser!r} (known: {sorted(TOOL_PARSERS)})")
    if not tools:
        return text, []
    return TOOL_PARSERS[parser](text, tools)
