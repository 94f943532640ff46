"""One agent episode's tokens, built call by call.

Invariant: every token a segment trains (loss mask 1) is a token the engine sampled, with the
behaviour logprob and version it reported, and every prompt a call sent is exactly a prefix of
its segment. A call whose messages extend what the segment holds (the messages it was built from,
then the assistant message returned) continues that segment: its prompt is the held ids plus the
chat template's text for the new messages (:func:`~rlorch.tasks.prompts.chat_suffix`, or the
bridge for templates that rewrite earlier turns). Any other call starts a new segment from the
rendered chat: a fork, counted, trained as a sequence of its own under the episode's reward.
"""

from __future__ import annotations

import enum
import json
from array import array
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from rlorch.openai_api import template_messages
from rlorch.tasks.prompts import ChatTemplateError, bridged_suffix, chat_suffix, encode_prompt, encode_text
from rlorch.types import (LOGPROBS, TOKEN_IDS, Generation, VersionStamps, as_array, logprob_array, mask_array,
                          token_ids)


class CallKind(str, enum.Enum):
    """How a call's prompt was made."""

    first = "first"
    """The episode's first call: the rendered chat."""
    extended = "extended"
    """The held ids plus the template's suffix for the new messages."""
    bridged = "bridged"
    """The held ids plus the new messages rendered after a stand-in history (the template
    rewrites earlier turns, so its own suffix does not exist)."""
    forked = "forked"
    """A new segment from the rendered chat: the messages do not extend what a segment holds."""


class ForkReason(str, enum.Enum):
    diverged = "diverged"
    """The messages are not the held ones plus new ones (edited, dropped or summarised history,
    an assistant message other than the one returned, other tools)."""
    template = "template"
    """The chat template rewrites earlier turns and the bridge is off (``task.agent_bridge``)."""
    concurrent = "concurrent"
    """Another call of the episode extended the same segment first."""


def message_key(message: dict) -> tuple:
    """What a message means for the rendered chat, for comparing the agent's history with the
    held one: role, text (None and "" alike, text parts joined), tool calls by name and parsed
    arguments (their ids and JSON spacing do not matter), the tool call answered, the name."""
    content = message.get("content")
    if isinstance(content, list):
        content = "".join(part.get("text", "") for part in content if isinstance(part, dict))
    calls = tuple((call.get("function") or {}).get("name", "") + "\x00" + _canonical_arguments(call)
                  for call in message.get("tool_calls") or ())
    return (message.get("role"), content or "", calls, message.get("tool_call_id") or "", message.get("name") or "")


def _canonical_arguments(call: dict) -> str:
    arguments = (call.get("function") or {}).get("arguments", "")
    try:
        return json.dumps(json.loads(arguments), sort_keys=True, separators=(",", ":"))
    except (TypeError, ValueError):
        return str(arguments)


@dataclass
class Segment:
    """One training sequence of the episode: a prompt, then sampled turns (mask 1) and the
    template's text between them (mask 0)."""

    tokens: array
    loss_mask: array
    logprobs: array
    versions: VersionStamps
    prompt_len: int
    tools_key: str
    held: list[tuple] = field(default_factory=list)
    """The keys of the messages ``tokens`` renders, the last assistant message included."""
    last_turn: str = ""
    """The last sampled turn's text with its special tokens (which closer it wrote)."""
    generation: int = 0
    """Calls recorded; a plan made at another count is outdated (a concurrent call)."""


@dataclass
class Plan:
    """What a call sends to the engine, and where its answer goes."""

    prompt_ids: array
    kind: CallKind
    segment: Optional[int]
    """The segment extended (None: a new one)."""
    generation: int
    fork_reason: Optional[ForkReason] = None
    messages: list[tuple] = field(default_factory=list)
    tools_key: str = ""


@dataclass
class CallRecord:
    """One call as the engine saw and answered it."""

    prompt_ids: array
    output_ids: array
    logprobs: array
    versions: VersionStamps
    finish_reason: str
    """As the run counts it: ``length`` only where the run's ``rollout.max_new_tokens`` cut the
    turn; a turn that reached the agent's own ``max_tokens`` ended where the agent asked, ``stop``
    (the agent itself was answered ``length``)."""
    kind: CallKind
    segment: int


