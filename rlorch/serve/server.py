"""``rlorch serve``: the CPU inference engine, a real HTTP server speaking SGLang's native API.

Request and response shapes follow SGLang 0.5.x (see the reference notes on its HTTP API), so
the same client drives this engine and SGLang. Generation is batched by
:class:`~rlorch.serve.batcher.Batcher`; behaviour logprobs are defined in
:mod:`rlorch.serve.sampling`.

Errors answer HTTP 400 with ``{"error": {"message": ...}}`` (weight updates: ``{"success":
false, "message": ...}``) and never stop the server.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import signal
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Optional

from aiohttp import web

from rlorch.config.schema import engine_max_batch
from rlorch.jsonlines import dumps
from rlorch.lifecycle import cancel_and_wait
from rlorch.serve.arguments import API_KEY_ENV, DTYPES, launched_parser
from rlorch.serve.batcher import Batcher, GenerationFailed, LoadError, Sequence
from rlorch.serve.http import BODY_TIMEOUT_KEY, BODY_TIMEOUT_S, IDLE_TIMEOUT_S, MAX_BODY_BYTES, json_body
from rlorch.serve.sampling import RequestError, RequestParams
from rlorch.tasks.prompts import encode_prompt
from rlorch.tokenizer import FastTokenizer, load_tokenizer

log = logging.getLogger("rlorch.serve")

_LOAD_FORMATS = (None, "auto", "safetensors")
_PAUSE_MODES = ("abort", "in_place", "retract")
_INT = {int}
HEALTH_CHECK_TIMEOUT = 20.0
"""Seconds ``/health_generate`` waits for its one token (SGLang's ``HEALTH_CHECK_TIMEOUT``)."""


def _decode_batch(tokenizer) -> Optional[Callable[..., list[str]]]:
    """The tokenizer's Rust backend ``decode_batch`` where it decodes exactly what
    ``tokenizer.decode`` does: a fast tokenizer that cleans up no spaces and whose class changes
    neither ``decode`` nor ``_decode`` (some rewrite the backend's text); else None."""
    if isinstance(tokenizer, FastTokenizer):
        return tokenizer.decode_batch
    from transformers import PreTrainedTokenizerBase

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return None
    kind = type(tokenizer)
    fast = next((c for c in kind.__mro__ if c.__name__ in ("TokenizersBackend", "PreTrainedTokenizerFast")
                 and "_decode" in vars(c)), None)
    if fast is None or kind._decode is not fast._decode or kind.decode is not PreTrainedTokenizerBase.decode:
        return None
    return backend.decode_batch


def rlorch_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("rlorch")
    except PackageNotFoundError:
        return "0+unknown"


def _error(message: str, status: int = 400) -> web.Response:
    return web.json_response({"error": {"message": message}}, status=status)


class CpuServer:
    """A causal LM behind SGLang's native HTTP API; one instance serves one model."""

    def __init__(self, model_path: Path, *, dtype: str = "float32", max_batch: int = 64, seed: int = 0,
                 weight_version: str = "0", min_step_time: float = 0.0, threads: Optional[int] = None,
                 api_key: Optional[str] = None, body_timeout: float = BODY_TIMEOUT_S,
                 idle_timeout: float = IDLE_TIMEOUT_S, group_timeout: Optional[float] = None,
                 implementation: str = "auto", device: str = "cpu", memory_fraction: Optional[float] = None,
                 tool_call_parser: Optional[str] = None):
        """``threads`` sets torch's (process-wide) intra-op threads; ``min_step_time`` throttles
        each decode step (seconds) to emulate a slower engine; ``api_key`` guards every endpoint
        but the health checks; ``body_timeout`` and ``idle_timeout`` bound slow and idle
        connections (seconds); ``group_timeout`` bounds joining a weight group and each transfer
        over it (seconds; default ``rlorch.serve.weight_sync.GROUP_TIMEOUT_S``): a member that
        died mid-broadcast holds the others up at most that long; ``implementation`` is
        ``model.implementation``; ``device`` is ``cpu`` or ``cuda`` (the model in ``dtype``
        there), and on cuda ``memory_fraction`` caps this process's share of the device
        (``--mem-fraction-static``: a colocated trainer keeps the rest); ``tool_call_parser`` names
        how ``/v1/chat/completions`` reads tool calls (:data:`rlorch.openai_api.TOOL_PARSERS`; None:
        tools are ignored)."""
        import torch

        from rlorch.openai_api import TOOL_PARSERS

        from rlorch.model import uses_native
        from rlorch.qwen2 import Qwen2ForCausalLM

        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
        if tool_call_parser is not None and tool_call_parser not in TOOL_PARSERS:
            raise ValueError(f"tool_call_parser must be one of {sorted(TOOL_PARSERS)}, got {tool_call_parser!r}")
        self.tool_call_parser = tool_call_parser
        if threads is not None:
            torch.set_num_threads(threads)
        self.model_path = str(model_path)
        self.dtype = getattr(torch, dtype)
        self.tokenizer = load_tokenizer(model_path)
        self._decode_batch = _decode_batch(self.tokenizer)
        if device != "cpu":
            if not torch.cuda.is_available():
                raise ValueError(f"device {device!r}: torch sees no CUDA device")
            if memory_fraction is not None:
                torch.cuda.set_per_process_memory_fraction(memory_fraction)
        self.device, self.memory_fraction = device, memory_fraction
        if uses_native(implementation, Path(model_path), device=device):
            self.model = Qwen2ForCausalLM.from_pretrained(Path(model_path), dtype=self.dtype).eval()
        else:
            from transformers import AutoModelForCausalLM
            from transformers.utils import logging as hf_logging

            hf_logging.set_verbosity_error()
            hf_logging.disable_progress_bar()
            self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=self.dtype).eval()
        self.model.to(device)
        from rlorch.serve.memory import MemoryOccupation

        self.memory = MemoryOccupation(self.model, device)
        config = self.model.config
        self.vocab_size = config.vocab_size
        self.context_len = int(getattr(config, "max_position_embeddings", 4096))
        self.max_batch = max_batch
        self.seed = seed
        self.min_step_time = min_step_time
        self.initial_version = weight_version
        self.api_key = api_key
        self.body_timeout, self.idle_timeout = body_timeout, idle_timeout
        self.max_text_chars = self.context_len * max(len(t) for t in self.tokenizer.get_vocab())
        self.address = ""
        self.batcher: Optional[Batcher] = None
        self._scheduler: Optional[asyncio.Task] = None
        self._runner: Optional[web.AppRunner] = None
        from rlorch.serve.weight_sync import WeightSync

        self.weight_sync = WeightSync(self, timeout=group_timeout)

    def _eos_ids(self) -> list[int]:
        eos = getattr(self.model.generation_config, "eos_token_id", None)
        if eos is None:
            eos = self.model.config.eos_token_id
        if eos is None:
            return []
        return list(eos) if isinstance(eos, (list, tuple)) else [eos]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    # ---- lifecycle ------------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[self._authorize])
        routes = [
            web.post("/generate", self.generate),
            web.post("/update_weights_from_disk", self.update_weights_from_disk),
            web.post("/pause_generation", self.pause_generation),
            web.post("/continue_generation", self.continue_generation),
            web.post("/abort_request", self.abort_request),
            web.get("/health", self.health),
            web.get("/health_generate", self.health_generate),
            web.get("/model_info", self.get_model_info),
            web.get("/server_info", self.get_server_info),
            web.get("/get_model_info", self.get_model_info),
            web.get("/get_server_info", self.get_server_info),
            web.get("/get_weight_version", self.get_weight_version),
            web.post("/update_weight_version", self.update_weight_version),
            web.get("/v1/models", self.models),
            web.get("/flush_cache", self.flush_cache),
            web.post("/flush_cache", self.flush_cache),
            web.get("/release_memory_occupation", self.release_memory_occupation),
            web.post("/release_memory_occupation", self.release_memory_occupation),
            web.get("/resume_memory_occupation", self.resume_memory_occupation),
            web.post("/resume_memory_occupation", self.resume_memory_occupation),
        ]
        from rlorch.serve.openai_routes import OpenAIRoutes

        openai = OpenAIRoutes(self, tool_call_parser=self.tool_call_parser)
        app.add_routes(routes + self.weight_sync.routes() + openai.routes())
        app[BODY_TIMEOUT_KEY] = self.body_timeout
        app.on_startup.append(self._on_startup)
        app.on_cleanup.append(self._on_cleanup)
        return app

    @web.middleware
    async def _authorize(self, request: web.Request, handler) -> web.StreamResponse:
        """With an API key (SGLang's ``--api-key``), every endpoint but the health checks needs
        ``Authorization: Bearer <key>``."""
        if self.api_key is None or request.path.startswith("/health") or request.method == "OPTIONS":
            return await handler(request)
        if not hmac.compare_digest(request.headers.get("Authorization", ""), f"Bearer {self.api_key}"):
            return web.json_response({"error": "Unauthorized"}, status=401)
        return await handler(request)

    async def _on_startup(self, app: web.Application) -> None:
        pad = self.tokenizer.pad_token_id
        self.batcher = Batcher(self.model, eos_ids=self._eos_ids(), pad_id=0 if pad is None else pad,
                               max_batch=self.max_batch, context_len=self.context_len, seed=self.seed,
                               weight_version=self.initial_version, min_step_time=self.min_step_time,
                               decode=self.decode, device=self.device)
        self._scheduler = asyncio.create_task(self.batcher.run(), name="rlorch-batcher")
        self._scheduler.add_done_callback(_log_scheduler_failure)

    async def _on_cleanup(self, app: web.Application) -> None:
        await cancel_and_wait(self._scheduler)
        if self.batcher is not None:
            self.batcher.close()

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Bind and serve in the running loop; return ``host:port`` (the real port when 0)."""
        self._runner = web.AppRunner(self.app(), access_log=None, handle_signals=False,
                                     handler_cancellation=True, shutdown_timeout=5.0,
                                     keepalive_timeout=self.idle_timeout, lingering_time=1.0)
        await self._runner.setup()
        await web.TCPSite(self._runner, host, port).start()
        self.address = f"{host}:{self._runner.addresses[0][1]}"
        return self.address

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # ---- /generate ------------------------------------------------------------------------

    async def generate(self, request: web.Request) -> web.Response:
        try:
            body = await json_body(request)
            prompts, params, rids, batched = await asyncio.to_thread(self._parse_generate, body)
        except RequestError as err:
            return _error(str(err))
        if self.memory.released and not self.batcher.paused:    # held while paused, until memory is back
            return _error(self.memory.describe())
        loop = asyncio.get_running_loop()
        seqs = []
        for prompt, param, rid in zip(prompts, params, rids):
            for sample in range(param.n):
                name = rid if param.n == 1 else f"{rid}_{sample}"
                seqs.append(Sequence(rid=name, prompt=prompt, params=param, done=loop.create_future()))
        try:
            await self.run_sequences(seqs)
        except GenerationFailed as err:
            return _error(str(err), status=500)
        answers = self._answers(seqs, bool(body.get("return_logprob", False)))
        # orjson, as SGLang answers /generate (a non-finite float goes out as null, as there).
        return web.Response(body=dumps(answers if batched or len(seqs) > 1 else answers[0]),
                            content_type="application/json")

    async def run_sequences(self, seqs: list[Sequence]) -> None:
        """Generate ``seqs`` to their end; a client that goes away aborts them. Raises
        :class:`GenerationFailed` when the generation loop has failed."""
        try:
            await self.batcher.submit(seqs)
            await asyncio.gather(*(seq.done for seq in seqs))
        except asyncio.CancelledError:
            self.batcher.abort_sequences(seqs, "Abort: client disconnected.")
            raise

    def _parse_generate(self, body: dict) -> tuple[list[list[int]], list[RequestParams], list[str], bool]:
        text, input_ids = body.get("text"), body.get("input_ids")
        if (text is None) == (input_ids is None):
            raise RequestError("exactly one of 'text' and 'input_ids' must be given")
        if body.get("stream"):
            raise RequestError("stream=true is not supported by rlorch serve")
        if not isinstance(body.get("return_logprob", False), bool):
            raise RequestError("return_logprob must be a boolean")
        if body.get("top_logprobs_num", 0) not in (0, None):
            raise RequestError("top_logprobs_num > 0 is not supported by rlorch serve")
        if text is not None:
            prompts, batched = self._parse_text(text)
        else:
            prompts, batched = self._parse_ids(input_ids)
        params = self._parse_params(body.get("sampling_params"), len(prompts), batched)
        rids = self._parse_rids(body.get("rid"), len(prompts), batched)
        return prompts, params, rids, batched

    def _parse_text(self, text: Any) -> tuple[list[list[int]], bool]:
        batched = isinstance(text, list)
        texts = text if batched else [text]
        if not texts or not all(isinstance(t, str) for t in texts):
            raise RequestError("text must be a string or a non-empty list of strings")
        if any(len(t) > self.max_text_chars for t in texts):
            raise RequestError(f"text longer than {self.max_text_chars} characters cannot fit the model's "
                               f"context length ({self.context_len} tokens)")
        # As training encodes a prompt (bos first): a model answers a served prompt as it learned to.
        prompts = [encode_prompt(self.tokenizer, t) for t in texts]
        return self.check_prompts(prompts, "text"), batched

    def _parse_ids(self, input_ids: Any) -> tuple[list[list[int]], bool]:
        if not isinstance(input_ids, list) or not input_ids:
            raise RequestError("input_ids must be a non-empty list of token ids (or a list of such lists)")
        batched = isinstance(input_ids[0], list)
        prompts = input_ids if batched else [input_ids]
        for prompt in prompts:
            # JSON numbers parse to exactly int (never a subclass; true/false are bool).
            if not isinstance(prompt, list) or not set(map(type, prompt)) <= _INT:
                raise RequestError("input_ids must be a list of integers or a list of lists of integers")
        return self.check_prompts(prompts, "input_ids"), batched

    def check_prompts(self, prompts: list[list[int]], field: str) -> list[list[int]]:
        for prompt in prompts:
            if not prompt:
                raise RequestError(f"{field} must not be empty")
            if min(prompt) < 0 or max(prompt) >= self.vocab_size:
                raise RequestError(f"token ids must lie in [0, {self.vocab_size})")
            if len(prompt) >= self.context_len:
                raise RequestError(f"the input ({len(prompt)} tokens) is longer than the model's "
                                   f"context length ({self.context_len} tokens)")
        return prompts

    def _parse_params(self, raw: Any, count: int, batched: bool) -> list[RequestParams]:
        if isinstance(raw, list):
            if not batched or len(raw) != count:
                raise RequestError(f"a list of sampling_params needs a batch of the same length ({count})")
            # A batch's samples mostly carry the same parameters: parsed once per run of items
            # alike, shared as one object as a single object's ``n`` samples share theirs. Alike
            # is by repr, which tells 5 from 5.0 and True from 1 (dict equality does not, and
            # each of them alone may be valid or not).
            parsed, last_repr, last = [], None, None
            for item in raw:
                text = repr(item)
                if last is None or text != last_repr:
                    last, last_repr = RequestParams.parse(item, self.vocab_size), text
                parsed.append(last)
            return parsed
        params = RequestParams.parse(raw, self.vocab_size)
        return [params] * count

    def _parse_rids(self, rid: Any, count: int, batched: bool) -> list[str]:
        if rid is None:
            rid = uuid.uuid4().hex
        if isinstance(rid, list):
            if not batched or len(rid) != count or not all(isinstance(r, str) for r in rid):
                raise RequestError(f"a list rid needs a batch of the same length ({count}) of strings")
            return rid
        if not isinstance(rid, str):
            raise RequestError("rid must be a string or a list of strings")
        return [f"{rid}_{i}" for i in range(count)] if batched else [rid]

    def _answers(self, seqs: list[Sequence], logprobs: bool) -> list[dict]:
        texts = self.texts(seqs)
        answers = []
        for seq, text in zip(seqs, texts):
            meta = {"id": seq.rid, "finish_reason": seq.finish, "prompt_tokens": len(seq.prompt),
                    "completion_tokens": len(seq.output_ids), "cached_tokens": 0,
                    "weight_version": seq.weight_version, "total_retractions": 0,
                    "e2e_latency": seq.finished_at - seq.created}
            if logprobs:
                meta["input_token_logprobs"] = []
                meta["output_token_logprobs"] = [[lp, tok, None] for lp, tok in zip(seq.logprobs, seq.output_ids)]
            answers.append({"text": text, "output_ids": seq.output_ids, "meta_info": meta})
        return answers

    def texts(self, seqs: list[Sequence]) -> list[str]:
        """Each sequence's text: the one its stop string cut, else its tokens decoded, by one
        backend call per ``skip_special_tokens`` setting where that decodes exactly as the
        tokenizer does (see :func:`_decode_batch`), else one decode each."""
        texts: list[Optional[str]] = [seq.text for seq in seqs]
        for skip in (True, False):
            rows = [i for i, seq in enumerate(seqs) if texts[i] is None and seq.params.skip_special_tokens is skip]
            if not rows:
                continue
            if self._decode_batch is not None:
                decoded = self._decode_batch([seqs[i].output_ids for i in rows], skip_special_tokens=skip)
            else:
                decoded = [self.decode(seqs[i].output_ids, skip) for i in rows]
            for i, text in zip(rows, decoded):
                texts[i] = text
        return texts

    # ---- weights and flow control ---------------------------------------------------------

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        def failed(message: str) -> web.Response:
            log.warning("update_weights_from_disk failed: %s", message)
            return web.json_response({"success": False, "message": message, "num_paused_requests": 0},
                                     status=400)

        try:
            body = await json_body(request)
        except RequestError as err:
            return failed(str(err))
        if "weights" in self.memory.released:
            return failed(self.memory.describe())
        path, fmt, version = body.get("model_path"), body.get("load_format"), body.get("weight_version")
        if not isinstance(path, str) or not path:
            return failed("model_path must be a non-empty string")
        if fmt not in _LOAD_FORMATS:
            return failed(f"load_format {fmt!r} is not supported (use auto or safetensors)")
        if version is not None and not isinstance(version, (str, int)) or isinstance(version, bool):
            return failed("weight_version must be a string")
        try:
            await self.batcher.load_weights(path, dtype=self.dtype,
                                            version=None if version is None else str(version),
                                            abort_all=bool(body.get("abort_all_requests", False)))
        except LoadError as err:
            return failed(str(err))
        self.model_path = path
        log.info("loaded weights from %s (weight_version %s)", path, self.batcher.weight_version)
        return web.json_response({"success": True, "message": "Succeeded to update model weights.",
                                  "num_paused_requests": 0})

    async def pause_generation(self, request: web.Request) -> web.Response:
        try:
            body = await json_body(request, empty_ok=True)
        except RequestError as err:
            return _error(str(err))
        mode = body.get("mode", "abort")
        if mode not in _PAUSE_MODES:
            return _error(f"mode must be one of {_PAUSE_MODES}, got {mode!r}")
        await self.batcher.pause(mode)
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(self, request: web.Request) -> web.Response:
        if self.memory.released:
            return _error(self.memory.describe())
        self.batcher.resume()
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def abort_request(self, request: web.Request) -> web.Response:
        try:
            body = await json_body(request)
        except RequestError as err:
            return _error(str(err))
        rid, abort_all = body.get("rid", ""), body.get("abort_all", False)
        if not isinstance(rid, str) or not isinstance(abort_all, bool):
            return _error("rid must be a string and abort_all a boolean")
        self.batcher.abort(rid, all_requests=abort_all)
        return web.Response(status=200)

    async def update_weight_version(self, request: web.Request) -> web.Response:
        try:
            body = await json_body(request)
        except RequestError as err:
            return _error(str(err))
        version = body.get("new_version")
        if not isinstance(version, (str, int)) or isinstance(version, bool):
            return web.json_response({"success": False, "message": "new_version must be a string"}, status=400)
        if body.get("abort_all_requests", True):
            self.batcher.abort(all_requests=True, message="Abort: weight version update.")
        self.batcher.weight_version = str(version)
        return web.json_response({"success": True, "message": f"Weight version updated to {version}."})

    # ---- health and info ------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        alive = self._scheduler is not None and not self._scheduler.done()
        return web.Response(status=200 if alive else 503)

    async def health_generate(self, request: web.Request) -> web.Response:
        """200 once a one-token generation succeeds; 503 after ``HEALTH_CHECK_TIMEOUT`` seconds.

        As in SGLang, the probe is a real request, so while paused it waits behind the pause
        and fails if the pause outlasts the timeout (a paused server is not ready to generate).
        """
        if self._scheduler is None or self._scheduler.done():
            return web.Response(status=503)
        seq = Sequence(rid=f"HEALTH_CHECK_{uuid.uuid4().hex}", prompt=[self._health_token()],
                       params=RequestParams(max_new_tokens=1), done=asyncio.get_running_loop().create_future())

        async def probe() -> None:
            await self.batcher.submit([seq])
            await asyncio.shield(seq.done)

        try:
            await asyncio.wait_for(probe(), timeout=HEALTH_CHECK_TIMEOUT)
        except asyncio.TimeoutError:
            self.batcher.abort(seq.rid)
            return web.Response(status=503)
        return web.Response(status=200)

    def _health_token(self) -> int:
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None and bos < self.vocab_size else 0

    def _server_args(self) -> dict:
        return {"model_path": self.model_path, "tokenizer_path": self.model_path,
                "served_model_name": self.model_path, "host": self.address.rsplit(":", 1)[0],
                "port": int(self.address.rsplit(":", 1)[1]) if self.address else None,
                "dtype": str(self.dtype).removeprefix("torch."), "max_running_requests": self.max_batch,
                "context_length": self.context_len, "random_seed": self.seed, "device": self.device,
                "mem_fraction_static": self.memory_fraction, "memory_released": sorted(self.memory.released),
                "skip_tokenizer_init": False, "tp_size": 1, "dp_size": 1}

    async def get_server_info(self, request: web.Request) -> web.Response:
        import torch

        info = {**self._server_args(), "weight_version": self.batcher.weight_version,
                "version": rlorch_version(), "status": "ready", "engine": "rlorch",
                "torch_threads": torch.get_num_threads(), "internal_states": [self.batcher.stats()]}
        return web.json_response(info)

    async def get_model_info(self, request: web.Request) -> web.Response:
        config = self.model.config
        return web.json_response({"model_path": self.model_path, "tokenizer_path": self.model_path,
                                  "is_generation": True, "weight_version": self.batcher.weight_version,
                                  "model_type": getattr(config, "model_type", None),
                                  "architectures": getattr(config, "architectures", None),
                                  "preferred_sampling_params": None})

    async def get_weight_version(self, request: web.Request) -> web.Response:
        return web.json_response({"weight_version": self.batcher.weight_version})

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": self.model_path, "object": "model", "created": int(time.time()), "owned_by": "rlorch",
             "root": self.model_path, "max_model_len": self.context_len}]})

    async def flush_cache(self, request: web.Request) -> web.Response:
        stats = self.batcher.stats()
        busy = stats["num_running_reqs"] or stats["num_waiting_reqs"]
        message = ("Cache flushed.\nPlease check backend logs for more details. (When there are running "
                   "or waiting requests, the operation will not be performed.)\n")
        return web.Response(text=message, status=400 if busy else 200)


    async def release_memory_occupation(self, request: web.Request) -> web.Response:
        return await self._occupation(request, release=True)

    async def resume_memory_occupation(self, request: web.Request) -> web.Response:
        return await self._occupation(request, release=False)

    async def _occupation(self, request: web.Request, *, release: bool) -> web.Response:
        """SGLang's answer: 200 ``null`` on success, 400 ``{"error": {"message"}}`` otherwise."""
        from rlorch.serve.memory import OccupationError, parse_tags

        def busy() -> Optional[str]:
            stats = self.batcher.stats()
            waiting = 0 if self.batcher.paused else stats["num_waiting_reqs"]
            if stats["num_running_reqs"] or waiting:
                return f"{stats['num_running_reqs']} running, {waiting} waiting (pause generation first)"
            return None

        try:
            body = await json_body(request, empty_ok=True) if request.can_read_body else {}
            tags = parse_tags(body.get("tags"))
            if release and (reason := busy()):    # refused now, as SGLang would die: never waited for
                raise OccupationError(f"release_memory_occupation should be called only when the server is idle: "
                                      f"{reason}")
            async with self.batcher.model_lock():
                if release:
                    await self.batcher.run_on_model_thread(lambda: self.memory.release(tags, busy))
                else:
                    await self.batcher.run_on_model_thread(lambda: self.memory.resume(tags))
        except (RequestError, OccupationError) as err:
            return web.json_response({"error": {"message": str(err)}}, status=400)
        log.info("%s memory: %s (released now: %s)", "released" if release else "resumed", list(tags),
                 sorted(self.memory.released))
        return web.json_response(None)


