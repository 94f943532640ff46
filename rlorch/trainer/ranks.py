"""Small collectives of the trainer's ranks: a value from rank 0, a few numbers reduced, rank 0's
log line."""

from __future__ import annotations

import torch
import torch.distributed as dist


def from_rank0(value):
    """Rank 0's ``value`` on every rank (any picklable object)."""
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def all_reduce(values: list[float], device, op: str = "sum") -> list[float]:
    """All-reduce a few numbers (on the device: NCCL reduces only device tensors)."""
    if dist.get_world_size() == 1:
        return values
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
    return tensor.tolist()


def say(worker, message: str) -> None:
    """Rank 0 prints ``message`` to the trainer's log."""
    if worker.rank == 0:
        print(f"[trainer] {message}", flush=True)


def barrier() -> None:
    """Every rank reaches this point before any goes on (nothing to wait for on one rank)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
