"""Reading JSONL records with errors that name the file and line."""

from __future__ import annotations

import json
from typing import Iterable

import orjson


def parse_record(line: str, where: str, required: Iterable[str], error: type[Exception]) -> dict:
    """One line as a JSON object holding ``required`` keys; raises ``error("FILE:LINE: ...")``."""
    try:
        item = orjson.loads(line)
    except orjson.JSONDecodeError:
        # What orjson refuses but the standard parser takes (NaN, integers past 64 bits) is
        # parsed as the standard parser would; what neither takes fails with its message.
        try:
            item = json.loads(line)
        except json.JSONDecodeError as err:
            raise error(f"{where}: not valid JSON ({err.msg})") from err
    if not isinstance(item, dict):
        raise error(f"{where}: expected a JSON object")
    missing = [key for key in required if key not in item]
    if missing:
        raise error(f"{where}: missing key(s) {', '.join(map(repr, missing))}")
    return item
