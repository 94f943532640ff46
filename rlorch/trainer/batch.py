"""Reading a shipped batch file (:mod:`rlorch.rundir.batchfile`, either format) and cutting it into
micro-batches.

Every rank reads the whole file (it is small next to the model) so all ranks agree on the
global token count, and on every rank's share, without a collective. A minibatch is cut either
by count (``trainer.fsdp.micro_batch_size`` sequences a pass, one padded row each; rank ``r``
trains rollouts ``r, r + W, ...``) or by tokens (``trainer.fsdp.max_tokens_per_micro_batch``:
sequences packed back to back into one row a pass, balanced across ranks, so no position is
padding and every rank does the same work).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

import numpy
import torch

from rlorch.jsonlines import parse_record
from rlorch.rundir import batchfile
from rlorch.trainer.prefix import SharedLayout, layout

_REQUIRED = ("tokens", "loss_mask", "logprobs", "advantage")


class BatchError(ValueError):
    """A batch file is malformed; the message names the file and line."""


NO_VERSION = -1
"""Version of a token no policy generated (prompt, environment reply, padding, unknown)."""


@dataclass
class Sequence:
    tokens: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    advantage: float
    reward: float
    versions: list[int] | None = None
    """Per-token policy version aligned with ``tokens`` (NO_VERSION off the loss mask); None
    when the batch line carries no stamps."""
    unlikelihood: bool = False
    """Whether each token's advantage is scaled by ``p / (1 - p)`` of the current policy
    (``"unlikelihood": true`` on the line; see :func:`rlorch.trainer.loss.unlikelihood_weights`)."""


def token_versions(mask: list[int], runs: object, where: str) -> list[int] | None:
    """Expand ``[[version, count], ...]`` over the masked tokens (``mask``: 0s and 1s), in order."""
    if runs is None:
        return None
    expanded: list[int] = []
    try:
        for version, count in runs:
            expanded += [int(version)] * int(count)
    except (TypeError, ValueError) as err:
        raise BatchError(f"{where}: versions must be [[version, count], ...] ({err})") from err
    masked = len(mask) - mask.count(0)
    if len(expanded) != masked:
        raise BatchError(f"{where}: versions cover {len(expanded)} tokens but loss_mask marks {masked}")
    if not masked:
        return [NO_VERSION] * len(mask)
    first = mask.index(1)
    if masked == len(mask) - first:    # one block (a prompt, then trained tokens only): no merge
        return [NO_VERSION] * first + expanded
    stamps = iter(expanded)
    return [next(stamps) if m else NO_VERSION for m in mask]


def _parse_line(path: Path, number: int, line: str) -> tuple[Sequence, object]:
    where = f"{path}:{number}"
    item = parse_record(line, where, _REQUIRED, BatchError, own=True)
    tokens, mask, logprobs = item["tokens"], item["loss_mask"], item["logprobs"]
    if not (isinstance(tokens, list) and isinstance(mask, list) and isinstance(logprobs, list)):
        raise BatchError(f"{where}: tokens, loss_mask and logprobs must be lists")
    if not tokens or not len(tokens) == len(mask) == len(logprobs):
        raise BatchError(f"{where}: tokens ({len(tokens)}), loss_mask ({len(mask)}) and logprobs "
                         f"({len(logprobs)}) must be non-empty and of equal length")
    if mask[0]:
        raise BatchError(f"{where}: loss_mask[0] is set, but the first token has no context to be trained on")
    try:
        arrays = [int(t) for t in tokens], [int(bool(m)) for m in mask], [float(p) for p in logprobs]
    except (TypeError, ValueError) as err:
        raise BatchError(f"{where}: non-numeric value ({err})") from err
    if not all(map(math.isfinite, arrays[2])):
        raise BatchError(f"{where}: advantage and logprobs must be finite")
    return _sequence(item, *arrays, where), item.get("segments")


def _sequence(item: dict, tokens: list[int], mask: list[int], logprobs: list[float], where: str) -> Sequence:
    """A record's :class:`Sequence` from its checked arrays: its advantage, reward, version
    stamps and unlikelihood mark checked here."""
    try:
        sequence = Sequence(tokens, mask, logprobs, float(item["advantage"]), float(item.get("reward", 0.0)))
    except (TypeError, ValueError) as err:
        raise BatchError(f"{where}: non-numeric value ({err})") from err
    if not math.isfinite(sequence.advantage):
        raise BatchError(f"{where}: advantage and logprobs must be finite")
    sequence.versions = token_versions(sequence.loss_mask, item.get("versions"), where)
    marked = item.get("unlikelihood", False)
    if not isinstance(marked, bool):
        raise BatchError(f"{where}: unlikelihood must be true or false, not {marked!r}")
    sequence.unlikelihood = marked
    return sequence


def _read_columns(path: Path, vocab_size: int) -> Iterator[tuple[Sequence, object, str]]:
    """The sequences of a safetensors batch file, its arrays checked whole (numpy) and each
    rollout named ``FILE: rollout I`` in an error."""
    try:
        columns = batchfile.read_columns(path)
    except batchfile.BatchFileError as err:
        raise BatchError(str(err)) from err
    bounds = numpy.concatenate(([0], numpy.cumsum(columns.lengths)))
    starts, ends = bounds[:-1], bounds[1:]

    def first(bad: numpy.ndarray) -> str:
        return f"{path}: rollout {int(numpy.searchsorted(ends, int(numpy.argmax(bad)), side='right'))}"

    if (columns.lengths == 0).any():
        raise BatchError(f"{path}: rollout {int(numpy.argmax(columns.lengths == 0))}: no tokens")
    if (columns.loss_mask[starts] != 0).any():
        index = int(numpy.argmax(columns.loss_mask[starts] != 0))
        raise BatchError(f"{path}: rollout {index}: loss_mask[0] is set, but the first token has no context to be "
                         f"trained on")
    if not numpy.isfinite(columns.logprobs).all():
        raise BatchError(f"{first(~numpy.isfinite(columns.logprobs))}: advantage and logprobs must be finite")
    outside = (columns.tokens < 0) | (columns.tokens >= vocab_size)
    if outside.any():
        raise BatchError(f"{first(outside)}: token id outside the vocabulary (size {vocab_size})")
    # Lists once, sliced per rollout: a numpy slice per rollout costs more than its tokens do.
    tokens, logprobs = columns.tokens.tolist(), columns.logprobs.tolist()
    mask, bounds = (columns.loss_mask != 0).view(numpy.int8).tolist(), bounds.tolist()
    for index, record in enumerate(columns.records):
        where = f"{path}: rollout {index}"
        if "advantage" not in record:
            raise BatchError(f"{where}: missing key(s) 'advantage'")
        start, end = bounds[index], bounds[index + 1]
        yield (_sequence(record, tokens[start:end], mask[start:end], logprobs[start:end], where),
               record.get("segments"), where)


def split_segments(sequence: Sequence, lengths: object, where: str) -> list[Sequence]:
    """A line holding several independent sequences back to back (``segments``: their lengths)
    as one :class:`Sequence` each, under the line's advantage and reward."""
    if lengths is None:
        return [sequence]
    if (not isinstance(lengths, list) or not all(isinstance(n, int) and n > 0 for n in lengths)
            or sum(lengths) != len(sequence.tokens)):
        raise BatchError(f"{where}: segments must be positive lengths summing to the {len(sequence.tokens)} tokens")
    parts, start = [], 0
    for length in lengths:
        end = start + length
        if sequence.loss_mask[start]:
            raise BatchError(f"{where}: the segment at token {start} starts with a trained token (no context)")
        versions = sequence.versions[start:end] if sequence.versions is not None else None
        parts.append(Sequence(sequence.tokens[start:end], sequence.loss_mask[start:end], sequence.logprobs[start:end],
                              sequence.advantage, sequence.reward, versions, sequence.unlikelihood))
        start = end
    return parts


