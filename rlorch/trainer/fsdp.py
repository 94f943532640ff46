"""The FSDP2 trainer worker: ``torchrun ... -m rlorch.trainer.fsdp --run-dir RUN_DIR [--resume CKPT]``.

It talks to the orchestrator only through the run directory (see :mod:`rlorch.rundir.layout`): it reads
batch N from ``rollouts/step_N.safetensors`` (or ``.jsonl``), takes one optimizer step, appends a line to
``trainer/metrics.jsonl``, publishes version N into ``weights/`` and writes full checkpoints.

Invariant: version N is the weights after exactly the batches 1..N, each trained once.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.distributed as dist

from rlorch.config.schema import Colocate, Proximal
from rlorch.lifecycle import orchestrator_pid, watch_parents
from rlorch.model import resolve_model_path
from rlorch.rundir.layout import PUBLISHED, CheckpointDir, RunDir, load_config, write_json_atomic
from rlorch.trainer import checkpoint, lora
from rlorch.trainer.broadcast import plan
from rlorch.trainer import head, loading, offload
from rlorch.trainer.batch import BatchError, MicroBatch, minibatch_slices, rank_share, read_batch
from rlorch.trainer.checkpoint import CheckpointError
from rlorch.trainer.loss import LossStats, MismatchStats, aggregate, loglinear_proximal, policy_loss, reference_kl
from rlorch.trainer.optimizer import make_optimizer
from rlorch.trainer.handoff import publish_asked, publish_on_request, publish_version, wait_handed_off, write_weights
from rlorch.trainer.publish import HFWriter, TokenizerFiles, clear_staging, discard_newer
from rlorch.trainer.ranks import all_reduce, from_rank0, say
from rlorch.trainer.worker import Worker
from rlorch.trainer.schedule import lr_factor

POLL_SECONDS = 0.01
"""Between looks for the next batch when the ranks must agree on what they saw (a collective
per look)."""
POLL_SECONDS_ALONE = 0.001
"""Between looks for the next batch on a single rank: a look is one stat, and the wait for a
batch that is already there is time the step loses."""
MAX_NONFINITE_STEPS = 3
"""Consecutive steps whose every update had a non-finite gradient before the trainer gives up."""


class NonFiniteError(RuntimeError):
    """Training produced non-finite numbers it cannot skip; the message names the step."""


def _setup_distributed(device_setting: str):
    use_cuda = device_setting == "cuda" or (device_setting == "auto" and torch.cuda.is_available())
    if use_cuda:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if "RANK" in os.environ:
        dist.init_process_group(backend="nccl" if use_cuda else "gloo")
    else:  # started without torchrun: a group of one
        dist.init_process_group(backend="nccl" if use_cuda else "gloo", store=dist.HashStore(), rank=0,
                                world_size=1)
    return device


def _decoder_layers(model) -> list:
    """The repeated blocks HF marks as not-to-split (``_no_split_modules``): one FSDP unit each
    (found by class, also once FSDP2 has subclassed them)."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    return [module for module in model.modules() if any(cls.__name__ in names for cls in type(module).__mro__)]


def checkpoint_activations(model) -> None:
    """Wrap each decoder layer's forward in a non-reentrant ``torch.utils.checkpoint``: its
    activations are recomputed in the backward pass instead of kept. The layer stays the same
    module (parameter names, state dicts and checkpoints are unchanged); applied before
    ``fully_shard`` so the FSDP unit gathers the layer's parameters around the recomputation
    too. Without gradients (the proximal pass) it runs the plain forward."""
    from torch.utils.checkpoint import checkpoint

    layers = _decoder_layers(model)
    if not layers:
        raise ValueError(f"trainer.activation_checkpointing: {type(model).__name__} names no decoder "
                         f"layer (_no_split_modules) to wrap")
    for layer in layers:
        def forward(*args, _forward=layer.forward, **kwargs):
            if not torch.is_grad_enabled():
                return _forward(*args, **kwargs)
            return checkpoint(_forward, *args, use_reentrant=False, **kwargs)

        layer.forward = forward


def mixed_precision(dtype: str):
    """FSDP2's policy for ``model.dtype`` below float32: parameters are all-gathered in that
    dtype for the forward and backward, gradients are reduced in float32 into the float32
    sharded parameters (the master weights, which the optimizer and its state keep in float32),
    and the logits come out in float32. None for float32: no policy, nothing cast."""
    if dtype == "float32":
        return None
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=getattr(torch, dtype), reduce_dtype=torch.float32,
                                output_dtype=torch.float32)


def uses_fsdp(world: int, dtype: str) -> bool:
    """Whether the model becomes FSDP2 units. One float32 rank has nothing to shard: FSDP2's
    per-parameter DTensor dispatch would cost about a quarter of a tiny model's CPU step for
    nothing. Mixed precision is FSDP2's even on one rank. DCP checkpoints reshard on load, so a
    run may resume under another world size either way."""
    return world > 1 or mixed_precision(dtype) is not None


def place(model, device, dtype: str, world: int):
    """``model`` with each decoder layer and the root as FSDP2 units over ``world`` ranks when
    :func:`uses_fsdp` says so, under ``model.dtype``'s mixed-precision policy (FSDP2 moves the
    shards to the mesh's device); otherwise (one float32 rank) the plain module, moved to
    ``device``."""
    if not uses_fsdp(world, dtype):
        return model.to(device)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device.type, (world,))
    policy = mixed_precision(dtype) or MixedPrecisionPolicy()
    # Only the root casts its output (the logits): a layer's stays in the compute dtype
    # for the next one (and for the final norm and head, which the root computes).
    inner = dataclasses.replace(policy, output_dtype=None)
    for layer in _decoder_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=inner)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def build_model(config, path, device, world: int, *, reference: bool = False) -> torch.nn.Module:
    """The policy, or with ``reference`` the frozen reference policy, loaded and placed for
    training over ``world`` ranks, its output layer scoring tokens in chunks (:mod:`.head`).

    The policy keeps float32 master weights whatever ``model.dtype`` is (mixed precision
    computes in it), with LoRA adapters when ``model.lora.rank > 0`` and activation checkpointing
    as configured. The reference is kept in ``model.dtype`` itself: FSDP would compute in it
    anyway, so its logprobs are the same for half the memory. Either is rlorch's own Qwen2 or
    transformers' as ``model.implementation`` resolves (:func:`rlorch.model.uses_native`).
    Sharded without LoRA, it is loaded once: built on the meta device and sharded, each rank
    reads only its own rows of the checkpoint (:mod:`rlorch.trainer.loading`)."""
    from rlorch.model import uses_native

    placed_as = "float32" if reference else config.model.dtype
    weights = getattr(torch, config.model.dtype) if reference else torch.float32
    lora_rank = 0 if reference else config.model.lora.rank
    native = uses_native(config.model.implementation, Path(path), lora=bool(config.model.lora.rank), device=device.type)
    skeleton = (loading.meta_skeleton(path, native=native)
                if uses_fsdp(world, placed_as) and not lora_rank else None)
    model = head.install(skeleton.to(weights) if skeleton is not None else _from_pretrained(path, native, weights))
    if reference:
        model.requires_grad_(False)
        model.eval()
    else:
        if lora_rank:
            model = lora.wrap(model, config.model.lora)
        if config.trainer.activation_checkpointing:
            checkpoint_activations(model)
    model = place(model, device, placed_as, world)
    return loading.materialise(model, path, device) if skeleton is not None else model


def build_reference(config, path, device, world: int = 1) -> Optional[torch.nn.Module]:
    """The reference policy for ``trainer.kl_coef > 0``: the initial weights, loaded from the
    model path (so a resumed run gets the very same ones without checkpointing them), frozen,
    sharded like the policy and never published. None at 0: no copy is kept."""
    return build_model(config, path, device, world, reference=True) if config.trainer.kl_coef else None


def _from_pretrained(path, native: bool, dtype: torch.dtype) -> torch.nn.Module:
    if native:
        from rlorch.qwen2 import Qwen2ForCausalLM

        return Qwen2ForCausalLM.from_pretrained(Path(path), dtype=dtype)
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype)


def build_worker(config, run, device, resume: Optional[Path]) -> Worker:
    torch.manual_seed(config.run.seed)
    rank, world = dist.get_rank(), dist.get_world_size()
    path = resolve_model_path(config.model.path) if rank == 0 else None
    path = from_rank0(path)
    model = build_model(config, path, device, world)
    sharded = uses_fsdp(world, config.model.dtype)
    # Frozen weights (LoRA's base) get no optimizer state.
    optimizer = make_optimizer((p for p in model.parameters() if p.requires_grad), lr=config.trainer.lr,
                               weight_decay=config.trainer.weight_decay, sharded=sharded)
    tokenizer = TokenizerFiles(path) if rank == 0 else None
    worker = Worker(config, run, model, optimizer, tokenizer, HFWriter(lora.base_model(model), tokenizer), device,
                    rank, world, sharded=sharded,
                    reference=build_reference(config, path, device, world))
    if resume is not None:
        worker.step, optimizer_steps = checkpoint.load(resume, model, optimizer,
                                                       trainable_only=bool(config.model.lora.rank))
        _refuse_nonfinite_checkpoint(worker, resume)
        # An older checkpoint lacks the count: every batch before it took the configured minibatches.
        worker.optimizer_steps = (optimizer_steps if optimizer_steps is not None
                                  else worker.step * config.trainer.minibatches)
        worker.saved.add(worker.step)
    return worker


def wait_for_batch(run, step: int, fmt: str, device, asked: Callable[[], bool] = lambda: False,
                   answer: Callable[[], None] = lambda: None) -> bool:
    """Block until batch ``step`` exists (True) or STOP appears first (False); meanwhile, each
    time ``asked()`` holds on any rank, every rank calls ``answer()`` (a collective).

    A batch already on disk is trained before STOP is honoured: the orchestrator persisted it as
    trained data when it shipped it.
    """
    batch = run.batch(step, fmt)
    pause = POLL_SECONDS_ALONE if dist.get_world_size() == 1 else POLL_SECONDS
    while True:
        # Every rank must take the same branch: any rank seeing a file decides for all.
        has_batch, stop, request = all_reduce([float(batch.exists()), float(run.stop_file.exists()),
                                                float(asked())], device, "max")
        if has_batch:
            while not batch.exists():
                time.sleep(pause)
            return True
        if stop:
            return False
        if request:
            answer()
        time.sleep(pause)


