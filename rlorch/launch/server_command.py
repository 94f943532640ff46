"""The command line of one launched inference server, read off the config (and its GPUs off the
placement, through the environment the launcher gives it)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from rlorch.config.schema import Colocate, InferenceBackend, engine_max_batch
from rlorch.serve.arguments import API_KEY_ENV  # noqa: F401  (the launchers and the client read it here)


def _cpu_command(config, *, model_path: Path, port: int, host: str) -> list[str]:
    """The engine's launched form (``python -m rlorch.serve.server``): every setting resolved
    here, so it composes no config. The API key reaches it through its environment
    (RLORCH_API_KEY), out of ``ps``; ``inference.launch_args`` are more of its flags (a flag
    given again there wins)."""
    inference = config.inference
    return [sys.executable, "-m", "rlorch.serve.server", "--host", host, "--port", str(port),
            "--parent-pid", str(os.getpid()), "--model-path", str(model_path),
            "--dtype", config.model.dtype, "--implementation", config.model.implementation,
            "--threads", str(inference.cpu.threads),
            "--max-batch", str(engine_max_batch(config)),
            "--seed", str(config.run.seed), "--transfer-timeout", f"{inference.transfer_timeout:g}",
            *(["--device", inference.cpu.device] if inference.cpu.device != "cpu" else []),
            *memory_args(config), *inference.launch_args]


def _sglang_command(config, *, model_path: Path, port: int, host: str) -> list[str]:
    """SGLang takes its API key only as ``--api-key`` (added by the launcher). In float32 it gets
    ``--attention-backend triton`` unless ``inference.launch_args`` name a backend: on Hopper
    SGLang picks FA3, which has no float32 kernels."""
    command = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model_path),
               "--host", host, "--port", str(port), "--weight-version", "0", "--dtype", config.model.dtype,
               "--random-seed", str(config.run.seed), "--tp-size", str(config.inference.tp_size),
               *memory_args(config), *config.inference.launch_args]
    if config.run.colocate is Colocate.swap and "--enable-memory-saver" not in config.inference.launch_args:
        command.append("--enable-memory-saver")    # without it a release frees nothing
    return command + fp32_attention_args(config)


def memory_args(config) -> list[str]:
    """``--mem-fraction-static`` from ``inference.memory_fraction`` (set, or sized for a colocated
    run by :mod:`rlorch.launch.colocation`) unless ``inference.launch_args`` give one."""
    fraction = config.inference.memory_fraction
    given = any(arg.split("=", 1)[0] == "--mem-fraction-static" for arg in config.inference.launch_args)
    return [] if fraction is None or given else ["--mem-fraction-static", f"{fraction:g}"]


def fp32_attention_args(config) -> list[str]:
    """``--attention-backend triton`` for a float32 SGLang server with no backend chosen, else []."""
    chosen = any(arg.split("=", 1)[0] == "--attention-backend" for arg in config.inference.launch_args)
    return [] if chosen or config.model.dtype != "float32" else ["--attention-backend", "triton"]


SERVER_COMMANDS = {InferenceBackend.cpu: _cpu_command, InferenceBackend.sglang: _sglang_command}
"""How each launched backend starts one server."""


def server_command(config, *, model_path: Path, port: int, host: str = "127.0.0.1") -> list[str]:
    """The command line of one launched server."""
    build = SERVER_COMMANDS.get(config.inference.backend)
    if build is None:
        raise ValueError(f"inference.backend={config.inference.backend.value!r} is not launched by rlorch.inference.servers")
    return build(config, model_path=model_path, port=port, host=host)
