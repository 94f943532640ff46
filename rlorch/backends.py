"""The backend registry: which module starts each inference engine and each trainer, and which
launcher places their processes.

A backend is one module that registers a starter here under its config enum value, plus a preset
in ``conf/inference/`` or ``conf/trainer/``; a launcher is one module with a class implementing
:class:`rlorch.launch.base.Launcher`. Modules are imported only when chosen, so ``rlorch --help``
never pays for torch.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any, Awaitable, Callable, Optional

from rlorch.config.schema import Config, InferenceBackend, TrainerBackend
from rlorch.rundir.layout import RunDir
from rlorch.types import Engine, PolicyVersion, Trainer

InferenceStarter = Callable[[Config, RunDir, PolicyVersion, Any], Awaitable[tuple[Engine, Any]]]
"""``(config, run_dir, policy, launcher) -> (engine, tokenizer or None)``: ready to generate."""
TrainerFactory = Callable[[Config, RunDir, Optional[Path], int, Any], Trainer]
"""``(config, run_dir, resume checkpoint or None, start step, launcher) -> trainer`` (not started)."""

INFERENCE_MODULES = {InferenceBackend.sim: "rlorch.inference.sim", InferenceBackend.cpu: "rlorch.inference.servers",
                     InferenceBackend.sglang: "rlorch.inference.servers"}
TRAINER_MODULES = {TrainerBackend.sim: "rlorch.trainer.sim", TrainerBackend.fsdp: "rlorch.trainer.process"}
LAUNCHERS = {"local": "rlorch.launch.local:LocalLauncher", "ray": "rlorch.launch.ray:RayLauncher"}
"""Each launcher's class as ``module:Class``."""

_inference: dict[InferenceBackend, InferenceStarter] = {}
_trainers: dict[TrainerBackend, TrainerFactory] = {}


def _registrar(table: dict) -> Callable:
    def backend(*kinds):
        def register(starter):
            for kind in kinds:
                table[kind] = starter
            return starter
        return register
    return backend


inference_backend = _registrar(_inference)
"""``@inference_backend(InferenceBackend.X, ...)`` registers an :data:`InferenceStarter`."""
trainer_backend = _registrar(_trainers)
"""``@trainer_backend(TrainerBackend.X, ...)`` registers a :data:`TrainerFactory`."""


def make_launcher(name: str = "local", config: Optional[Config] = None) -> Any:
    """The launcher ``name`` (``run.launcher``) for a run of ``config``."""
    module, _, cls = LAUNCHERS[name].partition(":")
    return getattr(importlib.import_module(module), cls)(config)


async def start_inference(config: Config, run_dir: RunDir, policy: PolicyVersion, launcher: Any) -> tuple[Engine, Any]:
    kind = config.inference.backend
    importlib.import_module(INFERENCE_MODULES[kind])
    return await _inference[kind](config, run_dir, policy, launcher)


def make_trainer(config: Config, run_dir: RunDir, resume: Optional[Path], start_step: int, launcher: Any) -> Trainer:
    kind = config.trainer.backend
    importlib.import_module(TRAINER_MODULES[kind])
    return _trainers[kind](config, run_dir, resume, start_step, launcher)