def train_step(worker: Worker, step: int) -> dict:
    """Train on batch ``step``: ``trainer.minibatches`` optimizer steps; returns its metrics line
    (global over ranks).

    The proximal logprobs are those of the weights before the batch's first update. The first
    minibatch's training forward runs on exactly those weights, so its own detached logprobs are
    its proximal ones and it measures the training-inference mismatch and the entropy as it
    goes. Later minibatches get theirs from a forward pass without gradients before the first
    update, or, under trainer.proximal=loglinear, estimated in their own training forward
    (:func:`_recomputes_proximal` says which).
    """

    started = time.perf_counter()
    trainer, model = worker.config.trainer, worker.model
    sequences = read_batch(worker.run.batch(step, worker.config.run.batch_format), model.config.vocab_size)
    pad_id = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    plan = []
    for part in minibatch_slices(len(sequences), trainer.minibatches):
        chunk = sequences[part]
        tokens = sum(sum(s.loss_mask) for s in chunk)
        plan.append((rank_share(chunk, worker.rank, worker.world, max_tokens=trainer.fsdp.max_tokens_per_micro_batch,
                                size=trainer.fsdp.micro_batch_size, pad_id=pad_id),
                     Counts(tokens, len(chunk))))
    model.train()
    probe = ProximalProbe(mismatch=MismatchStats(), version=step - 1)
    later_micros = [micro for micros, _ in plan[1:] for micro in micros]
    recompute = len(plan) > 1 and _recomputes_proximal(worker, later_micros)
    later = _proximal_pass(worker, later_micros, probe) if recompute else []
    loss_sum, stats, norms, skipped = 0.0, LossStats(), [], 0
    for index, (micros, counts) in enumerate(plan):
        worker.optimizer.zero_grad(set_to_none=True)
        proximal = [later.pop(0) for _ in micros] if index and recompute else [None] * len(micros)
        # The weights of update ``index`` are that many minibatches past the proximal version.
        estimate_at = probe.version + index / len(plan) if index and not recompute else None
        part_loss, part_stats = _accumulate(worker, micros, counts, proximal, probe, estimate_at)
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), trainer.max_grad_norm)
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
        norms.append(float(grad_norm))
        lr = set_lr(worker)
        worker.optimizer_steps += 1
        if not math.isfinite(float(grad_norm)):
            skipped += 1
        elif counts.tokens > 0:
            worker.optimizer.step()
        loss_sum += part_loss / len(plan)
        stats = stats.merge(part_stats)
    positions = float(sum(_positions_run(worker, micro) for micros, _ in plan for micro in micros))
    summed = all_reduce(stats.as_tensor().tolist() + [loss_sum, positions] + probe.sums(), worker.device)
    maxima = all_reduce([stats.ratio_max, probe.mismatch.max_abs], worker.device, "max")
    width = len(stats.as_tensor())
    merged = type(stats).from_tensor(torch.tensor(summed[:width]), maxima[0])
    rewards = [s.reward for s in sequences]
    # ref_kl only with a reference: its absence says no reference was kept.
    reference = {"ref_kl": merged.ref_kl_sum / max(merged.tokens, 1.0)} if worker.reference is not None else {}
    return {"step": step, "loss": summed[width], "grad_norm": sum(norms) / len(norms), **merged.summary(),
            **reference, **probe.summary(summed[width + 2:], maxima[1]), "minibatches": len(plan), "proximal_pass": recompute,
            "skipped_updates": skipped, "lr": lr,
            "tokens": int(sum(c.tokens for _, c in plan)), "sequences": len(sequences),
            "positions": int(summed[width + 1]),
            "reward_mean": sum(rewards) / len(rewards) if rewards else 0.0,
            "step_s": time.perf_counter() - started}


def set_lr(worker: Worker) -> float:
    """Set (and return) the learning rate of the update at ``worker.optimizer_steps``."""
    trainer = worker.config.trainer
    lr = trainer.lr * lr_factor(worker.optimizer_steps, schedule=trainer.lr_schedule.value,
                                warmup_steps=trainer.warmup_steps, min_lr_ratio=trainer.min_lr_ratio,
                                total_steps=worker.config.train.steps * trainer.minibatches)
    for group in worker.optimizer.param_groups:
        group["lr"] = lr
    return lr


@dataclass
class ProximalProbe:
    """What the weights before the batch's first update measured over the micro-batches they
    scored: the training-inference mismatch on tokens of ``version`` (those weights); and the
    entropy over every micro-batch, of whichever weights scored it (a later minibatch whose
    proximal pass is skipped is scored by its own)."""

    mismatch: MismatchStats
    version: int
    entropy_sum: float = 0.0
    tokens: float = 0.0

    def add(self, worker: Worker, micro, logp: torch.Tensor, entropy: torch.Tensor) -> None:
        """Record one micro-batch's logprobs and entropies under the proximal weights. Tokens
        stamped with ``version`` were sampled by the engines from these very weights: their
        logprob difference is the training-inference mismatch."""
        mask = micro.mask.to(worker.device)
        age0 = (mask > 0) & (micro.versions.to(worker.device) == self.version)
        self.mismatch.add(logp, micro.behaviour.to(worker.device), age0)
        self.add_entropy(worker, micro, entropy)

    def add_entropy(self, worker: Worker, micro, entropy: torch.Tensor) -> None:
        """Record one micro-batch's entropies (of whichever weights scored it)."""
        mask = micro.mask.to(worker.device)
        self.entropy_sum += float((entropy * mask).sum())
        self.tokens += float(mask.sum())

    def sums(self) -> list[float]:
        return [self.mismatch.tokens, self.mismatch.kl_sum, self.entropy_sum, self.tokens]

    def summary(self, sums: list[float], mismatch_max: float) -> dict:
        age0, kl_sum, entropy_sum, tokens = sums
        merged = MismatchStats(tokens=age0, kl_sum=kl_sum, max_abs=mismatch_max)
        return {**merged.summary(), "entropy": entropy_sum / tokens if tokens else None}


