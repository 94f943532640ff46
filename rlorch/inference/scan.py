"""``[[logprob, id, null], ...]`` read into arrays by simdjson: no Python object per token.

The shape is checked where it puts the brackets (every ``]`` of the body is found once, by numpy:
:class:`Brackets`): the span opens ``[[`` and closes ``]]``, and every other ``]`` in it ends an
entry with ``,null]`` followed by ``,[``. Each of those ``null`` is written over as ``9e99`` (four
bytes too), and simdjson parses the spans as one JSON array and hands back every leaf as one
float64 array (``as_buffer``): a string, ``true``, ``false`` or another ``null`` makes that refuse.
With no string, every bracket is structural and they balance, so each span is a list of flat
entries, each ending with a marker; the markers falling on every third leaf and nowhere else says
each entry holds exactly two numbers before it.

simdjson reads every number correctly rounded, as orjson and Python do, so the arrays are bit for
bit those of parsing the span as JSON and casting the logprobs to float32 and the ids to int. An
id must be an integral value in ``[0, 2**31)``. Anything else (a token's text in the entries,
whitespace before the ``null``, a number JSON refuses or simdjson cannot hold, such as an integer
past 64 bits, a logprob of exactly the marker) raises :class:`Irregular` (the caller parses the
body in full).
"""

from __future__ import annotations

import threading

import numpy
import simdjson

OPEN, CLOSE, COMMA = b"[],"
NEXT_ENTRY = numpy.uint64(int.from_bytes(b",null],[", "little"))
LAST_ENTRY = numpy.uint64(int.from_bytes(b",null]]", "little"))
MARKER = b"9e99"
"""Written over each entry's ``null``: the same four bytes long, a number no logprob or id is."""
ID_LIMIT = 2**31

_local = threading.local()


class Irregular(ValueError):
    """The span is not ``[[number, integer, null], ...]`` with the ``null`` written compactly."""


class Brackets:
    """Where every ``]`` of a body is, found in one numpy pass: the ends of the arrays cut out of
    it, and each entries array's entries."""

    def __init__(self, body: bytes | bytearray):
        self.at = numpy.flatnonzero(numpy.frombuffer(body, numpy.uint8) == CLOSE)
        self.doubled = numpy.flatnonzero(self.at[1:] - self.at[:-1] == 1)
        """Indices ``i`` of ``at`` where ``]]`` begins."""

    def list_end(self, opened: int) -> int:
        """Past the first ``]`` from ``opened`` (the end of a list of numbers whose ``[`` is at
        ``opened - 1``); -1: none."""
        i = int(numpy.searchsorted(self.at, opened))
        return -1 if i == len(self.at) else int(self.at[i]) + 1

    def entries_end(self, opened: int) -> int:
        """Past the end of the entries array whose ``[`` is at ``opened - 1``: ``[]``, or its first
        ``]]`` (no entry holds a bracket, which :func:`read_entries` checks); -1: none."""
        i = int(numpy.searchsorted(self.at, opened))
        if i < len(self.at) and self.at[i] == opened:
            return opened + 1
        k = int(numpy.searchsorted(self.doubled, i))
        return -1 if k == len(self.doubled) else int(self.at[self.doubled[k] + 1]) + 1

    def within(self, start: int, end: int) -> numpy.ndarray:
        """The ``]`` of ``body[start:end]``, absolute."""
        return self.at[numpy.searchsorted(self.at, start):numpy.searchsorted(self.at, end)]


def read_entries(body: bytes | bytearray, spans: list[tuple[int, int]],
                 brackets: Brackets | None = None) -> list[tuple[numpy.ndarray, numpy.ndarray]]:
    """Ids (int32) and logprobs (float32) of each entries array at ``body[start:end]`` for
    ``(start, end)`` in ``spans`` (in order, from its ``[`` to its ``]``, at least one entry
    each), all parsed together as one JSON array of the spans. ``brackets``: the body's, if
    found already."""
    brackets = brackets or Brackets(body)
    words = numpy.ndarray((max(0, len(body) - 7),), "<u8", buffer=body, strides=(1,))
    joined = bytearray(1 + sum(end - start + 1 for start, end in spans))
    joined[0], joined[-1] = OPEN, CLOSE
    nulls, counts, at, view = [], [], 1, memoryview(body)
    for start, end in spans:
        entry_closes = _entry_closes(body, words, brackets.within(start, end), start, end)
        nulls.append(entry_closes - start - 4 + at)
        counts.append(len(entry_closes))
        joined[at:at + end - start] = view[start:end]
        if at > 1:
            joined[at - 1] = COMMA
        at += end - start + 1
    nulls = numpy.concatenate(nulls)
    patched = numpy.frombuffer(joined, numpy.uint8)
    for k, byte in enumerate(MARKER):
        patched[nulls + k] = byte
    parser, refused = getattr(_local, "parser", None) or _parser(), None
    try:
        document = parser.parse(joined)
        values = numpy.frombuffer(document.as_buffer(of_type="d"), numpy.float64)
    except (ValueError, TypeError, RuntimeError) as err:  # RuntimeError: an integer past 64 bits
        refused = str(err)
    finally:
        document = None  # the parser is reused: no document may outlive the call, nor its error
    if refused is not None:
        raise Irregular(f"entries other than [number, integer, null]: {refused}")
    total = len(nulls)
    marker = float(MARKER)
    if (values.size != 3 * total or not (values[2::3] == marker).all()
            or (values[0::3] == marker).any()):
        raise Irregular("entries other than [number, integer, null]")
    written = values[1::3]
    ids = written.astype(numpy.int64)
    if not ((written >= 0) & (written < ID_LIMIT) & (ids == written)).all():
        raise Irregular("a token id that is not an integer in [0, 2**31)")
    with numpy.errstate(over="ignore"):  # past float32's range: -inf, as a cast of the JSON's float64
        logprobs = values[0::3].astype(numpy.float32)
    bounds = numpy.cumsum(counts)[:-1]
    return list(zip(numpy.split(ids.astype(numpy.int32), bounds), numpy.split(logprobs, bounds)))


def _parser() -> simdjson.Parser:
    """This thread's parser, kept so its buffers are allocated once."""
    _local.parser = simdjson.Parser()
    return _local.parser


def _entry_closes(body: bytes | bytearray, words: numpy.ndarray, closes: numpy.ndarray, start: int,
                  end: int) -> numpy.ndarray:
    """Where the entries of ``body[start:end]`` end (``closes``: its ``]``, absolute), the shape
    checked (see the module doc)."""
    # the first entry ends 8 bytes in at the least ([[a,null]), so no read below reaches back before the span
    if (len(closes) < 2 or body[start:start + 2] != b"[[" or closes[0] < start + 8 or closes[-1] != end - 1
            or closes[-2] != end - 2):
        raise Irregular("entries other than [logprob, id, null]")
    closes = closes[:-1]
    if not ((words[closes[:-1] - 5] == NEXT_ENTRY).all() and words[closes[-1] - 6] >> numpy.uint64(8) == LAST_ENTRY):
        raise Irregular("entries other than [logprob, id, null]")
    return closes
