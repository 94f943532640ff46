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
    """The task's environment; ``data.path`` set always means the jsonl task.

    ``task.name`` is a registered name, or ``package.module:Class`` for an environment of your
    own: ``Class(**task.params)`` must give an object with ``name``, ``make_prompt`` and an
    async ``episode`` (see :class:`rlorch.types.Environment`).
    """
    name = "jsonl" if config.data.path else config.task.name
    if ":" in name:
        return _user_environment(name, dict(config.task.params))
    if name not in _REGISTRY:
        raise ConfigError("task.name", f"unknown task {name!r} (registered: {', '.join(names())}; "
                                       "or your own as task=custom task.name=package.module:Class)")
    return _REGISTRY[name](config)


def _user_environment(spec: str, params: dict) -> Environment:
    import importlib
    import inspect

    module_name, _, attribute = spec.partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as err:
        raise ConfigError("task.name", f"cannot load {spec!r}: {err}") from err
    try:
        env = factory(**params)
    except TypeError as err:
        raise ConfigError("task.params", f"{spec}: {err}") from err
    missing = [m for m in ("name", "make_prompt", "episode") if not hasattr(env, m)]
    if missing or not inspect.iscoroutinefunction(getattr(env, "episode", None)):
        raise ConfigError("task.name", f"{spec} is not an environment: it needs name, make_prompt and "
                                       f"an async episode(conversation, answer) (missing: {', '.join(missing) or 'async episode'})")
    return env


from rlorch.tasks import calculator, digits, jsonl  # noqa: E402,F401  (registration side effect)