def _recomputes_proximal(worker: Worker, later_micros: list) -> bool:
    """Whether the minibatches after the first (``later_micros``: this rank's share of them) get
    their proximal logprobs from a forward pass (:func:`_proximal_pass`): only where the loss
    reads them, and under trainer.proximal=loglinear only where a trained token's version is
    unknown on any rank (nothing to interpolate from). Every rank answers the same: the pass
    runs the model, whose FSDP2 forward is collective."""
    trainer = worker.config.trainer
    if not trainer.correction.reads_proximal:
        return False
    if trainer.proximal is Proximal.recompute:
        return True
    unknown = not all(bool(((micro.versions >= 0) | (micro.mask == 0)).all()) for micro in later_micros)
    return all_reduce([float(unknown)], worker.device, "max")[0] > 0


def _proximal_pass(worker: Worker, micros: list, probe: ProximalProbe) -> list:
    """Logprobs of ``micros`` under the weights before any update of this batch (run before the
    first update), each recorded in ``probe``."""
    prox = []
    with torch.no_grad():
        for micro in micros:
            logp, entropy = _scores(worker, worker.model, micro, entropy=True)
            probe.add(worker, micro, logp, entropy)
            prox.append(logp)
    return prox


def scores(model, micro: MicroBatch, *, temperature: float, chunk_rows: int, device,
           entropy: bool, share_prompts: bool = False) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``model``'s logprob of every trained token of ``micro`` at the sampling ``temperature``
    (and the entropy of its distribution when asked), ``[rows, positions]`` with 0 elsewhere.
    The output layer runs over the trained positions only, ``chunk_rows`` at a time
    (:mod:`rlorch.trainer.head`); a packed row's positions restart at each sequence. With
    ``share_prompts`` and a model that takes a packing, the micro-batch runs in its shared
    layout (:mod:`rlorch.trainer.prefix`) where that saves positions."""
    shared = _layout_for(model, micro, share_prompts)
    request = head.request_for(micro.mask, micro.tokens, temperature=temperature, entropy=entropy,
                               chunk_rows=chunk_rows, device=device,
                               hidden_index=None if shared is None else shared.hidden_index)
    with head.scoring(request):
        if shared is not None:
            out = model(input_ids=shared.input_ids.to(device), use_cache=False,
                        position_ids=shared.position_ids.to(device), packing=shared.packing(device)).logits
        else:
            position_ids = micro.position_ids()
            out = model(input_ids=micro.tokens.to(device), use_cache=False,
                        position_ids=None if position_ids is None else position_ids.to(device)).logits
    return out[..., 0], out[..., 1] if entropy else None


def _layout_for(model, micro: MicroBatch, share_prompts: bool):
    """The layout ``micro`` runs in on ``model``: its shared one (None: as it is)."""
    return micro.shared_layout if share_prompts and accepts_packing(model) else None


def _positions_run(worker: Worker, micro: MicroBatch) -> int:
    """Positions the model's layers ran over for ``micro``."""
    shared = _layout_for(worker.model, micro, worker.config.trainer.fsdp.share_prompts)
    return micro.positions if shared is None else shared.positions


def accepts_packing(model) -> bool:
    """Whether ``model`` (under LoRA's wrapper too) takes a caller's packing: rlorch's own Qwen2."""
    return bool(getattr(lora.base_model(model), "accepts_packing", False))


def _scores(worker: Worker, model, micro: MicroBatch, *, entropy: bool):
    return scores(model, micro, temperature=worker.config.rollout.temperature,
                  chunk_rows=worker.config.trainer.fsdp.logit_chunk_rows, device=worker.device, entropy=entropy,
                  share_prompts=worker.config.trainer.fsdp.share_prompts)


