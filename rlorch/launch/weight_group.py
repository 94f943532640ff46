"""The process group weights travel over, between the trainer's rank 0 and the inference engines.

Both ends build it exactly as SGLang 0.5.23 does (``sglang.srt.utils.common.
init_custom_process_group``, called by ``/init_weights_update_group``), so the keys they look up
in the rendezvous store are the same: a rendezvous at ``tcp://master_address:master_port`` (rank
0, the trainer, hosts the store), the store wrapped in ``PrefixStore(group_name)``, then torch's
``_new_process_group_helper``, which adds ``PrefixStore(f"{group_name}/")`` and a device prefix.
A server with tensor parallelism joins once per TP rank, as ``rank_offset + tp_rank``; the group
has ``1 + Σ tp_size`` members. The group is created beside any default process group (a torchrun
job keeps its own), so joining it never disturbs the trainer's FSDP group. Tensors then travel by
``broadcast`` from rank 0, one per name, in the order both ends agreed on.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

GROUP_BACKENDS = ("gloo", "nccl")
DEFAULT_GROUP_NAME = "weight_update_group"


@dataclass(frozen=True)
class GroupSpec:
    """Where the group meets and who is in it (the fields of SGLang's InitWeightsUpdateGroupReqInput)."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = DEFAULT_GROUP_NAME
    backend: str = "nccl"

    def to_json(self) -> dict:
        return {"master_address": self.master_address, "master_port": self.master_port,
                "rank_offset": self.rank_offset, "world_size": self.world_size,
                "group_name": self.group_name, "backend": self.backend}


def rank_offsets(tp_sizes: list[int]) -> tuple[list[int], int]:
    """Each server's ``rank_offset`` (its TP ranks follow it) and the group's world size: rank 0
    is the trainer, server ``i`` takes ranks ``1 + Σ tp_size of the servers before`` onwards."""
    offsets, next_rank = [], 1
    for size in tp_sizes:
        offsets.append(next_rank)
        next_rank += size
    return offsets, next_rank


def init_custom_process_group(*, backend: str, init_method: str, world_size: int, rank: int, group_name: str,
                              timeout: timedelta):
    """A process group built as SGLang builds its end (see the module doc); the caller blocks
    until every member has joined or ``timeout`` passes (which raises)."""
    from torch.distributed.distributed_c10d import (Backend, PrefixStore, _new_process_group_helper, _world,
                                                    rendezvous)

    store, rank, world_size = next(rendezvous(init_method, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    group, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), store, group_name=group_name,
                                         backend_options=None, timeout=timeout, device_id=None)
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def open_group(spec: GroupSpec, *, rank: int, timeout: float):
    """Join the group as ``rank``; blocks until all ``world_size`` members have joined (or
    ``timeout`` seconds pass, which raises). Its collectives time out after ``timeout`` too."""
    if spec.backend not in GROUP_BACKENDS:
        raise ValueError(f"backend must be one of {GROUP_BACKENDS}, got {spec.backend!r}")
    return init_custom_process_group(backend=spec.backend, init_method=f"tcp://{spec.master_address}:{spec.master_port}",
                                     world_size=spec.world_size, rank=rank, group_name=spec.group_name,
                                     timeout=timedelta(seconds=timeout))


def broadcast(group, tensors: list) -> None:
    """Broadcast ``tensors`` from rank 0 (sent there, received in place elsewhere), in order, as
    SGLang receives them: one asynchronous broadcast per tensor, then every one waited for."""
    import torch.distributed as dist

    works = [dist.broadcast(tensor, src=0, group=group, async_op=True) for tensor in tensors]
    for work in works:
        work.wait()


def close_group(group) -> None:
    import torch.distributed as dist

    dist.destroy_process_group(group)


def dtype_name(dtype) -> str:
    """SGLang's spelling of a dtype in ``dtypes`` (``"bfloat16"``, not ``"torch.bfloat16"``)."""
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str):
    import torch

    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype
