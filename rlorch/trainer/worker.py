"""One trainer rank's state, shared by the step (:mod:`rlorch.trainer.fsdp`) and the hand-off of
its versions (:mod:`rlorch.trainer.handoff`)."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Optional

import torch

from rlorch.trainer.broadcast import Broadcaster
from rlorch.trainer.publish import HFWriter


@dataclass
class Worker:
    """One rank's state: the sharded model, its optimizer and where it is in the run."""

    config: object
    run: object
    model: object
    optimizer: object
    tokenizer: object
    writer: HFWriter
    """Rank 0: writes the HF directories of published versions and checkpoints."""
    device: object
    rank: int
    world: int
    step: int = 0
    saved: set = field(default_factory=set)
    """Checkpoints this life resumed from or wrote; any other one on disk gets overwritten."""
    sharded: bool = False
    """Whether the model is FSDP2 units (DTensor parameters): several ranks, or mixed precision."""
    reference: Optional[torch.nn.Module] = None
    """With ``trainer.kl_coef > 0``: the initial weights, frozen and sharded like the policy."""
    broadcaster: Optional[Broadcaster] = None
    """Rank 0 with ``inference.weight_transfer=distributed``: sends each version to the engines."""
    handing_off: Optional[Future] = None
    """Rank 0: the hand-off of the last version (broadcast or disk), running beside the next step."""
    hand_off_thread: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(max_workers=1, thread_name_prefix="rlorch-publish"))
    checkpointing: Optional[Future] = None
    """A single rank's checkpoint being written beside the next steps (:func:`save_checkpoint`)."""
    checkpoint_thread: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(max_workers=1, thread_name_prefix="rlorch-checkpoint"))
    nonfinite: int = 0
    """Consecutive steps that skipped every update for a non-finite gradient."""
    optimizer_steps: int = 0
    """Updates taken, minibatches (and skipped ones) included: the learning-rate schedule's
    position, saved in checkpoints."""
