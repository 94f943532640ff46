"""Loading a sharded model once: every rank reads only its own rows of each tensor.

A sharded model (FSDP2 units, :func:`rlorch.trainer.fsdp.uses_fsdp`) is built on the meta device
(no memory), sharded, given empty storage for its own shards on its device, and filled from the
checkpoint's safetensors files: each rank reads the rows of dimension 0 its shard holds, through
safetensors' memory-mapped slices. No rank ever holds the whole model in host memory, where
loading it whole on every rank would cost the world size times the model (a 7B model on 8 ranks:
about 244 GB of host memory, twice that with a reference model).

Buffers that checkpoints do not hold (non-persistent: a rotary embedding's inverse frequencies)
are rebuilt from the model's config; a model whose such buffers cannot be rebuilt is loaded
whole (:func:`meta_skeleton` returns None).
"""

from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path
from typing import Optional

import torch

INDEX_FILE = "model.safetensors.index.json"


def meta_skeleton(path: Path, *, native: bool) -> Optional[torch.nn.Module]:
    """The model of the HF directory ``path`` on the meta device (float32, nothing allocated), or
    None when its non-persistent buffers could not be rebuilt after materialisation."""
    path = Path(path)
    if native:
        from rlorch.model import read_config
        from rlorch.qwen2 import GENERATION_CONFIG_FILE, Qwen2ForCausalLM

        generation = path / GENERATION_CONFIG_FILE
        with torch.device("meta"):
            return Qwen2ForCausalLM(read_config(path), json.loads(generation.read_text()) if generation.is_file() else None)
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=torch.float32)
    return model if all(_rebuildable(module) for module in _with_transient_buffers(model)) else None


def _with_transient_buffers(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [module for module in model.modules() if module._non_persistent_buffers_set]


def _rebuildable(module: torch.nn.Module) -> bool:
    return type(module).__name__.endswith("RotaryEmbedding") and hasattr(module, "config")


def materialise(model: torch.nn.Module, path: Path, device: torch.device) -> torch.nn.Module:
    """Give a sharded meta ``model`` storage on ``device`` for its own shards and fill them from
    the HF directory ``path`` (each tensor converted to the parameter's dtype); rebuild its
    non-persistent buffers. A tensor the files lack (other than a tied output layer) or of
    another shape is an error naming it."""
    model.to_empty(device=device)
    files = _files_by_name(Path(path))
    state = model.state_dict(keep_vars=True)
    filled: set[int] = set()
    with ExitStack() as stack:
        from safetensors import safe_open

        handles = {file: stack.enter_context(safe_open(str(file), framework="pt", device="cpu"))
                   for file in set(files.values())}
        for name, tensor in state.items():
            if id(tensor) in filled:
                continue  # a tied tensor, filled under its other name
            if name not in files:
                if _tied_output(model, name):
                    continue
                raise ValueError(f"{path}: no tensor {name!r} in its safetensors files")
            _fill(tensor, handles[files[name]].get_slice(name), name, path)
            filled.add(id(tensor))
    for module in _with_transient_buffers(model):
        rebuilt = type(module)(module.config).to(device)
        for name in module._non_persistent_buffers_set:
            setattr(module, name, getattr(rebuilt, name))
    return model


def _fill(tensor: torch.Tensor, source, name: str, path: Path) -> None:
    """Copy this rank's rows of ``source`` (a safetensors slice) into ``tensor`` (a DTensor
    sharded on dimension 0, or a plain tensor)."""
    shape = list(source.get_shape())
    if list(tensor.shape) != shape:
        raise ValueError(f"{path}: {name!r} is {shape} in the files, {list(tensor.shape)} in the model")
    local, offset = tensor.detach(), 0
    if hasattr(local, "to_local"):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        _, offsets = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
        local, offset = local.to_local(), offsets[0] if offsets else 0
    if local.numel() == 0:
        return
    rows = source[offset:offset + local.shape[0]] if local.dim() else source[:]
    with torch.no_grad():
        local.copy_(rows.reshape(local.shape))


def _tied_output(model: torch.nn.Module, name: str) -> bool:
    config = getattr(model, "config", None)
    return name.endswith("lm_head.weight") and bool(getattr(config, "tie_word_embeddings", False))


def _files_by_name(path: Path) -> dict[str, Path]:
    """Each tensor's safetensors file: the index's weight map, else every file's own names."""
    index = path / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: path / file for name, file in weight_map.items()}
    from safetensors import safe_open

    found = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            found.update({name: file for name in handle.keys()})
    if not found:
        raise ValueError(f"{path}: no *.safetensors files")
    return found
