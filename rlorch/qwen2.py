"""Qwen2 causal LMs in plain torch: the tiny default model's architecture (and Qwen2/Qwen2.5
checkpoints'), under HF's parameter names, loaded from and written to HF directories.

It computes what transformers' ``Qwen2ForCausalLM`` computes, the same operations in the same
order: over a whole sequence its float32 logits equal transformers' bit for bit, and decoding
through its KV cache they agree within 1e-5 (tested). A checkpoint moves between it,
transformers and SGLang unchanged. It exists for start-up: importing transformers' modelling
code costs seconds of CPU on a small machine before the first step (more than torch itself),
and this module imports nothing but torch and safetensors. ``model.implementation`` chooses it
(:func:`rlorch.model.uses_native`); :func:`rlorch.model.unsupported` names what it does not
reproduce (another architecture, scaled RoPE, sliding-window attention), and such a model goes
through transformers.

The forward takes HF's keyword arguments as rlorch calls them: ``input_ids``, optionally
``attention_mask`` (1 = a real token; left padding in the engine), ``position_ids``, a
:class:`KVCache` (``cache`` or ``past_key_values``) and ``logits_to_keep``; it returns a
:class:`CausalLMOutput`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from rlorch.model import CONFIG_FILE, read_config

GENERATION_CONFIG_FILE = "generation_config.json"


class KVCache:
    """Keys and values per layer, ``(batch, kv_heads, length, head_dim)``, laid out as
    transformers' ``DynamicCache`` layers (``layers[i].keys`` / ``.values``), so the engine
    drops and joins rows of either the same way."""

    joinable = True
    """Every layer is full attention: rows may be joined (left-padded) between steps."""

    def __init__(self, num_layers: int) -> None:
        self.layers = [SimpleNamespace(keys=None, values=None) for _ in range(num_layers)]

    def length(self) -> int:
        keys = self.layers[0].keys
        return 0 if keys is None else keys.shape[-2]

    def update(self, index: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        layer = self.layers[index]
        if layer.keys is not None:
            keys, values = torch.cat([layer.keys, keys], dim=-2), torch.cat([layer.values, values], dim=-2)
        layer.keys, layer.values = keys, values
        return keys, values

    def batch_select_indices(self, index: torch.Tensor) -> None:
        for layer in self.layers:
            layer.keys, layer.values = layer.keys[index], layer.values[index]


@dataclass
class CausalLMOutput:
    """What the forward returns (a dataclass: FSDP2's mixed precision casts the tensors of one)."""

    logits: torch.Tensor


class _Linear(nn.Linear):
    """Left uninitialised: every weight comes from the checkpoint (:meth:`Qwen2ForCausalLM.from_pretrained`
    checks that each is there), and initialising a large one costs seconds on a CPU."""

    def reset_parameters(self) -> None:
        pass


class _Embedding(nn.Embedding):
    """Left uninitialised, as :class:`_Linear`."""

    def reset_parameters(self) -> None:
        pass


class Qwen2RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.variance_epsilon = eps

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        dtype = hidden.dtype
        hidden = hidden.to(torch.float32)
        hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * hidden.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


class Qwen2Attention(nn.Module):
    def __init__(self, config: dict, index: int) -> None:
        super().__init__()
        hidden = config["hidden_size"]
        self.index = index
        self.heads, self.kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
        self.head_dim = config.get("head_dim") or hidden // self.heads
        self.q_proj = _Linear(hidden, self.heads * self.head_dim, bias=True)
        self.k_proj = _Linear(hidden, self.kv_heads * self.head_dim, bias=True)
        self.v_proj = _Linear(hidden, self.kv_heads * self.head_dim, bias=True)
        self.o_proj = _Linear(self.heads * self.head_dim, hidden, bias=False)

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: Optional[torch.Tensor], cache: Optional[KVCache],
                packing: Optional["Packing"] = None) -> torch.Tensor:
        batch, length, _ = hidden.shape
        shape = (batch, length, -1, self.head_dim)
        query = self.q_proj(hidden).view(shape).transpose(1, 2)
        key = self.k_proj(hidden).view(shape).transpose(1, 2)
        value = self.v_proj(hidden).view(shape).transpose(1, 2)
        query = query * cos + _rotate_half(query) * sin
        key = key * cos + _rotate_half(key) * sin
        if cache is not None:
            key, value = cache.update(self.index, key, value)
        groups = self.heads // self.kv_heads
        if groups > 1:
            key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
        if packing is not None:
            return self.o_proj(packing.attend(query, key, value, self.head_dim ** -0.5))
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask,
                                             is_causal=mask is None and length > 1, scale=self.head_dim ** -0.5)
        return self.o_proj(out.transpose(1, 2).reshape(batch, length, -1))


