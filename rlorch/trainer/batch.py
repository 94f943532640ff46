"""Reading a shipped batch file and cutting it into padded micro-batches.

Every rank reads the whole file (it is small next to the model) so all ranks agree on the
global token count without a collective; rank ``r`` trains rollouts ``r, r + W, r + 2W, ...``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from rlorch.jsonlines import parse_record

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


def token_versions(mask: list[int], runs: object, where: str) -> list[int] | None:
    """Expand ``[[version, count], ...]`` over the masked tokens, in order."""
    if runs is None:
        return None
    try:
        expanded = [int(version) for version, count in runs for _ in range(int(count))]
    except (TypeError, ValueError) as err:
        raise BatchError(f"{where}: versions must be [[version, count], ...] ({err})") from err
    if len(expanded) != sum(mask):
        raise BatchError(f"{where}: versions cover {len(expanded)} tokens but loss_mask marks {sum(mask)}")
    stamps = iter(expanded)
    return [next(stamps) if m else NO_VERSION for m in mask]


def _parse_line(path: Path, number: int, line: str) -> Sequence:
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
        sequence = Sequence([int(t) for t in tokens], [int(bool(m)) for m in mask],
                            [float(p) for p in logprobs], float(item["advantage"]),
                            float(item.get("reward", 0.0)))
    except (TypeError, ValueError) as err:
        raise BatchError(f"{where}: non-numeric value ({err})") from err
    if not math.isfinite(sequence.advantage) or not all(map(math.isfinite, sequence.logprobs)):
        raise BatchError(f"{where}: advantage and logprobs must be finite")
    sequence.versions = token_versions(sequence.loss_mask, item.get("versions"), where)
    return sequence


def read_batch(path: Path, vocab_size: int) -> list[Sequence]:
    """All sequences of a batch file; raises :class:`BatchError` naming the first bad line."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise BatchError(f"{path}: unreadable ({err})") from err
    sequences = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        sequence = _parse_line(path, number, line)
        if any(not 0 <= t < vocab_size for t in sequence.tokens):
            raise BatchError(f"{path}:{number}: token id outside the vocabulary (size {vocab_size})")
        sequences.append(sequence)
    return sequences


@dataclass
class MicroBatch:
    tokens: torch.Tensor
    """[n, len] right-padded (causal attention never looks at the padding after a token)."""
    mask: torch.Tensor
    behaviour: torch.Tensor
    advantages: torch.Tensor
    versions: torch.Tensor
    """[n, len] per-token policy versions (NO_VERSION where none is known)."""


def micro_batches(sequences: list[Sequence], size: int, count: int, pad_id: int) -> list[MicroBatch]:
    """Exactly ``count`` micro-batches of at most ``size`` sequences.

    Every rank must run the same number of forward/backward passes (FSDP all-gathers are
    collectives), so a rank short of data gets all-masked filler that contributes nothing.
    """
    filler = Sequence([pad_id, pad_id], [0, 0], [0.0, 0.0], 0.0, 0.0)
    out = []
    for index in range(count):
        chunk = sequences[index * size:(index + 1) * size] or [filler]
        length = max(len(s.tokens) for s in chunk)
        out.append(MicroBatch(
            tokens=_padded([s.tokens for s in chunk], length, pad_id, torch.long),
            mask=_padded([s.loss_mask for s in chunk], length, 0, torch.float32),
            behaviour=_padded([s.logprobs for s in chunk], length, 0.0, torch.float32),
            advantages=torch.tensor([s.advantage for s in chunk]),
            versions=_padded([s.versions if s.versions is not None else [] for s in chunk], length,
                             NO_VERSION, torch.long)))
    return out


def _padded(rows: list[list], length: int, fill, dtype: torch.dtype) -> torch.Tensor:
    """``[len(rows), length]``: each row right-padded with ``fill`` (one tensor built at once)."""
    return torch.tensor([row + [fill] * (length - len(row)) for row in rows], dtype=dtype)


def minibatch_slices(count: int, minibatches: int) -> list[slice]:
    """``minibatches`` contiguous, near-equal slices of ``count`` sequences (never empty while
    ``count >= minibatches``; a batch with fewer sequences gets fewer minibatches)."""
    parts = max(1, min(minibatches, count))
    bounds = [round(i * count / parts) for i in range(parts + 1)]
    return [slice(bounds[i], bounds[i + 1]) for i in range(parts)]
