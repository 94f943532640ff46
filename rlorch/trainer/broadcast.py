"""Trainer rank 0's end of weight transfer over a process group (``inference.weight_transfer=distributed``).

The hand-shake, through the run directory, never lets either side wait longer than
``inference.transfer_timeout``:

1. At start, rank 0 picks the rendezvous and a group name unique to this start
   (``trainer/weight_group.json``) and becomes ready.
2. The orchestrator sizes the group from the servers it has (``1 + Σ tp_size``), writes
   ``trainer/weight_group.members.json`` and asks every engine to join (SGLang's
   ``/init_weights_update_group``); rank 0 joins once it reads the size. No size, or a group
   that has not formed, within the timeout leaves every version to the disk.
3. For each version rank 0 writes the offer ``broadcast/step_N.json`` (SGLang's
   ``names``/``dtypes``/``shapes``) and waits for the orchestrator's answer:
   ``broadcast/step_N.receiving`` once every engine has opened a weight-update session (only
   then does it broadcast), or ``step_N.refused`` (that version goes by disk at once).

   The answer can also be ``broadcast/step_N.regroup`` (``{"world_size": N}``): the set of
   servers changed (one restarted, joined or left). Rank 0 then destroys its group, announces a
   new one in ``weight_group.json`` (the name suffixed with a generation, a fresh port), joins
   it with that many members while the orchestrator has every server join too (the survivors
   destroyed the old group first: SGLang's ``/destroy_weights_update_group``), and waits for
   ``receiving``/``refused`` again.

4. ``broadcast/publish.request``: a restarted server cannot catch up over the group when no
   live server is left to receive the next version; the trainer, waiting for a batch, then
   writes its current weights to disk (:func:`rlorch.trainer.handoff.publish_on_request`).

Invariant: a version that was not broadcast is published to disk instead (and the log says so):
the watcher loads it from there, or skips it for a newer one published meanwhile, and counts
each version it loads from disk in ``transfer_fallbacks``. After a failed or
unanswered offer, or a rebuild that did not form, rank 0 holds no group; it keeps offering
later versions (with ``group_name`` null), so the orchestrator rebuilds the group for the next.
Only a group that never formed at start leaves every version to the disk.
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional

from rlorch.config.schema import WeightTransfer
from rlorch.launch.weight_group import GroupSpec, broadcast, close_group, dtype_name, open_group
from rlorch.rundir.layout import RunDir, parse_step, write_json_atomic

POLL_S = 0.05


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
    joined: bool = False
    """The group formed at start: only then are versions offered (and the group rebuilt)."""
    generation: int = 0
    """How many times the group was rebuilt; the suffix of its name."""
    base_name: str = ""

    def join(self) -> None:
        """Block until every engine has joined (the orchestrator asks them once the trainer is
        ready) or ``timeout`` passes; a group that does not form leaves every version to the disk."""
        members = _wait_for(self.run.weight_group_members, self.timeout)
        if members is None:
            self.log(f"weight group {self.spec.group_name} not sized by the orchestrator within "
                     f"{self.timeout:g}s; every version goes by disk")
            return
        self.spec = replace(self.spec, world_size=int(members["world_size"]))
        try:
            self.group = open_group(self.spec, rank=0, timeout=self.timeout)
        except Exception as err:  # torch raises RuntimeError, DistStoreError, DistNetworkError
            self.log(f"weight group {self.spec.group_name} did not form ({err}); every version goes by disk")
            return
        self.joined = True
        self.log(f"weight group {self.spec.group_name} ready: {self.spec.world_size - 1} engine(s) over "
                 f"{self.spec.backend}")

    def send(self, step: int, state: dict) -> bool:
        """Offer version ``step`` and broadcast it (rebuilding the group first when the
        orchestrator asks); False (said in the log) when it did not go through, so the caller
        publishes it to disk instead."""
        names = list(state)
        if not self.offer(step, names, [state[n].dtype for n in names], [list(state[n].shape) for n in names]):
            return False
        return self.transmit(step, (state[n] for n in names), last=True)

    def offer(self, step: int, names: list[str], dtypes: list, shapes: list[list[int]]) -> bool:
        """Offer version ``step`` (SGLang's names, dtypes and shapes) and wait for the answer,
        rebuilding the group first when the orchestrator asks; True once every engine is
        receiving: the tensors must then follow, in ``names``' order (:meth:`transmit`). False
        (said in the log): nothing is sent, the version goes by disk."""
        if not self.joined:
            return False
        offer = {"names": names, "dtypes": [dtype_name(dtype) for dtype in dtypes], "shapes": shapes,
                 "group_name": self.spec.group_name if self.group is not None else None}
        write_json_atomic(self.run.offer_for(step), offer)
        marks = [self.run.offer_mark(step, "receiving"), self.run.offer_mark(step, "refused")]
        answer = _wait_any([*marks, self.run.offer_mark(step, "regroup")], self.timeout)
        if answer is not None and answer.suffix == ".regroup":
            if not self.regroup(int(json.loads(answer.read_text())["world_size"])):
                self.run.offer_for(step).unlink(missing_ok=True)
                self.log(f"version {step} goes by disk (the weight group was not rebuilt)")
                self._forget_before(step)
                return False
            answer = _wait_any(marks, self.timeout)
        if answer is None or answer.suffix == ".refused" or self.group is None:
            self.run.offer_for(step).unlink(missing_ok=True)
            if answer is None:
                self.group = None
                self.log(f"no answer to the offer of version {step} within {self.timeout:g}s; "
                         f"version {step} goes by disk, the next one rebuilds the group")
            else:
                self.log(f"the engines refused version {step} over the group; it goes by disk")
            self._forget_before(step)
            return False
        return True

    def transmit(self, step: int, tensors, *, last: bool) -> bool:
        """Broadcast the next of the offered tensors (all of them with ``last``); False (said in
        the log) when the group failed: the group is dropped (the next version rebuilds it)."""
        try:
            broadcast(self.group, [tensor.to(self.device) for tensor in tensors])
        except Exception as err:  # a transport error or the group's timeout
            self.run.offer_for(step).unlink(missing_ok=True)
            self.group = None
            self._forget_before(step)
            self.log(f"broadcast of version {step} failed ({err}); version {step} goes by disk, "
                     "the next one rebuilds the group")
            return False
        if last:
            self._forget_before(step)
        return True

    def regroup(self, world_size: int) -> bool:
        """Leave the group and form a new one of ``world_size`` members under a new name and
        port (announced in ``weight_group.json``); False (said in the log) when it did not form
        within the timeout."""
        if self.group is not None:
            try:
                close_group(self.group)
            except Exception as err:  # a group whose peers died may not close cleanly; it is dropped anyway
                self.log(f"weight group {self.spec.group_name} did not close cleanly ({err})")
            self.group = None
        self.generation += 1
        self.base_name = self.base_name or self.spec.group_name
        self.spec = replace(self.spec, world_size=world_size, master_port=_free_port(self.spec.master_address),
                            group_name=f"{self.base_name}-g{self.generation}")
        write_json_atomic(self.run.weight_group, {**self.spec.to_json(), "pid": os.getpid(),
                                                  "generation": self.generation})
        try:
            self.group = open_group(self.spec, rank=0, timeout=self.timeout)
        except Exception as err:  # torch raises RuntimeError, DistStoreError, DistNetworkError
            self.log(f"weight group {self.spec.group_name} did not form ({err})")
            return False
        self.log(f"weight group rebuilt as {self.spec.group_name}: {world_size - 1} engine rank(s)")
        return True

    def _forget_before(self, step: int) -> None:
        for entry in self.run.offers.glob("step_*"):
            older = parse_step(entry.name.split(".")[0])
            if older is not None and older < step:
                entry.unlink(missing_ok=True)


def _wait_for(path, timeout: float) -> Optional[dict]:
    """The JSON object at ``path`` once it exists, or None after ``timeout`` seconds."""
    return json.loads(path.read_text()) if _wait_any([path], timeout) is not None else None


def _wait_any(paths: list, timeout: float):
    """The first of ``paths`` to exist, or None after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        found = next((path for path in paths if path.exists()), None)
        if found is not None or time.monotonic() > deadline:
            return found
        time.sleep(POLL_S)


TRANSFER_ADDRESS_ENV = "RLORCH_TRANSFER_ADDRESS"
"""Set by a launcher that knows the address engines reach this node at; overrides
``inference.transfer_address``."""


def plan(config, run: RunDir, device, log: Callable[[str], None]) -> Optional[Broadcaster]:
    """Rank 0: the broadcaster of this run (None with ``weight_transfer=disk``); its rendezvous
    is written to ``trainer/weight_group.json`` before the trainer reports ready. The group's
    backend follows the trainer's ``device`` (gloo on CPU, NCCL on CUDA), and its name is unique to
    this start, so servers that outlive a run (or hold a crashed start's group) never refuse it."""
    inference = config.inference
    if inference.weight_transfer != WeightTransfer.distributed:
        return None
    backend = "nccl" if str(device).startswith("cuda") else "gloo"
    # Under run.launcher=ray the launcher names this node's IP (the engines are on other nodes).
    address = os.environ.get(TRANSFER_ADDRESS_ENV) or inference.transfer_address
    spec = GroupSpec(master_address=address, master_port=_free_port(address),
                     rank_offset=1, world_size=0, backend=backend,
                     group_name=f"rlorch-{os.getpid()}-{time.time_ns() % 10**9}")
    run.offers.mkdir(parents=True, exist_ok=True)
    for entry in run.offers.glob("step_*"):
        entry.unlink(missing_ok=True)
    run.weight_group_members.unlink(missing_ok=True)
    run.publish_request.unlink(missing_ok=True)
    write_json_atomic(run.weight_group, {**spec.to_json(), "pid": os.getpid()})
    return Broadcaster(run, spec, inference.transfer_timeout, str(device), log)
