"""SGLang's /generate answers parsed into compact arrays: no Python object per token.

An answer's ``meta_info.output_token_logprobs`` is ``[[logprob, token_id, null], ...]``, about
25 bytes a token; a general JSON parser makes four Python objects of every entry. Here the
entries (and ``output_ids``, which repeats their ids) are cut out of the body before it is
parsed: the entries spans are read together by simdjson (:mod:`rlorch.inference.scan`) into an
int32 id array and a float32 logprob array each; the rest of the body, small, is parsed as
JSON, and the entries' place holds a :class:`Segment`. An answer this fast path cannot read
exactly (a token's text in the entries, a non-finite or missing logprob, an id that is not an
integer in int32's range) is parsed in full instead, and :func:`segment` reads its entries one
by one (and names the fault). :class:`AnswerParsers` runs the parse in worker processes
(``inference.parse_workers``).
"""

from __future__ import annotations

import asyncio
import logging
import math
import multiprocessing
import os
from array import array
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any, NamedTuple

import orjson

from rlorch.inference.scan import Brackets, Irregular, read_entries
from rlorch.jsonlines import loads
from rlorch.lifecycle import watch_parents
from rlorch.types import LOGPROBS, LONG, TOKEN_IDS

log = logging.getLogger(__name__)

ENTRIES, IDS = b'"output_token_logprobs":[', b'"output_ids":['
"""Where an answer's entries and ids start. Inside a JSON string the key's quotes are escaped, so
neither is ever found in a completion's text."""


SMALL_BODY = 16384
"""Bodies shorter than this (some 600 tokens) are parsed in full: the cuts cost more than they save."""


COMPACT_ANSWER_BYTES = 2048
"""Bodies with fewer bytes than this per answer (some 60 tokens each) are parsed in full too:
each answer's cut has a fixed cost that short entries do not repay. Measured, entries read into
arrays included: 64 answers of 3 tokens (the CPU default's) 0.62 ms cut against 0.17 ms in full;
of 100 tokens, 2.99 ms against 2.93 ms; of 200 tokens, 1.56 ms against 4.44 ms."""


SHORT_ENTRIES = 16 * LONG
"""Entries spans shorter than this (4 kB: some 120 entries) are parsed as JSON."""


class Segment(NamedTuple):
    """One answer's generated token ids (int32) and behaviour logprobs (float32)."""

    ids: array
    logprobs: array


class NotCompact(ValueError):
    """The fast path cannot read this body exactly; parse it in full."""


def parse_generate(body: bytes) -> Any:
    """A /generate answer (one object or a batch's list) with each ``output_token_logprobs``
    a :class:`Segment` and ``output_ids`` dropped (the entries carry the same ids); a small
    body, one of short answers (:data:`COMPACT_ANSWER_BYTES`) or an irregular one parsed in
    full (:func:`segment` reads its entries)."""
    if len(body) < SMALL_BODY or len(body) < COMPACT_ANSWER_BYTES * body.count(ENTRIES):
        return loads(body, exact=False)  # a few hundred tokens, or short answers
    try:
        return _parse_compact(body)
    except NotCompact:
        return loads(body, exact=False)


class AnswerParsers:
    """Worker processes that parse long /generate bodies (:func:`parse_generate`) beside the event
    loop, for a loop one core cannot keep up with: such a body goes to one over a pipe (pickled,
    some 35 bytes a token) and its tree, the arrays in it, comes back (some 8). At most
    ``QUEUED`` bodies per worker are out at once; past that, and under ``HANDED_OFF`` bytes, the
    loop parses the body itself (no body waits in a queue, held twice). If a worker dies
    (killed, out of memory), the rest of the run parses in the loop, with a warning: no answer
    is lost with it. The workers exit when the orchestrator does, killed or not."""

    HANDED_OFF = 1 << 18
    """Bytes (some 8,000 tokens) from which a body goes to a worker. The loop's CPU for a hand-off
    (the pickles, the pipe), against parsing the body itself, measured on SGLang-shaped bodies:
    0.34 at 5 MB, 0.44 at 1.3 MB, 0.63 at 320 KB, 0.8 at 80 KB, 2.2 at 20 KB."""
    QUEUED = 2
    """Bodies per worker out at once."""

    def __init__(self, workers: int):
        # spawn: a forked child would inherit the event loop's threads and sockets
        self._executor = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                                             initializer=_die_with, initargs=(os.getpid(),))
        self.workers = workers
        self.out = 0
        """Bodies with the workers now."""
        self.handed = 0
        """Bodies handed to the workers in all."""
        self.broken = False

    async def parse(self, body: bytes | bytearray) -> Any:
        if len(body) < self.HANDED_OFF or self.broken or self.out >= self.QUEUED * self.workers:
            return parse_generate(body)
        self.out += 1
        self.handed += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._executor, parse_generate, body)
        except BrokenProcessPool as err:
            if not self.broken:
                log.warning("an answer-parsing worker died (%s): answers are parsed in the event loop from now on", err)
                self.broken = True
            return parse_generate(body)
        finally:
            self.out -= 1

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def _die_with(orchestrator: int) -> None:
    """A worker's first act: exit once the orchestrator, its parent, is gone (a killed one closes
    nothing, and each worker holds its own end of the queue it waits on)."""
    watch_parents(orchestrator=None, parent=orchestrator, on_gone=lambda reason: os._exit(1))


