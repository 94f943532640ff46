"""Which GPUs each process of a run gets: the plan as data, read by the command builders.

Default split of the node's GPUs (``run.gpus``, else the visible count): launched SGLang servers
first, ``inference.tp_size`` consecutive GPUs each, then the trainer's ``trainer.fsdp.nproc``.
``inference.gpus`` / ``trainer.fsdp.gpus`` pin either side explicitly. Each process sees only its
own GPUs through ``CUDA_VISIBLE_DEVICES``. Invariants: no GPU is given to two processes, every id
exists, a server gets exactly ``tp_size`` GPUs; anything else is a :class:`ConfigError` naming the
keys. With 0 GPUs nothing is placed (a CPU run) unless a list pins GPUs.

Multi-node (``trainer.fsdp.nnodes > 1``): node 0 runs the orchestrator, the servers and a torchrun
agent; every other node runs one torchrun agent with its ``--node-rank``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rlorch.config.schema import Config, ConfigError, InferenceBackend, TrainerBackend


@dataclass
class Placement:
    servers: list[list[int]] = field(default_factory=list)
    """GPU ids per launched server (empty: not placed)."""
    trainer: list[int] = field(default_factory=list)
    """GPU ids of this node's trainer processes (empty: not placed)."""


def visible_gpus(config: Config) -> int:
    """``run.gpus`` when set, else the GPUs torch sees (0 without CUDA)."""
    if config.run.gpus is not None:
        return config.run.gpus
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _launches_gpu_servers(config: Config) -> bool:
    return config.inference.backend is InferenceBackend.sglang and not config.inference.addresses


def _trains_on_gpu(config: Config) -> bool:
    return config.trainer.backend is TrainerBackend.fsdp and config.trainer.fsdp.device != "cpu"


def place(config: Config, gpus: int) -> Placement:
    """Assign this node's ``gpus`` GPUs (see the module doc)."""
    inference, fsdp = config.inference, config.trainer.fsdp
    if gpus == 0 and not inference.gpus and not fsdp.gpus:
        return Placement()
    server_count = inference.num_servers if _launches_gpu_servers(config) else 0
    need_servers = server_count * inference.tp_size
    need_trainer = fsdp.nproc if _trains_on_gpu(config) else 0
    server_ids = list(inference.gpus)
    trainer_ids = list(fsdp.gpus)
    if server_ids:
        if len(server_ids) % inference.tp_size:
            raise ConfigError("inference.gpus", f"{len(server_ids)} GPUs do not divide into servers of "
                                                f"inference.tp_size={inference.tp_size}")
        if len(server_ids) != need_servers:
            raise ConfigError("inference.gpus", f"lists {len(server_ids)} GPUs; inference.num_servers="
                                                f"{inference.num_servers} x inference.tp_size={inference.tp_size} "
                                                f"launched servers need {need_servers}")
    if trainer_ids and len(trainer_ids) != need_trainer:
        raise ConfigError("trainer.fsdp.gpus", f"lists {len(trainer_ids)} GPUs; trainer.fsdp.nproc needs "
                                               f"{need_trainer}")
    overlap = sorted(set(server_ids) & set(trainer_ids))
    if overlap:
        raise ConfigError("inference.gpus", f"GPUs {overlap} are also in trainer.fsdp.gpus")
    for key, ids in (("inference.gpus", server_ids), ("trainer.fsdp.gpus", trainer_ids)):
        bad = [i for i in ids if not 0 <= i < gpus]
        if bad or len(set(ids)) != len(ids):
            raise ConfigError(key, f"GPU ids {ids} must be distinct and in [0, run.gpus={gpus})")
    free = [i for i in range(gpus) if i not in server_ids and i not in trainer_ids]
    if not server_ids:
        server_ids, free = free[:need_servers], free[need_servers:]
    if not trainer_ids:
        trainer_ids, free = free[:need_trainer], free[need_trainer:]
    if len(server_ids) < need_servers or len(trainer_ids) < need_trainer:
        raise ConfigError("run.gpus", f"{gpus} GPUs are too few: inference.num_servers={server_count} x "
                                      f"inference.tp_size={inference.tp_size} servers and "
                                      f"trainer.fsdp.nproc={need_trainer} trainer processes need "
                                      f"{need_servers + need_trainer}")
    size = inference.tp_size
    return Placement(servers=[server_ids[i * size:(i + 1) * size] for i in range(server_count)],
                     trainer=trainer_ids)


def visible_env(ids: list[int]) -> dict[str, str]:
    return {"CUDA_VISIBLE_DEVICES": ",".join(map(str, ids))} if ids else {}


def server_env(config: Config, index: int) -> dict[str, str]:
    """The environment launched server ``index`` gets on top of the runner's."""
    placement = place(config, visible_gpus(config))
    return visible_env(placement.servers[index]) if index < len(placement.servers) else {}


def trainer_env(config: Config) -> dict[str, str]:
    """The environment this node's torchrun agent gets on top of the runner's."""
    return visible_env(place(config, visible_gpus(config)).trainer)
