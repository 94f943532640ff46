"""The CPU engine's scheduler: requests that arrive together are decoded together.

One asyncio task gathers every waiting sequence (up to ``max_batch``) into a batch, left-pads the
prompts, prefills them in one forward pass (a prompt that several sequences share, as a GRPO
group's samples do, once: its KV cache rows are copied for each) and then decodes step by step
with a KV cache. Each sequence stops on its own (eos, a stop token or string, its length
budget); finished rows are dropped from the batch and their callers answered at once. Sequences
that arrive while a batch runs join it at the next step boundary (prefilled on their own, their
KV cache left-padded and concatenated to the running one) while there is room; otherwise they
form the next batch.

Invariants:
- Model compute runs on one worker thread, so a forward pass and a weight load never overlap,
  and the event loop stays free to answer HTTP (pause, abort, health) during decoding.
- A batch holds the model lock from prefill to its last step: every token of a response was made
  by the weights named in its ``weight_version``. A weight load takes the lock, so an update that
  does not abort waits for the running batch to finish; while one waits, no sequence joins that
  batch or starts another, so arrivals cannot hold it off and are decoded by the new weights.
- Pause (mode ``abort``) is honoured between decode steps: running and queued sequences return
  their partial output with finish type ``abort``; new submissions wait until ``resume``.
"""

from __future__ import annotations

import asyncio
import collections
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from rlorch.serve.sampling import RequestParams, sample

PAUSE_MESSAGE = "Abort: generation paused (pause_generation)."


class LoadError(RuntimeError):
    """A checkpoint could not be loaded; the live model is left unchanged."""


class GenerationFailed(RuntimeError):
    """The scheduler stopped on an error: every sequence it held, and any submitted after, fails
    with it (the server answers 5xx and its health check fails)."""


@dataclass(eq=False)
class Sequence:
    """One sample of one request; ``done`` resolves when ``finish`` is set."""

    rid: str
    prompt: list[int]
    params: RequestParams
    done: asyncio.Future
    created: float = field(default_factory=time.perf_counter)
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish: Optional[dict] = None
    weight_version: str = ""
    abort_message: Optional[str] = None
    text: Optional[str] = None
    finished_at: float = 0.0
    top_logprobs: int = 0
    """How many of the most likely tokens to record per step in ``top`` (OpenAI's ``top_logprobs``)."""
    top: list[list[tuple[int, float]]] = field(default_factory=list)
    seed: Optional[int] = None
    """Draw this sequence from its own generator seeded so (OpenAI's ``seed``), not the shared one."""
    generator: Any = None
    on_token: Optional[Callable[["Sequence"], None]] = None
    """Called on the event loop after each token that does not finish the sequence (streaming);
    ``done`` tells the end."""


@dataclass(eq=False)
class _Rows:
    """The tensors of one running batch, row-aligned with ``seqs``."""

    seqs: list[Sequence]
    cache: Any = None
    mask: Optional[torch.Tensor] = None
    positions: Optional[torch.Tensor] = None


class Batcher:
    def __init__(self, model, *, eos_ids: list[int], pad_id: int, max_batch: int, context_len: int,
                 seed: int = 0, weight_version: str = "0", min_step_time: float = 0.0,
                 decode: Optional[Callable[[list[int]], str]] = None, device: str = "cpu"):
        self.model = model
        self.device = torch.device(device)
        """Where the model, its KV cache and sampling (in float32, from a generator on the same
        device) live."""
        self.eos_ids = eos_ids
        self.pad_id = pad_id
        self.max_batch = max_batch
        self.context_len = context_len
        self.weight_version = weight_version
        self.min_step_time = min_step_time
        self._decode_text = decode
        self._generator = torch.Generator(device=self.device).manual_seed(seed)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rlorch-model")
        self._waiting: collections.deque[Sequence] = collections.deque()
        self._running: list[Sequence] = []
        self._wake = asyncio.Event()
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._lock = asyncio.Lock()
        self._updates_waiting = 0
        self._no_update_waiting = asyncio.Event()
        self._no_update_waiting.set()
        self.pause_mode: Optional[str] = None
        self._held = 0
        self.counters = collections.Counter({key: 0 for key in (
            "batches", "sequences", "joined", "max_batch_seen", "decode_steps", "generated_tokens",
            "weight_updates", "prefill_rows")})
        self._cache_kw = _cache_keyword(model)
        self._can_join = True
        self.failure: Optional[str] = None

    # ---- requests -------------------------------------------------------------------------

    async def submit(self, seqs: list[Sequence]) -> None:
        """Queue sequences for the next batch; while paused, wait for resume first."""
        if self.failure is not None:
            raise GenerationFailed(self.failure)
        if not self._resumed.is_set():
            self._held += len(seqs)
            try:
                await self._resumed.wait()
            finally:
                self._held -= len(seqs)
        for seq in seqs:
            if seq.seed is not None and seq.generator is None:
                seq.generator = torch.Generator(device=self.device).manual_seed(seq.seed % (1 << 63))
            if seq.params.max_new_tokens == 0 or len(seq.prompt) >= self.context_len:
                self._finish(seq, {"type": "length", "length": 0})
            else:
                self._waiting.append(seq)
        self._wake.set()

    def abort(self, rid: Optional[str] = None, *, all_requests: bool = False,
              message: str = "Abort requested (abort_request).") -> int:
        """Mark matching sequences (``rid`` itself or its ``rid_i`` parts) to return as aborted.

        Queued sequences are answered now; running ones at the next step boundary.
        """
        return self.abort_sequences([seq for seq in list(self._waiting) + self._running if all_requests
                                     or seq.rid == rid or seq.rid.startswith(f"{rid}_")], message)

    def abort_sequences(self, seqs: list[Sequence], message: str) -> int:
        marked = [seq for seq in seqs if seq.finish is None]
        for seq in marked:
            seq.abort_message = message
        for seq in [s for s in self._waiting if s.abort_message]:
            self._waiting.remove(seq)
            self._finish(seq, {"type": "abort", "message": seq.abort_message})
        return len(marked)

    async def pause(self, mode: str = "abort") -> None:
        """Stop generating. ``abort``: in-flight sequences return their partial output (returns
        once the decoder has stopped); ``in_place``/``retract``: they wait, kept, until resume."""
        self.pause_mode = mode
        self._resumed.clear()
        if mode == "abort":
            self.abort(all_requests=True, message=PAUSE_MESSAGE)
            await self._idle.wait()

    def resume(self) -> None:
        self.pause_mode = None
        self._resumed.set()
        self._wake.set()

    @property
    def paused(self) -> bool:
        return not self._resumed.is_set()

    async def load_weights(self, path: str, *, dtype: torch.dtype, version: Optional[str],
                           abort_all: bool) -> None:
        """Load an HF safetensors checkpoint into the live model; raise :class:`LoadError`."""
        await self.update_weights(lambda: load_checkpoint(self.model, Path(path), dtype), version=version,
                                  abort_all=abort_all)

    async def update_weights(self, load: Callable[[], None], *, version: Optional[str], abort_all: bool) -> None:
        """Run ``load`` (which changes the live weights, or raises leaving them unchanged) on the
        model thread under the model lock, then take ``version``."""
        if abort_all:
            self.abort(all_requests=True, message="Abort: weight update (abort_all_requests).")
        self._updates_waiting += 1
        self._no_update_waiting.clear()
        try:
            async with self._lock:
                await self.run_on_model_thread(load)
                if version is not None:
                    self.weight_version = version
        finally:
            self._updates_waiting -= 1
            if not self._updates_waiting:
                self._no_update_waiting.set()
                self._wake.set()
        self.counters["weight_updates"] += 1

    def model_lock(self) -> asyncio.Lock:
        """Held while the model's weights change (a load, a move between devices): no batch runs."""
        return self._lock

    async def run_on_model_thread(self, fn: Callable[[], Any]) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn)

    def stats(self) -> dict:
        return {"num_running_reqs": len(self._running), "num_waiting_reqs": len(self._waiting),
                "num_held_reqs": self._held, "num_updates_waiting": self._updates_waiting,
                "paused": self.paused, "weight_version": self.weight_version,
                **self.counters}

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    # ---- scheduler ------------------------------------------------------------------------

    async def run(self) -> None:
        """Form and decode batches until cancelled."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._waiting and not self.paused:
                if self._updates_waiting:
                    await self._no_update_waiting.wait()
                    continue
                batch = [self._waiting.popleft() for _ in range(min(self.max_batch, len(self._waiting)))]
                self._idle.clear()
                try:
                    async with self._lock:
                        await self._decode(batch)
                except Exception as err:
                    self._fail(batch + self._running + list(self._waiting), err)
                    raise
                finally:
                    self._running = []
                    self._idle.set()

    def _fail(self, seqs: list[Sequence], err: Exception) -> None:
        self.failure = f"generation loop failed: {type(err).__name__}: {err}"
        self._waiting.clear()
        for seq in seqs:
            if not seq.done.done():
                seq.done.set_exception(GenerationFailed(self.failure))

    async def _decode(self, batch: list[Sequence]) -> None:
        self._running = batch
        self.counters["batches"] += 1
        self.counters["sequences"] += len(batch)
        self.counters["max_batch_seen"] = max(self.counters["max_batch_seen"], len(batch))
        rows = _Rows(seqs=batch)
        started = time.perf_counter()
        drawn = await self.run_on_model_thread(lambda: self._prefill(rows))
        while True:
            self._record(rows.seqs, *drawn)
            await self._hold_in_place()
            for seq in rows.seqs:
                if seq.finish is None and seq.abort_message is not None:
                    self._finish(seq, {"type": "abort", "message": seq.abort_message})
            keep = [i for i, seq in enumerate(rows.seqs) if seq.finish is None]
            if not keep:
                return
            await self._throttle(started)
            last = [drawn[0][i] for i in keep]
            joining = await self._join(rows, len(keep))
            drawn = await self.run_on_model_thread(lambda: self._step(rows, keep, last, joining))
            started = time.perf_counter()
            self.counters["max_batch_seen"] = max(self.counters["max_batch_seen"], len(rows.seqs))

    async def _join(self, batch: _Rows, running: int) -> Optional[tuple[_Rows, list[int], list[int]]]:
        """Prefill waiting sequences that fit beside ``running`` rows; return their rows, the
        indices still unfinished after their first token, and those first tokens."""
        room = self.max_batch - running
        if not (self._waiting and room > 0) or self.paused or self._updates_waiting:
            return None
        if self._can_join and not _joinable(batch.cache):
            self._can_join = False
        if not self._can_join:
            return None
        seqs = [self._waiting.popleft() for _ in range(min(room, len(self._waiting)))]
        self._running = self._running + seqs
        self.counters["joined"] += len(seqs)
        self.counters["sequences"] += len(seqs)
        rows = _Rows(seqs=seqs)
        drawn = await self.run_on_model_thread(lambda: self._prefill(rows))
        self._record(seqs, *drawn)
        keep = [i for i, seq in enumerate(seqs) if seq.finish is None]
        return (rows, keep, [drawn[0][i] for i in keep]) if keep else None

    async def _hold_in_place(self) -> None:
        """While paused in place, keep the batch (and the model lock) until resume, or until the
        pause turns into an abort (which marks every running sequence aborted)."""
        while self.paused and self.pause_mode != "abort":
            try:
                await asyncio.wait_for(self._resumed.wait(), timeout=0.05)
            except asyncio.TimeoutError:
                pass

    async def _throttle(self, started: float) -> None:
        remaining = self.min_step_time - (time.perf_counter() - started)
        if remaining > 0:
            await asyncio.sleep(remaining)

    def _record(self, seqs: list[Sequence], tokens: list[int], logprobs: list[float],
                tops: Optional[list[list[tuple[int, float]]]] = None) -> None:
        self.counters["decode_steps"] += 1
        for row, (seq, token, logprob) in enumerate(zip(seqs, tokens, logprobs)):
            seq.output_ids.append(token)
            seq.logprobs.append(logprob)
            if tops is not None and seq.top_logprobs:
                seq.top.append(tops[row])
            self.counters["generated_tokens"] += 1
            reason = self._finish_reason(seq, token)
            if reason is not None:
                self._finish(seq, reason)
            elif seq.on_token is not None:
                seq.on_token(seq)

    def _finish_reason(self, seq: Sequence, token: int) -> Optional[dict]:
        params = seq.params
        if seq.abort_message is not None:
            return {"type": "abort", "message": seq.abort_message}
        if not params.ignore_eos and token in self.eos_ids:
            return {"type": "stop", "matched": token}
        if token in params.stop_token_ids:
            return {"type": "stop", "matched": token}
        if params.stop and self._decode_text is not None:
            text = self._decode_text(seq.output_ids)
            for stop in params.stop:
                at = text.find(stop)
                if at >= 0:
                    seq.text = text if params.no_stop_trim else text[:at]
                    return {"type": "stop", "matched": stop}
        generated = len(seq.output_ids)
        if generated >= params.max_new_tokens or len(seq.prompt) + generated >= self.context_len:
            return {"type": "length", "length": generated}
        return None

    def _finish(self, seq: Sequence, reason: dict) -> None:
        seq.finish = reason
        seq.weight_version = self.weight_version
        seq.finished_at = time.perf_counter()
        if not seq.done.done():
            seq.done.set_result(seq)

    # ---- model thread ---------------------------------------------------------------------

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> tuple:
        generators = [seq.generator for seq in seqs] if any(seq.generator is not None for seq in seqs) else None
        top = [seq.top_logprobs for seq in seqs] if any(seq.top_logprobs for seq in seqs) else None
        return sample(logits, [s.params for s in seqs], self._banned(seqs), self._generator,
                      generators=generators, top=top)

    def _banned(self, seqs: list[Sequence]) -> list[list[int]]:
        banned = []
        for seq in seqs:
            if len(seq.output_ids) < seq.params.min_new_tokens:
                eos = [] if seq.params.ignore_eos else self.eos_ids
                banned.append(list(eos) + list(seq.params.stop_token_ids))
            else:
                banned.append([])
        return banned

    @torch.no_grad()
    def _prefill(self, rows: _Rows) -> tuple:
        prompts, row_of = _distinct([seq.prompt for seq in rows.seqs])
        width = max(len(prompt) for prompt in prompts)
        # Left-padded rows built as lists, one tensor each (per-row tensor writes took ten times
        # as long: 1.6 ms for 128 short prompts, holding the GIL).
        ids = torch.tensor([[self.pad_id] * (width - len(prompt)) + list(prompt) for prompt in prompts],
                           dtype=torch.long, device=self.device)
        mask = torch.tensor([[0] * (width - len(prompt)) + [1] * len(prompt) for prompt in prompts],
                            dtype=torch.long, device=self.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        rows.cache = _new_cache(self.model)
        logits = self._forward(ids, mask, positions, rows.cache)
        self.counters["prefill_rows"] += len(prompts)
        if len(prompts) < len(rows.seqs):
            index = torch.tensor(row_of, device=self.device)
            rows.cache.batch_select_indices(index)
            logits, mask, positions = logits[index], mask[index], positions[index]
        rows.mask, rows.positions = mask, positions[:, -1:]
        return self._sample(logits, rows.seqs)

    @torch.no_grad()
    def _step(self, rows: _Rows, keep: list[int], last: list[int],
              joining: Optional[tuple[_Rows, list[int], list[int]]] = None) -> tuple:
        _select(rows, keep)
        if joining is not None:
            other, other_keep, other_last = joining
            _select(other, other_keep)
            _concat(rows, other)
            last = last + other_last
        rows.mask = torch.cat([rows.mask, rows.mask.new_ones((len(rows.seqs), 1))], dim=1)
        rows.positions = rows.positions + 1
        logits = self._forward(torch.tensor(last, device=self.device)[:, None], rows.mask, rows.positions,
                               rows.cache)
        return self._sample(logits, rows.seqs)

    def _forward(self, ids, mask, positions, cache) -> torch.Tensor:
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions,
                         use_cache=True, logits_to_keep=1, **{self._cache_kw: cache})
        return out.logits[:, -1]


def _distinct(prompts: list[list[int]]) -> tuple[list[tuple[int, ...]], list[int]]:
    """The distinct prompts in first-seen order, and for each input the index of its own."""
    row: dict[tuple[int, ...], int] = {}
    row_of = [row.setdefault(tuple(prompt), len(row)) for prompt in prompts]
    return list(row), row_of


def _select(rows: _Rows, keep: list[int]) -> None:
    """Drop finished rows from a batch's tensors and cache."""
    if len(keep) < len(rows.seqs):
        index = torch.tensor(keep, device=rows.mask.device)
        rows.cache.batch_select_indices(index)
        rows.mask, rows.positions = rows.mask[index], rows.positions[index]
        rows.seqs = [rows.seqs[i] for i in keep]


def _new_cache(model) -> Any:
    """An empty KV cache of the model's own kind (:mod:`rlorch.qwen2`'s, or transformers')."""
    if hasattr(model, "new_cache"):
        return model.new_cache()
    from transformers import DynamicCache

    return DynamicCache()


def _joinable(cache: Any) -> bool:
    """Only plain full-attention caches (:mod:`rlorch.qwen2`'s, or every layer a ``DynamicLayer``
    holding ``keys`` and ``values``) can take new rows; other models decode arrivals in the next
    batch instead."""
    if getattr(cache, "joinable", False):
        return cache.layers[0].keys is not None
    layers = getattr(cache, "layers", None)
    return bool(layers) and all(type(layer).__name__ == "DynamicLayer"
                                and getattr(layer, "keys", None) is not None for layer in layers)


def _concat(rows: _Rows, other: _Rows) -> None:
    """Append ``other``'s rows to ``rows``, left-padding the shorter KV cache (masked out)."""
    layers, extra = rows.cache.layers, other.cache.layers
    width = max(rows.mask.shape[1], other.mask.shape[1])

    def pad(tensor: torch.Tensor, dim_from_end: int, to: int) -> torch.Tensor:
        missing = to - tensor.shape[-dim_from_end]
        if missing == 0:
            return tensor
        return torch.nn.functional.pad(tensor, (0, 0) * (dim_from_end - 1) + (missing, 0))

    for mine, theirs in zip(layers, extra):
        mine.keys = torch.cat([pad(mine.keys, 2, width), pad(theirs.keys, 2, width)], dim=0)
        mine.values = torch.cat([pad(mine.values, 2, width), pad(theirs.values, 2, width)], dim=0)
    rows.mask = torch.cat([pad(rows.mask, 1, width), pad(other.mask, 1, width)], dim=0)
    rows.positions = torch.cat([rows.positions, other.positions], dim=0)
    rows.seqs = rows.seqs + other.seqs


def _cache_keyword(model) -> str:
    """Newer transformers name the KV cache argument ``cache``; older ones ``past_key_values``."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


@torch.no_grad()
def load_checkpoint(model, path: Path, dtype: torch.dtype) -> None:
    """Copy an HF safetensors checkpoint's tensors into ``model``.

    Every parameter must be present with its shape, and no unknown tensor may appear; all checks
    pass before the first copy, so a bad checkpoint leaves the live model as it was.
    """
    from safetensors.torch import load_file

    if not path.is_dir():
        raise LoadError(f"model_path {str(path)!r} is not a directory")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise LoadError(f"no *.safetensors files in {str(path)!r}")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            tensors.update(load_file(str(file)))
        except Exception as err:  # safetensors raises its own error types for corrupt files
            raise LoadError(f"cannot read {file.name}: {err}") from err
    load_tensors(model, tensors, dtype)


@torch.no_grad()
def load_tensors(model, tensors: dict, dtype: torch.dtype) -> None:
    """Copy named tensors (HF state-dict names) into ``model``: every parameter must be there with
    its shape, and no unknown name; all checks pass before the first copy."""
    params = dict(model.named_parameters())
    known = set(model.state_dict().keys())
    missing = sorted(set(params) - set(tensors))
    unexpected = sorted(set(tensors) - known)
    if missing or unexpected:
        raise LoadError(f"checkpoint does not match the served model: missing {missing[:5]}, "
                        f"unexpected {unexpected[:5]}")
    wrong = [name for name, p in params.items() if tuple(tensors[name].shape) != tuple(p.shape)]
    if wrong:
        raise LoadError(f"checkpoint shapes differ from the served model for {wrong[:5]}")
    for name, param in params.items():
        param.copy_(tensors[name].to(dtype))
