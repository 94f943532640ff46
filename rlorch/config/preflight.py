"""What can be checked before a run starts anything: the task exists, its data file is readable
and parses, the model directory exists, the plot's directory exists.

``rlorch validate-config`` and ``rlorch train`` run these checks up front, so bad input fails in
a second with one line naming the key or the file and line, and leaves no run directory.
"""

from __future__ import annotations

from pathlib import Path

from rlorch.config.schema import Config, ConfigError, InferenceBackend


def preflight(config: Config) -> None:
    """Raise :class:`ConfigError` naming the key (and file and line) of the first problem."""
    from rlorch.tasks.registry import make_environment
    from rlorch.tasks.dataset import DataError

    if config.run.launcher == "ray":
        import importlib.util

        if importlib.util.find_spec("ray") is None:
            raise ConfigError("run.launcher", 'ray is not installed: pip install "rlorch[ray]"')

    if config.model.path and config.inference.backend.generates_model_tokens and not _uncreated_built_in(config):
        from rlorch.model import resolve_model_path

        path = resolve_model_path(config.model.path)
        if config.model.implementation == "native":
            from rlorch.model import uses_native

            uses_native("native", path, lora=bool(config.model.lora.rank))  # refused naming the key
    if config.inference.launch_args and config.inference.backend == InferenceBackend.cpu:
        from rlorch.serve.arguments import launch_args_problem

        problem = launch_args_problem(list(config.inference.launch_args))
        if problem:
            raise ConfigError("inference.launch_args", problem)
    try:
        environment = make_environment(config)
    except DataError as err:
        raise ConfigError("data.path", str(err)) from err
    answer_tokens = getattr(environment, "answer_tokens", None)
    if answer_tokens is not None and answer_tokens > config.rollout.max_new_tokens:
        # Every answer of that length would be cut: a run that cannot learn, found only at its end.
        raise ConfigError("rollout.max_new_tokens",
                          f"{config.rollout.max_new_tokens} cannot hold task {config.task.name}'s longest answer "
                          f"({answer_tokens} tokens): set rollout.max_new_tokens={answer_tokens} or more")
    if config.task.agent:
        load_agent(config.task.agent)


def _uncreated_built_in(config: Config) -> bool:
    """``model.path`` names a built-in model not created yet: a Qwen2 of rlorch's own, nothing to
    check, and not created here (``validate-config`` stays fast; a run creates it first)."""
    from rlorch.model import BUILT_IN_MODELS, CONFIG_FILE, model_directory

    return config.model.path in BUILT_IN_MODELS and not (model_directory(config.model.path) / CONFIG_FILE).is_file()


def load_agent(spec: str):
    """``task.agent``'s function; an import that fails, or a function that is not an agent, is
    refused naming the key (``openai`` missing says how to install it)."""
    from rlorch.agents.episodes import check_agent
    from rlorch.tasks.base import import_spec

    try:
        agent = import_spec(spec, "task.agent")
    except ConfigError as err:
        if "openai" in str(err):
            raise ConfigError("task.agent", f"{str(err).removeprefix('task.agent: ')}; the openai client: "
                                            "pip install 'rlorch[agents]'") from err
        raise
    problem = check_agent(agent, spec)
    if problem:
        raise ConfigError("task.agent", problem)
    return agent


def run_warnings(config: Config) -> list[str]:
    """What ``train`` and ``validate-config`` warn about: the config's own warnings and GPUs the
    placement leaves idle."""
    from rlorch.config.schema import warnings_for
    from rlorch.launch.placement import idle_gpu_warning

    idle = idle_gpu_warning(config)
    return warnings_for(config) + ([idle] if idle else [])


def writable_file(path: str, key: str) -> Path:
    """``path``'s directory exists (an output file such as ``--plot`` can be written there)."""
    target = Path(path).expanduser()
    if not target.parent.is_dir():
        raise ConfigError(key, f"{target.parent} is not a directory (cannot write {target})")
    return target
