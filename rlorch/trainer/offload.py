"""``run.colocate=swap``: a rank's state off the device while the engines generate, back on it
to train.

What moves: the model's parameters (FSDP2 re-registers its shards after a move), the frozen
reference's, and every optimizer state tensor with a dimension (AdamW's moments, DTensors under
FSDP2, travel as their local shards; its 0-d ``step`` counters stay where the optimizer keeps
them). Gradients are already gone: each step ends with ``zero_grad(set_to_none=True)``. After a
move to the host the allocator's cached blocks go back to the device, or the engines' resume
would find them taken. On a CPU "device" the model stays where it is, but the optimizer state is
parked in its host buffers and brought back all the same, so every CPU swap run goes through the
moves' bookkeeping as a GPU run does.

The marker ``trainer/offloaded`` (``{"step": N}``) is written by rank 0 once every rank has
moved: the orchestrator gives the engines their memory back only for versions up to N.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch
from torch.distributed.tensor import DTensor

from rlorch.rundir.layout import write_json_atomic
from rlorch.trainer.ranks import barrier
from rlorch.trainer.worker import Worker


_HOST_BUFFERS: dict[tuple[int, str], torch.Tensor] = {}
"""Host copies of optimizer state (pinned where CUDA is), kept across steps: a copy into pinned
memory runs at the link's speed, and pinning anew each step would cost as much as the copy."""


@dataclass(frozen=True)
class Parked:
    """An optimizer state tensor while its rank is off the device: its local values on the host,
    and what makes the optimizer's tensor of them again once they are back on a device. Under
    FSDP2 the state is a DTensor, whose values are its local shard; a host buffer cannot be a
    DTensor (``DTensor.from_local`` moves its tensor to the mesh's device), so the shard travels
    alone and the DTensor is rebuilt around it on the device."""

    host: torch.Tensor
    rebuild: Callable[[torch.Tensor], torch.Tensor]


def _host_buffer(local: torch.Tensor, slot: tuple[int, str]) -> torch.Tensor:
    buffer = _HOST_BUFFERS.get(slot)
    if buffer is None or buffer.shape != local.shape or buffer.dtype != local.dtype:
        buffer = _HOST_BUFFERS[slot] = torch.empty(local.shape, dtype=local.dtype,
                                                   pin_memory=torch.cuda.is_available())
    return buffer


def _park(value: torch.Tensor, slot: tuple[int, str]) -> Parked:
    if isinstance(value, DTensor):
        mesh, placements, shape, stride = value.device_mesh, value.placements, value.shape, value.stride()
        local = value.to_local()

        def rebuild(on_device: torch.Tensor) -> torch.Tensor:
            return DTensor.from_local(on_device, mesh, placements, run_check=False, shape=shape, stride=stride)
    else:
        local, rebuild = value, (lambda on_device: on_device)
    host = _host_buffer(local, slot).copy_(local, non_blocking=True)
    return Parked(host, rebuild)


def park_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Replace every optimizer state tensor with a dimension by its :class:`Parked` host copy
    (the 0-d ``step`` counters stay). The copies are asynchronous where the host buffer is
    pinned: synchronize the device before the host copies are read or the device's are reused.
    Nothing may read the optimizer's state until :func:`unpark_optimizer_state`."""
    for index, state in enumerate(optimizer.state.values()):
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                state[key] = _park(value, (index, key))


def unpark_optimizer_state(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    """Bring every :class:`Parked` state tensor back onto ``device`` as the tensor it was."""
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, Parked):
                state[key] = value.rebuild(value.host.to(device, non_blocking=True))


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def to_host(worker: Worker, step: int) -> float:
    """Move the rank's state to the host, return the device's cached blocks, and (rank 0, after
    every rank) mark ``step`` as offloaded; the seconds it took."""
    started = time.perf_counter()
    device = torch.device(worker.device)
    _synchronize(device)
    if device.type != "cpu":
        worker.model.to("cpu")
        if worker.reference is not None:
            worker.reference.to("cpu")
    park_optimizer_state(worker.optimizer)
    _synchronize(device)
    if device.type != "cpu":
        torch.cuda.empty_cache()
    barrier()
    if worker.rank == 0:
        write_json_atomic(worker.run.trainer_offloaded, {"step": step})
    return time.perf_counter() - started


def to_device(worker: Worker) -> float:
    """Move the rank's state back to its device; the seconds it took."""
    started = time.perf_counter()
    device = torch.device(worker.device)
    if device.type != "cpu":
        worker.model.to(device)
        if worker.reference is not None:
            worker.reference.to(device)
    unpark_optimizer_state(worker.optimizer, device)
    _synchronize(device)
    return time.perf_counter() - started