def _log_scheduler_failure(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("generation loop failed; answering 500 and failing health checks from now on",
                  exc_info=task.exception())


class ServerThread:
    """A :class:`CpuServer` on a background thread's own event loop (tests, benchmarks, embedding
    in synchronous code). ``address`` is valid once the constructor returns."""

    def __init__(self, server: CpuServer, host: str = "127.0.0.1", port: int = 0):
        self.server = server
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="rlorch-serve", daemon=True)
        self._thread.start()
        self.address = asyncio.run_coroutine_threadsafe(server.start(host, port), self.loop).result(60)

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


async def _watch_parent(parent: int, stop: asyncio.Event) -> None:
    """Stop when the launching process is gone, so a killed runner leaves no engine behind."""
    while True:
        try:
            os.kill(parent, 0)
        except ProcessLookupError:
            break
        except PermissionError:
            pass
        await asyncio.sleep(1.0)
    log.warning("launching process %d is gone; shutting down", parent)
    stop.set()


async def _serve_until_signal(server: CpuServer, host: str, port: int, parent: Optional[int] = None) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    if parent is not None:
        loop.create_task(_watch_parent(parent, stop))
    address = await server.start(host, port)
    log.info("rlorch serve %s listening on http://%s (model %s, weight_version %s, device %s, dtype %s)",
             rlorch_version(), address, server.model_path, server.initial_version, server.device,
             str(server.dtype).removeprefix("torch."))
    await stop.wait()
    log.info("shutting down: aborting in-flight requests")
    server.batcher.abort(all_requests=True, message="Abort: server shutting down.")
    await server.stop()
    log.info("stopped")