def _parse_compact(body: bytes) -> Any:
    """Each key is looked for from where the last cut ended, so the spans are skipped, not
    scanned (a search for the other key runs over the ids list at most); where each array ends
    comes from the body's brackets, found in one pass."""
    pieces, segments, at = [], [], 0
    entries_at, ids_at = body.find(ENTRIES), body.find(IDS)
    if entries_at < 0:
        return loads(body, exact=False)
    brackets = Brackets(body)
    while entries_at >= 0 or ids_at >= 0:
        if entries_at >= 0 and (ids_at < 0 or entries_at < ids_at):
            opened = entries_at + len(ENTRIES)
            end = brackets.entries_end(opened)
            if end < 0:
                raise NotCompact("unterminated entries")
            segments.append((opened - 1, end))
            pieces += [body[at:opened - 1], b"%d" % (len(segments) - 1)]
        else:
            opened = ids_at + len(IDS)
            end = brackets.list_end(opened)
            if end < 0:
                raise NotCompact("unterminated output_ids")
            pieces += [body[at:opened - 1], b"null"]
        at = end
        if entries_at < at:
            entries_at = body.find(ENTRIES, at)
        if ids_at < at:
            ids_at = body.find(IDS, at)
    if not segments:
        raise NotCompact("output_ids without entries")
    pieces.append(body[at:])
    segments = _entries(body, segments, brackets)
    tree = loads(b"".join(pieces), exact=False)
    placed = 0
    for answer in tree if isinstance(tree, list) else [tree]:
        meta = answer.get("meta_info") if isinstance(answer, dict) else None
        index = meta.get("output_token_logprobs") if isinstance(meta, dict) else None
        if type(index) is int:  # else null: an answer aborted before it generated
            if index != placed:
                raise NotCompact("entries outside meta_info")
            meta["output_token_logprobs"] = segments[index]
            placed += 1
    if placed != len(segments):
        raise NotCompact("entries outside meta_info")
    return tree


def _entries(body: bytes, spans: list[tuple[int, int]], brackets: Brackets) -> list[Segment]:
    """Each ``[[lp, id, null], ...]`` at ``body[start:end]`` as arrays: a short one parsed as
    JSON, the others read together by :func:`rlorch.inference.scan.read_entries` (bit for bit
    what parsing them as JSON gives); anything else in a span (a string, a third value, a
    ``null`` not written ``,null]``) is refused."""
    segments: list[Any] = [None] * len(spans)
    long = []
    for number, (start, end) in enumerate(spans):
        if end - start == 2:
            segments[number] = Segment(array(TOKEN_IDS), array(LOGPROBS))
        elif end - start < SHORT_ENTRIES:  # a few entries: orjson's objects cost less than the fixed costs
            try:
                segments[number] = Segment(*segment(orjson.loads(body[start:end])))
            except (orjson.JSONDecodeError, ValueError, TypeError, IndexError) as err:
                raise NotCompact(str(err)) from None
        else:
            long.append(number)
    if long:
        try:
            read = read_entries(body, [spans[number] for number in long], brackets)
        except Irregular as err:
            raise NotCompact(str(err)) from None
        for number, (ids, logprobs) in zip(long, read):
            out_ids, out_logprobs = array(TOKEN_IDS), array(LOGPROBS)
            out_ids.frombytes(memoryview(ids).cast("B"))
            out_logprobs.frombytes(memoryview(logprobs).cast("B"))
            segments[number] = Segment(out_ids, out_logprobs)
    return segments


def segment(entries: Any) -> tuple[array, array]:
    """Ids and logprobs of one answer's ``output_token_logprobs``: a :class:`Segment` as it is,
    a parsed list entry by entry (raises ``ValueError`` naming a non-finite logprob)."""
    if isinstance(entries, Segment):
        return entries.ids, entries.logprobs
    logprobs = [e[0] for e in entries]
    if not all(isinstance(lp, (int, float)) and math.isfinite(lp) for lp in logprobs):
        raise ValueError(f"non-finite behaviour logprob: {logprobs}")
    return array(TOKEN_IDS, [int(e[1]) for e in entries]), array(LOGPROBS, [float(lp) for lp in logprobs])
