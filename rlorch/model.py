"""Model directories: the tiny default model, and which code runs a model.

The tiny default is an HF-format Qwen2 causal LM with a character-level tokenizer, created
locally on first use (deterministic random init: RL teaches it), never downloaded. Qwen2 is an
architecture SGLang serves too, so the same checkpoints load in both. Creation is atomic (build
in a temporary directory, then rename) because several processes may ask at once.

:func:`uses_native` decides ``model.implementation`` for a model directory (rlorch's own Qwen2 in
:mod:`rlorch.qwen2`, or transformers'), reading its ``config.json`` alone: this module imports
neither torch nor transformers unless it creates the default model.
"""

from __future__ import annotations

import json
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


NATIVE_ARCHITECTURE = "Qwen2ForCausalLM"
"""The architecture :mod:`rlorch.qwen2` runs."""
CONFIG_FILE = "config.json"


def read_config(path: Path) -> dict:
    """A model directory's ``config.json``."""
    return json.loads((Path(path) / CONFIG_FILE).read_text())


def unsupported(config: dict) -> Optional[str]:
    """Why :mod:`rlorch.qwen2` cannot reproduce the model ``config`` describes (None: it can)."""
    architectures = config.get("architectures") or []
    if architectures != [NATIVE_ARCHITECTURE]:
        return f"architecture {architectures or config.get('model_type')} (only {NATIVE_ARCHITECTURE})"
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if (rope.get("rope_type") or rope.get("type") or "default") != "default":
        return f"RoPE type {rope.get('rope_type') or rope.get('type')!r}"
    if config.get("use_sliding_window"):
        return "sliding-window attention"
    if any(kind != "full_attention" for kind in config.get("layer_types") or []):
        return "layers other than full attention"
    if config.get("hidden_act", "silu") != "silu":
        return f"activation {config.get('hidden_act')!r}"
    return None


def uses_native(implementation: str, path: Path, *, lora: bool = False, device: str = "cpu") -> bool:
    """Whether a model directory is run by :mod:`rlorch.qwen2` (``model.implementation``):
    ``native`` always (an unsupported model is an error naming ``model.implementation``), ``hf``
    never, ``auto`` for a supported model without LoRA (peft wraps transformers' modules) on the
    CPU (on a GPU transformers' attention kernels stay, until this module is measured there)."""
    if implementation == "hf":
        return False
    reason = unsupported(read_config(path))
    if implementation == "native":
        if reason or lora:
            from rlorch.config.schema import ConfigError

            raise ConfigError("model.implementation", f"native cannot run {path}: "
                              f"{reason or 'LoRA (model.lora.rank > 0) needs transformers'}; use auto or hf")
        return True
    return reason is None and not lora and device == "cpu"


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