def read_batch(path: Path, vocab_size: int) -> list[Sequence]:
    """All sequences of a batch file, safetensors or JSON lines (:mod:`rlorch.rundir.batchfile`);
    raises :class:`BatchError` naming the file and the first bad rollout (or line)."""
    try:
        binary = batchfile.is_safetensors(path)
    except batchfile.BatchFileError as err:
        raise BatchError(str(err)) from err
    sequences = []
    if binary:
        for sequence, segments, where in _read_columns(path, vocab_size):
            sequences.extend(split_segments(sequence, segments, where))
        return sequences
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise BatchError(f"{path}: unreadable ({err})") from err
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        sequence, segments = _parse_line(path, number, line)
        if any(not 0 <= t < vocab_size for t in sequence.tokens):
            raise BatchError(f"{path}:{number}: token id outside the vocabulary (size {vocab_size})")
        sequences.extend(split_segments(sequence, segments, f"{path}:{number}"))
    return sequences


@dataclass
class MicroBatch:
    """One forward/backward pass: ``[rows, positions]`` tensors, either padded (one sequence a
    row, right-padded) or packed (every sequence of the pass in one row, back to back)."""

    tokens: torch.Tensor
    """[rows, len]; padding after a sequence (causal attention never looks at it)."""
    mask: torch.Tensor
    behaviour: torch.Tensor
    advantages: torch.Tensor
    """[rows, len]: each token carries its sequence's advantage (0 on padding)."""
    unlikelihood: torch.Tensor
    """[rows, len] bool: the positions whose advantage the loss scales by ``p / (1 - p)``."""
    versions: torch.Tensor
    """[rows, len] per-token policy versions (NO_VERSION where none is known)."""
    segments: torch.Tensor
    """[rows, len]: the index of each position's sequence within this micro-batch (padding
    takes its row's), for aggregations per sequence."""
    sequences: int
    """Real sequences in this micro-batch (0 for a filler)."""
    lengths: Optional[list[int]] = None
    """Packed: the lengths of the sequences in the row, in order (their positions restart at
    0 and attention stays within each). None: padded rows."""

    @property
    def positions(self) -> int:
        """Positions the model runs over (real tokens plus padding)."""
        return self.tokens.numel()

    @functools.cached_property
    def shared_layout(self) -> Optional[SharedLayout]:
        """This micro-batch with each distinct prompt once (:func:`rlorch.trainer.prefix.layout`),
        or None where that saves too little; worked out once for all its passes."""
        return layout(self.tokens, self.mask, self.lengths)

    def position_ids(self) -> Optional[torch.Tensor]:
        """Packed: ``[1, len]`` positions restarting at every sequence; padded: None (0..len-1)."""
        if self.lengths is None:
            return None
        return torch.cat([torch.arange(length) for length in self.lengths]).unsqueeze(0)


