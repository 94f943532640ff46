"""``run.colocate=swap``: a rank's state off the device while the engines generate, back on it
to train.

What moves is storage, not tensors. Every device storage the rank's state holds (the model's
parameter shards and buffers, the frozen reference's, the optimizer's state tensors with a
dimension: AdamW's moments, DTensors under FSDP2, whose storage is their local shard) is copied
whole into a host buffer and resized to nothing; on the way back it is resized and filled again.
Every tensor, DTensor and FSDP2 parameter stays the same object with the same metadata, so
neither FSDP2 nor the optimizer (whose state is keyed by parameter) sees a thing, and the same
code runs on a CPU "device": its storages are freed and refilled there too, but for those over a
file's memory (see :func:`state_storages`), so a CPU swap run goes through the GPU's path.

Gradients do not travel: the step's are dropped first (each step starts from none). The 0-d
``step`` counters stay. After the move to the host the allocator's cached blocks go back to the
device, or the engines' resume would find them taken.

The marker ``trainer/offloaded`` (``{"step": N}``) is written by rank 0 once every rank has
moved: the orchestrator gives the engines their memory back only for versions up to N.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator

import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from rlorch.rundir.layout import write_json_atomic
from rlorch.trainer.ranks import barrier
from rlorch.trainer.worker import Worker


def _as_bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over the whole of ``storage`` (padding an FSDP2 shard holds included)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


@dataclass
class HostCopies:
    """The storages a rank has parked on the host, each beside its host copy. The copies are kept
    across steps (pinned where CUDA is): a copy into pinned memory runs at the link's speed, and
    pinning anew each step would cost as much as the copy.

    Invariant: while ``parked`` is not empty every storage in it has size 0 and nothing may read
    a tensor on it; :meth:`unpark` restores each to its size and bytes."""

    buffers: list[torch.Tensor] = field(default_factory=list)
    parked: list[tuple[torch.UntypedStorage, torch.Tensor]] = field(default_factory=list)

    def park(self, storages: list[torch.UntypedStorage]) -> int:
        """Copy each storage to its host buffer, then free it; the bytes parked. A failure before
        the frees (a host buffer that cannot be allocated) leaves every storage as it was."""
        if self.parked:
            raise RuntimeError("offload: state is already on the host")
        pinned = torch.cuda.is_available()
        copies = []
        for index, storage in enumerate(storages):
            if index == len(self.buffers):
                self.buffers.append(torch.empty(0, dtype=torch.uint8))
            if self.buffers[index].numel() != storage.nbytes():
                self.buffers[index] = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=pinned)
            self.buffers[index].copy_(_as_bytes(storage), non_blocking=True)
            copies.append((storage, self.buffers[index]))
        _synchronize(storages)    # every copy has landed before any storage is freed
        for storage, _ in copies:
            storage.resize_(0)
        self.parked = copies
        return sum(host.numel() for _, host in copies)

    def unpark(self) -> None:
        """Give every parked storage its size back and its bytes from the host."""
        storages = [storage for storage, _ in self.parked]
        for storage, host in self.parked:
            storage.resize_(host.numel())
            _as_bytes(storage).copy_(host, non_blocking=True)
        _synchronize(storages)
        self.parked.clear()


def _synchronize(storages: list[torch.UntypedStorage]) -> None:
    if any(storage.device.type == "cuda" for storage in storages):
        torch.cuda.synchronize()


def _tensors(worker: Worker) -> Iterator[torch.Tensor]:
    for module in (worker.model, worker.reference):
        if module is not None:
            yield from module.parameters()
            yield from module.buffers()
    for state in worker.optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                yield value


def _reshard(worker: Worker) -> None:
    """Every FSDP2 module back to its shards: a root after a forward without backward (the
    reference's, every step) keeps its parameters gathered, and those are not the shards."""
    for module in (worker.model, worker.reference):
        for part in module.modules() if module is not None else ():
            if isinstance(part, FSDPModule):
                part.reshard()


def state_storages(worker: Worker) -> list[torch.UntypedStorage]:
    """Each distinct storage of the rank's state on its device, in a fixed order (parameters,
    buffers, reference, optimizer state), so a host buffer meets the same storage every step.
    Tied parameters share one storage and are parked once. A storage over a file's memory (a
    model read from safetensors straight onto the CPU) cannot be freed and stays: it is host
    memory already. On a GPU every storage is the allocator's; one that is not is refused
    rather than left on the device unseen."""
    device = torch.device(worker.device)
    seen, storages = set(), []
    for tensor in _tensors(worker):
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        storage = local.untyped_storage()
        if storage.device.type != device.type or storage.nbytes() == 0 or storage.data_ptr() in seen:
            continue
        if not storage.resizable():
            if device.type == "cpu":
                continue
            raise RuntimeError(f"offload: a {tuple(local.shape)} {local.dtype} tensor of the trainer's state "
                               "lies on memory that cannot be freed (not the allocator's)")
        seen.add(storage.data_ptr())
        storages.append(storage)
    return storages


HOST = HostCopies()
"""This process's parked state (one rank a process)."""


def to_host(worker: Worker, step: int) -> float:
    """Move the rank's state to the host, return the device's cached blocks, and (rank 0, after
    every rank) mark ``step`` as offloaded; the seconds it took."""
    started = time.perf_counter()
    worker.optimizer.zero_grad(set_to_none=True)
    with torch.no_grad():
        _reshard(worker)
        HOST.park(state_storages(worker))
    if torch.device(worker.device).type == "cuda":
        torch.cuda.empty_cache()
    barrier()
    if worker.rank == 0:
        write_json_atomic(worker.run.trainer_offloaded, {"step": step})
    return time.perf_counter() - started


def to_device(worker: Worker) -> float:
    """Move the rank's state back to its device (nothing when it is there); the seconds it took."""
    started = time.perf_counter()
    HOST.unpark()
    return time.perf_counter() - started
