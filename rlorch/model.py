"""Model directories: the built-in tiny models, and which code runs a model.

The tiny default (``model.path`` empty or ``tiny``) is an HF-format Qwen2 causal LM with a
character-level tokenizer, created locally on first use (deterministic random init: RL teaches
it), never downloaded; ``tiny-copy`` is the same pretrained to copy (below). Qwen2 is an
architecture SGLang serves too, so the same checkpoints load in both. Creation is atomic (build
in a temporary directory, then rename) because several processes may ask at once.

:func:`uses_native` decides ``model.implementation`` for a model directory (rlorch's own Qwen2 in
:mod:`rlorch.qwen2`, or transformers'), reading its ``config.json`` alone: this module imports
neither torch nor transformers unless it creates the default model.
"""

from __future__ import annotations

import json
import os
import random
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


BUILT_IN_MODELS = {"tiny": DEFAULT_MODEL_NAME, "tiny-copy": "tiny-qwen2-copy-v1"}
"""``model.path`` names of the models created locally, and their directories under the cache:
``tiny`` (the default, random) and ``tiny-copy`` (the same pretrained to copy: :func:`create_copy_model`)."""


def cache_dir() -> Path:
    """Where created models live (``RLORCH_HOME``, default ``~/.cache/rlorch``)."""
    return Path(os.environ.get("RLORCH_HOME", Path.home() / ".cache" / "rlorch"))


def default_model_path() -> Path:
    return cache_dir() / "models" / DEFAULT_MODEL_NAME


def model_directory(path: Optional[str]) -> Path:
    """Where ``model.path`` points, created or not: a directory (a directory named like a
    built-in wins), a built-in's place in the cache, or the tiny default's when empty."""
    if not path:
        return default_model_path()
    resolved = Path(path).expanduser()
    if path in BUILT_IN_MODELS and not (resolved / CONFIG_FILE).is_file():
        return cache_dir() / "models" / BUILT_IN_MODELS[path]
    return resolved


def resolve_model_path(path: Optional[str]) -> Path:
    """The model directory to use: ``path`` if given (a directory, which must exist, or a
    built-in's name, created on first use), else the tiny default."""
    if not path:
        return ensure_default_model()
    resolved = Path(path).expanduser()
    if (resolved / CONFIG_FILE).is_file():
        return resolved
    if path in BUILT_IN_MODELS:
        return {"tiny": ensure_default_model, "tiny-copy": ensure_copy_model}[path]()
    from rlorch.config.schema import ConfigError

    raise ConfigError("model.path", f"{resolved} is not an HF model directory (no config.json), nor a built-in "
                                    f"model ({', '.join(BUILT_IN_MODELS)})")


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

    def create(staging: Path) -> None:
        tokenizer = build_tokenizer()
        model = build_model(tokenizer)
        model.save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)

    return _created(default_model_path(), create)


def ensure_copy_model() -> Path:
    """Create the tiny copy model once (pretraining, about 2 minutes on 2 cores, with a line on
    stderr); later calls return its directory."""
    import sys

    def create(staging: Path) -> None:
        print("creating the tiny copy model (model.path=tiny-copy): pretraining it to copy, once, "
              "about 2 minutes on 2 cores…", file=sys.stderr, flush=True)
        create_copy_model(staging, log=lambda line: print(line, file=sys.stderr, flush=True))

    return _created(cache_dir() / "models" / BUILT_IN_MODELS["tiny-copy"], create)


def _created(target: Path, create) -> Path:
    """``target``, made by ``create(staging)`` first if it does not exist. Atomic: built in a
    temporary directory beside it, then renamed (several processes may ask at once; the first
    rename wins)."""
    if (target / CONFIG_FILE).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".creating-", dir=target.parent))
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        create(staging)
        os.rename(staging, target)
    except OSError:
        if not (target / CONFIG_FILE).is_file():
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


# The tiny copy model (``model.path=tiny-copy``) ---------------------------------------------------
# The tiny model given the one skill every pretrained language model has and a random one lacks,
# copying what came before: the tiny default's shape and tokenizer, pretrained by next-token
# prediction on random strings of the tokenizer's characters in which short spans recur (the
# induction pattern: after ``a b ... a``, predict ``b``). Nothing in the corpus is a task's format,
# a chat turn or an answer. A random 2-layer model learns a task's fixed positional copies from
# reward alone (the default reverse task), but not "copy what followed the last time this token
# appeared" at a place that moves, which an agent answering with its tool's result needs.
# Pretraining runs once, on the CPU, when the model is first asked for (about 2 minutes on 2 cores):
# COPY_STEPS steps, then on in chunks until the copy accuracy on a fixed probe set reaches
# REQUIRED_COPY_ACCURACY (the skill arrives as a sudden drop of the loss a few thousand steps in,
# whose exact step may vary a little between machines).