def _filler(pad_id: int) -> Sequence:
    """An all-masked sequence for a rank short of data: it runs the collectives, trains nothing."""
    return Sequence([pad_id, pad_id], [0, 0], [0.0, 0.0], 0.0, 0.0)


def rank_share(chunk: list[Sequence], rank: int, world: int, *, max_tokens: Optional[int], size: int,
               pad_id: int) -> list[MicroBatch]:
    """Rank ``rank``'s micro-batches of a minibatch: packed rows of at most ``max_tokens``
    tokens (:func:`plan_by_tokens`) when a budget is set, else padded micro-batches of at most
    ``size`` sequences (:func:`plan_by_count`). Every rank gets the same number (FSDP's
    all-gathers are collectives): a rank short of data gets all-masked fillers."""
    if max_tokens:
        plan = plan_by_tokens([len(s.tokens) for s in chunk], world, max_tokens)[rank]
        return [packed([chunk[index] for index in members], pad_id) for members in plan]
    plan = plan_by_count(len(chunk), world, size)[rank]
    return [padded([chunk[index] for index in members], pad_id) for members in plan]


def padded(chunk: list[Sequence], pad_id: int) -> MicroBatch:
    """``chunk`` one sequence a row, right-padded to the longest (a filler row when empty)."""
    real = len(chunk)
    chunk = chunk or [_filler(pad_id)]
    length = max(len(s.tokens) for s in chunk)
    return MicroBatch(
        tokens=_padded([s.tokens for s in chunk], length, pad_id, torch.long),
        mask=_padded([s.loss_mask for s in chunk], length, 0, torch.float32),
        behaviour=_padded([s.logprobs for s in chunk], length, 0.0, torch.float32),
        advantages=_padded([[s.advantage] * len(s.tokens) for s in chunk], length, 0.0, torch.float32),
        unlikelihood=_padded([[s.unlikelihood] * len(s.tokens) for s in chunk], length, False, torch.bool),
        versions=_padded([s.versions if s.versions is not None else [] for s in chunk], length,
                         NO_VERSION, torch.long),
        segments=torch.arange(len(chunk)).unsqueeze(-1).expand(len(chunk), length).contiguous(),
        sequences=real)


