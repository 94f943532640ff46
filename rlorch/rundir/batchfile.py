"""The batch file: one training step's rollouts, written by the orchestrator, read by the trainer
(and read back by the orchestrator when a checkpoint lists them untrained).

Two formats (``run.batch_format``), told apart by their first bytes, not their names:

- ``safetensors`` (the default; ``rollouts/step_N.safetensors``), about 9 bytes a token. Tensors:

  ============  =======  ===================================================================
  ``lengths``   int64    [rollouts]: each rollout's tokens
  ``tokens``    int32    [tokens]: every rollout's tokens back to back
  ``logprobs``  float32  [tokens]: behaviour logprobs aligned with ``tokens``
  ``loss_mask`` int8     [tokens]: 1 on the trained (model) tokens
  ``records``   uint8    one JSON object per rollout and line, UTF-8: every other field
                         (``advantage``, ``reward``, ``versions``, ``segments``, ...)
  ============  =======  ===================================================================

  and ``__metadata__ = {"format": "rlorch.batch.v1"}``. The arrays are written as they are held
  (no copy, no text); any safetensors reader opens it (``safetensors.numpy.load_file``).
- ``jsonl`` (``rollouts/step_N.jsonl``): one JSON object per rollout and line, the arrays as
  lists; about 20 bytes a token, for reading with a text tool.

Invariant: both carry the same records; :func:`read_records` gives one dict per rollout with
every field and the three arrays as lists, whichever format it reads.
"""

from __future__ import annotations

import json
import struct
import sys
from array import array
from pathlib import Path
from typing import Any, Iterable, Iterator, NamedTuple

import numpy
import orjson

FORMATS = ("safetensors", "jsonl")
SUFFIXES = {"safetensors": ".safetensors", "jsonl": ".jsonl"}
FORMAT_TAG = "rlorch.batch.v1"
ARRAYS = ("tokens", "loss_mask", "logprobs")
"""The per-token fields, held as arrays, written as tensors (safetensors) or lists (JSON lines)."""

# Tensor name -> (safetensors dtype, little-endian numpy dtype), in file order: each tensor
# starts at a multiple of its item size when the data section starts 8-aligned.
_TENSORS = {"lengths": ("I64", "<i8"), "tokens": ("I32", "<i4"), "logprobs": ("F32", "<f4"),
            "loss_mask": ("I8", "i1"), "records": ("U8", "u1")}
_LITTLE_ENDIAN = sys.byteorder == "little"
"""Whether an ``array`` of ids, logprobs or mask holds the bytes the file holds (safetensors is
little-endian)."""


class BatchFileError(ValueError):
    """A batch file that cannot be read as one; the message names the file."""


class Row(NamedTuple):
    """One rollout for the file: its other fields and its three arrays (int32, int8, float32)."""

    fields: dict
    tokens: Any
    loss_mask: Any
    logprobs: Any


class Columns(NamedTuple):
    """A safetensors batch file as read: the arrays of all rollouts and one record each."""

    records: list[dict]
    lengths: numpy.ndarray
    tokens: numpy.ndarray
    loss_mask: numpy.ndarray
    logprobs: numpy.ndarray


def encode(rows: list[Row], fmt: str) -> Iterator[Any]:
    """The file's bytes in pieces (buffers), for :func:`rlorch.rundir.layout.write_atomic`:
    nothing per token is converted for ``safetensors`` and the file is never whole in memory."""
    if fmt == "jsonl":
        return _jsonl(rows)
    if fmt != "safetensors":
        raise ValueError(f"run.batch_format: unknown batch format {fmt!r} (expected one of {', '.join(FORMATS)})")
    return _safetensors(rows)


def _jsonl(rows: list[Row]) -> Iterator[bytes]:
    options = orjson.OPT_APPEND_NEWLINE | orjson.OPT_SERIALIZE_NUMPY
    for row in rows:
        yield orjson.dumps({**row.fields, "tokens": _view(row.tokens, "<i4"), "loss_mask": _view(row.loss_mask, "i1"),
                            "logprobs": _view(row.logprobs, "<f4")}, option=options)


def _safetensors(rows: list[Row]) -> Iterator[Any]:
    for index, row in enumerate(rows):
        if not len(row.tokens) == len(row.loss_mask) == len(row.logprobs):
            raise ValueError(f"batch file: rollout {index} has {len(row.tokens)} tokens, {len(row.loss_mask)} mask "
                             f"entries and {len(row.logprobs)} logprobs")
    records = b"".join(orjson.dumps(row.fields, option=orjson.OPT_APPEND_NEWLINE) for row in rows)
    lengths = numpy.fromiter((len(row.tokens) for row in rows), dtype="<i8", count=len(rows))
    total = int(lengths.sum())
    sizes = {"lengths": lengths.nbytes, "tokens": 4 * total, "logprobs": 4 * total, "loss_mask": total,
             "records": len(records)}
    header, offset = {"__metadata__": {"format": FORMAT_TAG}}, 0
    for name, (dtype, numpy_dtype) in _TENSORS.items():
        count = sizes[name] // numpy.dtype(numpy_dtype).itemsize
        header[name] = {"dtype": dtype, "shape": [count], "data_offsets": [offset, offset + sizes[name]]}
        offset += sizes[name]
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)    # the data section starts 8-aligned, as safetensors writes it
    yield struct.pack("<Q", len(text)) + text
    yield lengths.tobytes()
    for name, typecode, numpy_dtype in (("tokens", "i", "<i4"), ("logprobs", "f", "<f4"), ("loss_mask", "b", "i1")):
        for row in rows:
            values = getattr(row, name)
            held_as_written = _LITTLE_ENDIAN and isinstance(values, array) and values.typecode == typecode
            yield values if held_as_written else _view(values, numpy_dtype)
    yield records


