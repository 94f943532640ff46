"""JSON in and out: records of JSONL files with errors that name the file and line, and the
fast codec (orjson) wherever it says exactly what Python's own would."""

from __future__ import annotations

import json
import re
from typing import Any, Iterable

import orjson

_LONG_NUMBER = re.compile(rb"[\[,:\s]-?\d{19}")
"""Where a JSON number of 19 digits or more may start (after ``[``, ``,``, ``:`` or a space)."""


def dumps(value: Any) -> bytes:
    """``value`` as JSON: orjson, which writes a non-finite float as null (as SGLang's server
    does), or Python's encoder for what orjson refuses (an integer past 64 bits, a string that
    is not valid UTF-8), which keeps the integer exact and escapes the string."""
    try:
        return orjson.dumps(value)
    except TypeError:
        return json.dumps(value).encode()


def loads(raw: bytes | str, *, exact: bool = True) -> Any:
    """JSON text, parsed by orjson where that reads what the text says, else by Python's parser:
    text orjson refuses (NaN, Infinity) and, when ``exact``, text with a number of 19 digits or
    more, which orjson would read as a float (without ``exact``: text whose writer never puts
    such an integer in it). Bad text raises Python's parser's error."""
    if not (exact and _LONG_NUMBER.search(raw if isinstance(raw, bytes) else raw.encode())):
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError:
            pass
    return json.loads(raw)


def parse_record(line: str, where: str, required: Iterable[str], error: type[Exception], *,
                 own: bool = False) -> dict:
    """One line as a JSON object holding ``required`` keys; raises ``error("FILE:LINE: ...")``.

    ``own``: a line rlorch wrote itself (token ids, counts, logprobs), parsed by orjson first.
    orjson reads an integer past 64 bits as a float, which no field of such a line can hold
    (a user's data file can: it goes to the standard parser, exact); a line orjson refuses
    (NaN, Infinity) goes to the standard parser too, which takes it or names the fault.
    """
    try:
        item = loads(line, exact=False) if own else json.loads(line)
    except json.JSONDecodeError as err:
        raise error(f"{where}: not valid JSON ({err.msg})") from err
    if not isinstance(item, dict):
        raise error(f"{where}: expected a JSON object")
    missing = [key for key in required if key not in item]
    if missing:
        raise error(f"{where}: missing key(s) {', '.join(map(repr, missing))}")
    return item

