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
    "jsonl": "rlorch.tasks.dataset:data_task",
}
"""Each built-in task's factory as ``module:function``, imported only when chosen."""
PARAMS: dict[str, str] = {
    "reverse": "rlorch.tasks.digits:DigitParams",
    "sort": "rlorch.tasks.digits:DigitParams",
    "reverse_retry": "rlorch.tasks.digits:RetryParams",
    "calculator": "rlorch.tasks.calculator:CalculatorParams",
}
"""The dataclass of each built-in task's ``task.params`` (jsonl takes none)."""


def names() -> list[str]:
    return sorted(BUILT_IN)


def _factory(name: str) -> Factory:
    import importlib

    module, _, function = BUILT_IN[name].partition(":")
    return getattr(importlib.import_module(module), function)


def make_environment(config: Config) -> Environment:
    """The task's environment; ``data.path`` set always means the data task (``jsonl``).

    ``task.name`` is a registered name, or ``package.module:Class`` for an environment of your
    own (importable from the working directory, as in a Hydra application):
    ``Class(**task.params)`` must give an object with ``name``, ``make_prompt`` and an async
    ``episode`` (see :class:`rlorch.types.Environment`). ``task.reward`` belongs to the data task.
    """
    name = "jsonl" if config.data.path else config.task.name
    if config.task.reward and name != "jsonl":
        raise ConfigError("task.reward", "reward functions score a task from data: set data.path (an environment "
                                         "of your own computes its reward in episode)")
    if ":" in name:
        return _user_environment(name, dict(config.task.params))
    if name not in BUILT_IN:
        raise ConfigError("task.name", f"unknown task {name!r} (registered: {', '.join(names())}; "
                                       "or your own as task=custom task.name=package.module:Class)")
    return _factory(name)(config)


def _user_environment(spec: str, params: dict) -> Environment:
    import inspect

    from rlorch.tasks.base import import_spec

    factory = import_spec(spec, "task.name")
    try:
        env = factory(**params)
    except TypeError as err:
        raise ConfigError("task.params", f"{spec}: {err}") from err
    missing = [m for m in ("name", "make_prompt", "episode") if not hasattr(env, m)]
    if missing or not inspect.iscoroutinefunction(getattr(env, "episode", None)):
        raise ConfigError("task.name", f"{spec} is not an environment: it needs name, make_prompt and "
                                       f"an async episode(conversation, answer) (missing: {', '.join(missing) or 'async episode'})")
    return env


def params_of(name: str) -> list[str] | None:
    """The parameter names a built-in task takes, or None for a task of your own (whose
    parameters only its constructor knows)."""
    import dataclasses
    import importlib

    if name not in BUILT_IN:
        return None
    if name not in PARAMS:
        return []
    module, _, cls = PARAMS[name].partition(":")
    return [f.name for f in dataclasses.fields(getattr(importlib.import_module(module), cls))]


def unknown_param(task: str, key: str) -> ConfigError:
    """The error for ``task.params.<key>`` that the chosen task's preset does not list: the
    closest parameter of a built-in task's own params dataclass, or for a task of your own the
    ``+`` a parameter the preset does not list needs."""
    import difflib

    param = key.rsplit(".", 1)[-1]
    known = params_of(task)
    if known is None:
        return ConfigError(key, f"task {task} has no {param} in its preset; a new parameter takes a +: "
                                f"+{key}=VALUE")
    if param in known:
        return ConfigError(key, f"task {task} takes {param}, but the preset in use does not list it; set it "
                                f"with a +: +{key}=VALUE")
    close = difflib.get_close_matches(param, known, n=1, cutoff=0.6)
    hint = f" (did you mean task.params.{close[0]}?)" if close else ""
    return ConfigError(key, f"unknown parameter of task {task}{hint}; it takes: {', '.join(known) or 'none'}")