def _view(values: Any, dtype: str) -> numpy.ndarray:
    """``values`` as a numpy array of ``dtype`` over the same memory where it already is one (an
    ``array`` of that type on a little-endian machine), else converted."""
    if isinstance(values, array):
        values = numpy.frombuffer(values, dtype=values.typecode) if len(values) else numpy.zeros(0, values.typecode)
    return numpy.asarray(values).astype(dtype, copy=False)


_MAX_HEADER = 100_000_000
"""The longest header safetensors reads. Eight bytes of text read as a length are past 2^56."""


def is_safetensors(path: Path) -> bool:
    """Whether ``path`` starts as a safetensors file does: a little-endian header length
    safetensors would read, then ``{`` (a file cut short after that is a damaged safetensors
    file, and reading it says so)."""
    try:
        with open(path, "rb") as handle:
            head = handle.read(9)
    except OSError as err:
        raise BatchFileError(f"{path}: unreadable ({err})") from err
    return len(head) == 9 and head[8:9] == b"{" and struct.unpack("<Q", head[:8])[0] <= _MAX_HEADER


def read_columns(path: Path) -> Columns:
    """A safetensors batch file's arrays and records, their shapes checked against each other;
    raises :class:`BatchFileError` naming the file."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="numpy") as handle:
            tag = (handle.metadata() or {}).get("format")
            if tag != FORMAT_TAG:
                raise BatchFileError(f"{path}: a safetensors file, but not a batch file (format {tag!r}, "
                                     f"expected {FORMAT_TAG!r})")
            missing = [name for name in _TENSORS if name not in handle.keys()]
            if missing:
                raise BatchFileError(f"{path}: missing tensor(s) {', '.join(missing)}")
            tensors = {name: handle.get_tensor(name) for name in _TENSORS}
    except (SafetensorError, OSError) as err:
        raise BatchFileError(f"{path}: not a readable safetensors file ({err})") from err
    for name, (_, numpy_dtype) in _TENSORS.items():
        if tensors[name].ndim != 1 or tensors[name].dtype != numpy.dtype(numpy_dtype):
            raise BatchFileError(f"{path}: tensor {name} must be 1-D {numpy.dtype(numpy_dtype)}, "
                                 f"not {tensors[name].dtype} of shape {list(tensors[name].shape)}")
    lengths, tokens = tensors["lengths"], tensors["tokens"]
    if (lengths < 0).any() or int(lengths.sum()) != len(tokens):
        raise BatchFileError(f"{path}: lengths sum to {int(lengths.sum())}, but tokens has {len(tokens)}")
    if not len(tokens) == len(tensors["logprobs"]) == len(tensors["loss_mask"]):
        raise BatchFileError(f"{path}: tokens ({len(tokens)}), loss_mask ({len(tensors['loss_mask'])}) and "
                             f"logprobs ({len(tensors['logprobs'])}) must be of equal length")
    records = _records(path, tensors["records"].tobytes(), len(lengths))
    return Columns(records, lengths, tokens, tensors["loss_mask"], tensors["logprobs"])


def _records(path: Path, text: bytes, count: int) -> list[dict]:
    """The ``records`` lines as dicts: parsed as one JSON array (a line never holds a raw newline:
    JSON escapes it), or line by line to name the one at fault."""
    lines = text.splitlines()
    if len(lines) != count:
        raise BatchFileError(f"{path}: {len(lines)} records for {count} rollouts")
    try:
        records = orjson.loads(b"[" + b",".join(lines) + b"]")
    except orjson.JSONDecodeError:
        records = None
    if records is not None and len(records) == count and all(isinstance(record, dict) for record in records):
        return records
    for index, line in enumerate(lines):
        try:
            record = orjson.loads(line)
        except orjson.JSONDecodeError as err:
            raise BatchFileError(f"{path}: rollout {index}: record is not valid JSON ({err})") from err
        if not isinstance(record, dict):
            raise BatchFileError(f"{path}: rollout {index}: record must be a JSON object")
    raise BatchFileError(f"{path}: records do not hold one JSON object per line")


def read_records(path: Path) -> list[dict]:
    """One dict per rollout, every field with the three arrays as lists, from either format."""
    if is_safetensors(path):
        columns = read_columns(path)
        bounds = numpy.concatenate(([0], numpy.cumsum(columns.lengths)))
        return [{**record, **{name: getattr(columns, name)[start:end].tolist() for name in ARRAYS}}
                for record, start, end in zip(columns.records, bounds[:-1].tolist(), bounds[1:].tolist())]
    try:
        lines = Path(path).read_bytes().splitlines()
    except OSError as err:
        raise BatchFileError(f"{path}: unreadable ({err})") from err
    records = []
    for number, line in enumerate(lines, start=1):
        if line.strip():
            try:
                records.append(orjson.loads(line))
            except orjson.JSONDecodeError as err:
                raise BatchFileError(f"{path}:{number}: not valid JSON ({err})") from err
    return records


def iter_rows(records: Iterable[dict]) -> Iterator[Row]:
    """Records as read (:func:`read_records`) as rows to write again."""
    for record in records:
        yield Row({k: v for k, v in record.items() if k not in ARRAYS},
                  *(record[name] for name in ARRAYS))
