"""Which GPUs each process of a run gets: the plan as data, read by the command builders.

Default split of the node's GPUs (``run.gpus``, else the visible count): launched SGLang servers
first, ``inference.tp_size`` consecutive GPUs each, then the trainer's ``trainer.fsdp.nproc``.
``inference.gpus`` / ``trainer.fsdp.gpus`` pin either side explicitly. Each process sees only its
own GPUs through ``CUDA_VISIBLE_DEVICES``. Invariants: no GPU is given to two processes, every id
exists, a server gets exactly ``tp_size`` GPUs; anything else is a :class:`ConfigError` naming the
keys. With 0 GPUs nothing is placed (a CPU run) unless a list pins GPUs.

Filling the node (:func:`resolve_layout`): an unset (null) ``inference.num_servers`` or
``trainer.fsdp.nproc`` is resolved before anything reads it. A pinned list sets its side's count.
Beside launched SGLang servers, with both on this node's GPUs: the trainer takes
``trainer.fsdp.nproc`` GPUs (unset too: half the node rounded down to a power of two, at least 1)
and the servers as many ``tp_size`` groups as the rest holds (at least 1); a set
``num_servers`` leaves the trainer the GPUs its servers do not take. Launched CPU engines
(``inference=cpu``) are counted from this machine's usable cores (:func:`cpu_engines_for`), and
an unset ``inference.cpu.max_batch`` is each engine's share of a step's rollouts. Anywhere else
(no GPUs, servers elsewhere, a CPU trainer, CPU engines placed by Ray) an unset count is 1 —
except launched servers beside a CPU trainer, which take every ``tp_size`` group of the node.
GPUs left over are named by :func:`idle_gpu_warning`; :func:`layout_choice` says what an unset
count became.

Colocated (:mod:`rlorch.launch.colocation`: ``run.colocate``, or one GPU): servers and trainer
ranks share GPUs. Server ``i`` takes ids ``i*tp_size ..`` and the trainer ``0 .. nproc-1`` (or
their pinned lists, which may overlap); an unset ``trainer.fsdp.nproc`` becomes the node's GPUs
and an unset ``inference.num_servers`` as many ``tp_size`` groups as the node holds.

Plan ids are indices into what the orchestrator sees: with an inherited ``CUDA_VISIBLE_DEVICES``
(``4,5,6,7``) id ``i`` is its ``i``-th entry, so node 0's children get the physical names
(:func:`inherited_devices`); the list must be at least ``run.gpus`` long.

Multi-node (``trainer.fsdp.nnodes > 1``): node 0 runs the orchestrator, the servers and a torchrun
agent; every other node runs one torchrun agent with its ``--node-rank``, on GPUs of its own:
``trainer.fsdp.gpus`` when pinned, else ``0..nproc-1`` (its own ``CUDA_VISIBLE_DEVICES`` is not
known here, so nothing is translated there).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Optional

from rlorch.config.schema import Colocate, Config, ConfigError, InferenceBackend
from rlorch.launch.colocation import (ASSUMED_GPU_GIB, GIB, MemorySplit, colocation, launches_gpu_engines, memory_split,
                                     trains_on_gpu)


@dataclass
class Placement:
    servers: list[list[int]] = field(default_factory=list)
    """GPU ids per launched server (empty: not placed)."""
    trainer: list[int] = field(default_factory=list)
    """GPU ids of this node's trainer processes (empty: not placed)."""


_launches_gpu_servers = launches_gpu_engines
_trains_on_gpu = trains_on_gpu


GPU_DEVICE_FILES = ("/dev/nvidia[0-9]*", "/dev/kfd")
"""Device files a GPU driver creates (NVIDIA's per-GPU nodes, ROCm's kernel fusion driver):
without any, no process here can see a GPU, whatever torch would say."""


def has_gpu_driver() -> bool:
    """Whether this machine exposes a GPU driver's device files (cheap: no torch import)."""
    import glob

    return any(glob.glob(pattern) for pattern in GPU_DEVICE_FILES)


def gpu_memory(config: Config) -> tuple[float, str]:
    """One GPU's memory in GiB and where the figure comes from: ``run.gpu_memory_gb``, else the
    first visible device's total, else :data:`rlorch.launch.colocation.ASSUMED_GPU_GIB`."""
    if config.run.gpu_memory_gb is not None:
        return config.run.gpu_memory_gb, "run.gpu_memory_gb"
    if has_gpu_driver():
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_properties(0).total_memory / GIB, "measured"
    return ASSUMED_GPU_GIB, "assumed: no GPU visible, set run.gpu_memory_gb"