class Qwen2MLP(nn.Module):
    def __init__(self, config: dict) -> None:
        super().__init__()
        hidden, inner = config["hidden_size"], config["intermediate_size"]
        self.gate_proj = _Linear(hidden, inner, bias=False)
        self.up_proj = _Linear(hidden, inner, bias=False)
        self.down_proj = _Linear(inner, hidden, bias=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(hidden)) * self.up_proj(hidden))


class Qwen2DecoderLayer(nn.Module):
    def __init__(self, config: dict, index: int) -> None:
        super().__init__()
        self.self_attn = Qwen2Attention(config, index)
        self.mlp = Qwen2MLP(config)
        self.input_layernorm = Qwen2RMSNorm(config["hidden_size"], config["rms_norm_eps"])
        self.post_attention_layernorm = Qwen2RMSNorm(config["hidden_size"], config["rms_norm_eps"])

    def forward(self, hidden, cos, sin, mask, cache, packing=None):
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), cos, sin, mask, cache, packing)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class Qwen2Model(nn.Module):
    def __init__(self, config: dict) -> None:
        super().__init__()
        self.embed_tokens = _Embedding(config["vocab_size"], config["hidden_size"])
        self.layers = nn.ModuleList(Qwen2DecoderLayer(config, index)
                                    for index in range(config["num_hidden_layers"]))
        self.norm = Qwen2RMSNorm(config["hidden_size"], config["rms_norm_eps"])


