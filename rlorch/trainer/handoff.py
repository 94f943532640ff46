"""Handing a trained version to the engines: over the weight group or to disk, and the HF
checkpoint of a checkpoint's weights.

Two ways, by where the weights are (:func:`streams`). Sharded or on an accelerator, a version
goes out one tensor at a time (:mod:`rlorch.trainer.streaming`), gathered, cast on the device
and broadcast or written as it comes, and the hand-off is done when :func:`publish_version`
returns. On one CPU rank the weights are on the host already: a copy of them is handed off on
rank 0's hand-off thread while the next step trains. LoRA merges its adapters over the whole
state dict, so it takes the second way on any device.

Invariant: versions are handed off one at a time and in order; a version that was not
broadcast whole is published to disk.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from rlorch.trainer import lora, streaming
from rlorch.trainer.broadcast import Broadcaster
from rlorch.trainer.publish import StreamedHF, prune, publish
from rlorch.trainer.ranks import from_rank0, say
from rlorch.trainer.worker import Worker


def _full_state_dict(model, sharded: bool) -> dict:
    """Collective: the full (unsharded) state dict on rank 0's CPU, empty elsewhere. An unsharded
    model is a plain module whose own state dict is that already (on its device)."""
    if not sharded:
        return {name: tensor.to("cpu") for name, tensor in model.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def served_state(worker: Worker) -> dict:
    """Collective: the weights engines serve, on rank 0 (empty elsewhere): the full state dict
    with LoRA adapters merged, under the base model's names, in ``model.dtype`` (tied tensors
    stay tied). In float32 without LoRA it is the full state dict itself."""
    state = _full_state_dict(worker.model, worker.sharded)
    if not state:
        return state
    adapters = worker.config.model.lora
    if adapters.rank:
        state = lora.merged(state, adapters.alpha / adapters.rank)
    return cast(state, getattr(torch, worker.config.model.dtype))


def cast(state: dict, dtype: torch.dtype) -> dict:
    """``state`` in ``dtype``; tensors already in it are passed through, and two names of one
    tensor (tied weights) get one cast tensor."""
    done: dict[tuple, torch.Tensor] = {}
    out = {}
    for name, tensor in state.items():
        if tensor.is_floating_point() and tensor.dtype != dtype:
            view = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
            if view not in done:
                done[view] = tensor.to(dtype)
            tensor = done[view]
        out[name] = tensor
    return out


def streams(worker: Worker) -> bool:
    """Whether versions go out tensor by tensor (:mod:`rlorch.trainer.streaming`): whenever the
    weights are sharded or on an accelerator. One CPU rank's weights are on the host already (a
    version is a copy of them, handed off beside the next step), and LoRA merges its adapters
    over the whole state dict."""
    return (worker.sharded or worker.device.type != "cpu") and not worker.config.model.lora.rank


def _served_tensors(worker: Worker):
    return streaming.served_tensors(worker.model, getattr(torch, worker.config.model.dtype), worker.rank)


def _write_stream(worker: Worker, target: Path, tensors) -> None:
    """Rank 0: an HF directory of ``tensors`` into ``target`` as they come."""
    out = StreamedHF(target, worker.writer.tokenizer.source, worker.writer.tokenizer,
                     getattr(torch, worker.config.model.dtype))
    for name, tensor in tensors:
        out.add(name, tensor)
    out.close()


def _streamed(worker: Worker, consume: Callable) -> object:
    """Collective: every rank gathers the served tensors; rank 0's ``consume`` takes them on the
    hand-off thread as they come and its result is returned there (None elsewhere)."""
    if worker.rank != 0:
        for _ in _served_tensors(worker):
            pass
        return None
    return streaming.stream(_served_tensors(worker), consume, worker.hand_off_thread)


def write_weights(worker: Worker, target: Path) -> None:
    """Collective: the HF checkpoint of the current weights into ``target`` (rank 0 writes)."""
    if streams(worker):
        _streamed(worker, lambda tensors: _write_stream(worker, target, tensors))
        return
    state = served_state(worker)
    if worker.rank == 0:
        worker.writer.write(target, state)


def own_copy(model, state: dict) -> dict:
    """``state`` with every tensor that shares storage with the live (unsharded) model cloned.
    On one rank the full state dict of weights already on the CPU is the parameters themselves,
    which the next optimizer step changes in place while the hand-off still reads them; an
    offloaded tensor is already a copy and is kept as it is. (Across ranks the full state dict
    is gathered into new tensors.)"""
    live = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    return {name: tensor.clone() if tensor.untyped_storage().data_ptr() in live else tensor
            for name, tensor in state.items()}


def publish_version(worker: Worker, step: int, *, last: bool = False) -> None:
    """Hand version ``step`` to the engines: broadcast when a group is up, else (or when the
    broadcast fails) publish to disk; the last version always goes to disk as well, and is
    waited for. Versions are handed off one at a time and in order (the previous hand-off is
    finished, and its error raised, before the next starts).

    Tensor by tensor (:func:`streams`), the hand-off is done when this returns. Otherwise it
    runs on rank 0's hand-off thread while the next step trains, from a copy of the state taken
    now, so training on does not change what is handed off."""
    if streams(worker):
        _publish_streamed(worker, step, last)
        return
    state = served_state(worker)
    if not worker.sharded:
        state = own_copy(worker.model, state)
    if worker.rank == 0:
        wait_handed_off(worker)
        worker.handing_off = worker.hand_off_thread.submit(_hand_off, worker, step, state, last)
        if last:
            wait_handed_off(worker)
    if worker.world > 1:
        dist.barrier()


def _publish_streamed(worker: Worker, step: int, last: bool) -> None:
    """Collective: version ``step`` streamed to the group or the disk. A broadcast that fails
    part-way has sent tensors nobody kept: the ranks then gather the version again, for the disk."""
    if worker.rank == 0:
        wait_handed_off(worker)
    offer = streaming.offer_of(worker.model, getattr(torch, worker.config.model.dtype))
    delivered = _streamed(worker, lambda tensors: _deliver(worker, step, tensors, offer, last))
    if not from_rank0(delivered if worker.rank == 0 else None):
        _streamed(worker, lambda tensors: _to_disk_streamed(worker, step, tensors))


def _deliver(worker: Worker, step: int, tensors, offer: tuple, last: bool) -> bool:
    """Rank 0, on the hand-off thread: broadcast ``tensors`` if the engines take version ``step``
    over the group, and write them to disk when they do not or when it is the ``last``; whether
    the version reached the engines one way or the other."""
    broadcaster = worker.broadcaster
    if broadcaster is None or not broadcaster.offer(step, *offer):
        _to_disk_streamed(worker, step, tensors)
        return True
    sent = _broadcast_each(broadcaster, step, tensors, len(offer[0]))
    if last:
        _to_disk_streamed(worker, step, sent)
        return True
    for _ in sent:
        pass
    return broadcaster.group is not None


def _broadcast_each(broadcaster: Broadcaster, step: int, tensors, count: int):
    """``tensors`` passed on after each is broadcast; after a failure (the broadcaster drops its
    group) they are passed on unsent."""
    for index, (name, tensor) in enumerate(tensors, start=1):
        if broadcaster.group is not None:
            broadcaster.transmit(step, [tensor], last=index == count)
        yield name, tensor


def _to_disk_streamed(worker: Worker, step: int, tensors) -> None:
    """Rank 0: version ``step`` published to ``weights/`` from ``tensors``, the oldest beyond the
    kept ones pruned."""
    publish(worker.run, step, lambda target: _write_stream(worker, target, tensors))
    prune(worker.run, worker.config.trainer.keep_weight_versions)


def _hand_off(worker: Worker, step: int, state: dict, last: bool) -> None:
    sent = worker.broadcaster is not None and worker.broadcaster.send(step, state)
    if not sent or last:
        _to_disk(worker, step, state)


def _to_disk(worker: Worker, step: int, state: dict) -> None:
    """Rank 0: version ``step`` published to ``weights/``, the oldest beyond the kept ones pruned."""
    publish(worker.run, step, lambda target: worker.writer.write(target, state))
    prune(worker.run, worker.config.trainer.keep_weight_versions)


def publish_asked(worker: Worker) -> bool:
    """Rank 0: the orchestrator asks for the current weights on disk (``publish_request``) and
    no hand-off is under way (one that is may yet put them there)."""
    return (worker.rank == 0 and worker.run.publish_request.exists()
            and (worker.handing_off is None or worker.handing_off.done()))


def publish_on_request(worker: Worker) -> None:
    """Collective: publish the current weights (version ``worker.step``) to disk unless a
    version at least that new is there already; rank 0 then clears the request. This is how a
    server restarted while the current version went over the weight group only catches up
    when no other server is left to receive the next one (the request says which version it
    needs; a newer one serves as well: its responses are stamped with what it loaded)."""
    if worker.rank == 0:
        wait_handed_off(worker)
    needed = None
    if worker.rank == 0:
        newest = max((version for version, _ in worker.run.published_weights()), default=-1)
        needed = worker.step > 0 and newest < worker.step
    if from_rank0(needed):
        if streams(worker):
            _streamed(worker, lambda tensors: _to_disk_streamed(worker, worker.step, tensors))
        else:
            state = served_state(worker)
            if worker.rank == 0:
                _to_disk(worker, worker.step, state)
        say(worker, f"version {worker.step} published to disk on the orchestrator's request")
    if worker.rank == 0:
        worker.run.publish_request.unlink(missing_ok=True)
    if worker.world > 1:
        dist.barrier()


def wait_handed_off(worker: Worker) -> None:
    if worker.handing_off is not None:
        pending, worker.handing_off = worker.handing_off, None
        pending.result()
