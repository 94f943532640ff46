"""The tiny default model: an HF-format Qwen2 causal LM with a character-level tokenizer.

Created locally on first use (deterministic random init: RL teaches it), never downloaded. Qwen2 is
an architecture SGLang serves too, so the same checkpoints load in both. Creation is atomic
(build in a temporary directory, then rename) because several processes may ask at once.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Optional

DEFAULT_MODEL_NAME = "tiny-qwen2-digits-v2"
SPECIAL_TOKENS = ["<pad>", "<bos>", "<eos>", "<unk>"]
CHARACTERS = list("0123456789") + list("=:,|+-") + list("abcdefghijklmnopqrstuvwxyz")
CHAT_TEMPLATE = ("{{ bos_token }}{% for message in messages %}{{ message['role'] }}:{{ message['content'] }}"
                 "{{ eos_token }}{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")
"""The tiny tokenizer's chat template: ``<bos>user:3+4=<eos>assistant:`` and the model's turn ends
with ``<eos>``, as it does in text form. Roles are lowercase letters and ``:`` (the vocabulary
has no whitespace). Text prompts do not use it, so the default run is the same with or without it."""
TINY_SHAPE = dict(hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)


def cache_dir() -> Path:
    """Where created models live (``RLORCH_HOME``, default ``~/.cache/rlorch``)."""
    return Path(os.environ.get("RLORCH_HOME", Path.home() / ".cache" / "rlorch"))


def default_model_path() -> Path:
    return cache_dir() / "models" / DEFAULT_MODEL_NAME


def resolve_model_path(path: Optional[str]) -> Path:
    """The model directory to use: ``path`` if given (it must exist), else the tiny default."""
    if path:
        resolved = Path(path).expanduser()
        if not (resolved / "config.json").is_file():
            from rlorch.config.schema import ConfigError

            raise ConfigError("model.path", f"{resolved} is not an HF model directory (no config.json)")
        return resolved
    return ensure_default_model()


def build_tokenizer():
    """A character-level fast tokenizer; every character is one token (no whitespace: the
    default tasks write their prompts without it), with a chat template (:data:`CHAT_TEMPLATE`)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: index for index, token in enumerate(SPECIAL_TOKENS + CHARACTERS)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<bos>",
                                        eos_token="<eos>", unk_token="<unk>")
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_model(tokenizer, seed: int = 0):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=len(tokenizer), tie_word_embeddings=True,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, torch_dtype="float32", **TINY_SHAPE)
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config)


def ensure_default_model() -> Path:
    """Create the tiny default model once; later calls return its directory."""
    target = default_model_path()
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".creating-", dir=target.parent))
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        tokenizer = build_tokenizer()
        model = build_model(tokenizer)
        model.save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)
        os.rename(staging, target)
    except OSError:
        if not (target / "config.json").is_file():
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
