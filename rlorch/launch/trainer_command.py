"""The command line of the trainer's torchrun agent (or of its single worker) on one node, and
what a launcher on that node needs to start a one-node torchrun's ranks itself."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

from rlorch.launch.placement import resolve_layout

from rlorch.config.schema import ConfigError

_MULTI_NODE_FLAGS = ("--nnodes", "--node-rank", "--rdzv-endpoint", "--rdzv-backend", "--rdzv-id",
                     "--rdzv-conf", "--master-addr", "--master-port")


def master_address(endpoint: str) -> tuple[str, str]:
    """``(host, port)`` of ``trainer.fsdp.rdzv_endpoint`` (``host:port``, ``[v6]:port``)."""
    host, _, port = endpoint.rpartition(":")
    host = host.strip("[]")
    if not host or not port.isdigit():
        raise ConfigError("trainer.fsdp.rdzv_endpoint", f"must be host:port (got {endpoint!r})")
    return host, port


def _nproc(config) -> int:
    """``trainer.fsdp.nproc``, resolved for this node when unset (rlorch.launch.placement)."""
    nproc = config.trainer.fsdp.nproc
    return resolve_layout(config).trainer.fsdp.nproc if nproc is None else nproc


def _static_rendezvous(config, node_rank: Optional[int]) -> list[str]:
    """torchrun's static rendezvous across ``trainer.fsdp.nnodes``: node ``node_rank`` (default
    ``trainer.fsdp.node_rank``) joins node 0's agent at ``trainer.fsdp.rdzv_endpoint``. Static,
    not c10d: c10d ignores ``--node-rank`` and assigns node ranks itself, so global rank 0 —
    which hosts the weight group's store — could land off node 0."""
    trainer = config.trainer.fsdp
    # Unset only with run.launcher=ray, which fills in node 0's IP and a free port there.
    host, port = master_address(trainer.rdzv_endpoint or "<node 0 ip>:0")
    rank = trainer.node_rank if node_rank is None else node_rank
    return ["--nnodes", str(trainer.nnodes), "--node-rank", str(rank), "--master-addr", host,
            "--master-port", port]


def trainer_command(config, run_dir: Path, resume: Optional[Path] = None, *,
                    node_rank: Optional[int] = None) -> list[str]:
    """The command line the runner launches: the worker itself for one process on one node and
    no extra torchrun arguments (torchrun's agent would cost a second torch import at every
    start); else torchrun: ``--standalone`` on one node, a static rendezvous at
    ``trainer.fsdp.rdzv_endpoint`` across ``trainer.fsdp.nnodes`` (:func:`_static_rendezvous`),
    or whatever the extra torchrun arguments set up."""
    trainer = config.trainer.fsdp
    nproc = _nproc(config)
    if nproc == 1 and trainer.nnodes == 1 and not trainer.torchrun_args:
        command = [sys.executable, "-m", "rlorch.trainer.fsdp", "--run-dir", str(run_dir)]
        return command + (["--resume", str(resume)] if resume is not None else [])
    flags = {arg.split("=", 1)[0].replace("_", "-") for arg in trainer.torchrun_args}
    command = [sys.executable, "-m", "torch.distributed.run"]
    if trainer.nnodes > 1:
        command += _static_rendezvous(config, node_rank)
    elif not flags & set(_MULTI_NODE_FLAGS):
        command.append("--standalone")
    command += ["--nproc-per-node", str(nproc), *trainer.torchrun_args,
                "-m", "rlorch.trainer.fsdp", "--run-dir", str(run_dir)]
    if resume is not None:
        command += ["--resume", str(resume)]
    return command


TORCHRUN = ("-m", "torch.distributed.run")
WORKER = ("-m", "rlorch.trainer.fsdp")


def standalone_ranks(command: list[str]) -> Optional[tuple[int, list[str]]]:
    """``(nproc, the worker's own command)`` when ``command`` is exactly a one-node torchrun of
    the trainer worker (``--standalone --nproc-per-node N``, nothing else: what
    :func:`trainer_command` builds on one node without ``trainer.fsdp.torchrun_args``), else None.
    A launcher on that node may then start the ranks itself with :func:`rank_env`: torchrun's
    agent only sets their environment and watches them, and costs a torch import of its own and
    a cold start of every rank."""
    head = [sys.executable, *TORCHRUN, "--standalone", "--nproc-per-node"]
    if command[:len(head)] != head or len(command) < len(head) + 3 or not command[len(head)].isdigit():
        return None
    rest = command[len(head) + 1:]
    if tuple(rest[:2]) != WORKER:
        return None
    return int(command[len(head)]), [sys.executable, *WORKER, *rest[2:]]


def rank_env(rank: int, nproc: int, port: int) -> dict[str, str]:
    """The environment torchrun gives rank ``rank`` of ``nproc`` on one node, with rank 0 hosting
    the rendezvous store at ``127.0.0.1:port`` (``init_process_group``'s ``env://``)."""
    return {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc),
            "LOCAL_WORLD_SIZE": str(nproc), "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1",
            "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(nproc), "ROLE_NAME": "default",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
