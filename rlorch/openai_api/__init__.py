"""OpenAI-compatible chat and completions: request parsing, tool-call parsing and response
shaping, shared by ``rlorch serve``'s ``/v1`` routes and the agent gateway (``rlorch.agents.gateway``).

Pure: no aiohttp, no torch. Shapes follow SGLang's OpenAI-compatible routes (its
``entrypoints/openai/protocol.py``, ``serving_chat.py``, ``serving_completions.py``), errors
OpenAI's ``{"error": {"message", "type", "param", "code"}}``.
"""

from rlorch.openai_api.requests import (ApiError, ChatRequest, CompletionRequest, parse_chat_request,
                                        parse_completion_request, template_messages)
from rlorch.openai_api.responses import (SSE_DONE, ChatChoice, CompletionChoice, TokenLogprob, chat_completion_body,
                                         chat_completion_chunks, chat_logprobs, completion_body, completion_chunks,
                                         completion_logprobs, sse, sse_data)
from rlorch.openai_api.tools import TOOL_PARSERS, new_call_id, parse_tool_calls

__all__ = ["ApiError", "ChatRequest", "CompletionRequest", "parse_chat_request", "parse_completion_request",
           "template_messages", "ChatChoice", "CompletionChoice", "TokenLogprob", "chat_completion_body",
           "chat_completion_chunks", "completion_body", "completion_chunks", "sse",
           "sse_data", "SSE_DONE", "chat_logprobs", "completion_logprobs", "TOOL_PARSERS",
           "new_call_id", "parse_tool_calls"]
