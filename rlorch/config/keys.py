"""Every key the config schema has, and a check that refuses any other, suggesting the closest.

Hydra accepts ``+key=value`` for a key the schema lacks (and OmegaConf then drops it) and
reports a typo in a YAML preset without its name; this check runs first, on the command line's
keys and on a user preset's leaves, so an unknown key is always named, with a suggestion.
``task.params`` is free-form (each environment's own parameters) and accepts any key below it.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import typing
from typing import Any, Iterable, Iterator

from rlorch.config.schema import Config, ConfigError

FREE_FORM = ("task.params",)
"""Sections whose keys are not in the schema."""
RENAMED = {"trainer.keep": "trainer.keep_weight_versions"}
"""Keys that were renamed, to their new names (a key that moved into a backend's own section,
e.g. ``inference.latency`` to ``inference.sim.latency``, is found by :func:`moved_to`)."""
BACKEND_SECTIONS = ("inference.sim", "inference.cpu", "trainer.sim", "trainer.fsdp")


@functools.lru_cache(maxsize=1)
def schema_keys() -> frozenset[str]:
    """Dotted names of every section and field, e.g. ``rollout`` and ``rollout.max_staleness``."""
    return frozenset(_walk(Config, ""))


def _walk(cls: type, prefix: str) -> Iterator[str]:
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        name = f"{prefix}{field.name}"
        yield name
        kind = hints.get(field.name)
        if dataclasses.is_dataclass(kind):
            yield from _walk(kind, f"{name}.")


def override_key(item: str) -> str:
    """The dotted key of a ``key=value`` override, without Hydra's ``+``, ``++`` or ``~``."""
    return item.split("=", 1)[0].lstrip("+~").strip()


def moved_to(key: str) -> str | None:
    """The key's new name when it was renamed or moved into a backend's section, else None."""
    if key in RENAMED:
        return RENAMED[key]
    section, _, leaf = key.rpartition(".")
    for moved in BACKEND_SECTIONS:
        if moved.rpartition(".")[0] == section and f"{moved}.{leaf}" in schema_keys():
            return f"{moved}.{leaf}"
    return None


def suggest(key: str) -> str:
    """`` (did you mean X?)``: the key's new name, the closest key of its section, a key of
    another section with the same last segment, the closest key anywhere; or ''."""
    renamed = moved_to(key)
    if renamed is not None:
        return f" (did you mean {renamed}?)"
    section = key.rsplit(".", 1)[0] if "." in key else ""
    known = sorted(schema_keys())
    same_leaf = [k for k in known if "." in key and k.rsplit(".", 1)[-1] == key.rsplit(".", 1)[-1]]
    if len(same_leaf) == 1:
        return f" (did you mean {same_leaf[0]}?)"
    siblings = [k for k in known if k.rsplit(".", 1)[0] == section] if section in schema_keys() else []
    for pool, cutoff in ((siblings, 0.6), (known, 0.75)):
        match = difflib.get_close_matches(key, pool, n=1, cutoff=cutoff)
        if match:
            return f" (did you mean {match[0]}?)"
    leaf = key.rsplit(".", 1)[-1]
    by_leaf = difflib.get_close_matches(leaf, sorted({k.rsplit(".", 1)[-1] for k in known}), n=1, cutoff=0.8)
    if by_leaf:
        full = [k for k in known if k.rsplit(".", 1)[-1] == by_leaf[0]]
        return f" (did you mean {full[0]}?)"
    return ""


def check_key(key: str, where: str = "") -> None:
    """Raise ConfigError naming ``key`` (and ``where`` it came from) unless the schema has it."""
    if key in schema_keys() or any(key == f or key.startswith(f"{f}.") for f in FREE_FORM):
        return
    raise ConfigError(key, f"unknown key{where}{suggest(key)}")


def check_overrides(overrides: Iterable[str], groups: Iterable[str] = ()) -> None:
    """Each ``key=value`` names a schema key or a config group (``inference=sim``)."""
    groups = set(groups)
    for item in overrides:
        key = override_key(item)
        if key in groups or key.split("@", 1)[0] in groups:
            continue
        check_key(key)


def leaf_keys(node: Any, prefix: str = "") -> Iterator[str]:
    """Dotted keys of a loaded YAML mapping's leaves (a mapping's own key when it is empty)."""
    if isinstance(node, dict) and node:
        for name, value in node.items():
            yield from leaf_keys(value, f"{prefix}{name}.")
    elif prefix:
        yield prefix[:-1]


def check_preset(loaded: dict, source: str) -> None:
    """A user YAML preset's keys (besides ``defaults`` and ``hydra``) are schema keys."""
    for name, value in loaded.items():
        if name in ("defaults", "hydra"):
            continue
        for key in leaf_keys({name: value}):
            if not any(key == f or key.startswith(f"{f}.") for f in FREE_FORM):
                check_key(key, f" in {source}")
