"""``run.colocate=swap``: a rank's state off the device while the engines generate, back on it
to train.

What moves: the model's parameters (FSDP2 re-registers its shards after a move), the frozen
reference's, and every optimizer state tensor with a dimension (AdamW's moments; its 0-d
``step`` counters stay where the optimizer keeps them). Gradients are already gone: each step
ends with ``zero_grad(set_to_none=True)``. After a move to the host the allocator's cached blocks
go back to the device, or the engines' resume would find them taken. On a CPU "device" the
moves are no-ops and only the marker is written, so the swap step's order runs everywhere.

The marker ``trainer/offloaded`` (``{"step": N}``) is written by rank 0 once every rank has
moved: the orchestrator gives the engines their memory back only for versions up to N.
"""

from __future__ import annotations

import time

import torch

from rlorch.rundir.layout import write_json_atomic
from rlorch.trainer.ranks import barrier
from rlorch.trainer.worker import Worker


_HOST_BUFFERS: dict[tuple[int, str], torch.Tensor] = {}
"""Pinned host copies of optimizer state, kept across steps: a copy into pinned memory runs at
the link's speed, and pinning anew each step would cost as much as the copy."""


def _to_host(value: torch.Tensor, slot: tuple[int, str]) -> torch.Tensor:
    buffer = _HOST_BUFFERS.get(slot)
    if buffer is None or buffer.shape != value.shape or buffer.dtype != value.dtype:
        buffer = _HOST_BUFFERS[slot] = torch.empty(value.shape, dtype=value.dtype, pin_memory=True)
    return buffer.copy_(value, non_blocking=True)


def _move(worker: Worker, device: torch.device) -> None:
    worker.model.to(device)
    if worker.reference is not None:
        worker.reference.to(device)
    for index, state in enumerate(worker.optimizer.state.values()):
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                state[key] = (_to_host(value, (index, key)) if device.type == "cpu"
                              else value.to(device, non_blocking=True))
    torch.cuda.synchronize()


def to_host(worker: Worker, step: int) -> float:
    """Move the rank's state to the host, return the device's cached blocks, and (rank 0, after
    every rank) mark ``step`` as offloaded; the seconds it took."""
    started = time.perf_counter()
    device = torch.device(worker.device)
    if device.type != "cpu":
        torch.cuda.synchronize(device)
        _move(worker, torch.device("cpu"))
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
        _move(worker, device)
    return time.perf_counter() - started
