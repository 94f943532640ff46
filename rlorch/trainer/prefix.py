"""Shared prompts: each distinct prompt of a micro-batch runs through the model once.

GRPO samples every prompt ``group_size`` times, so a padded micro-batch holds each prompt's
tokens that many times, and the model's layers run over every copy. Causal attention makes a
prompt's hidden states the same in every copy, and a sequence's last token scores nothing (no
trained token follows it). :func:`layout` lays a micro-batch out for the model as one packed
row: each distinct *prefix* (a sequence's tokens before its first trained token) once, then
each sequence's tokens from its first trained token up to, not including, its last one. Every
layer but attention runs over that row alone; attention gives each sequence a virtual row of
its prefix's slots followed by its own (:class:`rlorch.qwen2.Packing`'s gather), so each of
its queries sees exactly the keys it sees in its padded row. The output layer scores each
trained token from the hidden state its padded row would have there (``hidden_index``).

The scores are those of the padded micro-batch up to float rounding (the same operations on
differently shaped matrices; tested within 1e-5, gradients too). On the default task (prompts
of 5 tokens, 8 samples each, 3 new tokens) a 64-sequence micro-batch runs over 168 positions
instead of 512.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch

if TYPE_CHECKING:
    from rlorch.qwen2 import Packing

WORTH_SHARING = 0.9
"""Laid-out positions, as a fraction of the micro-batch's, at or below which the layout is used;
a smaller saving is left to the plain pass, whose attention needs no gathers."""


@dataclass(frozen=True)
class SharedLayout:
    """A micro-batch as one packed row of distinct prefixes and trained spans."""

    input_ids: torch.Tensor
    """``[1, N]`` token ids: each distinct prefix, then each sequence's span."""
    position_ids: torch.Tensor
    """``[1, N]``: each token's position in its own sequence."""
    gather: torch.Tensor
    """``[sequences, longest]``: for each sequence with a trained token, the row positions of
    its prefix then its span (padding reads position 0, after every real slot)."""
    scatter: torch.Tensor
    """``[N]``: each row position's slot in the flattened ``gather`` layout (a prefix's slots
    in the virtual row of the first sequence that shares it)."""
    lengths: torch.Tensor
    """``[sequences]``: the real slots of each sequence's ``gather`` row (its prefix and span)."""
    hidden_index: torch.Tensor
    """For each trained token of the micro-batch, in ``torch.nonzero(mask)`` order, the row
    position whose hidden state scores it."""

    @property
    def positions(self) -> int:
        return self.input_ids.shape[1]

    def packing(self, device) -> Packing:
        """How the row's positions attend, on ``device``, for the model's ``packing=``."""
        from rlorch.qwen2 import Packing

        return Packing(self.gather.to(device), self.scatter.to(device), self.lengths.to(device))


def spans(mask: torch.Tensor, lengths: Optional[list[int]]) -> list[tuple[int, int, int]]:
    """``(row, start, length)`` of each sequence of a micro-batch: a padded one's rows (padding
    included, it is never trained), a packed one's sequences of its single row."""
    if lengths is None:
        return [(row, 0, mask.shape[1]) for row in range(mask.shape[0])]
    starts = [0]
    for length in lengths[:-1]:
        starts.append(starts[-1] + length)
    return [(0, start, length) for start, length in zip(starts, lengths)]


def layout(tokens: torch.Tensor, mask: torch.Tensor, lengths: Optional[list[int]] = None) -> Optional[SharedLayout]:
    """The shared layout of a micro-batch's ``[rows, positions]`` tokens and loss mask
    (``lengths``: a packed row's sequences), or None where it would not save
    :data:`WORTH_SHARING` of the positions (or no token is trained, or one is at position 0,
    which no hidden state scores)."""
    token_rows, mask_rows = tokens.tolist(), (mask != 0).tolist()
    prefixes: dict[tuple[int, ...], int] = {}   # prefix tokens -> its first position in the row
    prefix_owner: dict[int, int] = {}           # prefix start -> the virtual row holding its slots
    ids: list[int] = []
    positions: list[int] = []
    laid: list[tuple[int, int, int, int]] = []  # per trained sequence: prefix start, prefix length, span start, span length
    hidden_index: list[int] = []
    for row, start, length in spans(mask, lengths):
        trained = [offset for offset, on in enumerate(mask_rows[row][start:start + length]) if on]
        if not trained:
            continue
        first, last = trained[0], trained[-1]
        if first == 0:
            return None
        sequence = token_rows[row][start:start + length]
        key = tuple(sequence[:first])
        prefix_at = prefixes.get(key)
        if prefix_at is None:
            prefix_at = prefixes[key] = len(ids)
            prefix_owner[prefix_at] = len(laid)
            ids += key
            positions += range(first)
        span_at = len(ids)
        ids += sequence[first:last]
        positions += range(first, last)
        laid.append((prefix_at, first, span_at, last - first))
        # Token t is scored by the hidden state at t - 1: the prefix's last for the first.
        hidden_index += [prefix_at + first - 1] + [span_at + offset - first - 1 for offset in trained[1:]]
    if not laid or len(ids) > WORTH_SHARING * mask.numel():
        return None
    prefix_at, prefix_length, span_at, span_length = torch.tensor(laid, dtype=torch.long).unbind(1)
    owns_prefix = torch.tensor([prefix_owner[at] == number for number, (at, *_) in enumerate(laid)])
    longest = int((prefix_length + span_length).max())
    offset = torch.arange(longest)
    in_prefix = offset < prefix_length[:, None]
    in_span = ~in_prefix & (offset < (prefix_length + span_length)[:, None])
    gather = torch.where(in_prefix, prefix_at[:, None] + offset,
                         torch.where(in_span, (span_at - prefix_length)[:, None] + offset, 0))
    # Every row position is read back from one slot: a span's from its own virtual row, a
    # prefix's from its owner's.
    read = in_span | (in_prefix & owns_prefix[:, None])
    scatter = torch.empty(len(ids), dtype=torch.long)
    scatter[gather[read]] = torch.arange(len(laid) * longest).view(len(laid), longest)[read]
    return SharedLayout(input_ids=torch.tensor([ids], dtype=torch.long),
                        position_ids=torch.tensor([positions], dtype=torch.long), gather=gather,
                        scatter=scatter, lengths=prefix_length + span_length,
                        hidden_index=torch.tensor(hidden_index, dtype=torch.long))
