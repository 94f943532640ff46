"""Trainer rank 0's end of weight transfer over a process group (``inference.weight_transfer=distributed``).

At start, rank 0 picks the rendezvous (``trainer/weight_group.json``, read by the orchestrator,
which asks every engine to join with SGLang's ``/init_weights_update_group``) and then joins
the group itself. For each new version it writes the offer ``broadcast/step_N.json`` (SGLang's
``names``/``dtypes``/``shapes`` of the full state dict) and broadcasts the tensors in that
order; the orchestrator's watcher sees the offer and has every engine receive it with
``/update_weights_from_distributed``.

Invariant: a version that could not be broadcast is published to disk instead (and the log
says so): the watcher then loads it from there. After a failed broadcast the group is
abandoned and later versions go by disk as well.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Any, Callable, Optional

from rlorch.config.schema import InferenceBackend, WeightTransfer
from rlorch.rundir.layout import RunDir, parse_step, write_json_atomic
from rlorch.launch.weight_group import GroupSpec, broadcast, dtype_name, open_group


def engine_count(config) -> int:
    return len(config.inference.addresses) or config.inference.num_servers


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


@dataclass
class Broadcaster:
    run: RunDir
    spec: GroupSpec
    timeout: float
    device: str
    log: Callable[[str], None]
    group: Any = None

    def join(self) -> None:
        """Block until every engine has joined (the orchestrator asks them once the trainer is
        ready); a group that does not form leaves every version to the disk."""
        try:
            self.group = open_group(self.spec, rank=0, timeout=self.timeout)
        except RuntimeError as err:
            self.log(f"weight group {self.spec.group_name} did not form ({err}); every version goes by disk")
            return
        self.log(f"weight group {self.spec.group_name} ready: {self.spec.world_size - 1} engine(s) over "
                 f"{self.spec.backend}")

    def send(self, step: int, state: dict) -> bool:
        """Offer version ``step`` and broadcast it; False (said in the log) when it did not go
        through, so the caller publishes it to disk instead."""
        if self.group is None:
            return False
        names = list(state)
        offer = {"names": names, "dtypes": [dtype_name(state[n].dtype) for n in names],
                 "shapes": [list(state[n].shape) for n in names], "group_name": self.spec.group_name}
        write_json_atomic(self.run.offer_for(step), offer)
        try:
            broadcast(self.group, [state[n].to(self.device) for n in names])
        except RuntimeError as err:
            self.run.offer_for(step).unlink(missing_ok=True)
            self.group = None
            self.log(f"broadcast of version {step} failed ({err}); version {step} and later ones go by disk")
            return False
        finally:
            self._forget_before(step)
        return True

    def _forget_before(self, step: int) -> None:
        for entry in self.run.offers.glob("step_*.json"):
            older = parse_step(entry.name.removesuffix(".json"))
            if older is not None and older < step:
                entry.unlink(missing_ok=True)


def plan(config, run: RunDir, log: Callable[[str], None]) -> Optional[Broadcaster]:
    """Rank 0: the broadcaster of this run (None with ``weight_transfer=disk``); its rendezvous
    is written to ``trainer/weight_group.json`` before the trainer reports ready."""
    inference = config.inference
    if inference.weight_transfer != WeightTransfer.distributed:
        return None
    backend = "gloo" if inference.backend == InferenceBackend.cpu else "nccl"
    spec = GroupSpec(master_address=inference.transfer_address, master_port=_free_port(inference.transfer_address),
                     rank_offset=1, world_size=1 + engine_count(config), backend=backend)
    run.offers.mkdir(parents=True, exist_ok=True)
    for entry in run.offers.glob("step_*.json"):
        entry.unlink(missing_ok=True)
    write_json_atomic(run.weight_group, {**spec.to_json(), "pid": os.getpid()})
    return Broadcaster(run, spec, inference.transfer_timeout, "cpu" if backend == "gloo" else "cuda", log)
