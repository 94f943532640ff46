"""Served weights gathered and handed on one tensor at a time.

A sharded model's version is never assembled whole: the ranks gather one parameter at a time
(``full_tensor()``, a collective every rank joins in the same order), rank 0 casts it to the
served dtype on the device and hands it to a consumer (the weight group's broadcast, or a
safetensors shard on disk) running on another thread, through a queue of at most
:data:`IN_FLIGHT` tensors. The ranks' memory beyond their shards is then a few full tensors,
where gathering the whole state dict to rank 0's host would hold the model there in float32 and
again in the served dtype (a 7B model: 45 GB of host memory on rank 0 every step).
"""

from __future__ import annotations

import queue
from collections import Counter
from concurrent.futures import Executor, Future
from typing import Callable, Iterator, TypeVar

import torch

IN_FLIGHT = 2
"""Gathered tensors waiting for the consumer: the producer blocks beyond them."""

_END = object()
T = TypeVar("T")


def served_tensors(model: torch.nn.Module, dtype: torch.dtype, rank: int) -> Iterator[tuple[str, torch.Tensor]]:
    """Collective: every rank walks ``model``'s state dict in the same order and gathers each
    tensor; rank 0 is given each one, full, cast to ``dtype`` (floating point only) on its
    device, under every name it has (tied weights are gathered once); the others get nothing."""
    state = model.state_dict(keep_vars=True)
    names_of = Counter(id(tensor) for tensor in state.values())
    tied: dict[int, torch.Tensor] = {}
    for name, tensor in state.items():
        full = tied.get(id(tensor))
        if full is None:
            full = tensor.detach()
            if hasattr(full, "full_tensor"):
                full = full.full_tensor()
            if full.is_floating_point():
                full = full.to(dtype)
            if names_of[id(tensor)] > 1:
                tied[id(tensor)] = full
        if rank == 0:
            yield name, full


def offer_of(model: torch.nn.Module, dtype: torch.dtype) -> tuple[list[str], list[torch.dtype], list[list[int]]]:
    """The names, dtypes and shapes :func:`served_tensors` will give, without gathering."""
    state = model.state_dict(keep_vars=True)
    names = list(state)
    dtypes = [dtype if state[name].is_floating_point() else state[name].dtype for name in names]
    return names, dtypes, [list(state[name].shape) for name in names]


def stream(tensors: Iterator[tuple[str, torch.Tensor]], consume: Callable[[Iterator[tuple[str, torch.Tensor]]], T],
           executor: Executor) -> T:
    """Run ``consume`` on ``executor`` over ``tensors`` as this thread produces them (at most
    :data:`IN_FLIGHT` ahead) and return its result. A consumer that fails or returns early stops
    nothing: the rest is still produced (the other ranks gather too) and dropped; its error is
    raised once the producer is done."""
    handoff: queue.Queue = queue.Queue(maxsize=IN_FLIGHT)
    future = executor.submit(lambda: _drained(consume, handoff))
    for item in tensors:
        _put(handoff, item, future)
    _put(handoff, _END, future)
    return future.result()


def _drained(consume: Callable, handoff: queue.Queue):
    def items():
        while (item := handoff.get()) is not _END:
            yield item

    remaining = items()
    try:
        return consume(remaining)
    finally:
        for _ in remaining:  # whatever the consumer left, so the producer never blocks
            pass


def _put(handoff: queue.Queue, item, consumer: Future) -> None:
    """Queue ``item`` unless the consumer has ended (with an error, or early)."""
    while not consumer.done():
        try:
            handoff.put(item, timeout=0.05)
            return
        except queue.Full:
            continue