def served_weights(path: Optional[str]) -> tuple[Optional[str], Optional[int]]:
    """``model.path`` as ``rlorch serve`` reads it, and the version it serves: a run directory
    means its newest published weights (``weights/step_N/``, else the newest complete
    checkpoint's) and their step; anything else as given, with no step."""
    from rlorch.rundir.layout import CheckpointDir, RunDir

    if not path:
        return path, None
    run = RunDir(Path(path).expanduser())
    if not run.is_run:
        return path, None
    found = [*run.published_weights(), *((step, CheckpointDir(p).weights) for step, p in run.complete_checkpoints())]
    if found:
        step, weights = max(found, key=lambda item: item[0])
        return str(weights), step
    from rlorch.config.schema import ConfigError

    raise ConfigError("model.path", f"{path} is a run directory with no published weights yet")


def serve_command(config, *, host: str, port: int, weight_version: Optional[str] = None,
                  parent: Optional[int] = None, api_key: Optional[str] = None, min_step_time: float = 0.0,
                  tool_call_parser: Optional[str] = None) -> int:
    """``rlorch serve``: run the CPU engine the composed ``config`` describes until SIGINT/SIGTERM
    (or until process ``parent`` is gone); the exit status (2 for a bad model path)."""
    return serve_model(config.model.path, host=host, port=port, dtype=config.model.dtype,
                       implementation=config.model.implementation, threads=config.inference.cpu.threads,
                       max_batch=engine_max_batch(config), seed=config.run.seed,
                       transfer_timeout=config.inference.transfer_timeout, weight_version=weight_version,
                       parent=parent, api_key=api_key, min_step_time=min_step_time,
                       device=config.inference.cpu.device, memory_fraction=config.inference.memory_fraction,
                       tool_call_parser=tool_call_parser)


