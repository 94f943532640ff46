"""Whether a checkpoint can be resumed from, checked before a resume moves or deletes anything.

A resume at step N rewrites the run directory (later batches and checkpoints move aside, newer
weights go): it may only start once everything it will read is known to be readable — the
orchestrator's state, the trainer's state and its sharded model and optimizer, and the HF
weights the engines load. :func:`check_checkpoint` reads only.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

from rlorch.rundir.layout import CheckpointDir, RunDir


def check_checkpoint(path: Path, run_dir: RunDir, step: int, config) -> Optional[str]:
    """None when checkpoint ``path`` (step ``step``) is resumable, else what is wrong with it,
    naming the file."""
    parts = CheckpointDir(path)
    if parts.nonfinite.exists():
        return (f"{parts.nonfinite}: the trainer found non-finite values in this checkpoint when it loaded it "
                f"({parts.nonfinite.read_text().strip()}); delete the marker to try it anyway")
    for problem in (_check_state(parts.state, step), _check_trainer(parts.trainer, step, config),
                    _check_weights(parts, run_dir, step, config)):
        if problem is not None:
            return problem
    return None


def _load_json(path: Path) -> tuple[Optional[dict], Optional[str]]:
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as err:
        return None, f"{path}: unreadable ({type(err).__name__}: {err})"
    if not isinstance(data, dict):
        return None, f"{path}: expected a JSON object"
    return data, None


def _check_state(path: Path, step: int) -> Optional[str]:
    from rlorch.rundir.state import ResumeState

    data, problem = _load_json(path)
    if problem is not None:
        return problem
    try:
        state = ResumeState.from_json(data, lambda group_id: SimpleNamespace(group_id=group_id, attempt=0))
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        return f"{path}: malformed ({type(err).__name__}: {err})"
    if state.step != step:
        return f"{path}: holds step {state.step}, not {step}"
    return None


def _check_trainer(trainer_dir: Path, step: int, config) -> Optional[str]:
    from rlorch.config.schema import TrainerBackend

    path = trainer_dir / "trainer_state.json"
    data, problem = _load_json(path)
    if problem is not None:
        return problem
    if data.get("step") != step:
        return f"{path}: holds step {data.get('step')!r}, not {step}"
    if config.trainer.backend is TrainerBackend.fsdp:
        flat = trainer_dir / "state.safetensors"   # a single CPU rank's (rlorch.trainer.checkpoint)
        return _check_safetensors(flat) if flat.is_file() else _check_dcp(trainer_dir / "dcp")
    return None


def _check_dcp(path: Path) -> Optional[str]:
    """The sharded state's metadata parses and every shard file is as long as it says."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        metadata = FileSystemReader(str(path)).read_metadata()
    except Exception as err:
        return f"{path}/.metadata: unreadable ({type(err).__name__}: {err})"
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in needed.items():
        shard = path / name
        actual = shard.stat().st_size if shard.is_file() else -1
        if actual < size:
            return f"{shard}: truncated or missing ({max(actual, 0)} of {size} bytes)"
    return None


def _check_weights(parts: CheckpointDir, run_dir: RunDir, step: int, config) -> Optional[str]:
    """The HF weights the engines will load: the checkpoint's own, else the published ones."""
    if not config.inference.backend.generates_model_tokens:
        return None
    weights = parts.weights if parts.weights.is_dir() else run_dir.weights_for(step)
    if not (weights / "config.json").is_file():
        return f"{weights}: no HF weights (config.json missing)"
    files = sorted(weights.glob("*.safetensors"))
    if not files:
        return f"{weights}: no *.safetensors weights"
    for file in files:
        problem = _check_safetensors(file)
        if problem is not None:
            return problem
    return None


def _check_safetensors(path: Path) -> Optional[str]:
    """The header parses and the file is as long as its tensors need."""
    try:
        with open(path, "rb") as handle:
            size = int.from_bytes(handle.read(8), "little")
            header = json.loads(handle.read(size))
        end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
    except (OSError, ValueError, KeyError, TypeError, IndexError) as err:
        return f"{path}: unreadable safetensors ({type(err).__name__}: {err})"
    if path.stat().st_size < 8 + size + end:
        return f"{path}: truncated ({path.stat().st_size} of {8 + size + end} bytes)"
    return None
