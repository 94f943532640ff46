"""The environment registry: a task name (or a data file) to an :class:`Environment`.

Every environment is deterministic in ``(index, seed)``: the same prompt comes back for the same
pair in every process, which is what lets a resumed run continue its prompt stream exactly.
"""

from __future__ import annotations

from typing import Callable

from rlorch.config import Config, ConfigError
from rlorch.types import Environment

Factory = Callable[[Config], Environment]
_REGISTRY: dict[str, Factory] = {}


def register(name: str) -> Callable[[Factory], Factory]:
    def add(factory: Factory) -> Factory:
        _REGISTRY[name] = factory
        return factory
    return add


def names() -> list[str]:
    return sorted(_REGISTRY)


def make_environment(config: Config) -> Environment:
    """The task's environment; ``data.path`` set always means the jsonl task."""
    name = "jsonl" if config.data.path else config.task.name
    if name not in _REGISTRY:
        raise ConfigError("task.name", f"unknown task {name!r} (registered: {', '.join(names())})")
    return _REGISTRY[name](config)


from rlorch.tasks import digits, jsonl  # noqa: E402,F401  (registration side effect)