@dataclass(frozen=True)
class Counts:
    """A minibatch's masked tokens and sequences over all its micro-batches and ranks: the
    normalisers that make the summed micro-batch losses its ``trainer.loss_agg`` exactly."""

    tokens: int
    sequences: int


def _accumulate(worker: Worker, micros: list, counts: Counts, proximal: list, probe: ProximalProbe,
                estimate_at: Optional[float] = None):
    """Forward/backward every micro-batch; gradients accumulate to the minibatch's aggregate
    (``trainer.loss_agg``).

    A micro-batch without proximal logprobs runs on the proximal weights themselves (the first
    minibatch): its detached logprobs are the proximal ones, recorded in ``probe``. With
    ``estimate_at`` (the version of the weights of a later minibatch, fractional) they are
    estimated from its own logprobs instead (:func:`loglinear_proximal`), and ``probe`` records
    only its entropy."""
    trainer, device = worker.config.trainer, worker.device
    loss_sum, stats = 0.0, LossStats()
    for micro, prox in zip(micros, proximal):
        mask, segments = micro.mask.to(device), micro.segments.to(device)
        counted = dict(agg=trainer.loss_agg, tokens=max(counts.tokens, 1), sequences=max(counts.sequences, 1),
                       segments=segments)
        logp, entropy = _scores(worker, worker.model, micro, entropy=prox is None or bool(trainer.entropy_coef))
        if prox is None and estimate_at is None:
            prox = logp.detach()
            probe.add(worker, micro, prox, entropy.detach())
        elif prox is None:
            probe.add_entropy(worker, micro, entropy.detach())
            if trainer.correction.reads_proximal:
                prox = loglinear_proximal(logp, micro.behaviour.to(device), micro.versions.to(device),
                                          proximal_version=probe.version, current_version=estimate_at)
        loss, micro_stats = policy_loss(
            logp, micro.behaviour.to(device), mask, micro.advantages.to(device),
            correction=trainer.correction, clip_eps=trainer.clip_eps, is_cap=trainer.is_cap,
            prox=prox, normalizer=counted["tokens"], agg=trainer.loss_agg, sequences=counted["sequences"],
            segments=segments, clip_high=trainer.clip_high, unlikelihood=micro.unlikelihood.to(device),
            unlikelihood_scale=trainer.unlikelihood_scale, unlikelihood_level=trainer.unlikelihood_level)
        if trainer.entropy_coef:
            loss = loss - trainer.entropy_coef * aggregate(entropy, mask, **counted)
        if worker.reference is not None:
            with torch.no_grad():
                ref_logp, _ = _scores(worker, worker.reference, micro, entropy=False)
            kl = reference_kl(logp, ref_logp, trainer.kl_estimator)
            loss = loss + trainer.kl_coef * aggregate(kl, mask, **counted)
            micro_stats.ref_kl_sum = float((kl.detach() * mask).sum())
        # FSDP averages gradients over ranks; scaling by the world size keeps the global token mean.
        (loss * worker.world).backward()
        loss_sum += loss.item()
        stats = stats.merge(micro_stats)
    return loss_sum, stats


def save_checkpoint(worker: Worker, step: int, *, wait: bool = False) -> None:
    """Checkpoint step ``step`` (once per life), one checkpoint at a time and in order.

    On a single CPU rank whose version ``step`` is on disk, only a copy of the state is taken
    here; the checkpoint thread writes it while the next steps train (its COMPLETE marker comes
    last, so nothing reads it before). ``wait`` (STOP, the last step) returns once it is
    complete. Otherwise every rank saves collectively, on this thread: on a GPU the copy would
    double the model's and optimizer's memory on the device."""
    wait_handed_off(worker)
    wait_checkpointed(worker)
    if step in worker.saved:
        return
    worker.saved.add(step)
    trainable_only = bool(worker.config.model.lora.rank)
    if _checkpoints_beside_training(worker) and (worker.run.weights_for(step) / PUBLISHED).exists():
        write = checkpoint.begin_single_rank_save(worker.run, step, worker.model, worker.optimizer,
                                                  optimizer_steps=worker.optimizer_steps, trainable_only=trainable_only)
        worker.checkpointing = worker.checkpoint_thread.submit(write)
        if wait:
            wait_checkpointed(worker)
        return
    checkpoint.save(worker.run, step, worker.model, worker.optimizer, rank=worker.rank,
                    write_weights=lambda target: write_weights(worker, target),
                    optimizer_steps=worker.optimizer_steps, trainable_only=trainable_only)