def packed(chunk: list[Sequence], pad_id: int) -> MicroBatch:
    """``chunk`` back to back in one row (a filler row when empty)."""
    real = len(chunk)
    chunk = chunk or [_filler(pad_id)]

    def row(values, dtype) -> torch.Tensor:
        return torch.tensor([value for part in values for value in part], dtype=dtype).unsqueeze(0)

    return MicroBatch(
        tokens=row([s.tokens for s in chunk], torch.long),
        mask=row([s.loss_mask for s in chunk], torch.float32),
        behaviour=row([s.logprobs for s in chunk], torch.float32),
        advantages=row([[s.advantage] * len(s.tokens) for s in chunk], torch.float32),
        unlikelihood=row([[s.unlikelihood] * len(s.tokens) for s in chunk], torch.bool),
        versions=row([s.versions if s.versions is not None else [NO_VERSION] * len(s.tokens) for s in chunk],
                     torch.long),
        segments=row([[index] * len(s.tokens) for index, s in enumerate(chunk)], torch.long),
        sequences=real, lengths=[len(s.tokens) for s in chunk])


def _padded(rows: list[list], length: int, fill, dtype: torch.dtype) -> torch.Tensor:
    """``[len(rows), length]``: each row right-padded with ``fill`` (one tensor built at once)."""
    return torch.tensor([row + [fill] * (length - len(row)) for row in rows], dtype=dtype)


def plan_by_count(count: int, ranks: int, size: int) -> list[list[list[int]]]:
    """Per rank, its micro-batches as lists of sequence indices: rank ``r`` takes sequences
    ``r, r + W, ...`` in micro-batches of at most ``size``; every rank gets as many micro-batches
    as the fullest (empty lists are fillers)."""
    per_rank = max(1, math.ceil(math.ceil(count / ranks) / size))
    plans = []
    for rank in range(ranks):
        mine = list(range(rank, count, ranks))
        plans.append([mine[index * size:(index + 1) * size] for index in range(per_rank)])
    return plans


def plan_by_tokens(lengths: list[int], ranks: int, budget: int) -> list[list[list[int]]]:
    """Per rank, its micro-batches as lists of sequence indices, at most ``budget`` tokens each
    (a sequence longer than the budget alone in one), the same number on every rank and with
    near-equal tokens, so the ranks step in lockstep without waiting on each other.

    The fewest micro-batches a rank can take (``K``) is found by trying ``K = 1, 2, ...``: the
    sequences, longest first, each go to the lightest of the ``ranks * K`` bins (longest
    processing time first); ``K`` holds when no bin overflows. Bins are dealt to the ranks in
    turn, heaviest first, so every rank's total is close to the mean too."""
    order = sorted(range(len(lengths)), key=lambda index: (-lengths[index], index))
    per_rank = max(1, math.ceil(sum(lengths) / (ranks * budget)))
    while True:
        bins = _longest_first(order, lengths, ranks * per_rank, budget)
        if bins is not None:
            break
        per_rank += 1
    bins.sort(key=lambda members: -sum(lengths[index] for index in members))
    return [[sorted(members) for members in bins[rank::ranks]] for rank in range(ranks)]


def _longest_first(order: list[int], lengths: list[int], count: int, budget: int) -> Optional[list[list[int]]]:
    """``order`` (longest first) into ``count`` bins, each into the lightest; None when a bin
    would pass ``budget`` with more than one sequence."""
    import heapq

    bins: list[list[int]] = [[] for _ in range(count)]
    heap = [(0, slot) for slot in range(count)]
    for index in order:
        load, slot = heapq.heappop(heap)
        if load and load + lengths[index] > budget:
            return None
        bins[slot].append(index)
        heapq.heappush(heap, (load + lengths[index], slot))
    return bins


def minibatch_slices(count: int, minibatches: int) -> list[slice]:
    """``minibatches`` contiguous, near-equal slices of ``count`` sequences (never empty while
    ``count >= minibatches``; a batch with fewer sequences gets fewer minibatches)."""
    parts = max(1, min(minibatches, count))
    bounds = [round(i * count / parts) for i in range(parts + 1)]
    return [slice(bounds[i], bounds[i + 1]) for i in range(parts)]