class Qwen2ForCausalLM(nn.Module):
    _no_split_modules = ["Qwen2DecoderLayer"]
    """The repeated block: one FSDP unit, one activation-checkpointed region each (as HF's)."""
    accepts_packing = True
    """The forward takes a :class:`Packing` (``packing=``) for a row laid out by its caller."""

    def __init__(self, config: dict, generation_config: Optional[dict] = None) -> None:
        super().__init__()
        self.raw_config = dict(config)
        self.config = SimpleNamespace(**{"pad_token_id": None, "eos_token_id": None, **config})
        self.generation_config = SimpleNamespace(**(generation_config or {}))
        self.raw_generation_config = generation_config
        self.model = Qwen2Model(config)
        self.lm_head = _Linear(config["hidden_size"], config["vocab_size"], bias=False)
        self.tied = bool(config.get("tie_word_embeddings", False))
        if self.tied:
            self.lm_head.weight = self.model.embed_tokens.weight
        rope = config.get("rope_parameters") or {}
        self.rope_theta = float(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
        self.head_dim = self.model.layers[0].self_attn.head_dim

    @classmethod
    def from_pretrained(cls, path: Path, dtype: torch.dtype = torch.float32) -> "Qwen2ForCausalLM":
        """The model of an HF directory (every safetensors file in it), in ``dtype``; a missing,
        unknown or misshapen tensor is an error naming it."""
        from safetensors.torch import load_file

        path = Path(path)
        generation = path / GENERATION_CONFIG_FILE
        # Built on the CPU, not the meta device: a meta module's construction imports torch's
        # reference operators (seconds), and its layers are left uninitialised anyway.
        model = cls(read_config(path), json.loads(generation.read_text()) if generation.is_file() else None)
        tensors: dict[str, torch.Tensor] = {}
        for file in sorted(path.glob("*.safetensors")):
            tensors.update(load_file(str(file)))
        if model.tied:
            tensors.pop("lm_head.weight", None)
        expected = {name: tuple(param.shape) for name, param in model.named_parameters()}
        problems = sorted(set(expected) ^ set(tensors)) + sorted(
            name for name in set(expected) & set(tensors) if tuple(tensors[name].shape) != expected[name])
        if problems:
            raise ValueError(f"{path}: the weights do not match its config.json at {problems[:5]}")
        model.load_state_dict({name: tensor.to(dtype) for name, tensor in tensors.items()},
                              strict=False, assign=True)
        if model.tied:
            model.lm_head.weight = model.model.embed_tokens.weight
        return model

    def save_pretrained(self, target: Path, state_dict: Optional[dict] = None, **_: object) -> None:
        """An HF directory: this model's config (and generation config) and one safetensors
        file of ``state_dict`` (default: the model's), the tied head left out as transformers
        writes it."""
        from safetensors.torch import save_file

        target = Path(target)
        target.mkdir(parents=True, exist_ok=True)
        state = dict(self.state_dict() if state_dict is None else state_dict)
        if self.tied:
            state.pop("lm_head.weight", None)
        (target / CONFIG_FILE).write_text(json.dumps(self.raw_config, indent=2, sort_keys=True) + "\n")
        if self.raw_generation_config is not None:
            (target / GENERATION_CONFIG_FILE).write_text(
                json.dumps(self.raw_generation_config, indent=2, sort_keys=True) + "\n")
        save_file({name: tensor.contiguous() for name, tensor in state.items()}, str(target / "model.safetensors"),
                  metadata={"format": "pt"})

    def new_cache(self) -> KVCache:
        return KVCache(len(self.model.layers))

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin, ``(batch, 1, length, head_dim)``, computed in float32 as HF does."""
        device = positions.device
        inv_freq = 1.0 / (self.rope_theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.int64, device=device)
                                              .float() / self.head_dim))
        freqs = positions[..., None].float() * inv_freq
        angles = torch.cat((freqs, freqs), dim=-1)[:, None]
        return angles.cos().to(dtype), angles.sin().to(dtype)

    def forward(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                position_ids: Optional[torch.Tensor] = None, cache: Optional[KVCache] = None,
                past_key_values: Optional[KVCache] = None, logits_to_keep: int = 0,
                packing: Optional["Packing"] = None, **_: object):
        """``packing``: how one row's positions attend (else found from ``position_ids``)."""
        cache = cache if cache is not None else past_key_values
        past = cache.length() if cache is not None else 0
        batch, length = input_ids.shape
        hidden = self.model.embed_tokens(input_ids)
        if position_ids is None:
            position_ids = torch.arange(past, past + length, device=input_ids.device).expand(batch, length)
        cos, sin = self._rope(position_ids, hidden.dtype)
        mask = None
        if attention_mask is not None or past:
            mask = _attention_mask(attention_mask, batch, past, length, input_ids.device)
        elif batch == 1 and cache is None and packing is None:
            packing = Packing.of(position_ids[0])
        for layer in self.model.layers:
            hidden = layer(hidden, cos, sin, mask, cache, packing)
        hidden = self.model.norm(hidden)
        if logits_to_keep:
            hidden = hidden[:, -logits_to_keep:]
        return CausalLMOutput(logits=self.lm_head(hidden))


DENSE_ROW_POSITIONS = 192
"""Rows of at most this many positions attend in one call over the whole row under a mask of
who sees whom, instead of gathered into one padded row per sequence. Small rows are all
per-row overhead: on one CPU thread, 64 sequences packed into 168 positions took 0.66 ms
(forward and backward, 4 heads of 16) in one masked call against 1.12 ms gathered, gathers
included; at 224 positions the masked call took 1.04 ms against 0.80 ms, its cost growing with
the square of the row."""


class Packing:
    """Sequences back to back in one row, found as transformers finds them: ``position_ids``
    restart at 0 where a sequence starts (or laid out by the caller, as the trainer's shared
    prompts are, where a sequence's slots may name positions it shares with others). Attention
    stays within each sequence. A row of more than :data:`DENSE_ROW_POSITIONS` positions has
    its queries, keys and values laid out one sequence a row, right-padded, for one causal
    attention call (a real query never sees the padding after it), and the real positions read
    back into the row; a shorter one attends in place under :meth:`visible`. Only attention
    sees padding; every other layer runs on the row's real tokens alone."""

    def __init__(self, gather: torch.Tensor, scatter: torch.Tensor, lengths: torch.Tensor) -> None:
        self.gather = gather
        """``[sequences, longest]``: the row position of each padded slot (padding reads position 0)."""
        self.scatter = scatter
        """``[row length]``: each row position's slot in the flattened padded layout."""
        self.lengths = lengths
        """``[sequences]``: the real (leading) slots of each sequence's padded row."""
        self._visible: Optional[torch.Tensor] = None

    @classmethod
    def of(cls, position_ids: torch.Tensor) -> Optional["Packing"]:
        """The packing of a row's ``position_ids`` (1-D), or None when it holds one sequence."""
        starts = torch.nonzero(position_ids == 0).flatten()
        if starts.numel() <= 1:
            return None
        ends = torch.cat([starts[1:], starts.new_tensor([position_ids.numel()])])
        lengths = ends - starts
        longest = int(lengths.max())
        offsets = torch.arange(longest, device=position_ids.device)
        gather = torch.where(offsets < lengths[:, None], starts[:, None] + offsets, 0)
        sequence = torch.cumsum((position_ids == 0).long(), 0) - 1
        return cls(gather, sequence * longest + position_ids, lengths)

    @property
    def positions(self) -> int:
        return self.scatter.numel()

    def visible(self) -> torch.Tensor:
        """``[positions, positions]`` boolean: whether the row position of each query may see that
        of each key. A position shared by several sequences (a prompt) has the same slot and
        the same slots before it in each, so every sequence that holds it agrees on its row."""
        if self._visible is None:
            slots = torch.arange(self.gather.shape[1], device=self.gather.device)
            real = slots < self.lengths[:, None]
            sees = real[:, :, None] & real[:, None, :] & (slots[:, None] >= slots[None, :])
            visible = torch.zeros(self.positions, self.positions, dtype=torch.bool, device=self.gather.device)
            visible[self.gather[:, :, None].expand_as(sees)[sees], self.gather[:, None, :].expand_as(sees)[sees]] = True
            self._visible = visible
        return self._visible

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float) -> torch.Tensor:
        """Causal attention of ``[1, heads, length, head_dim]`` tensors within each sequence;
        returns ``[1, length, heads * head_dim]``."""
        heads, head_dim = query.shape[1], query.shape[3]
        if self.positions <= DENSE_ROW_POSITIONS:
            out = F.scaled_dot_product_attention(query, key, value, attn_mask=self.visible(), scale=scale)
            return out.transpose(1, 2).reshape(1, self.positions, heads * head_dim)
        slots = self.gather.flatten()

        def laid_out(tensor: torch.Tensor) -> torch.Tensor:  # [sequences, heads, longest, head_dim]
            return tensor[0].index_select(1, slots).view(heads, *self.gather.shape, head_dim).transpose(0, 1)

        out = F.scaled_dot_product_attention(laid_out(query), laid_out(key), laid_out(value), is_causal=True,
                                             scale=scale)
        flat = out.transpose(1, 2).reshape(-1, heads * head_dim)
        return flat.index_select(0, self.scatter).unsqueeze(0)


def _attention_mask(attention_mask: Optional[torch.Tensor], batch: int, past: int, length: int,
                    device: torch.device) -> torch.Tensor:
    """Boolean ``(batch, 1, length, past + length)``: causal, and never to a padding key. A query
    always sees its own key, so a padding row attends to something (its output is never read)
    instead of producing NaN, which would reach real rows through the values."""
    total = past + length
    keys = torch.arange(total, device=device)
    queries = torch.arange(past, total, device=device)
    allowed = (keys[None, :] <= queries[:, None])[None, None]
    if attention_mask is not None:
        allowed = allowed & attention_mask[:, None, None, :total].bool()
    return allowed | (keys[None, :] == queries[:, None])[None, None]
