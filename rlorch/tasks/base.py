"""What environments share: the single-turn episode, and parameters read from ``task.params``."""

from __future__ import annotations

import dataclasses
import importlib
import os
import sys
from typing import Any, TypeVar

from rlorch.config.schema import ConfigError
from rlorch.types import Conversation

P = TypeVar("P")


class SingleTurn:
    """An environment of one model turn, scored by ``score(completion, answer)``.

    The orchestrator samples the first turns of a group together (one engine call for the group);
    an environment that overrides :meth:`episode` gets one conversation per sample instead.
    """

    async def episode(self, conversation: Conversation, answer: Any) -> float:
        return self.score(await conversation.generate(), answer)

    def score(self, completion: str, answer: Any) -> float:
        raise NotImplementedError


def is_single_turn(env: object) -> bool:
    """Whether ``env`` runs the unmodified single-turn episode (so groups may be batched)."""
    return getattr(type(env), "episode", None) is SingleTurn.episode


def task_params(params_type: type[P], values: dict[str, Any]) -> P:
    """``task.params`` as the task's own dataclass; an unknown key or bad value names the key."""
    known = {f.name for f in dataclasses.fields(params_type)}
    for key in values:
        if key not in known:
            import difflib

            close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6)
            hint = f" (did you mean task.params.{close[0]}?)" if close else ""
            raise ConfigError(f"task.params.{key}", f"unknown parameter{hint}; this task takes: {', '.join(sorted(known))}")
    try:
        return params_type(**values)
    except ConfigError:
        raise
    except (TypeError, ValueError) as err:
        raise ConfigError("task.params", str(err)) from err


def require(condition: bool, key: str, message: str) -> None:
    """A task parameter check: raises :class:`ConfigError` naming ``task.params.<key>``."""
    if not condition:
        raise ConfigError(f"task.params.{key}", message)


def import_spec(spec: str, key: str) -> Any:
    """``package.module:attribute``, imported with the working directory on ``sys.path`` (as a
    Hydra application has it), so a module beside where ``rlorch`` runs is found."""
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise ConfigError(key, f"{spec!r} is not package.module:name")
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)
    try:
        return getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as err:
        raise ConfigError(key, f"cannot load {spec!r}: {err}") from err
