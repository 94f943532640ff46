"""``[[logprob, id, null], ...]`` read as bytes by numpy: no Python object per token.

Every byte of a span is accounted for: the brackets, commas and nulls are found where the shape
puts them, and every other byte belongs to a number whose characters are checked against JSON's
number grammar. Numbers are read from a matrix of their characters (one row a number, aligned on
its last byte, gathered eight bytes at a time through an unaligned ``uint64`` view of the body;
eight digits are summed in one 64-bit word):

- an id is at most ten digits, its value below 2**31;
- a logprob is its decimal digits ``D`` (at most 18 significant) and exponent ``E``, and
  ``D * 10**E`` in float64 is correctly rounded when ``D < 2**53`` and ``|E| <= 22`` (both
  factors exact, one rounding). With more digits ``D`` itself rounds, so the float64 may be an ulp
  or two off the correctly rounded one; it rounds to the same float32 unless it lies within a
  few ulps of a float32 rounding boundary. A number where either rule cannot vouch for the
  float32 (that boundary, ``|E| > 22``, more digits, a float32 subnormal or overflow) is read by
  Python's ``float``, which rounds correctly, as orjson does.

So the arrays are bit for bit those of parsing the span as JSON and casting the float64 logprobs
to float32. Anything off the shape raises :class:`Irregular` (the caller parses the body in full).
"""

from __future__ import annotations

import re

import numpy

CHUNK = 16384
"""Numbers read together: bounds the matrices (a few MB a chunk)."""

MAX_LOGPROB_CHARS = 32
MAX_ID_DIGITS = 10
SIG_DIGITS = 18
"""Significant digits an int64 holds exactly whatever they are."""

EXACT = 2**53
POW10_INT = 10 ** numpy.arange(19, dtype=numpy.int64)
POW10_FLOAT = 10.0 ** numpy.arange(23)
FLOAT32_ULP_BITS = 29
"""Bits of a float64's mantissa below a float32's."""
MIDPOINT = 1 << (FLOAT32_ULP_BITS - 1)
MARGIN = 16
"""Float64 ulps around a float32 rounding midpoint where an estimate is not trusted."""
FLOAT32_NORMAL = 2.0 ** -125
FLOAT32_LARGE = 3.4e38
PAD = 32
"""Bytes a body needs before its first span: every gather of 8 bytes back from a number's end
stays inside it (a body without them is copied behind zeros)."""
TAIL = b" 0" + bytes(PAD + MAX_LOGPROB_CHARS)
"""After a copied body: a ``0`` (a number too long for the matrix is read as some ``0`` of the
body, then by ``float`` after a check of its grammar), and zeros."""
JSON_NUMBER = re.compile(rb"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")

DIGIT0, MINUS, PLUS, DOT, COMMA, LOWER_E, OPEN, CLOSE = b"0-+.,e[]"


class Irregular(ValueError):
    """The span is not ``[[number, integer, null], ...]`` written compactly."""


def read_entries(body: bytes | bytearray, spans: list[tuple[int, int]]) -> list[tuple[numpy.ndarray, numpy.ndarray]]:
    """Ids (int32) and logprobs (float32) of each entries array at ``body[start:end]`` for
    ``(start, end)`` in ``spans`` (in order, from its ``[`` to its ``]``, at least one entry
    each), all read together. The body is read where it lies when it has room around the spans
    for the reads of 8 bytes (it has, but at its very ends), else a copy with room."""
    zero = body.find(b"0", PAD)
    if spans[0][0] < PAD or len(body) - spans[-1][1] < 8 or zero < 0:
        body, spans = b"".join((bytes(PAD), body, TAIL)), [(start + PAD, end + PAD) for start, end in spans]
        zero = len(body) - len(TAIL) + 1
    words = numpy.ndarray((len(body) - 7,), "<u8", buffer=body, strides=(1,))
    each = [_entry_closes(body, words, start, end) for start, end in spans]
    counts = [len(closes) for closes in each]
    closes = numpy.concatenate(each)
    starts = closes - 2
    starts[1:] = closes[:-1] + 3
    firsts = numpy.cumsum([0] + counts[:-1])
    starts[firsts] = [start + 2 for start, _ in spans]
    ids = numpy.empty(len(closes), numpy.int32)
    logprobs = numpy.empty(len(closes), numpy.float32)
    for at in range(0, len(closes), CHUNK):
        part = slice(at, at + CHUNK)
        ids[part], splits = _ids(words, closes[part] - 5)
        logprobs[part] = _logprobs(words, body, starts[part], splits, zero)
    bounds = numpy.cumsum(counts)[:-1]
    return list(zip(numpy.split(ids, bounds), numpy.split(logprobs, bounds)))


