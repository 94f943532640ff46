"""Colocation: launched servers and the trainer on the same GPUs, and the memory split between
them, as data (the plan prints it; the server command lines read the engines' share).

Whether a run colocates (:func:`colocation`): ``run.colocate`` when set; ``auto`` colocates
(resident) only when the node cannot give one ``inference.tp_size`` server and one trainer rank
GPUs of their own, so a one-GPU machine runs without a setting.

The split (:func:`memory_split`) is arithmetic on the model's shape, from its ``config.json``,
and the run's settings. Every figure is an estimate, stated as one in the plan:

- trainer state: float32 master weights, gradients and AdamW's two moments, 16 bytes a trained
  parameter (LoRA: 4 a frozen one, 16 a trained one), 4 more a parameter for the frozen reference
  of ``trainer.kl_coef > 0``;
- trainer activations at one pass's tokens (``trainer.fsdp.max_tokens_per_micro_batch``, else
  ``micro_batch_size`` rows of prompt + ``rollout.max_new_tokens``, the prompt taken as long as
  the completion): with activation checkpointing each layer keeps its input and one layer's
  intermediates live at a time; without it every layer's are; and three ``logit_chunk_rows x
  vocabulary`` float32 buffers of the output layer;
- each process's CUDA context and workspace: :data:`PROCESS_OVERHEAD_GIB`;
- the engine's static memory (what ``--mem-fraction-static`` of the free memory covers): its
  weights in ``model.dtype`` and its KV cache; at least :data:`MIN_KV_TOKENS` tokens, or
  ``rollout.max_concurrent`` sequences of prompt + completion when more, must fit.

resident: the engines take what the trainer's estimate leaves, less both overheads and
:data:`MARGIN_GIB`, as a share of the memory free when they start (they start before the trainer
allocates). swap: the engines release everything while the trainer trains and the trainer moves
its state to the host while they generate, so each side gets the device less the other's
residue (its CUDA context). ``inference.memory_fraction`` overrides the computed share.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from rlorch.config.schema import Colocate, Config, ConfigError, InferenceBackend, TrainerBackend

GIB = 1024 ** 3
PROCESS_OVERHEAD_GIB = 1.5
"""A CUDA process's context, allocator slack and library workspaces (cuBLAS, attention)."""
ENGINE_RUNTIME_GIB = 1.0
"""An engine's memory outside its static pool: activations of a decode batch, sampling buffers."""
MARGIN_GIB = 1.0
"""Left free on a shared device: estimates are estimates, fragmentation is real."""
MIN_KV_TOKENS = 16384
"""The smallest KV cache an engine is worth running with."""
MAX_FRACTION = 0.88
"""The largest static share given to an engine (SGLang's own choice on a large GPU is about it)."""
ASSUMED_GPU_GIB = 80.0
"""The GPU size a plan assumes where none is visible and ``run.gpu_memory_gb`` is empty."""
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def launches_gpu_engines(config: Config) -> bool:
    """Whether the run launches servers that run on GPUs: SGLang's, or `rlorch serve` on cuda."""
    inference = config.inference
    if inference.addresses:
        return False
    return (inference.backend is InferenceBackend.sglang
            or (inference.backend is InferenceBackend.cpu and inference.cpu.device == "cuda"))


def trains_on_gpu(config: Config) -> bool:
    return config.trainer.backend is TrainerBackend.fsdp and config.trainer.fsdp.device != "cpu"


def colocation(config: Config, gpus: int) -> Colocate:
    """``resident``, ``swap`` or ``off`` for a node of ``gpus`` GPUs: ``run.colocate`` as set, and
    ``auto`` resolved — resident where GPU engines and a GPU trainer cannot each get their own
    (fewer than ``inference.tp_size + 1`` GPUs), off otherwise."""
    chosen = config.run.colocate
    if chosen is not Colocate.auto:
        return chosen
    if gpus > 0 and launches_gpu_engines(config) and trains_on_gpu(config) and gpus < config.inference.tp_size + 1:
        if config.inference.distributed:
            raise ConfigError("inference.weight_transfer",
                              f"run.gpus={gpus} colocates the servers and the trainer (run.colocate=auto), and "
                              "distributed cannot run colocated: NCCL refuses two ranks on one GPU; use "
                              "inference.weight_transfer=disk, or more GPUs")
        return Colocate.resident
    return Colocate.off