def colocated_split(config: Config, gpus: Optional[int] = None) -> Optional[MemorySplit]:
    """The memory split of a colocated run on this node (None when it does not colocate)."""
    gpus = layout_gpus(config) if gpus is None else gpus
    mode = colocation(config, gpus)
    if not mode.shares or not (launches_gpu_engines(config) and trains_on_gpu(config) and gpus > 0):
        return None
    return memory_split(config, mode, gpu_memory(config))


def visible_gpus(config: Config) -> int:
    """``run.gpus`` when set; else 0 when the run puts nothing on GPUs or the machine has no GPU
    driver (no torch import: importing it costs the orchestrator seconds of a small machine's
    start-up); else the GPUs torch sees (0 without CUDA; an inherited ``CUDA_VISIBLE_DEVICES``
    limits them)."""
    if config.run.gpus is not None:
        return config.run.gpus
    if not (_launches_gpu_servers(config) or _trains_on_gpu(config)) or not has_gpu_driver():
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def layout_gpus(config: Config) -> int:
    """The GPUs an unset count is resolved against: ``run.gpus``, else the visible count where
    launched SGLang servers share the node (the only layout an unset count depends on), else 0,
    so the CPU default never imports torch for it."""
    if config.run.gpus is not None or _launches_gpu_servers(config):
        return visible_gpus(config)
    return 0


