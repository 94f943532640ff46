"""LoRA adapters (``model.lora.rank > 0``, through ``peft``) and the merge that publishes them.

Only the adapters train: the base weights are frozen, the optimizer holds the adapters alone
and checkpoints keep only them (the base weights are the model path's, reloaded on resume).
Engines never see an adapter: every published version is the merged full weights under the
base model's own names, so any engine loads it as it loads the base checkpoint.
"""

from __future__ import annotations

import re

import torch

PEFT_PREFIX = "base_model.model."
"""What ``PeftModel`` puts before the base model's own state-dict names."""
_ADAPTER = re.compile(r"^(?P<module>.+)\.lora_(?P<part>[AB])\.[^.]+\.weight$")
_ORIGINAL = ".original_module."
"""peft's frozen copy of a module trained in full (``modules_to_save``): not served."""
_TRAINED_COPY = re.compile(r"\.modules_to_save\.[^.]+\.")
"""peft's trained copy of such a module: served under the module's own name."""


def wrap(model, lora) -> torch.nn.Module:
    """``model`` with adapters of ``lora`` (a ``LoraConfig`` section) on its target modules,
    every other weight frozen. Seeded by the caller: the adapters' initial A is random."""
    from peft import LoraConfig, get_peft_model

    # ensure_weight_tying: a tied input embedding trained in full (``modules_to_save``) trains
    # one copy that the output head shares, as the served model (one tied tensor) does.
    return get_peft_model(model, LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=0.0,
                                            target_modules=list(lora.target_modules),
                                            modules_to_save=list(lora.modules_to_save) or None,
                                            ensure_weight_tying=True))


def base_model(model) -> torch.nn.Module:
    """The HF model inside a ``PeftModel`` (the one whose ``save_pretrained`` writes full weights)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def merged(state: dict, scaling: float) -> dict:
    """The full state dict of a ``PeftModel`` with every adapter merged into its base weight:
    ``W + scaling * B @ A`` under the base model's names (``PEFT_PREFIX`` and ``.base_layer``
    dropped, no ``lora_`` key left); a module trained in full (``modules_to_save``) is its
    trained copy. Tensors of modules without adapters are passed through (tied weights stay
    one tensor)."""
    adapters: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in state.items():
        found = _ADAPTER.match(name)
        if found:
            adapters.setdefault(found["module"], {})[found["part"]] = tensor
    out = {}
    for name, tensor in state.items():
        if _ADAPTER.match(name) or _ORIGINAL in name:
            continue
        name = _TRAINED_COPY.sub(".", name)
        module, _, leaf = name.rpartition(".")
        if module.endswith(".base_layer"):
            owner = module.removesuffix(".base_layer")
            parts = adapters.get(owner)
            if leaf == "weight" and parts:
                delta = parts["B"].float() @ parts["A"].float()
                tensor = (tensor.float() + scaling * delta).to(tensor.dtype)
            name = f"{owner}.{leaf}"
        out[name.removeprefix(PEFT_PREFIX)] = tensor
    return out