@dataclass(frozen=True)
class ModelShape:
    """What the memory arithmetic needs of a model's ``config.json``."""

    parameters: int
    layers: int
    hidden: int
    intermediate: int
    vocab: int
    kv_bytes_per_token_element: int
    """KV cache entries per token (keys and values, every layer), to multiply by a dtype's bytes."""

    @classmethod
    def of(cls, hf: dict) -> "ModelShape":
        hidden, layers = int(hf["hidden_size"]), int(hf["num_hidden_layers"])
        intermediate, vocab = int(hf["intermediate_size"]), int(hf["vocab_size"])
        heads = int(hf["num_attention_heads"])
        kv_heads = int(hf.get("num_key_value_heads") or heads)
        head_dim = int(hf.get("head_dim") or hidden // heads)
        attention = hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim + heads * head_dim * hidden
        attention_bias = heads * head_dim + 2 * kv_heads * head_dim    # Qwen2's q, k, v biases
        per_layer = attention + attention_bias + 3 * hidden * intermediate + 2 * hidden
        embeddings = vocab * hidden * (1 if hf.get("tie_word_embeddings") else 2)
        return cls(parameters=layers * per_layer + embeddings + hidden, layers=layers, hidden=hidden,
                   intermediate=intermediate, vocab=vocab, kv_bytes_per_token_element=2 * layers * kv_heads * head_dim)


def model_shape(config: Config) -> Optional[ModelShape]:
    """The run's model's shape; None where its ``config.json`` cannot be read (a plan made on a
    machine without the model)."""
    from rlorch.model import SPECIAL_TOKENS, CHARACTERS, TINY_SHAPE, read_config

    if not config.model.path:
        return ModelShape.of({**TINY_SHAPE, "vocab_size": len(SPECIAL_TOKENS) + len(CHARACTERS),
                              "tie_word_embeddings": True})
    try:
        return ModelShape.of(read_config(Path(config.model.path).expanduser()))
    except (OSError, ValueError, KeyError, TypeError):
        return None


@dataclass(frozen=True)
class MemorySplit:
    """One GPU's memory between the engine and the trainer, in GiB (estimates)."""

    mode: Colocate
    gpu_gib: float
    source: str
    """Where ``gpu_gib`` comes from: ``measured``, ``run.gpu_memory_gb``, or an assumption."""
    trainer_state_gib: float
    trainer_activations_gib: float
    engine_weights_gib: float
    engine_kv_gib: float
    fraction: float
    """The engines' static share of the free memory (``--mem-fraction-static``)."""
    chosen: bool
    """Whether ``fraction`` is ``inference.memory_fraction`` as set (else computed here)."""
    kv_tokens: int

    @property
    def trainer_gib(self) -> float:
        return self.trainer_state_gib + self.trainer_activations_gib + PROCESS_OVERHEAD_GIB

    def describe(self) -> str:
        """The plan's line: mode, the device, each side's estimate and the engines' share."""
        source = self.source
        share = "inference.memory_fraction" if self.chosen else "computed"
        return (f"colocated ({self.mode.value}) on a {self.gpu_gib:.0f} GiB GPU ({source}): trainer ~"
                f"{self.trainer_gib:.1f} GiB (state {self.trainer_state_gib:.1f} + activations "
                f"{self.trainer_activations_gib:.1f} + process {PROCESS_OVERHEAD_GIB:g}); engine static "
                f"{self.fraction:.2f} of free (~{self.fraction * self.gpu_gib:.1f} GiB, {share}: weights "
                f"{self.engine_weights_gib:.1f} + KV {self.engine_kv_gib:.1f} = ~{self.kv_tokens:,} tokens) + runtime "
                f"{ENGINE_RUNTIME_GIB + PROCESS_OVERHEAD_GIB:g}"
                + ("; swap: each side holds the device while the other is off it" if self.mode is Colocate.swap
                   else ""))


def pass_tokens(config: Config) -> int:
    """Tokens of one trainer pass: the token budget, else micro-batch rows of prompt and completion."""
    fsdp = config.trainer.fsdp
    if fsdp.max_tokens_per_micro_batch:
        return fsdp.max_tokens_per_micro_batch
    return fsdp.micro_batch_size * 2 * config.rollout.max_new_tokens


def trainer_estimate(config: Config, shape: ModelShape) -> tuple[float, float]:
    """(state, activations) of one trainer rank in GiB, as the module doc counts them, sharded
    over ``trainer.fsdp.nproc`` ranks."""
    fsdp, ranks = config.trainer.fsdp, max(1, config.trainer.fsdp.nproc or 1)
    lora = config.model.lora.rank
    trained = (2 * lora * shape.hidden * 4 * shape.layers) if lora else shape.parameters
    state = (16 * trained + (4 * shape.parameters if lora else 0)) / ranks
    if config.trainer.kl_coef > 0:
        state += 4 * shape.parameters / ranks
    compute = DTYPE_BYTES.get(config.model.dtype, 4)
    tokens = pass_tokens(config)
    layer = tokens * (10 * shape.hidden + 3 * shape.intermediate) * compute
    kept = tokens * shape.hidden * compute * shape.layers
    activations = (kept + layer) if config.trainer.activation_checkpointing else layer * shape.layers
    activations += 3 * fsdp.logit_chunk_rows * shape.vocab * 4
    return state / GIB, activations / GIB


def memory_split(config: Config, mode: Colocate, gpu: tuple[float, str]) -> Optional[MemorySplit]:
    """The split of a colocated run on a GPU of ``gpu`` = (GiB, where that figure comes from); None for
    ``mode`` off. Raises :class:`ConfigError` naming the keys when the estimate does not fit the
    GPU, or the model's shape cannot be read and ``inference.memory_fraction`` is empty."""
    if not mode.shares:
        return None
    shape = model_shape(config)
    gpu, source = gpu
    chosen = config.inference.memory_fraction
    if shape is None:
        if chosen is None:
            raise ConfigError("inference.memory_fraction", f"the model's config.json ({config.model.path}) cannot be "
                                                           "read to size a colocated split: set the engines' share")
        return MemorySplit(mode, gpu, source, 0.0, 0.0, 0.0, 0.0, chosen, True, 0)
    state, activations = trainer_estimate(config, shape)
    trainer = state + activations + PROCESS_OVERHEAD_GIB
    engine_dtype = DTYPE_BYTES.get(config.model.dtype, 4)
    weights = shape.parameters * engine_dtype / GIB
    kv_per_token = shape.kv_bytes_per_token_element * engine_dtype / GIB
    wanted = max(MIN_KV_TOKENS, config.rollout.max_concurrent * 2 * config.rollout.max_new_tokens)
    engine_outside = ENGINE_RUNTIME_GIB + PROCESS_OVERHEAD_GIB
    if mode is Colocate.resident:
        room = gpu - trainer - engine_outside - MARGIN_GIB
    else:
        room = gpu - PROCESS_OVERHEAD_GIB - engine_outside - MARGIN_GIB
        if trainer > gpu - PROCESS_OVERHEAD_GIB - MARGIN_GIB:
            raise ConfigError("run.colocate", f"swap: the trainer's estimate ({trainer:.1f} GiB) exceeds the "
                                              f"{gpu:.0f} GiB GPU even with the engines released; use LoRA "
                                              "(model.lora.rank) or a smaller trainer.fsdp.max_tokens_per_micro_batch")
    fraction = chosen if chosen is not None else min(MAX_FRACTION, max(0.0, room) / gpu)
    kv = fraction * gpu - weights
    if chosen is None and kv < wanted * kv_per_token:
        need = weights + wanted * kv_per_token
        swap_fits = trainer <= gpu - PROCESS_OVERHEAD_GIB - MARGIN_GIB    # swap's own first check
        advice = ("use run.colocate=swap (rollout.max_staleness=0), LoRA (model.lora.rank) or a smaller "
                  "trainer.fsdp.max_tokens_per_micro_batch" if mode is Colocate.resident and swap_fits
                  else "use LoRA (model.lora.rank), a smaller trainer.fsdp.max_tokens_per_micro_batch or a GPU "
                       "with more memory (the trainer alone does not fit it, so swap would not either)"
                  if mode is Colocate.resident
                  else "use LoRA (model.lora.rank) or a GPU with more memory")
        raise ConfigError("run.colocate", f"{mode.value} does not fit a {gpu:.0f} GiB GPU: the trainer needs "
                                          f"~{trainer:.1f} GiB and the engine ~{need + engine_outside:.1f} GiB "
                                          f"({wanted:,} KV tokens); {advice}")
    return MemorySplit(mode, gpu, source, state, activations, weights, max(0.0, kv), round(fraction, 3),
                       chosen is not None, int(max(0.0, kv) / kv_per_token) if kv_per_token else 0)
