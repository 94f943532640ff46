"""The environment registry: a task name (or a data file) to an :class:`Environment`.

Every environment is deterministic in ``(index, seed)``: the same prompt comes back for the same
pair in every process, which is what lets a resumed run continue its prompt stream exactly.
"""


from __future__ import annotations

from typing import Callable

from rlorch.config.schema import Config, ConfigError
from rlorch.types import Environment

Factory = Callable[[Config], Environment]
BUILT_IN: dict[str, str] = {
    "reverse": "rlorch.tasks.digits:reverse_task",
    "reverse_retry": "rlorch.tasks.digits:reverse_retry_task",
    "sort": "rlorch.tasks.digits:sort_task",
    "calculator": "rlorch.tasks.calculator:calculator_task",
    "jsonl": "rlorch.tasks.jsonl:jsonl_task",
}
"""Each built-in task's factory as ``module:function``, imported only when chosen."""


def names() -> list[str]:
    return sorted(BUILT_IN)


def _factory(name: str) -> Factory:
    import importlib

    module, _, function = BUILT_IN[name].partition(":")
    return getattr(importlib.import_module(module), function)


def make_environment(config: Config) -> Environment:
    """The task's environment; ``data.path`` set always means the jsonl task.

    ``task.name`` is a registered name, or ``package.module:Class`` for an environment of your
    own: ``Class(**task.params)`` must give an object with ``name``, ``make_prompt`` and an
    async ``episode`` (see :class:`rlorch.types.Environment`).
    """
    name = "jsonl" if config.data.path else config.task.name
    if ":" in name:
        return _user_environment(name, dict(config.task.params))
    if name not in BUILT_IN:
        raise ConfigError("task.name", f"unknown task {name!r} (registered: {', '.join(names())}; "
                                       "or your own as task=custom task.name=package.module:Class)")
    return _factory(name)(config)


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
