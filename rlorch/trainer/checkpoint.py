"""Full resumable trainer state under ``checkpoints/step_N/``.

Layout: the model's and optimizer's state, either ``trainer/dcp/`` (sharded,
torch.distributed.checkpoint: what several ranks save together) or ``trainer/state.safetensors``
(a single CPU rank's, written beside training: :func:`begin_single_rank_save`); with LoRA the
model part is the adapters alone, the frozen base being the model path's. Then
``trainer/trainer_state.json`` (step, RNG states, optimizer steps taken), ``weights/`` (HF copy
of version N) and, last, ``trainer/COMPLETE``. Either state resumes on any number of ranks.
Invariant: a checkpoint without COMPLETE is never resumed from and is overwritten by the next
save of the same step.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import threading
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from rlorch.rundir.layout import COMPLETE, PUBLISHED, CheckpointDir, RunDir, mark, write_json_atomic

STATE_FILE = "trainer_state.json"
FLAT_STATE_FILE = "state.safetensors"
"""A single rank's model and optimizer state as full tensors: ``model/<name>`` and
``optim/<name>/<key>``, the optimizer's param groups as JSON in the file's metadata."""


def import_dcp_in_background() -> threading.Thread:
    """Import torch.distributed.checkpoint on a thread (a second of CPU on a small machine): the
    first checkpoint needs it, the first steps do not. An import that needs it meanwhile waits
    for this one (Python's per-module import locks)."""
    def load() -> None:
        import torch.distributed.checkpoint  # noqa: F401

    thread = threading.Thread(target=load, name="rlorch-import-dcp", daemon=True)
    thread.start()
    return thread


class CheckpointError(RuntimeError):
    """A checkpoint cannot be resumed from; the message names the path."""


def is_complete(checkpoint: Path) -> bool:
    return CheckpointDir(checkpoint).complete


def _encode(state: torch.Tensor) -> str:
    return base64.b64encode(state.cpu().numpy().tobytes()).decode()


def _decode(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8).clone()


def rng_state() -> dict[str, Any]:
    state = {"torch": _encode(torch.get_rng_state())}
    if torch.cuda.is_available():
        state["cuda"] = [_encode(s) for s in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(_decode(state["torch"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([_decode(s) for s in state["cuda"]])


def link_or_copy_tree(source: Path, target: Path, skip: tuple[str, ...] = (PUBLISHED,)) -> None:
    """Hardlink every file (copy across filesystems); the weights are immutable once published."""
    target.mkdir(parents=True, exist_ok=True)
    for entry in source.iterdir():
        if entry.name in skip:
            continue
        if entry.is_dir():
            link_or_copy_tree(entry, target / entry.name, skip)
            continue
        destination = target / entry.name
        destination.unlink(missing_ok=True)
        try:
            os.link(entry, destination)
        except OSError:
            shutil.copy2(entry, destination)


def save(run: RunDir, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
         rank: int, write_weights: Callable[[Path], None], optimizer_steps: int = 0,
         trainable_only: bool = False) -> Path:
    """Collective: every rank calls it. Replaces whatever ``checkpoints/step_N/trainer`` and
    ``weights`` held (a checkpoint of an abandoned trajectory, or a partial one): COMPLETE goes
    first and comes back last, after a barrier. ``write_weights(dir)`` is called on every rank
    (it gathers the full state dict) when version ``step`` was not published, else rank 0 links
    the published files. ``optimizer_steps`` (the learning-rate schedule's position) goes into
    the state file. ``trainable_only`` leaves frozen parameters (LoRA's base) out."""
    checkpoint = run.checkpoint(step)
    trainer_dir = CheckpointDir(checkpoint).trainer
    if rank == 0:
        _clear(checkpoint)
    dist.barrier()
    import torch.distributed.checkpoint as dcp

    model_state, optim_state = _state(model, optimizer, trainable_only)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(trainer_dir / "dcp"))
    published = run.weights_for(step)
    if (published / PUBLISHED).exists():
        if rank == 0:
            link_or_copy_tree(published, CheckpointDir(checkpoint).weights)
    else:
        write_weights(CheckpointDir(checkpoint).weights)
    if rank == 0:
        write_json_atomic(trainer_dir / STATE_FILE, _trainer_state(step, dist.get_world_size(), optimizer_steps))
    dist.barrier()
    if rank == 0:
        _complete(checkpoint)
    dist.barrier()
    return checkpoint


def _trainer_state(step: int, world_size: int, optimizer_steps: int) -> dict:
    """``trainer_state.json``: the step, the RNG's state now, the ranks it was saved from and the
    optimizer steps taken."""
    return {"step": step, "rng": rng_state(), "world_size": world_size, "optimizer_steps": optimizer_steps}


def _clear(checkpoint: Path) -> None:
    """Rank 0: an empty ``step_N`` to write into (COMPLETE goes first)."""
    parts = CheckpointDir(checkpoint)
    (parts.trainer / COMPLETE).unlink(missing_ok=True)
    shutil.rmtree(parts.trainer, ignore_errors=True)
    shutil.rmtree(parts.weights, ignore_errors=True)
    parts.trainer.mkdir(parents=True, exist_ok=True)


def _complete(checkpoint: Path) -> None:
    """Rank 0, once every file is written: everything on disk, then COMPLETE."""
    from rlorch.trainer.publish import fsync_tree

    fsync_tree(checkpoint)
    mark(CheckpointDir(checkpoint).trainer, COMPLETE)


def begin_single_rank_save(run: RunDir, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
                           optimizer_steps: int = 0, trainable_only: bool = False) -> Callable[[], Path]:
    """A single rank's checkpoint of step ``step`` in two halves: this call (on the training
    thread, milliseconds) clears ``step_N``, links the published weights of version ``step``
    (they must be published by now) and copies the model's, optimizer's and RNG's state; the
    returned function (on any thread, while training goes on) writes that copy to
    :data:`FLAT_STATE_FILE` (DCP where it is not plain tensors), the state file and, last,
    COMPLETE. Same invariant as :func:`save`; no collective runs, so the write may overlap the
    next steps."""
    checkpoint = run.checkpoint(step)
    published = run.weights_for(step)
    if not (published / PUBLISHED).exists():
        raise CheckpointError(f"{published}: version {step} is not published, so it cannot be linked "
                              f"into {checkpoint}")
    _clear(checkpoint)
    link_or_copy_tree(published, CheckpointDir(checkpoint).weights)
    model_state, optim_state = _state(model, optimizer, trainable_only)
    state = _cloned({"model": model_state, "optim": optim_state})
    trainer_state = _trainer_state(step, 1, optimizer_steps)

    def write() -> Path:
        trainer_dir = CheckpointDir(checkpoint).trainer
        flat = _flat(state["model"], state["optim"])
        if flat is not None:
            from safetensors.torch import save_file

            save_file(flat[0], str(trainer_dir / FLAT_STATE_FILE), metadata=flat[1])
        else:
            import torch.distributed.checkpoint as dcp

            dcp.save(state, checkpoint_id=str(trainer_dir / "dcp"), no_dist=True)
        write_json_atomic(trainer_dir / STATE_FILE, trainer_state)
        _complete(checkpoint)
        return checkpoint

    return write


def _flat(model_state: dict, optim_state: dict) -> Optional[tuple[dict, dict]]:
    """``(tensors, metadata)`` of :data:`FLAT_STATE_FILE` for plain state dicts (None where a
    value is not a plain tensor or the param groups are not JSON: those go to DCP). Torch's DCP
    would cost a second of CPU to import and a pickled record per tensor to write."""
    tensors = {f"model/{name}": value for name, value in model_state.items()}
    for name, values in optim_state["state"].items():
        tensors.update({f"optim/{name}/{key}": value for key, value in values.items()})
    if not all(isinstance(value, torch.Tensor) and not hasattr(value, "to_local") for value in tensors.values()):
        return None
    try:
        groups = json.dumps(optim_state["param_groups"])
    except (TypeError, ValueError):
        return None
    return {key: value.contiguous() for key, value in tensors.items()}, {"param_groups": groups}


def _read_flat(path: Path) -> tuple[dict, dict]:
    """The model's and optimizer's full state dicts held by :data:`FLAT_STATE_FILE`."""
    from safetensors import safe_open

    model_state: dict = {}
    optim_state: dict = {"state": {}, "param_groups": []}
    with safe_open(str(path), framework="pt") as handle:
        optim_state["param_groups"] = json.loads((handle.metadata() or {})["param_groups"])
        for key in handle.keys():
            kind, _, rest = key.partition("/")
            # Copies, not views of the file: the state lives on after the load, and a swap run's
            # offload frees its storages, which a view of the file's memory cannot be.
            if kind == "model":
                model_state[rest] = handle.get_tensor(key).clone()
            else:
                name, _, field = rest.rpartition("/")
                optim_state["state"].setdefault(name, {})[field] = handle.get_tensor(key).clone()
    return model_state, optim_state


def _cloned(value: Any) -> Any:
    """``value`` with every tensor copied: the live ones change with the next optimizer step."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {key: _cloned(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_cloned(item) for item in value)
    return value


def _options(trainable_only: bool):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(ignore_frozen_params=trainable_only)


def plain_state_dicts(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Optional[tuple[dict, dict]]:
    """``get_state_dict(model, optimizer)``'s answer, the optimizer's state under each
    parameter's name, for a model of plain tensors on one process whose parameters' names are
    its state dict's and whose optimized parameters have all taken a step; None for any other.
    Its lookups import torch's compiler (seconds of CPU beside the trainer's first steps)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        return None
    names: dict = {}
    for name, parameter in model.named_parameters():  # a tied weight under its first name
        names.setdefault(parameter, name)
    model_state = model.state_dict()
    indices = [p for group in optimizer.param_groups for p in group["params"]]
    if (any(hasattr(p, "to_local") for p in names) or not set(names.values()) <= model_state.keys()
            or not all(p in names and p in optimizer.state for p in indices)):
        return None   # sharded, renamed by a wrapper, or no optimizer state made yet
    saved = optimizer.state_dict()
    fqn = {index: names[parameter] for index, parameter in enumerate(indices)}
    optim_state = {"state": {fqn[index]: state for index, state in saved["state"].items()},
                   "param_groups": [{**group, "params": [fqn[index] for index in group["params"]]}
                                    for group in saved["param_groups"]]}
    return model_state, optim_state


def _state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, trainable_only: bool) -> tuple[dict, dict]:
    """The model's and optimizer's state dicts; ``trainable_only`` keeps the parameters that
    train alone (a weight tied to a frozen one is frozen too, though ``ignore_frozen_params``
    keeps its second name)."""
    plain = plain_state_dicts(model, optimizer)
    if plain is not None:
        model_state, optim_state = plain
    else:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optim_state = get_state_dict(model, optimizer, options=_options(trainable_only))
    if trainable_only:
        trainable = {name for name, parameter in model.named_parameters() if parameter.requires_grad}
        model_state = {name: value for name, value in model_state.items() if name in trainable}
    return model_state, optim_state


def load(checkpoint: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
         trainable_only: bool = False) -> tuple[int, Optional[int]]:
    """Restore model, optimizer and RNG from a COMPLETE checkpoint; returns its step and the
    optimizer steps taken (None in a checkpoint written before they were recorded).
    ``trainable_only``: the checkpoint holds the trainable parameters alone (as saved with it);
    the frozen ones keep the values they were built with."""
    trainer_dir = CheckpointDir(checkpoint).trainer
    if not is_complete(checkpoint):
        raise CheckpointError(f"{checkpoint}: not a complete checkpoint (no trainer/{COMPLETE})")
    try:
        state = json.loads((trainer_dir / STATE_FILE).read_text())
        step = int(state["step"])
    except (OSError, ValueError, KeyError) as err:
        raise CheckpointError(f"{trainer_dir / STATE_FILE}: unreadable ({err})") from err
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    flat = trainer_dir / FLAT_STATE_FILE
    source = flat if flat.is_file() else trainer_dir / "dcp"
    try:
        if source == flat:   # full tensors, sharded onto this rank's parameters by set_state_dict
            model_state, optim_state = _read_flat(flat)
        else:
            model_state, optim_state = _state(model, optimizer, trainable_only)
            dcp.load({"model": model_state, "optim": optim_state}, checkpoint_id=str(source))
    except Exception as err:
        raise CheckpointError(f"{source}: unreadable ({type(err).__name__}: "
                              f"{str(err).splitlines()[0] if str(err) else ''})") from err
    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state,
                   # Frozen weights are not in the checkpoint; the state read holds every trainable one.
                   options=StateDictOptions(full_state_dict=source == flat, ignore_frozen_params=trainable_only,
                                            strict=not trainable_only))
    try:
        set_rng_state(state["rng"])
    except (KeyError, TypeError, ValueError, RuntimeError) as err:
        raise CheckpointError(f"{trainer_dir / STATE_FILE}: bad rng state ({type(err).__name__}: {err})") from err
    optimizer_steps = state.get("optimizer_steps")
    return step, int(optimizer_steps) if optimizer_steps is not None else None
