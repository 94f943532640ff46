"""Reading JSONL records with errors that name the file and line."""

from __future__ import annotations

import json
from typing import Iterable

import orjson


def parse_record(line: str, where: str, required: Iterable[str], error: type[Exception], *,
                 own: bool = False) -> dict:
    """One line as a JSON object holding ``required`` keys; raises ``error("FILE:LINE: ...")``.

    ``own``: a line rlorch wrote itself (token ids, counts, logprobs), parsed by orjson first.
    orjson reads an integer past 64 bits as a float, which no field of such a line can hold
    (a user's data file can: it goes to the standard parser, exact); a line orjson refuses
    (NaN, Infinity) goes to the standard parser too, which takes it or names the fault.
    """
    try:
        item = _parse(line, own)
    except json.JSONDecodeError as err:
        raise error(f"{where}: not valid JSON ({err.msg})") from err
    if not isinstance(item, dict):
        raise error(f"{where}: expected a JSON object")
    missing = [key for key in required if key not in item]
    if missing:
        raise error(f"{where}: missing key(s) {', '.join(map(repr, missing))}")
    return item


def _parse(line: str, own: bool) -> object:
    if own:
        try:
            return orjson.loads(line)
        except orjson.JSONDecodeError:
            pass
    return json.loads(line)