def usable_cores() -> int:
    """The CPUs this process may run on: its affinity mask (``taskset``, a cpuset), capped by a
    cgroup v2 CPU quota (``docker --cpus``) rounded up, at least 1."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
    except (OSError, ValueError):
        return max(1, cores)
    if quota != "max" and int(period) > 0:
        cores = min(cores, -(-int(quota) // int(period)))
    return max(1, cores)


def cpu_engines_for(cores: int) -> int:
    """Launched CPU engines for a machine of ``cores`` usable cores: one for up to five, then
    one more per two cores beyond the four that the trainer, the orchestrator and the first
    engine keep busy. The trainer (one process, one thread) is the slower side: on 2 cores one
    engine is paused or idle about a third of the loop, so a second one only shares the cores
    with the trainer (``scripts/bench_to_accuracy.py``, 8 seeds: median 28.9 s to 80% held-out
    with one engine, 30.8 s with two; the rule beyond 2 cores is unmeasured)."""
    return max(1, (cores - 2) // 2)


def engine_batch(batch_size: int, servers: int) -> int:
    """``inference.cpu.max_batch`` where unset: each of ``servers`` engines' share of a step's
    ``batch_size`` rollouts, so one decode batch carries a whole step between them."""
    return max(1, -(-batch_size // max(servers, 1)))


def _launches_cpu_engines(config: Config) -> bool:
    return config.inference.backend is InferenceBackend.cpu and not config.inference.addresses


def _half_power_of_two(gpus: int) -> int:
    """The largest power of two <= gpus // 2, at least 1: 8 -> 4, 6 -> 2, 2 -> 1."""
    return 1 << max(gpus // 2, 1).bit_length() - 1


def _counts(config: Config, gpus: int, cores: Optional[int] = None) -> tuple[int, int]:
    """``(num_servers, nproc)`` with unset ones resolved by the fill rule (the module doc); set
    ones come back unchanged. ``cores``: this machine's, for launched CPU engines (None: they
    are placed elsewhere, by Ray)."""
    inference, fsdp = config.inference, config.trainer.fsdp
    tp = inference.tp_size
    servers = inference.num_servers
    nproc = fsdp.nproc
    if servers is None and inference.gpus:
        servers = max(1, len(inference.gpus) // tp)
    if nproc is None and fsdp.gpus:
        nproc = len(fsdp.gpus)
    gpu_servers = _launches_gpu_servers(config) and gpus > 0
    gpu_trainer = _trains_on_gpu(config) and gpus > 0
    if gpu_servers and gpu_trainer and colocation(config, gpus).shares:
        nproc = gpus if nproc is None else nproc
        servers = max(1, gpus // tp) if servers is None else servers
    elif gpu_servers and gpu_trainer:
        if nproc is None:
            nproc = _half_power_of_two(gpus) if servers is None else max(1, gpus - servers * tp)
        if servers is None:
            servers = max(1, (gpus - nproc) // tp)
    elif gpu_servers and servers is None:
        servers = max(1, gpus // tp)
    if servers is None and cores is not None and _launches_cpu_engines(config):
        servers = cpu_engines_for(cores)
    return (1 if servers is None else servers), (1 if nproc is None else nproc)


def fill_counts(config: Config, gpus: int) -> Config:
    """``config`` with unset ``inference.num_servers`` and ``trainer.fsdp.nproc`` filled for a
    node of ``gpus`` GPUs, and nothing placed: under Ray the cluster places, so this machine's
    devices are not checked."""
    return _filled(config, gpus)


def _filled(config: Config, gpus: int, cores: Optional[int] = None) -> Config:
    servers, nproc = _counts(config, gpus, cores)
    inference = config.inference
    cpu = inference.cpu
    if cpu.max_batch is None:
        cpu = replace(cpu, max_batch=engine_batch(config.rollout.batch_size, servers))
    if (servers, nproc, cpu) == (inference.num_servers, config.trainer.fsdp.nproc, inference.cpu):
        return config
    trainer = replace(config.trainer, fsdp=replace(config.trainer.fsdp, nproc=nproc))
    return replace(config, inference=replace(inference, num_servers=servers, cpu=cpu), trainer=trainer)


def resolve_layout(config: Config, gpus: Optional[int] = None, cores: Optional[int] = None) -> Config:
    """``config`` with ``inference.num_servers``, ``inference.cpu.max_batch`` and
    ``trainer.fsdp.nproc`` set for a node of ``gpus`` GPUs (default :func:`layout_gpus`) and
    ``cores`` cores (default :func:`usable_cores`), by the fill rule of the module doc; a config
    with all set comes back as is, an unset one as a copy. Invariant: the result places on this
    node — an impossible split or an inherited ``CUDA_VISIBLE_DEVICES`` shorter than ``gpus``
    raises :class:`ConfigError` here, before anything starts."""
    gpus = layout_gpus(config) if gpus is None else gpus
    resolved = _filled(config, gpus, usable_cores() if cores is None else cores)
    place(resolved, gpus)
    inherited_devices(gpus)
    split = colocated_split(resolved, gpus)
    if split is not None:    # auto becomes the mode it chose; the engines' share becomes a flag
        resolved = replace(resolved, run=replace(resolved.run, colocate=split.mode),
                           inference=replace(resolved.inference, memory_fraction=split.fraction))
    return resolved


def colocation_note(unresolved: Config, gpus: Optional[int] = None) -> Optional[str]:
    """One line on how a colocated run shares the node (None when it does not colocate)."""
    gpus = layout_gpus(unresolved) if gpus is None else gpus
    split = colocated_split(_filled(unresolved, gpus), gpus)
    if split is not None:
        chosen = "" if unresolved.run.colocate.shares else f"{gpus} GPU{'s' * (gpus != 1)}, run.colocate=auto: "
        return chosen + split.describe()
    mode = colocation(unresolved, gpus)
    if mode.shares:
        return (f"colocated ({mode.value}) with nothing on a GPU: the engines and the trainer share this "
                "machine's cores" + (", the engines releasing their memory while the trainer trains"
                                     if mode is Colocate.swap else ""))
    return None


def layout_choice(unresolved: Config, resolved: Config, cores: Optional[int] = None) -> Optional[str]:
    """One line saying what the unset CPU engine layout of ``unresolved`` became in ``resolved``
    (None when nothing of it was left unset, or no CPU engines are launched)."""
    if not _launches_cpu_engines(unresolved):
        return None
    inference = resolved.inference
    chosen = [f"inference.num_servers={inference.num_servers}" if unresolved.inference.num_servers is None else "",
              f"inference.cpu.max_batch={inference.cpu.max_batch}" if unresolved.inference.cpu.max_batch is None else ""]
    chosen = [part for part in chosen if part]
    if not chosen:
        return None
    cores = usable_cores() if cores is None else cores
    return f"layout for {cores} usable core{'s' * (cores != 1)}: {', '.join(chosen)} (set them to choose)"


def place(config: Config, gpus: int) -> Placement:
    """Assign this node's ``gpus`` GPUs (see the module doc); unset counts are filled first."""
    config = _filled(config, gpus)
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
    for key, ids in (("inference.gpus", server_ids), ("trainer.fsdp.gpus", trainer_ids)):
        bad = [i for i in ids if not 0 <= i < gpus]
        if bad or len(set(ids)) != len(ids):
            raise ConfigError(key, f"GPU ids {ids} must be distinct and in [0, run.gpus={gpus})")
    size = inference.tp_size
    if need_servers and need_trainer and colocation(config, gpus).shares:
        server_ids = server_ids or list(range(need_servers))
        trainer_ids = trainer_ids or list(range(need_trainer))
        if max(server_ids + trainer_ids) >= gpus:
            raise ConfigError("run.gpus", f"{gpus} GPUs are too few even colocated: inference.num_servers="
                                          f"{server_count} x inference.tp_size={size} servers need {need_servers}, "
                                          f"trainer.fsdp.nproc={need_trainer} ranks need {need_trainer}")
        return Placement(servers=[server_ids[i * size:(i + 1) * size] for i in range(server_count)],
                         trainer=trainer_ids)
    overlap = sorted(set(server_ids) & set(trainer_ids))
    if overlap:
        raise ConfigError("inference.gpus", f"GPUs {overlap} are also in trainer.fsdp.gpus (or set "
                                            "run.colocate=resident to share them)")
    free = [i for i in range(gpus) if i not in server_ids and i not in trainer_ids]
    if not server_ids:
        server_ids, free = free[:need_servers], free[need_servers:]
    if not trainer_ids:
        trainer_ids, free = free[:need_trainer], free[need_trainer:]
    if len(server_ids) < need_servers or len(trainer_ids) < need_trainer:
        raise ConfigError("run.gpus", f"{gpus} GPUs are too few: inference.num_servers={server_count} x "
                                      f"inference.tp_size={inference.tp_size} servers and "
                                      f"trainer.fsdp.nproc={need_trainer} trainer processes need "
                                      f"{need_servers + need_trainer} (or set run.colocate=resident to share "
                                      "them)")
    return Placement(servers=[server_ids[i * size:(i + 1) * size] for i in range(server_count)],
                     trainer=trainer_ids)


def idle_gpu_warning(config: Config, gpus: Optional[int] = None) -> Optional[str]:
    """A line naming the keys when this node's GPUs (default :func:`layout_gpus`) stay idle
    although the run places processes on GPUs (None when every GPU is used, or nothing is on
    GPUs: a CPU run)."""
    gpus = layout_gpus(config) if gpus is None else gpus
    config = _filled(config, gpus)
    placement = place(config, gpus)
    used = {i for ids in placement.servers for i in ids} | set(placement.trainer)
    idle = [i for i in range(gpus) if i not in used]
    if not used or not idle:
        return None
    inference, nproc = config.inference, config.trainer.fsdp.nproc
    parts = []
    if placement.servers:
        parts.append(f"inference.num_servers={inference.num_servers} x inference.tp_size={inference.tp_size}")
    if placement.trainer:
        parts.append(f"trainer.fsdp.nproc={nproc}")
    head = f"GPUs {idle} of this node's {gpus} (run.gpus) stay idle: {' and '.join(parts)} use {len(used)}"
    if placement.servers and len(idle) < inference.tp_size:
        return f"{head}; too few for another server of inference.tp_size={inference.tp_size}"
    return (f"{head}; set inference.num_servers and trainer.fsdp.nproc to null to fill the node, "
            "or raise them")


def inherited_devices(gpus: int) -> list[str]:
    """What plan id ``i`` names on node 0: the ``i``-th entry of the ``CUDA_VISIBLE_DEVICES`` the
    orchestrator inherited, else ``i``. Raises :class:`ConfigError` (``run.gpus``) when the
    inherited list has fewer than ``gpus`` entries."""
    inherited = os.environ.get("CUDA_VISIBLE_DEVICES")
    if inherited is None:
        return [str(i) for i in range(gpus)]
    devices = [d.strip() for d in inherited.split(",") if d.strip()]
    if len(devices) < gpus:
        raise ConfigError("run.gpus", f"{gpus} GPUs planned, but the inherited CUDA_VISIBLE_DEVICES="
                                      f"{inherited!r} makes {len(devices)} visible")
    return devices


def visible_env(ids: list[int], devices: Optional[list[str]] = None) -> dict[str, str]:
    """``CUDA_VISIBLE_DEVICES`` for plan ids ``ids``, each translated through ``devices`` (see
    :func:`inherited_devices`) when given; {} for no ids."""
    names = [devices[i] for i in ids] if devices is not None else [str(i) for i in ids]
    return {"CUDA_VISIBLE_DEVICES": ",".join(names)} if names else {}


def node_trainer_gpus(config: Config, placement: Placement, node: int) -> list[int]:
    """The trainer's GPU ids on ``node``: node 0's come from the placement (after the servers);
    any other node is all the trainer's — ``trainer.fsdp.gpus`` when pinned, else
    ``0..nproc-1`` — and has none when node 0's trainer has none (a CPU trainer)."""
    if node == 0 or not placement.trainer:
        return placement.trainer
    fsdp = config.trainer.fsdp
    return list(fsdp.gpus) or list(range(len(placement.trainer)))


def server_env(config: Config, index: int) -> dict[str, str]:
    """The environment launched server ``index`` gets on top of the runner's (node 0)."""
    gpus = visible_gpus(config)
    placement = place(config, gpus)
    if index >= len(placement.servers):
        return {}
    return visible_env(placement.servers[index], inherited_devices(gpus))


def trainer_env(config: Config, node: Optional[int] = None) -> dict[str, str]:
    """The environment ``node``'s torchrun agent (default: ``trainer.fsdp.node_rank``) gets on top
    of the runner's; only node 0's ids are translated through the inherited devices."""
    node = config.trainer.fsdp.node_rank if node is None else node
    gpus = visible_gpus(config)
    ids = node_trainer_gpus(config, place(config, gpus), node)
    return visible_env(ids, inherited_devices(gpus) if node == 0 else None)
