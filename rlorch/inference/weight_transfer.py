"""The orchestrator's part in ``inference.weight_transfer=distributed``: once the trainer is ready,
size the weight group from the servers (``1 + Σ tp_size``), tell the trainer
(``trainer/weight_group.members.json``) and have every engine join (the trainer's rank 0 joins
at the same time). A trainer that exits meanwhile fails the run at once, naming it.

Versions then arrive as offers the weight watcher has the engines receive; the trainer side and
the whole hand-shake are :mod:`rlorch.trainer.broadcast`. When the servers change, the pool
rebuilds the group through :func:`regroup`: it asks the trainer for a new group in its answer to
the offer, and reads the new rendezvous from ``weight_group.json``. When a restarted server
cannot catch up over the group (no live server is left to receive the next version), the pool
asks the trainer to write its weights to disk (``broadcast/publish.request``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Callable, Optional

from rlorch.config.schema import Config, WeightTransfer
from rlorch.lifecycle import cancel_and_wait
from rlorch.rundir.layout import RunDir, write_json_atomic

log = logging.getLogger("rlorch.weight_transfer")
TRAINER_POLL_S = 0.2
REGROUP_POLL_S = 0.05
RENDEZVOUS_KEYS = ("master_address", "master_port", "group_name", "backend")
"""What an engine needs of the trainer's announcement in ``weight_group.json`` to join its group."""


class TrainerExited(RuntimeError):
    """The trainer died while the engines were joining its weight group."""


async def join_weight_group(config: Config, run_dir: RunDir, engines,
                            trainer_error: Callable[[], Optional[str]] = lambda: None) -> bool:
    """Have every engine join the group the trainer announced in ``trainer/weight_group.json``;
    False (and a warning) when they could not: the trainer then publishes every version to disk.
    Raises :class:`TrainerExited` when ``trainer_error`` reports the trainer gone meanwhile."""
    if config.inference.weight_transfer != WeightTransfer.distributed:
        return False
    engines.regroup = lambda version, world_size: regroup(run_dir, version, world_size,
                                                          config.inference.transfer_timeout)
    engines.published = run_dir.published_weights
    engines.request_publish = lambda version: write_json_atomic(run_dir.publish_request, {"version": version})
    announced = json.loads(run_dir.weight_group.read_text())
    _, world_size = engines.weight_group_ranks()
    spec = {**{key: announced[key] for key in RENDEZVOUS_KEYS}, "rank_offset": 1, "world_size": world_size}
    write_json_atomic(run_dir.weight_group_members, {"world_size": world_size})
    joining = asyncio.create_task(engines.init_weights_update_group(spec))
    try:
        while not joining.done():
            problem = trainer_error()
            if problem:
                raise TrainerExited(f"the trainer exited while the engines joined its weight group: {problem}")
            await asyncio.wait({joining}, timeout=TRAINER_POLL_S)
        joining.result()
    except TrainerExited:
        raise
    except Exception as err:  # the disk is the fallback: a group that did not form must not end the run
        log.warning("the engines did not join the weight group (%s); weights go by disk", err)
        return False
    finally:
        await cancel_and_wait(joining)
    return True


async def regroup(run_dir: RunDir, version: int, world_size: int, timeout: float) -> dict:
    """Ask the trainer, in the answer to the offer of ``version``, for a new group of
    ``world_size`` members; its rendezvous once it announces it (a new ``group_name`` in
    ``weight_group.json``). Raises :class:`TimeoutError` after ``timeout`` seconds, or at once
    once the trainer has withdrawn the offer (it gave up waiting and sent that version by disk)."""
    def announced() -> dict:
        try:
            return json.loads(run_dir.weight_group.read_text())
        except (OSError, ValueError):
            return {}

    before = announced().get("group_name")
    write_json_atomic(run_dir.offer_mark(version, "regroup"), {"world_size": world_size})
    deadline = time.monotonic() + timeout
    while (spec := announced()).get("group_name") in (None, before):
        if not run_dir.offer_for(version).exists():
            raise TimeoutError(f"the trainer withdrew its offer of version {version} (it went by disk)")
        if time.monotonic() > deadline:
            raise TimeoutError(f"the trainer announced no new weight group within {timeout:g}s")
        await asyncio.sleep(REGROUP_POLL_S)
    return {key: spec[key] for key in RENDEZVOUS_KEYS}
