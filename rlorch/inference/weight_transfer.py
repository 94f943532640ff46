"""The orchestrator's part in ``inference.weight_transfer=distributed``: once the trainer is ready,
every engine joins the trainer's weight group (the trainer's rank 0 joins it at the same time).

Versions then arrive as offers the weight watcher has the engines receive; the trainer side is
:mod:`rlorch.trainer.broadcast`.
"""

from __future__ import annotations

import json
import logging

from rlorch.config.schema import Config, WeightTransfer
from rlorch.rundir.layout import RunDir

log = logging.getLogger("rlorch.weight_transfer")


async def join_weight_group(config: Config, run_dir: RunDir, engines) -> bool:
    """Have every engine join the group the trainer announced in ``trainer/weight_group.json``;
    False (and a warning) when they could not: the trainer then publishes every version to disk."""
    if config.inference.weight_transfer != WeightTransfer.distributed:
        return False
    announced = json.loads(run_dir.weight_group.read_text())
    spec = {key: announced[key] for key in ("master_address", "master_port", "rank_offset", "world_size",
                                             "group_name", "backend")}
    try:
        await engines.init_weights_update_group(spec)
    except Exception as err:  # the disk is the fallback: a group that did not form must not end the run
        log.warning("the engines did not join the weight group (%s); weights go by disk", err)
        return False
    return True
