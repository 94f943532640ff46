"""A process group between the trainer's rank 0 and the inference engines, for weight transfer.

Both ends follow SGLang's ``/init_weights_update_group`` semantics: the trainer is rank 0 and
hosts the rendezvous store at ``master_address:master_port``; engine ``i`` joins as rank
``rank_offset`` (one rank per engine here), and the group has ``world_size`` members. The group
is created beside any default process group (a torchrun job keeps its own), from its own store,
so joining it never disturbs the trainer's FSDP group. Tensors then travel by ``broadcast``
from rank 0, one per name, in the order both ends agreed on.
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


def open_group(spec: GroupSpec, *, rank: int, timeout: float):
    """Join the group as ``rank``; blocks until all ``world_size`` members have joined (or
    ``timeout`` seconds pass, which raises)."""
    import torch.distributed as dist

    if spec.backend not in GROUP_BACKENDS:
        raise ValueError(f"backend must be one of {GROUP_BACKENDS}, got {spec.backend!r}")
    wait = timedelta(seconds=timeout)
    store = dist.TCPStore(spec.master_address, spec.master_port, spec.world_size, is_master=rank == 0,
                          wait_for_workers=False, timeout=wait)
    prefixed = dist.PrefixStore(spec.group_name, store)
    if spec.backend == "gloo":
        return dist.ProcessGroupGloo(prefixed, rank, spec.world_size, wait)
    return dist.ProcessGroupNCCL(prefixed, rank, spec.world_size)


def broadcast(group, tensors: list) -> None:
    """Broadcast ``tensors`` from rank 0 (send there, receive in place elsewhere), in order."""
    import torch.distributed as dist

    options = dist.BroadcastOptions()
    options.rootRank = 0
    works = [group.broadcast([tensor], options) for tensor in tensors]
    for work in works:
        work.wait()


def dtype_name(dtype) -> str:
    """SGLang's spelling of a dtype in ``dtypes`` (``"bfloat16"``, not ``"torch.bfloat16"``)."""
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str):
    import torch

    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype
