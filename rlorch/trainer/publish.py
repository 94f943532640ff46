"""Publishing weights: an HF checkpoint per version, made visible only when whole.

Invariant: a directory ``weights/step_N`` exists only once every file in it is written (in
``weights/.staging-step_N``, then renamed), and it counts as published only once its PUBLISHED
marker exists, so a reader never loads half a checkpoint.

A version is for the engines, which read it through the page cache: it is not fsynced. What must
outlive a crash of the machine is a checkpoint, and a checkpoint hard-links its version's files
and fsyncs every file it holds before its COMPLETE (:mod:`rlorch.trainer.checkpoint`), so the
version a resume loads is on disk. (On a 2-core VM the fsyncs of every version cost the
trainer's process 5-10% of its CPU a step on the default run.)
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

from rlorch.rundir.layout import PUBLISHED, RunDir, fsync_dir, step_name

STAGING_PREFIX = ".staging-"


def fsync_tree(path: Path) -> None:
    for root, _, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(root))


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "chat_template.jinja", "chat_template.json", "vocab.json", "merges.txt", "tokenizer.model",
                   "vocab.txt")
"""The files a tokenizer may keep in an HF directory (fast, slow and chat-template forms)."""


class TokenizerFiles:
    """A model directory's tokenizer, as files: each version gets them byte for byte, so the
    trainer never loads (or imports) a tokenizer to publish one."""

    def __init__(self, source: Path) -> None:
        self.source = Path(source)

    def save_pretrained(self, target: Path) -> None:
        for name in TOKENIZER_FILES:
            if (self.source / name).is_file():
                shutil.copyfile(self.source / name, Path(target) / name)


def write_hf(target: Path, model, state_dict: dict, tokenizer) -> None:
    """An HF directory (config, safetensors weights, tokenizer) from a full state dict. The
    config names the weights' dtype: ``save_pretrained`` writes the model's own, which under
    mixed precision is the float32 of the master weights, not the served dtype."""
    dtypes = {tensor.dtype for tensor in state_dict.values() if tensor.is_floating_point()}
    target.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(target, state_dict=state_dict)
    if len(dtypes) == 1:
        _set_config_dtype(target / "config.json", str(dtypes.pop()).removeprefix("torch."))
    if tokenizer is not None:
        tokenizer.save_pretrained(target)


def _set_config_dtype(path: Path, dtype: str) -> None:
    import json

    config = json.loads(path.read_text())
    keys = [key for key in ("dtype", "torch_dtype") if key in config]
    if all(config[key] == dtype for key in keys):
        return
    for key in keys or ["dtype"]:
        config[key] = dtype
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                      "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                      "BOOL": torch.bool}
"""safetensors' names of the dtypes a weights file is written raw in (any other goes through
``save_file``)."""


@dataclass
class _Layout:
    """What a full HF save of this model wrote besides its weights, and how it wrote them."""

    files: dict[str, bytes]
    """Every file but the weights (config, generation config, tokenizer), with its bytes."""
    weights_file: str
    names: list[str]
    """The tensors in the weights file, in the state dict's names (tied copies left out)."""
    metadata: Optional[dict[str, str]]
    header: Optional[bytes] = None
    """The weights file's bytes up to its data (length and JSON header), where every tensor's
    data follows the previous one's with no gap and its dtype is in :data:`SAFETENSORS_DTYPES`:
    a version with the same dtypes and shapes is then that header and its tensors' bytes in
    ``order``, byte for byte what ``save_file`` writes."""
    order: tuple[tuple[str, torch.dtype, tuple[int, ...]], ...] = ()
    """Each tensor's name, dtype and shape, in the order of its data in the file."""


class HFWriter:
    """Writes HF directories of one model's versions.

    The first write is a full ``save_pretrained`` (config, generation config, tokenizer,
    safetensors). Later versions change only the tensors: they get the first write's other files
    byte for byte and a safetensors file with the same tensors under the same names, which costs
    a fraction of ``save_pretrained``'s Python work per version. The shortcut is taken only where
    the first write proved it exact: one weights file, no subdirectories, and every tensor in it
    equal (dtype, shape, values) to the state dict's tensor of the same name; any other model is
    written by ``save_pretrained`` every time, as is a state dict lacking one of the names or
    tying two of them to one storage.
    """

    def __init__(self, model, tokenizer) -> None:
        self.model, self.tokenizer = model, tokenizer
        self._layout: Optional[_Layout] = None
        self._learned = False

    def write(self, target: Path, state_dict: dict) -> None:
        """Write ``state_dict`` as an HF directory into ``target``, which is new or emptied (the
        first write takes every file in it for the model's own)."""
        layout = self._layout
        if layout is None or not _fits(layout, state_dict):
            # save_pretrained takes entries out of the dict it is given as it writes them.
            write_hf(target, self.model, dict(state_dict), self.tokenizer)
            if not self._learned:
                self._learned = True
                self._layout = _learn_layout(target, state_dict)
            return
        from safetensors.torch import save_file

        target.mkdir(parents=True, exist_ok=True)
        for name, data in layout.files.items():
            (target / name).write_bytes(data)
        if layout.header is not None and all(state_dict[name].dtype == dtype and tuple(state_dict[name].shape) == shape
                                             for name, dtype, shape in layout.order):
            # save_file's own Python costs about a millisecond a version on the default model,
            # on the hand-off thread, holding the interpreter lock the training step needs.
            with open(target / layout.weights_file, "wb") as handle:
                handle.write(layout.header)
                for name, _, _ in layout.order:
                    handle.write(_raw_bytes(state_dict[name]))
            return
        save_file({name: state_dict[name].contiguous() for name in layout.names},
                  str(target / layout.weights_file), metadata=layout.metadata)


def _raw_bytes(tensor: torch.Tensor):
    """The bytes of ``tensor``'s values in row-major order, as a buffer (a view where it can)."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy() if flat.numel() else b""


def _fits(layout: _Layout, state_dict: dict) -> bool:
    """Whether ``state_dict`` holds every tensor of ``layout``, none sharing storage with
    another (``save_pretrained`` drops tied copies by storage, so a state dict whose tensors
    are tied differently is written another way)."""
    storages = set()
    for name in layout.names:
        tensor = state_dict.get(name)
        if tensor is None:
            return False
        storages.add(tensor.untyped_storage().data_ptr())
    return len(storages) == len(layout.names)


def _learn_layout(target: Path, state_dict: dict) -> Optional[_Layout]:
    from safetensors import safe_open

    entries = list(target.iterdir())
    weights = [entry for entry in entries if entry.suffix == ".safetensors"]
    if len(weights) != 1 or any(not entry.is_file() for entry in entries):
        return None
    with safe_open(str(weights[0]), framework="pt") as handle:
        names, metadata = list(handle.keys()), handle.metadata()
        for name in names:
            mine = state_dict.get(name)
            theirs = handle.get_tensor(name)
            if mine is None or mine.dtype != theirs.dtype or not torch.equal(mine.cpu(), theirs):
                return None
    header, order = _raw_layout(weights[0])
    return _Layout(files={entry.name: entry.read_bytes() for entry in entries if entry != weights[0]},
                   weights_file=weights[0].name, names=names, metadata=metadata, header=header, order=order)


def _raw_layout(path: Path) -> tuple[Optional[bytes], tuple]:
    """A safetensors file's header bytes and its tensors in data order (see :class:`_Layout`),
    or (None, ()) where its data is not the tensors back to back in dtypes written raw, or where
    this machine's byte order is not safetensors' (little-endian)."""
    import json
    import sys

    if sys.byteorder != "little":
        return None, ()
    raw = path.read_bytes()
    length = int.from_bytes(raw[:8], "little")
    entries = {name: entry for name, entry in json.loads(raw[8:8 + length]).items() if name != "__metadata__"}
    order, end = [], 0
    for name, entry in sorted(entries.items(), key=lambda item: item[1]["data_offsets"][0]):
        dtype = SAFETENSORS_DTYPES.get(entry["dtype"])
        begin, stop = entry["data_offsets"]
        if dtype is None or begin != end:
            return None, ()
        order.append((name, dtype, tuple(entry["shape"])))
        end = stop
    if 8 + length + end != len(raw):
        return None, ()
    return raw[:8 + length], tuple(order)


def publish(run: RunDir, step: int, write: Callable[[Path], None]) -> Path:
    """Rank 0: version ``step`` written by ``write(directory)`` into ``weights/step_N``, marked
    PUBLISHED.

    A version directory left by an earlier life of the run (a resume re-trains steps after its
    checkpoint) is replaced: it belongs to a trajectory that no longer exists.
    """
    final = run.weights_for(step)
    staging = run.weights / f"{STAGING_PREFIX}{step_name(step)}"
    shutil.rmtree(staging, ignore_errors=True)
    write(staging)
    if final.exists():
        stale = run.weights / f"{STAGING_PREFIX}stale-{step_name(step)}"
        shutil.rmtree(stale, ignore_errors=True)
        os.rename(final, stale)
        shutil.rmtree(stale, ignore_errors=True)
    os.rename(staging, final)
    (final / PUBLISHED).touch()
    return final


SHARD_BYTES = 2 * 1024 ** 3
"""The largest safetensors file a streamed version writes; a larger model gets HF's sharded
layout (``model-0000i-of-0000n.safetensors`` and ``model.safetensors.index.json``)."""


class StreamedHF:
    """An HF directory written tensor by tensor as the trainer's ranks gather them: at most one
    shard's tensors (:data:`SHARD_BYTES`) are on the host at once, never the whole model.

    The config and generation config are the source model directory's (the trained model keeps
    its architecture), with ``dtype`` set to the tensors'; the tokenizer's files are copied. A
    tied output layer (``tie_word_embeddings``) is left out, as ``save_pretrained`` leaves it."""

    def __init__(self, target: Path, source: Path, tokenizer, dtype: torch.dtype, *,
                 shard_bytes: int = SHARD_BYTES) -> None:
        import json

        self.target, self.source, self.tokenizer, self.dtype = Path(target), Path(source), tokenizer, dtype
        self.shard_bytes = shard_bytes
        self.tied = bool(json.loads((self.source / "config.json").read_text()).get("tie_word_embeddings", False))
        self.target.mkdir(parents=True, exist_ok=True)
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.shards: list[list[str]] = []
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if self.tied and name == "lm_head.weight":
            return
        host = tensor.detach().to("cpu").contiguous()
        size = host.numel() * host.element_size()
        if self.pending and self.pending_bytes + size > self.shard_bytes:
            self._flush()
        self.pending[name] = host
        self.pending_bytes += size
        self.total_bytes += size

    def _flush(self) -> None:
        from safetensors.torch import save_file

        save_file(self.pending, str(self.target / f".shard-{len(self.shards) + 1}"), metadata={"format": "pt"})
        self.shards.append(list(self.pending))
        self.pending, self.pending_bytes = {}, 0

    def close(self) -> None:
        """The last shard, the index (several shards), config and tokenizer files."""
        import json

        if self.pending or not self.shards:
            self._flush()
        count = len(self.shards)
        names = (["model.safetensors"] if count == 1
                 else [f"model-{index:05d}-of-{count:05d}.safetensors" for index in range(1, count + 1)])
        for index, name in enumerate(names, start=1):
            os.rename(self.target / f".shard-{index}", self.target / name)
        if count > 1:
            weight_map = {tensor: file for file, members in zip(names, self.shards) for tensor in members}
            (self.target / "model.safetensors.index.json").write_text(json.dumps(
                {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}, indent=2, sort_keys=True))
        for name in ("config.json", "generation_config.json"):
            if (self.source / name).is_file():
                shutil.copyfile(self.source / name, self.target / name)
        _set_config_dtype(self.target / "config.json", str(self.dtype).removeprefix("torch."))
        if self.tokenizer is not None:
            self.tokenizer.save_pretrained(self.target)


def prune(run: RunDir, keep: int) -> list[Path]:
    """Delete published versions beyond the newest ``keep`` (never the newest); the marker goes
    first, so a reader never sees a PUBLISHED directory that is being deleted."""
    published = [path for _, path in run.published_weights()]
    doomed = published[:-max(keep, 1)]
    for path in doomed:
        (path / PUBLISHED).unlink(missing_ok=True)
        shutil.rmtree(path, ignore_errors=True)
    return doomed


def discard_newer(run: RunDir, step: int) -> list[Path]:
    """Remove published versions after ``step`` (rank 0, at start). After a resume from step N
    they belong to an abandoned trajectory; serving them would break "version M is the weights
    after batches 1..M"."""
    doomed = [path for version, path in run.published_weights() if version > step]
    for path in doomed:
        (path / PUBLISHED).unlink(missing_ok=True)
        shutil.rmtree(path, ignore_errors=True)
    return doomed


def clear_staging(run: RunDir) -> None:
    """Remove staging directories a crashed trainer left behind (rank 0, at start)."""
    for entry in run.weights.glob(f"{STAGING_PREFIX}*"):
        shutil.rmtree(entry, ignore_errors=True)