def serve_model(model_path: Optional[str], *, host: str, port: int, dtype: str, implementation: str, threads: int,
                max_batch: int, seed: int, transfer_timeout: float, weight_version: Optional[str], parent: Optional[int],
                api_key: Optional[str], min_step_time: float, device: str = "cpu",
                memory_fraction: Optional[float] = None, tool_call_parser: Optional[str] = None) -> int:
    """Run the CPU engine on ``model_path`` (a run directory: its newest weights) until
    SIGINT/SIGTERM (or until process ``parent`` is gone); the exit status (2 for a bad model
    path or an address it cannot bind). ``weight_version`` None: a run directory's weights
    report their step, any other model 0."""
    from rlorch.config.schema import ConfigError
    from rlorch.model import resolve_model_path

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from rlorch.openai_api import TOOL_PARSERS

    if tool_call_parser is not None and tool_call_parser not in TOOL_PARSERS:
        log.error("cannot serve: --tool-call-parser must be one of %s, got %r", sorted(TOOL_PARSERS), tool_call_parser)
        return 2
    try:
        served, step = served_weights(model_path)
        path = resolve_model_path(served)
    except ConfigError as err:
        log.error("cannot serve: %s", err)
        return 2
    if weight_version is None:
        weight_version = str(step or 0)
    server = CpuServer(path, dtype=dtype, max_batch=max_batch, seed=seed, weight_version=weight_version,
                       threads=threads, api_key=api_key or None, min_step_time=min_step_time,
                       group_timeout=transfer_timeout, implementation=implementation, device=device,
                       memory_fraction=memory_fraction, tool_call_parser=tool_call_parser)
    try:
        asyncio.run(_serve_until_signal(server, host, port, parent))
    except OSError as err:
        log.error("cannot serve on %s:%d: %s", host, port, err.strerror or err)
        return 2
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    """An engine as rlorch launches it. Nothing is composed: it starts a few tenths of a second
    sooner than ``rlorch serve`` would (Hydra's imports and a composition)."""
    args = launched_parser().parse_args(argv)
    return serve_model(args.model_path, host=args.host, port=args.port, dtype=args.dtype,
                       implementation=args.implementation, threads=args.threads, max_batch=args.max_batch,
                       seed=args.seed, transfer_timeout=args.transfer_timeout, weight_version=args.weight_version,
                       parent=args.parent_pid, api_key=os.environ.get(API_KEY_ENV), min_step_time=args.min_step_time,
                       device=args.device, memory_fraction=args.mem_fraction_static,
                       tool_call_parser=args.tool_call_parser)


if __name__ == "__main__":
    raise SystemExit(main())