COPY_SEQUENCE_LENGTH = 48
COPY_BATCH = 64
COPY_LR = 3e-3
COPY_STEPS = 4000
"""Steps before the first check; the copy skill appeared at 2,200-2,800 steps in every run measured."""
MORE_COPY_STEPS = 500
MAX_COPY_STEPS = 10000
REQUIRED_COPY_ACCURACY = 0.5
"""Share of the recurring spans' predictable tokens (all but each span's first) predicted right,
greedily: a random model scores about 1/42; the trained one 0.6-0.7 (a token that occurs twice
before makes its successor ambiguous, which caps it)."""
UNIFORM_LOSS_WEIGHT = 0.3
"""Weight of the loss on every position beside the copyable ones: it keeps predictions where no
copy is possible near uniform, so the model still samples widely there (RL needs to explore)."""


class CopyPriorError(RuntimeError):
    """The copy skill did not appear within :data:`MAX_COPY_STEPS`."""


def _copy_sample(rng: random.Random, characters: list[int], bos: int) -> tuple[list[int], list[int]]:
    """A random string with 2-4 spans of 2-5 characters copied later in it; the mask marks the
    copies' tokens after their first that the finished string still lets one predict by copying
    (a later span may overwrite an earlier one's source)."""
    sequence = [rng.choice(characters) for _ in range(COPY_SEQUENCE_LENGTH)]
    copied: set[int] = set()
    for _ in range(rng.randint(2, 4)):
        length = rng.randint(2, 5)
        source = rng.randint(0, COPY_SEQUENCE_LENGTH - 2 * length - 2)
        copy = rng.randint(source + length + 1, COPY_SEQUENCE_LENGTH - length)
        sequence[copy:copy + length] = sequence[source:source + length]
        copied.update(range(copy + 1, copy + length))
    mask = [int(position in copied and _copyable(sequence, position)) for position in range(COPY_SEQUENCE_LENGTH)]
    return [bos] + sequence, [0] + mask


def _copyable(sequence: list[int], position: int) -> bool:
    """Whether the token at ``position`` followed its predecessor somewhere before."""
    previous, token = sequence[position - 1], sequence[position]
    return any(sequence[j - 1] == previous and sequence[j] == token for j in range(1, position - 1))


def _copy_batch(rng: random.Random, characters: list[int], bos: int, size: int):
    import torch

    pairs = [_copy_sample(rng, characters, bos) for _ in range(size)]
    return (torch.tensor([tokens for tokens, _ in pairs]),
            torch.tensor([mask for _, mask in pairs], dtype=torch.float32)[:, 1:])


def copy_accuracy(model, probe) -> float:
    """Greedy next-token accuracy on the probe's copyable positions."""
    import torch

    tokens, mask = probe
    with torch.no_grad():
        predicted = model(tokens).logits[:, :-1].argmax(-1)
    return float(((predicted == tokens[:, 1:]).float() * mask).sum() / mask.sum())


def pretrain_copying(model, tokenizer, *, seed: int = 0, log=None) -> tuple[int, float]:
    """Pretrain ``model`` in place; returns (steps, probe copy accuracy). Deterministic for a
    seed on one machine."""
    import torch
    import torch.nn.functional as F

    characters = [tokenizer.convert_tokens_to_ids(c) for c in CHARACTERS]
    bos = tokenizer.bos_token_id
    torch.manual_seed(seed)
    data = random.Random(seed)
    probe = _copy_batch(random.Random(seed + 1), characters, bos, 512)
    optimizer = torch.optim.AdamW(model.parameters(), lr=COPY_LR, weight_decay=0.0)
    model.train()
    steps, target, accuracy = 0, COPY_STEPS, 0.0
    while True:
        for _ in range(target - steps):
            tokens, mask = _copy_batch(data, characters, bos, COPY_BATCH)
            logits = model(tokens).logits[:, :-1]
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), tokens[:, 1:].reshape(-1),
                                   reduction="none").view(mask.shape)
            total = (loss * mask).sum() / mask.sum() + UNIFORM_LOSS_WEIGHT * loss.mean()
            optimizer.zero_grad(set_to_none=True)
            total.backward()
            optimizer.step()
        steps = target
        model.eval()
        accuracy = copy_accuracy(model, probe)
        model.train()
        if log is not None:
            log(f"copy prior: step {steps}, probe copy accuracy {accuracy:.2f}")
        if accuracy >= REQUIRED_COPY_ACCURACY:
            model.eval()
            return steps, accuracy
        if steps >= MAX_COPY_STEPS:
            raise CopyPriorError(f"the copy skill did not appear in {MAX_COPY_STEPS} steps (probe copy accuracy "
                                 f"{accuracy:.2f} < {REQUIRED_COPY_ACCURACY})")
        target = steps + MORE_COPY_STEPS


def create_copy_model(directory: Path, log=None) -> None:
    """Write the tiny copy model (weights, tokenizer, ``copy_prior.json`` with how it was made)
    into ``directory``."""
    import torch

    tokenizer = build_tokenizer()
    model = build_model(tokenizer)
    with torch.random.fork_rng():
        steps, accuracy = pretrain_copying(model, tokenizer, log=log)
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    (directory / "copy_prior.json").write_text(json.dumps(
        {"steps": steps, "probe_copy_accuracy": round(accuracy, 4), "sequence_length": COPY_SEQUENCE_LENGTH,
         "batch": COPY_BATCH, "lr": COPY_LR, "uniform_loss_weight": UNIFORM_LOSS_WEIGHT}, indent=1) + "\n")