def _entry_closes(body: bytes | bytearray, words: numpy.ndarray, start: int, end: int) -> numpy.ndarray:
    """Where the entries of ``body[start:end]`` end (their ``]``), the shape checked."""
    raw = numpy.frombuffer(body, numpy.uint8)[start:end]
    closes = numpy.flatnonzero(raw == CLOSE) + start
    count = closes.size - 1
    if count < 1 or closes[-1] != end - 1 or numpy.count_nonzero(raw == COMMA) != 3 * count - 1:
        raise Irregular("entries other than [logprob, id, null]")
    closes = closes[:-1]
    _check_shape(body, start, end, words, closes)
    return closes


NEXT_ENTRY = numpy.uint64(int.from_bytes(b",null],[", "little"))
LAST_ENTRY = numpy.uint64(int.from_bytes(b",null]]", "little"))
SEVEN_BYTES = numpy.uint64(2**56 - 1)


def _check_shape(body: bytes | bytearray, start: int, end: int, words: numpy.ndarray, closes: numpy.ndarray) -> None:
    """``[`` + entries ``[a,b,null]`` joined by ``,`` + ``]`` (``body[start:end]``; ``closes``
    are all its ``]`` but the last): each entry's ``,null]`` before its ``]``, and after it ``,[``
    or the span's ``]``. With each entry's comma between ``a`` and ``b`` (found by
    :func:`_ids`) that is every comma the span has (counted), so every other byte is in an ``a``
    or a ``b``, which are checked as numbers."""
    if (body[start:start + 2] != b"[[" or closes[-1] != end - 2
            or not (words[closes[:-1] - 5] == NEXT_ENTRY).all()
            or words[closes[-1] - 5] & SEVEN_BYTES != LAST_ENTRY):
        raise Irregular("entries other than [logprob, id, null]")


def _ids(words: numpy.ndarray, ends: numpy.ndarray) -> tuple[numpy.ndarray, numpy.ndarray]:
    """The ids ending at ``ends`` (after the last comma in the 16 bytes before each): integers
    below 2**31 without a leading zero, and where each one's comma is."""
    blocks = _words(words, ends - 16, 2)
    chars = blocks.view(numpy.uint8)
    commas = chars == COMMA
    comma_at = 15 - commas[:, ::-1].argmax(axis=1)
    lengths = 15 - comma_at
    if not commas[numpy.arange(len(ends)), comma_at].all() or lengths.min() < 1 or lengths.max() > MAX_ID_DIGITS:
        raise Irregular("a token id of no digits or more than ten")
    kept = _keep(comma_at + 1, 2)
    digits = ((blocks & kept) | (ZERO_CHARS & ~kept)).view(numpy.uint8) - DIGIT0
    first = digits[numpy.arange(len(ends)), comma_at + 1]
    if (digits > 9).any() or ((first == 0) & (lengths > 1)).any():
        raise Irregular("a token id that is not a JSON integer")
    eights = _eight_digits(digits.view(numpy.uint64))
    values = eights[:, 0] * numpy.uint64(10**8) + eights[:, 1]
    if values.max() >= 2**31:
        raise Irregular("a token id past int32")
    return values, ends - 16 + comma_at


def _keep(dropped: numpy.ndarray, count: int) -> numpy.ndarray:
    """Masks of ``count`` words a row keeping all bytes but the first ``dropped`` of each row."""
    keep = numpy.empty((len(dropped), count), numpy.uint64)
    for k in range(count):
        keep[:, k] = KEEP.take(numpy.clip(dropped - 8 * k, 0, 8))
    return keep


KEEP = numpy.array([(2**64 - 1) << (8 * dropped) & (2**64 - 1) for dropped in range(9)], numpy.uint64)
"""A word's bytes from the ``i``-th on (``KEEP[i]``); ``KEEP[8]`` none."""


def _words(words: numpy.ndarray, starts: numpy.ndarray, count: int) -> numpy.ndarray:
    """``count`` unaligned 8-byte words from each of ``starts``, one row each."""
    return numpy.stack([words[starts + 8 * k] for k in range(count)], axis=1)