def _checkpoints_beside_training(worker: Worker) -> bool:
    """A single CPU rank: its checkpoints are written on the checkpoint thread, without DCP
    (:func:`checkpoint.begin_single_rank_save`), so it never imports DCP to train."""
    return worker.world == 1 and str(worker.device).startswith("cpu")


def wait_checkpointed(worker: Worker) -> None:
    """The checkpoint being written beside training is complete (its error, if any, raised)."""
    if worker.checkpointing is not None:
        pending, worker.checkpointing = worker.checkpointing, None
        pending.result()


def _append_metrics(run, record: dict) -> None:
    with open(run.trainer_metrics, "a", encoding="utf-8") as handle:
        handle.write(json.dumps(record) + "\n")


def run_loop(worker: Worker) -> None:
    """Train steps ``worker.step + 1 .. train.steps``; checkpoint on STOP and at the end. With
    ``run.colocate=swap`` each step brings the rank's state onto the device first and, once its
    version is published and its checkpoint written, moves it off again (:mod:`offload`)."""
    config, run = worker.config, worker.run
    first, last = worker.step + 1, config.train.steps
    swap = config.run.colocate is Colocate.swap
    for step in range(first, last + 1):
        if not wait_for_batch(run, step, worker.config.run.batch_format, worker.device,
                              asked=lambda: publish_asked(worker), answer=lambda: _publish_asked_for(worker, swap)):
            if worker.step > 0:  # step 0 is the base model: nothing to save
                if swap:
                    offload.to_device(worker)
                save_checkpoint(worker, worker.step, wait=True)
            say(worker, f"STOP after step {worker.step}")
            return
        onload_s = offload.to_device(worker) if swap else None
        record = train_step(worker, step)
        _check_finite(worker, step, record)
        worker.step = step
        # The metrics line goes out before the version is published: whoever sees version N
        # can read step N's figures.
        if worker.rank == 0:
            _append_metrics(run, record)
        if step % config.trainer.publish_every == 0 or step == last:
            started = time.perf_counter()
            publish_version(worker, step, last=step == last)
            record["publish_s"] = time.perf_counter() - started
        say(worker, " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in record.items()))
        if step == first and not _checkpoints_beside_training(worker):
            checkpoint.import_dcp_in_background()   # after the first step, which does not need it
        if step % config.trainer.checkpoint_every == 0 or step == last:
            save_checkpoint(worker, step, wait=step == last or swap)
        if swap:
            wait_handed_off(worker)
            offload_s = offload.to_host(worker, step)
            say(worker, f"swap: onload {onload_s:.3f}s offload {offload_s:.3f}s")


def _publish_asked_for(worker: Worker, swap: bool) -> None:
    """:func:`publish_on_request`, with a swap run's state on the device while it reads the
    weights (a parked storage holds nothing to read)."""
    if swap:
        offload.to_device(worker)
    publish_on_request(worker)
    if swap:
        offload.to_host(worker, worker.step)


def _check_finite(worker: Worker, step: int, record: dict) -> None:
    """A step whose gradients were all non-finite changed nothing (its updates were skipped and
    counted in ``skipped_updates``); three in a row fail the run. Weights that are not finite
    anyway are never published: the run fails naming the step."""
    worker.nonfinite = worker.nonfinite + 1 if record["skipped_updates"] == record["minibatches"] else 0
    if worker.nonfinite >= MAX_NONFINITE_STEPS:
        raise NonFiniteError(f"non-finite gradients at steps {step - worker.nonfinite + 1}..{step} "
                             f"(every update skipped); check trainer.lr and the rewards")
    shards = [p.detach().to_local() if hasattr(p, "to_local") else p.detach() for p in worker.model.parameters()]
    finite = all_finite(shards)
    if all_reduce([0.0 if finite else 1.0], worker.device, "max")[0] > 0:
        raise NonFiniteError(f"step {step}: the weights hold non-finite values; version {step} is not published")


def _refuse_nonfinite_checkpoint(worker: Worker, resume: Path) -> None:
    """A checkpoint whose weights or optimizer state hold a NaN or an inf (damaged on disk: a
    trained one never does, its step's check stops first) fails the resume before any step,
    every rank together, and is marked so the next resume takes an older one."""
    def local(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.detach().to_local() if hasattr(tensor, "to_local") else tensor.detach()

    parts = {"weights": [local(p) for p in worker.model.parameters()],
             "optimizer state": [local(v) for state in worker.optimizer.state.values() for v in state.values()
                                 if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dim() > 0]}
    bad = [name for name, tensors in parts.items()
           if all_reduce([0.0 if all_finite(tensors) else 1.0], worker.device, op="max")[0] > 0]
    if not bad:
        return
    what = " and ".join(bad) + " hold non-finite values"
    marker = CheckpointDir(resume).nonfinite
    if worker.rank == 0:
        marker.write_text(what + "\n")
    raise NonFiniteError(f"checkpoint {resume}: its {what} (damaged on disk?); marked {marker.name}, so "
                         f"`rlorch resume {resume.parent.parent}` takes the newest checkpoint before it")


def all_finite(tensors: list[torch.Tensor]) -> bool:
    """Whether every value of ``tensors`` (on one device) is finite. A tensor's max-abs norm is
    non-finite exactly when one of its values is (NaN propagates through the max, which never
    overflows): one reduction per tensor and no boolean masks (on CUDA, one kernel for all)."""
    present = [tensor for tensor in tensors if tensor.numel()]  # a rank's shard may be empty
    if not present:
        return True
    norms = torch._foreach_norm(present, float("inf"))
    return bool(torch.stack([norm.float() for norm in norms]).isfinite().all())


def _watch_orchestrator(run: RunDir) -> None:
    """Record this rank's pid (the orchestrator kills its process group on stop, even when
    torchrun is already dead) and exit at once when the orchestrator or torchrun is gone:
    a trainer without its orchestrator would keep training and publishing into the run."""
    run.trainer_workers.mkdir(parents=True, exist_ok=True)
    write_json_atomic(run.worker_pid(int(os.environ.get("RANK", "0"))), {"pid": os.getpid()})

    def gone(reason: str) -> None:
        print(f"rlorch trainer: {reason}; exiting", file=sys.stderr, flush=True)
        os._exit(3)

    watch_parents(orchestrator=orchestrator_pid(), parent=os.getppid(), on_gone=gone)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlorch.trainer.fsdp", description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", required=True, type=Path)
    parser.add_argument("--resume", type=Path, default=None, help="RUN_DIR/checkpoints/step_N")
    args = parser.parse_args(argv)

    run = RunDir(args.run_dir)
    _watch_orchestrator(run)
    config = load_config(run.config)
    device = _setup_distributed(config.trainer.fsdp.device)
    try:
        worker = build_worker(config, run, device, args.resume)
        if worker.rank == 0:
            run.make()
            clear_staging(run)
            discard_newer(run, worker.step)
            worker.broadcaster = plan(config, run, device, log=lambda message: say(worker, message))
        if config.run.colocate is Colocate.swap:    # the engines start after this, on what is left
            offload.to_host(worker, worker.step)
        if worker.rank == 0:
            write_json_atomic(run.trainer_ready, {"step": worker.step, "world_size": worker.world,
                                                      "device": str(device), "pid": os.getpid()})
            if worker.broadcaster is not None:
                worker.broadcaster.join()
        run_loop(worker)
    except (BatchError, CheckpointError, NonFiniteError) as err:
        print(f"rlorch trainer: {err}", file=sys.stderr, flush=True)
        return 2
    except Exception as err:
        print(f"rlorch trainer: {type(err).__name__}: {err}", file=sys.stderr, flush=True)
        raise
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
