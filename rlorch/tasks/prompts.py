"""Prompts as the model sees them: one function, :func:`encode_prompt`, turns a prompt (text, or a
list of chat messages) into token ids. Training (``episode.PromptSource``) and ``rlorch serve``'s
``text`` requests both call it, so a model answers a served prompt as it was trained to.

- Text: the tokenizer's ``bos`` (when it has one), then the text's tokens, no other special tokens.
- Messages (``[{"role": ..., "content": ...}, ...]``): the tokenizer's chat template with the
  generation prompt, rendered to text and tokenized without adding special tokens (the template
  writes its own, ``bos`` included), as ``apply_chat_template`` does.

The chat form of a conversation (``episode.EngineConversation``) grows by suffixes: the ids of
earlier turns are kept as they are (the engine's own ids for model turns) and only the text the
template adds for new messages is tokenized (:func:`chat_suffix`).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Union

Message = dict
Messages = list
PromptInput = Union[str, Sequence[Message]]

CHARACTER_IDS = bytes(1 + (code % 60) for code in range(256))
"""The sim backends' tokenizer on ASCII text: character code -> token id (``1 + code % 60``)."""


class ChatTemplateError(ValueError):
    """A chat-form prompt for a tokenizer without a chat template, or messages the template
    cannot render incrementally."""


def is_messages(prompt: Any) -> bool:
    """Whether ``prompt`` is a list of chat messages (dicts with ``role`` and ``content``)."""
    return isinstance(prompt, (list, tuple)) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in prompt) and len(prompt) > 0


def encode_text(tokenizer: Any, text: str) -> list[int]:
    """Token ids of ``text`` with no special tokens added (the sim backends have no tokenizer:
    one id per character)."""
    if tokenizer is None:
        if text.isascii():
            return list(text.encode().translate(CHARACTER_IDS))
        return [1 + (ord(c) % 60) for c in text]
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def encode_prompt(tokenizer: Any, prompt: PromptInput, *, tools: Optional[list] = None) -> list[int]:
    """The token ids a prompt is generated from, in training and in ``rlorch serve`` alike
    (``tools``: the function definitions a chat template renders, as OpenAI's ``tools``)."""
    if not isinstance(prompt, str):
        return encode_text(tokenizer, _render(tokenizer, prompt, True, tools))
    ids = encode_text(tokenizer, prompt)
    if tokenizer is not None and tokenizer.bos_token_id is not None:
        return [tokenizer.bos_token_id] + ids
    return ids or [1]


def render_chat(tokenizer: Any, messages: Sequence[Message], *, generation_prompt: bool,
                tools: Optional[list] = None) -> str:
    """The chat template's text for ``messages`` (with the assistant's generation prompt)."""
    require_chat_template(tokenizer)
    extra = {"tools": tools} if tools else {}
    return tokenizer.apply_chat_template(list(messages), add_generation_prompt=generation_prompt,
                                         tokenize=False, **extra)


def require_chat_template(tokenizer: Any) -> None:
    if tokenizer is None:
        return
    if not getattr(tokenizer, "chat_template", None):
        name = getattr(tokenizer, "name_or_path", "") or "this model"
        raise ChatTemplateError(
            f"{name}: the tokenizer has no chat template, so a prompt of messages cannot be rendered; "
            "use a text prompt, an instruct model, or set tokenizer.chat_template in tokenizer_config.json")


def _sim_template(messages: Sequence[Message], generation_prompt: bool) -> str:
    text = "".join(f"{m['role']}:{m['content']};" for m in messages)
    return text + ("assistant:" if generation_prompt else "")


def turn_closer(tokenizer: Any) -> str:
    """What the template writes after an assistant message's content (``<|im_end|>\\n`` for
    Qwen's, ``<eos>`` for the tiny model's): a model turn that ended without it (cut by the length
    limit, or stopped by a stop string) gets it from the environment's next message."""
    probe = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "rlorchprobe"}]
    text = _render(tokenizer, probe, False)
    return text[text.rindex("rlorchprobe") + len("rlorchprobe"):]


def _render(tokenizer: Any, messages: Sequence[Message], generation_prompt: bool,
            tools: Optional[list] = None) -> str:
    if tokenizer is None:
        return _sim_template(messages, generation_prompt)
    return render_chat(tokenizer, messages, generation_prompt=generation_prompt, tools=tools)


def chat_suffix(tokenizer: Any, history: Sequence[Message], new: Sequence[Message], *, last_turn: str,
                tools: Optional[list] = None) -> str:
    """The text that follows the trajectory so far when the environment adds ``new`` messages:
    the rest of the last model turn's closer (``last_turn`` is that turn's text with special
    tokens), the new messages as the template renders them, and the generation prompt.

    Raises :class:`ChatTemplateError` where the template renders earlier messages differently
    once later ones follow (then earlier ids could not be kept)."""
    return _suffix(tokenizer, history, new, last_turn, tools,
                   "the chat template renders earlier messages differently once new ones follow, so a "
                   "conversation cannot keep the ids already generated")


BRIDGE_HISTORY = ({"role": "user", "content": "x"}, {"role": "assistant", "content": "x"})
"""The stand-in history :func:`bridged_suffix` renders new messages after."""


def bridged_suffix(tokenizer: Any, new: Sequence[Message], *, last_turn: str, tools: Optional[list] = None) -> str:
    """:func:`chat_suffix` for a template that renders earlier turns differently once later ones
    follow (Qwen3's drops past reasoning): the new messages as the template renders them after a
    stand-in user and assistant turn, so the ids already sampled are kept as they were. The
    sequence then differs from a fresh rendering of the whole chat (the sampled reasoning stays),
    which is what was sampled. Raises :class:`ChatTemplateError` where even that is not a suffix."""
    return _suffix(tokenizer, [dict(m) for m in BRIDGE_HISTORY], new, last_turn, tools,
                   "the chat template does not render new messages as a suffix even after a stand-in history")


def _suffix(tokenizer: Any, history: Sequence[Message], new: Sequence[Message], last_turn: str,
            tools: Optional[list], refusal: str) -> str:
    """The closer's rest, then what rendering ``new`` after ``history`` adds (``refusal``: the
    error where the longer rendering does not start with the shorter)."""
    before = _render(tokenizer, history, False, tools)
    after = _render(tokenizer, [*history, *new], True, tools)
    if not after.startswith(before):
        raise ChatTemplateError(refusal)
    return _closer_rest(tokenizer, history, last_turn) + after[len(before):]


def _closer_rest(tokenizer: Any, history: Sequence[Message], last_turn: str) -> str:
    """What is still missing of the template's closer after the last model turn (all of it for a
    turn the length limit or a stop string cut, none for one that wrote it)."""
    closer = turn_closer(tokenizer) if history and history[-1]["role"] == "assistant" else ""
    done = next((k for k in range(len(closer), 0, -1) if last_turn.endswith(closer[:k])), 0)
    return closer[done:]
