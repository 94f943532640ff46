"""The launch plan ``rlorch train --dry-run`` prints: the placement joined with the command
builders, one record per process, starting nothing."""

from __future__ import annotations

import json
import os
import shlex
import sys
from pathlib import Path
from typing import Optional

from rlorch.config.schema import Config, InferenceBackend, TrainerBackend
from rlorch.launch.placement import (colocation_note, fill_counts, idle_gpu_warning, inherited_devices, node_trainer_gpus, place,
                                     resolve_layout, visible_env, visible_gpus)
from rlorch.launch.server_command import server_command
from rlorch.launch.trainer_command import trainer_command


def launch_plan(config: Config, *, run_dir: Path) -> list[dict]:
    """One record per process the run would start: ``role``, ``node``, ``command`` (a shell
    line), ``env`` (what it changes). Starts nothing; ports of launched servers are placeholders.
    Unset server and trainer counts are filled first (:func:`resolve_layout`); node 0's GPU ids
    are translated through an inherited ``CUDA_VISIBLE_DEVICES``, other nodes' are their own."""
    gpus = visible_gpus(config)
    config = resolve_layout(config, gpus)
    placement, devices = place(config, gpus), inherited_devices(gpus)
    plan = [{"role": "orchestrator", "node": 0, "command": "rlorch train (this process)", "env": {}}]
    if config.inference.addresses:
        plan += [{"role": "server", "node": None, "command": f"(running at {a})", "env": {}}
                 for a in config.inference.addresses]
    elif config.inference.backend in (InferenceBackend.cpu, InferenceBackend.sglang):
        model = Path(config.model.path) if config.model.path else Path("<default model>")
        for i in range(config.inference.num_servers):
            command = server_command(config, model_path=model, port=30000 + i)
            env = visible_env(placement.servers[i], devices) if i < len(placement.servers) else {}
            plan.append({"role": f"server-{i}", "node": 0, "command": shlex.join(command), "env": env})
    if config.inference.router:
        plan.append({"role": "router", "node": None, "command": f"(running at {config.inference.router})",
                     "env": {}})
    if config.trainer.backend is TrainerBackend.fsdp:
        for node in range(config.trainer.fsdp.nnodes):
            command = trainer_command(config, run_dir, node_rank=node)
            ids = node_trainer_gpus(config, placement, node)
            env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
                   **visible_env(ids, devices if node == 0 else None)}
            plan.append({"role": "trainer", "node": node, "command": shlex.join(command), "env": env})
    else:
        plan.append({"role": "trainer", "node": 0, "command": f"(in process: trainer={config.trainer.backend.value})",
                     "env": {}})
    return plan


def ray_plan(config: Config, *, run_dir: Path) -> list[dict]:
    """With ``run.launcher=ray``: one record per placement group (``bundles``, ``strategy``),
    then one per actor with the command it runs (``<node ip>`` and ``<port>`` are filled on its
    node; the trainer's rendezvous is node 0's). Starts nothing, needs no cluster."""
    from rlorch.launch.ray import node_trainer_command, requests, server_bundles

    config = fill_counts(config, config.run.gpus or 0)
    plan: list[dict] = [{"role": "orchestrator", "node": 0, "command": "rlorch train (this process, the Ray driver)",
                         "env": {}}]
    plan += [{"role": "placement_group", **group} for group in requests(config)]
    if config.inference.addresses:
        plan += [{"role": "server", "node": None, "command": f"(running at {a})", "env": {}}
                 for a in config.inference.addresses]
    elif config.inference.backend in (InferenceBackend.cpu, InferenceBackend.sglang):
        model = Path(config.model.path) if config.model.path else Path("<default model>")
        gpus = int(sum(b.get("GPU", 0) for b in server_bundles(config)))
        for i in range(config.inference.num_servers):
            command = server_command(config, model_path=model, port=0, host="<node ip>")
            placeholders = {"--port": "<port>", "--parent-pid": "<actor pid>"}
            command = [placeholders.get(command[j - 1], a) if j else a for j, a in enumerate(command)]
            plan.append({"role": f"server-{i}", "placement_group": f"server-{i}", "bundle": 0,
                         "command": shlex.join(command),
                         "env": {"CUDA_VISIBLE_DEVICES": f"<{gpus} GPU ids from Ray>"} if gpus else {}})
    if config.trainer.backend is TrainerBackend.fsdp:
        nnodes = config.trainer.fsdp.nnodes
        command = trainer_command(config, run_dir)
        for node in range(nnodes):
            line = node_trainer_command(command, node, "<node 0 ip>", "<port>") if nnodes > 1 else command
            plan.append({"role": "trainer", "placement_group": "trainer", "bundle": node, "command": shlex.join(line),
                         "env": {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}})
    else:
        plan.append({"role": "trainer", "node": 0, "command": f"(in process: trainer={config.trainer.backend.value})",
                     "env": {}})
    return plan


def print_plan(config: Config, run_dir: Optional[Path] = None) -> None:
    """The plan on stdout, one JSON line per process; idle GPUs as a warning on stderr."""
    run_dir = run_dir or Path(config.run.dir or "<run dir>")
    if config.run.launcher == "ray":
        for record in ray_plan(config, run_dir=run_dir):
            print(json.dumps(record))
        return
    for record in launch_plan(config, run_dir=run_dir):
        print(json.dumps(record))
    note = colocation_note(config, visible_gpus(config))
    if note:
        print(f"note: {note}", file=sys.stderr)
    warning = idle_gpu_warning(config, visible_gpus(config))
    if warning:
        print(f"warning: {warning}", file=sys.stderr)