def _eight_digits(blocks: numpy.ndarray) -> numpy.ndarray:
    """Each uint64 of eight digit values (0-9, the first the most significant) as its integer."""
    blocks = (blocks * numpy.uint64(10) + (blocks >> numpy.uint64(8))) & numpy.uint64(0x00FF00FF00FF00FF)
    blocks = (blocks * numpy.uint64(100) + (blocks >> numpy.uint64(16))) & numpy.uint64(0x0000FFFF0000FFFF)
    return (blocks * numpy.uint64(10000) + (blocks >> numpy.uint64(32))) & numpy.uint64(0xFFFFFFFF)


BLOCK_STARTS = numpy.arange(0, 32, 8)
ZERO_CHARS = numpy.uint64(int.from_bytes(b"0" * 8, "little"))


def _logprobs(words: numpy.ndarray, body: bytes | bytearray, starts: numpy.ndarray, ends: numpy.ndarray,
              zero: int) -> numpy.ndarray:
    """JSON numbers, as float64 correctly rounded then cast to float32 (see the module doc).

    Read from a matrix of each number's bytes aligned on its last (its first at column
    ``width - length``): the grammar is checked on the positions of its signs, point and ``e``,
    each found once in the whole matrix; the mantissa is the matrix's last 24 bytes, or for a
    number with an exponent the 24 before its ``e``."""
    lengths = ends - starts
    if lengths.min() < 1:
        raise Irregular("a logprob of no characters")
    long = numpy.flatnonzero(lengths > MAX_LOGPROB_CHARS)
    if long.size:
        given = [bytes(body[starts[row]:ends[row]]) for row in long]
        if not all(JSON_NUMBER.fullmatch(text) for text in given):
            raise Irregular("a logprob that is not a JSON number")
        starts, ends = starts.copy(), ends.copy()
        starts[long] = zero
        ends[long] = starts[long] + 1
        lengths = ends - starts
    longest = int(lengths.max())
    width = max(MANTISSA_WIDTH, -(-longest // 8) * 8)
    blocks = _words(words, ends - width, width // 8)
    chars = blocks.view(numpy.uint8)
    count = len(starts)
    first = width - lengths
    kept = _keep(first, width // 8)
    inside = kept.view(numpy.uint8) != 0
    is_digit = (chars - DIGIT0) < 10
    is_e = ((chars | 0x20) == LOWER_E) & inside
    is_dot = (chars == DOT) & inside
    is_sign = ((chars == MINUS) | (chars == PLUS)) & inside
    if numpy.count_nonzero(is_digit & inside) + numpy.count_nonzero(is_e) + numpy.count_nonzero(is_dot) \
            + numpy.count_nonzero(is_sign) != lengths.sum():
        raise Irregular("a logprob that is not a JSON number")
    e_rows, e_at = _at_most_one(is_e, width)
    has_dot, dot_at = _at_most_one(is_dot, width, count)
    sign_at = numpy.flatnonzero(is_sign)
    sign_rows, sign_columns = sign_at // width, sign_at % width
    negative = numpy.zeros(count, bool)
    at_start = sign_columns == first[sign_rows]
    negative[sign_rows[at_start]] = True
    e_column = numpy.full(count, width)
    e_column[e_rows] = e_at
    exponent_sign = numpy.zeros(count, bool)
    exponent_sign[sign_rows[~at_start]] = True
    lead = first + negative
    integer_end = numpy.where(has_dot, dot_at, e_column)
    first_char = chars[numpy.arange(count), numpy.minimum(lead, width - 1)]
    if not ((chars.reshape(-1)[sign_at[at_start]] == MINUS).all()
            and (sign_columns[~at_start] == e_column[sign_rows[~at_start]] + 1).all()
            and (integer_end > lead).all()
            and not ((first_char == DIGIT0) & (integer_end - lead > 1)).any()
            and (~has_dot | (dot_at + 1 < e_column)).all()
            and (e_column[e_rows] + 1 + exponent_sign[e_rows] < width).all()):
        raise Irregular("a logprob that is not a JSON number")
    digits = (blocks[:, -MANTISSA_WIDTH // 8:] & kept[:, -MANTISSA_WIDTH // 8:]).view(numpy.uint8)
    mantissa_chars = e_column - lead
    if e_rows.size:
        digits[e_rows] = _mantissa_chars(words, ends[e_rows] - width + e_at, mantissa_chars[e_rows])
    after_dot = numpy.where(has_dot, e_column - dot_at, 0)
    whole, unsure = _mantissa(digits, mantissa_chars, after_dot)
    exponent = numpy.where(has_dot, dot_at + 1 - e_column, 0)
    if e_rows.size:
        written, too_long = _exponents(chars[e_rows], e_at + 1 + exponent_sign[e_rows], width)
        negative_exponent = exponent_sign[e_rows] & (chars[e_rows, e_at + 1] == MINUS)
        exponent[e_rows] += numpy.where(negative_exponent, -written, written)
        unsure[e_rows] |= too_long
    unsure |= numpy.abs(exponent) > 22
    scale = POW10_FLOAT[numpy.clip(numpy.abs(exponent), 0, 22)]
    values = whole.astype(numpy.float64)
    values = numpy.where(exponent >= 0, values * scale, values / scale)
    low = (values.view(numpy.uint64) & numpy.uint64((1 << FLOAT32_ULP_BITS) - 1)).astype(numpy.int64)
    unsure |= (whole > EXACT) & (numpy.abs(low - MIDPOINT) <= MARGIN)
    unsure |= ((values < FLOAT32_NORMAL) & (values != 0)) | (values > FLOAT32_LARGE)
    values = numpy.where(negative & ((values != 0) | has_dot | (e_column < width)), -values, values)  # JSON's -0 is 0
    for row in numpy.flatnonzero(unsure):
        values[row] = float(body[starts[row]:ends[row]])
    for row, text in zip(long, given if long.size else ()):
        values[row] = float(text)
    if not numpy.isfinite(values).all():
        raise Irregular("a logprob past float64")
    with numpy.errstate(over="ignore"):  # past float32's range: -inf, as a cast of the JSON's float64
        return values.astype(numpy.float32)


def _at_most_one(found: numpy.ndarray, width: int, rows: int | None = None):
    """Where each row of ``found`` holds its one True: (rows, columns) of the rows that hold one,
    or with ``rows`` a mask of those rows and every row's column; two in a row raise."""
    at = numpy.flatnonzero(found)
    holding = at // width
    if (holding[1:] == holding[:-1]).any():
        raise Irregular("a logprob that is not a JSON number")
    if rows is None:
        return holding, at % width
    mask, columns = numpy.zeros(rows, bool), numpy.zeros(rows, numpy.int64)
    mask[holding], columns[holding] = True, at % width
    return mask, columns


MANTISSA_WIDTH = 24


def _mantissa_chars(words: numpy.ndarray, ends: numpy.ndarray, chars: numpy.ndarray) -> numpy.ndarray:
    """The 24 bytes before each of ``ends``, those before its last ``chars`` made zero."""
    blocks = _words(words, ends - MANTISSA_WIDTH, MANTISSA_WIDTH // 8)
    blocks &= _keep(MANTISSA_WIDTH - chars, MANTISSA_WIDTH // 8)
    return blocks.view(numpy.uint8)


def _mantissa(chars: numpy.ndarray, count: numpy.ndarray, after_dot: numpy.ndarray) -> tuple[numpy.ndarray, numpy.ndarray]:
    """Mantissas as int64 from 24 bytes ending on each (``count`` of them its, the others zero;
    the point ``after_dot`` of them from the end, 0 for none), and whether one has more than 18
    significant digits (its int64 is then not to be used). The point is made a zero digit;
    read so, the digits left of it are worth ten times theirs."""
    values = chars - DIGIT0
    values *= values < 10
    eights = _eight_digits(values.view(numpy.uint64))
    unsure = (count > MANTISSA_WIDTH) | (eights[:, 0] >= 100)
    read = (eights[:, 0] * numpy.uint64(10**16) + eights[:, 1] * numpy.uint64(10**8) + eights[:, 2]).astype(numpy.int64)
    right = read % POW10_INT[numpy.clip(after_dot - 1, 0, SIG_DIGITS)]
    whole = numpy.where(after_dot > 0, (read - right) // 10 + right, read)
    return whole, unsure


def _exponents(chars: numpy.ndarray, first: numpy.ndarray, end: int) -> tuple[numpy.ndarray, numpy.ndarray]:
    """The exponents' digits (rows of ``chars`` from column ``first`` to ``end``) as integers,
    and whether one has more than three digits (read then by ``float``)."""
    rows = numpy.arange(len(first))
    written = numpy.zeros(len(first), numpy.int64)
    for k in range(3):
        column = numpy.minimum(first + k, end - 1)
        written = numpy.where(first + k < end, written * 10 + (chars[rows, column] - DIGIT0), written)
    return written, end - first > 3