class Trajectory:
    """The segments of one episode (see the module's docstring)."""

    def __init__(self, tokenizer: Any, *, bridge: bool = True):
        self.tokenizer = tokenizer
        self.bridge = bridge
        self.segments: list[Segment] = []
        self.calls: list[CallRecord] = []
        self.fork_reasons: list[ForkReason] = []

    @property
    def forks(self) -> int:
        """Segments beyond the first."""
        return max(0, len(self.segments) - 1)

    def plan(self, messages: Sequence[dict], tools: Optional[list] = None) -> Plan:
        """The prompt for a call with ``messages`` (and ``tools``)."""
        keys = [message_key(m) for m in messages]
        tools_key = json.dumps(tools, sort_keys=True) if tools else ""
        if not self.segments:
            return Plan(self._render(messages, tools), CallKind.first, None, 0, None, keys, tools_key)
        index, segment = len(self.segments) - 1, self.segments[-1]
        held = segment.held
        if tools_key != segment.tools_key or len(keys) <= len(held) or keys[:len(held)] != held:
            return self._fork(messages, tools, keys, tools_key, ForkReason.diverged)
        new = template_messages(messages[len(held):])
        history = template_messages(messages[:len(held)])
        kind = CallKind.extended
        try:
            suffix = chat_suffix(self.tokenizer, history, new, last_turn=segment.last_turn, tools=tools)
        except ChatTemplateError:
            if not self.bridge:
                return self._fork(messages, tools, keys, tools_key, ForkReason.template)
            try:
                suffix = bridged_suffix(self.tokenizer, new, last_turn=segment.last_turn, tools=tools)
            except ChatTemplateError:
                return self._fork(messages, tools, keys, tools_key, ForkReason.template)
            kind = CallKind.bridged
        prompt = segment.tokens + token_ids(encode_text(self.tokenizer, suffix))
        return Plan(prompt, kind, index, segment.generation, None, keys, tools_key)

    def _fork(self, messages, tools, keys, tools_key, reason: ForkReason) -> Plan:
        return Plan(self._render(messages, tools), CallKind.forked, None, 0, reason, keys, tools_key)

    def _render(self, messages: Sequence[dict], tools: Optional[list]) -> array:
        return token_ids(encode_prompt(self.tokenizer, template_messages(messages), tools=tools))

    def record(self, plan: Plan, generation: Generation, reply: dict, last_turn: str, *,
               agent_limit: bool = False) -> CallRecord:
        """Add a call's answer: ``reply`` is the assistant message returned to the agent,
        ``last_turn`` the sampled text with its special tokens; ``agent_limit``: the call's
        length limit was the agent's ``max_tokens``, not the run's."""
        output = as_array(TOKEN_IDS, generation.output_ids)
        logprobs = as_array(LOGPROBS, generation.logprobs)
        kind = plan.kind
        segment = self.segments[plan.segment] if plan.segment is not None else None
        if segment is not None and segment.generation != plan.generation:
            segment, kind = None, CallKind.forked
            self.fork_reasons.append(ForkReason.concurrent)
        elif kind is CallKind.forked:
            self.fork_reasons.append(plan.fork_reason)
        if segment is None:
            prompt_len = len(plan.prompt_ids)
            segment = Segment(token_ids(plan.prompt_ids), mask_array(bytes(prompt_len)),
                              logprob_array(bytes(4 * prompt_len)), VersionStamps(), prompt_len, plan.tools_key)
            self.segments.append(segment)
        else:
            added = len(plan.prompt_ids) - len(segment.tokens)
            segment.tokens += plan.prompt_ids[len(segment.tokens):]
            segment.loss_mask.frombytes(bytes(added))
            segment.logprobs.frombytes(bytes(4 * added))
        segment.tokens += output
        segment.loss_mask.frombytes(b"\x01" * len(output))
        segment.logprobs += logprobs
        segment.versions.concat(generation.versions)
        segment.held = [*plan.messages, message_key(reply)]
        segment.last_turn = last_turn
        segment.generation += 1
        finish_reason = "stop" if agent_limit and generation.finish_reason == "length" else generation.finish_reason
        record = CallRecord(plan.prompt_ids, output, logprobs, generation.versions, finish_reason, kind,
                            self.segments.index(segment))
        self.calls.append(record)
        return record

    def sequence(self) -> tuple[array, array, array, VersionStamps, Optional[list[int]]]:
        """The episode as one rollout's fields: tokens, loss mask, logprobs and versions of the
        segments back to back, and the segments' lengths (None for one segment)."""
        tokens, mask, logprobs, versions = token_ids(), mask_array(), logprob_array(), VersionStamps()
        for segment in self.segments:
            tokens += segment.tokens
            mask += segment.loss_mask
            logprobs += segment.logprobs
            versions.concat(segment.versions)
        lengths = [len(s.tokens) for s in self.segments] if len(self.segments) > 1 else None
        return tokens, mask, logprobs, versions, lengths
