"""The command line of the trainer's torchrun agent (or of its single worker) on one node."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

_MULTI_NODE_FLAGS = ("--nnodes", "--node-rank", "--rdzv-endpoint", "--rdzv-backend", "--rdzv-id",
                     "--rdzv-conf", "--master-addr", "--master-port")


def trainer_command(config, run_dir: Path, resume: Optional[Path] = None, *,
                    node_rank: Optional[int] = None) -> list[str]:
    """The command line the runner launches: the worker itself for one process on one node and
    no extra torchrun arguments (torchrun's agent would cost a second torch import at every
    start); else torchrun: ``--standalone`` on one node, a c10d rendezvous at
    ``trainer.fsdp.rdzv_endpoint`` across ``trainer.fsdp.nnodes`` (``node_rank`` defaults to
    ``trainer.fsdp.node_rank``), or whatever the extra torchrun arguments set up."""
    trainer = config.trainer.fsdp
    if trainer.nproc == 1 and trainer.nnodes == 1 and not trainer.torchrun_args:
        command = [sys.executable, "-m", "rlorch.trainer.fsdp", "--run-dir", str(run_dir)]
        return command + (["--resume", str(resume)] if resume is not None else [])
    flags = {arg.split("=", 1)[0].replace("_", "-") for arg in trainer.torchrun_args}
    command = [sys.executable, "-m", "torch.distributed.run"]
    if trainer.nnodes > 1:
        rank = trainer.node_rank if node_rank is None else node_rank
        command += ["--nnodes", str(trainer.nnodes), "--node-rank", str(rank), "--rdzv-backend", "c10d",
                    "--rdzv-endpoint", trainer.rdzv_endpoint, "--rdzv-id", config.run.name]
    elif not flags & set(_MULTI_NODE_FLAGS):
        command.append("--standalone")
    command += ["--nproc-per-node", str(trainer.nproc), *trainer.torchrun_args,
                "-m", "rlorch.trainer.fsdp", "--run-dir", str(run_dir)]
    if resume is not None:
        command += ["--resume", str(resume)]
    return command
