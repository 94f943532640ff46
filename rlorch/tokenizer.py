"""A model directory's tokenizer, loaded without importing transformers where its files define it.

Importing transformers' tokenizer code imports torch and costs seconds of CPU on a small machine,
in the orchestrator and in every engine, before the first rollout. A directory whose
``tokenizer_config.json`` names a generic fast tokenizer (``TokenizersBackend`` or
``PreTrainedTokenizerFast``, as rlorch's own models do) is fully defined by its ``tokenizer.json``:
:class:`FastTokenizer` runs that file through the ``tokenizers`` library (which transformers runs
too) and renders the chat template with jinja2 as transformers does. Any other tokenizer class
(a model-specific one may rebuild the pipeline in code) goes through ``AutoTokenizer``.

One divergence is known: transformers 5 loads rlorch's tiny model (a ``qwen2`` model type) as
Qwen2's byte-level BPE whatever its config names, which drops characters outside the vocabulary
where the file maps them to ``<unk>``. Text inside the vocabulary, which every task writes, gets
the same ids either way (tested).

:class:`FastTokenizer` offers the part of transformers' interface rlorch calls:
``tokenizer(text, add_special_tokens=False)["input_ids"]``, ``decode``, ``decode_batch``, the
special tokens' ids (``all_special_ids`` too), ``chat_template`` /
``apply_chat_template(..., tokenize=False)`` and ``get_vocab``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional, Sequence

GENERIC_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")
SPECIAL_KEYS = ("bos_token", "eos_token", "pad_token", "unk_token")


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def defined_by_files(path: Path) -> bool:
    """Whether ``path``'s ``tokenizer.json`` is the whole tokenizer (see the module's docstring)."""
    path = Path(path)
    settings = _read_json(path / "tokenizer_config.json")
    return ((path / "tokenizer.json").is_file() and settings.get("tokenizer_class") in GENERIC_CLASSES
            and not settings.get("clean_up_tokenization_spaces", False))


def load_tokenizer(path: Path) -> Any:
    """The tokenizer of model directory ``path``: a :class:`FastTokenizer` where its files define
    it, else transformers' ``AutoTokenizer``."""
    if defined_by_files(path):
        return FastTokenizer(Path(path))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


class FastTokenizer:
    """``tokenizer.json`` through the ``tokenizers`` library, with ``tokenizer_config.json``'s
    special tokens and chat template."""

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer

        self.name_or_path = str(path)
        self.source = Path(path)
        self.backend_tokenizer = Tokenizer.from_file(str(self.source / "tokenizer.json"))
        settings = _read_json(self.source / "tokenizer_config.json")
        self.special_tokens = {key: _content(settings.get(key)) for key in SPECIAL_KEYS if settings.get(key)}
        template = self.source / "chat_template.jinja"
        self.chat_template: Optional[str] = (template.read_text() if template.is_file()
                                             else settings.get("chat_template"))
        self._template = None

    def _id(self, key: str) -> Optional[int]:
        token = self.special_tokens.get(key)
        return None if token is None else self.backend_tokenizer.token_to_id(token)

    @property
    def bos_token_id(self) -> Optional[int]:
        return self._id("bos_token")

    @property
    def eos_token_id(self) -> Optional[int]:
        return self._id("eos_token")

    @property
    def pad_token_id(self) -> Optional[int]:
        return self._id("pad_token")

    @property
    def all_special_ids(self) -> list[int]:
        """The ids of the special tokens (named in the config, or added as special)."""
        named = {self._id(key) for key in self.special_tokens} - {None}
        added = {index for index, token in self.backend_tokenizer.get_added_tokens_decoder().items() if token.special}
        return sorted(named | added)

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    def get_vocab(self) -> dict[str, int]:
        return self.backend_tokenizer.get_vocab(with_added_tokens=True)

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        return {"input_ids": self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids}

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.backend_tokenizer.decode(_ints(ids), skip_special_tokens=skip_special_tokens)

    def decode_batch(self, batch: Sequence[Sequence[int]], skip_special_tokens: bool = False) -> list[str]:
        return self.backend_tokenizer.decode_batch([_ints(ids) for ids in batch],
                                                   skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list, add_generation_prompt: bool = False, tokenize: bool = True,
                            **extra: Any):
        """The chat template rendered as transformers renders it (a sandboxed jinja2 environment
        trimming blocks, with ``raise_exception`` and the special tokens); ids if ``tokenize``."""
        if not self.chat_template:
            raise ValueError(f"{self.name_or_path}: the tokenizer has no chat template")
        if self._template is None:
            self._template = _compile(self.chat_template)
        text = self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     **self.special_tokens, **extra)
        return self(text, add_special_tokens=False)["input_ids"] if tokenize else text


def _content(value: Any) -> Optional[str]:
    """A special token as ``tokenizer_config.json`` writes it: a string, or ``{"content": ...}``."""
    return value.get("content") if isinstance(value, dict) else value


def _ints(ids: Any) -> list[int]:
    return ids.tolist() if hasattr(ids, "tolist") else list(ids)


def _compile(source: str):
    from datetime import datetime

    from jinja2.exceptions import TemplateError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        raise TemplateError(message)

    def strftime_now(format: str) -> str:
        return datetime.now().strftime(format)

    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
        # jinja2's own filter escapes HTML characters, which transformers' does not.
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    environment.filters["tojson"] = tojson
    environment.globals.update(raise_exception=raise_exception, strftime_now=strftime_now)
    return environment.from_string(source)
