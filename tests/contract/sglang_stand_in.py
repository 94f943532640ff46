"""SGLang's real HTTP application with a stand-in behind it, for contract tests on a CPU.

Run as ``python tests/contract/sglang_stand_in.py --port P [--shape 0.5.3] [--token-delay S]``.

What is real: ``sglang.srt.entrypoints.http_server.app`` (every route, request parsing into
``GenerateReqInput``/``AbortReq``/``PauseGenerationReqInput``/``UpdateWeightFromDiskReqInput``,
its validation and error responses, its ``/health_generate`` probe loop with its timeout) and
sglang's own weight-version span helpers that build ``meta_info.weight_versions``.

What is stubbed (``StandInTokenizerManager``): the ``TokenizerManager`` object the routes call,
i.e. the part that tokenizes, talks to the scheduler and runs the model. It "generates" token
a token drawn uniformly from ``VOCAB`` ids (seeded by the request id) every ``--token-delay``
seconds with logprob ``-1.0``,
and mirrors the tokenizer manager and scheduler behaviour rlorch relies on, as read in the
0.5.23 sources:

- a rid already in flight is refused with ``ValueError("Duplicate request ID detected: ...")``
  (the route turns it into HTTP 400);
- ``abort_request(rid)`` only acts when ``rid`` itself is in flight, then aborts every request
  whose rid *starts with* ``rid`` (the scheduler's prefix match);
- ``pause_generation`` (mode ``abort``) aborts everything in flight and holds new requests
  until ``continue_generation``; modes ``retract``/``in_place`` keep them and resume them;
- an update while paused in place changes the version mid-request, reported as
  ``meta_info.weight_versions`` spans (sglang's ``compute_weight_version_spans``);
- ``/health_generate`` is answered only by a request that produces a token, so while paused
  it waits and fails with 503 after ``HEALTH_CHECK_TIMEOUT`` (20 s; ``--health-timeout`` sets it).

- weights over a process group: ``/init_weights_update_group`` joins with SGLang's own
  ``init_custom_process_group`` (gloo on CPU) as ``rank_offset + tp_rank`` (tp_rank 0); the
  weight-update session is kept as the scheduler keeps it (no ``/update_weights_from_distributed``
  outside ``/begin_weight_update`` ... ``/end_weight_update``, a second begin refused, with the
  scheduler's messages); an update receives one broadcast per tensor with the given names,
  dtypes and shapes, as SGLang's model runner does, and ``--dump-dir`` saves each received
  version as ``DIR/version-<weight_version>.safetensors``; ``/destroy_weights_update_group``
  frees the name. ``--refuse-sessions`` refuses every ``/begin_weight_update`` (a server that
  cannot take weights over the group).

- memory occupation, as ``weight_updater.py`` keeps it: ``/release_memory_occupation`` adds its
  tags (none or ``[]``: ``kv_cache``, ``weights``, ``cuda_graph``) to the released set after
  asserting the scheduler idle (requests held by a pause do not count), ``/resume_memory_occupation``
  removes each of its tags and raises on one never released, and both answer 200 ``null``. Where
  the scheduler's assertion or ``KeyError`` would kill SGLang the stand-in exits (status 3,
  the reason on stderr), and so it does on a token generated or weights loaded into released
  memory. ``/flush_cache`` answers 400 while a request runs. ``--refuse-release`` answers every
  release with a tokenizer-side 400; ``--exit-after-release`` exits once a release is answered
  (an engine lost while its memory is released); a resume that arrives first is held until then,
  so the loss always falls before the memory is back. ``/server_info``'s internal state lists the
  control calls in order (``calls``) and the released tags.

``--shape 0.5.3`` answers a request aborted while queued the way 0.5.3 did (no
``output_token_logprobs``, no ``weight_version``); ``--shape 0.5.5`` omits ``weight_version``
from ``meta_info``. No lifespan runs (it only builds the OpenAI adapters, which are not used).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import importlib.abc
import importlib.machinery
import random
import sys
import time
import types

VOCAB = 40


class _Placeholder:
    """Stands for any torchvision attribute; using one raises."""

    def __init__(self, *args, **kwargs):
        pass

    def __call__(self, *args, **kwargs):
        raise RuntimeError("torchvision is a placeholder in the contract-test environment")

    def __getattr__(self, name):
        return _Placeholder()


class _PlaceholderModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder()


class _TorchvisionPlaceholder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """sglang's model configs import torchvision at module level; the PyPI torchvision wheel is
    built against CUDA torch and cannot load on the CPU torch here. Only image processors use
    it and none runs, so an inert module stands in (version ``0.0`` keeps transformers off its
    torchvision paths)."""

    def find_spec(self, name, path, target=None):
        if name == "torchvision" or name.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        return _PlaceholderModule(spec.name)

    def exec_module(self, module):
        module.__path__ = []
        module.__version__ = "0.0"


def install_torchvision_placeholder() -> None:
    try:
        import torchvision  # noqa: F401
    except Exception:
        sys.modules.pop("torchvision", None)
        sys.meta_path.insert(0, _TorchvisionPlaceholder())


class _Request:
    def __init__(self, rid: str, input_ids: list[int], max_new_tokens: int):
        self.rid = rid
        self.input_ids = input_ids
        self.max_new_tokens = max_new_tokens
        self.output: list[int] = []
        self.events: list = []
        self.aborted = False
        self.started = False
        self.rng = random.Random(rid)


class StandInTokenizerManager:
    """The attributes and coroutines of sglang's ``TokenizerManager`` that the native routes use."""

    def __init__(self, *, model_path: str, shape: str, token_delay: float):
        from sglang.srt.managers.tokenizer_manager import ServerStatus

        self.model_path = model_path
        self.served_model_name = model_path
        self.shape = shape
        self.token_delay = token_delay
        self.server_status = ServerStatus.Up
        self.gracefully_exit = False
        self.is_generation = True
        self.last_receive_tstamp = 0.0
        self.rid_to_state: dict[str, _Request] = {}
        self.startup_time = time.time()
        self.is_pause = False
        self.pause_mode = "abort"
        self.weight_version = "0"
        self.model_config = types.SimpleNamespace(is_image_understandable_model=False,
                                                  is_audio_understandable_model=False,
                                                  hf_config=types.SimpleNamespace(model_type="stand-in",
                                                                                  architectures=["StandIn"]))
        self._resumed = asyncio.Event()
        self._resumed.set()
        self.updates = 0
        self.groups: dict = {}
        self.session_open = False
        self.dump_dir = None
        self.refuse_sessions = False
        self.released: set[str] = set()
        self.calls: list[str] = []
        self.refuse_release = False
        self.exit_after_release = False

    def is_ready(self) -> bool:
        return not self.is_pause

    def config_value(self, name: str):
        return {"weight_version": self.weight_version}.get(name)

    def create_abort_task(self, obj):
        return None

    async def get_internal_state(self):
        """What ``/server_info`` reports as ``internal_states``: here, the requests the app holds
        and the tokens each has generated, so that tests poll on state instead of sleeping."""
        return [{"requests": {rid: len(req.output) for rid, req in self.rid_to_state.items()},
                 "calls": list(self.calls), "released": sorted(self.released)}]

    async def generate_request(self, obj, request=None):
        """One request, or (like TokenizerManager._handle_batch_request without streaming) a batch
        run as its sub-requests side by side and answered as one list in request order."""
        obj.normalize_batch_and_arguments()
        if obj.is_single:
            yield await self._one(obj)
        else:
            yield list(await asyncio.gather(*(self._one(obj[i]) for i in range(obj.batch_size))))

    async def _one(self, obj) -> dict:
        from sglang.srt.utils.weight_versions import (WeightVersionEvent, add_weight_versions_to_meta_info,
                                                      compute_weight_version_spans)

        rid = obj.rid if isinstance(obj.rid, str) else obj.rid[0]
        if rid in self.rid_to_state:
            raise ValueError(f"Duplicate request ID detected: {rid}")
        params = obj.sampling_params or {}
        req = _Request(rid, list(obj.input_ids), int(params.get("max_new_tokens", 16)))
        self.rid_to_state[rid] = req
        try:
            await self._run(req)
        finally:
            self.rid_to_state.pop(rid, None)
        queued_abort = req.aborted and not req.started
        meta = {"id": rid, "prompt_tokens": len(req.input_ids), "completion_tokens": len(req.output),
                "cached_tokens": 0, "e2e_latency": 0.0,
                "finish_reason": ({"type": "abort", "message": "Abort before prefill"} if req.aborted
                                  else {"type": "length", "length": len(req.output)})}
        if queued_abort and self.shape == "0.5.3":
            meta["prompt_tokens"] = 0
            return {"text": "", "meta_info": meta}
        if self.shape != "0.5.5":
            meta["weight_version"] = self.weight_version
            if req.events:
                spans = compute_weight_version_spans(
                    [WeightVersionEvent(old_version=v, num_output_tokens=n) for v, n in req.events],
                    self.weight_version, len(req.output))
                add_weight_versions_to_meta_info(meta, spans, len(req.output))
        if obj.return_logprob:
            meta["input_token_logprobs"] = [[None, t, None] for t in req.input_ids]
            meta["output_token_logprobs"] = [[-1.0, t, None] for t in req.output]
        return {"text": "".join(chr(97 + t % 26) for t in req.output), "output_ids": list(req.output),
                "meta_info": meta}

    async def _run(self, req: _Request) -> None:
        while not req.aborted and len(req.output) < req.max_new_tokens:
            if self.is_pause:
                await self._resumed.wait()
                continue
            req.started = True
            await asyncio.sleep(self.token_delay)
            if req.aborted or (self.is_pause and self.pause_mode == "abort"):
                continue
            if self.is_pause:
                continue
            if self.released & {"kv_cache", "weights"}:
                _die(f"generated a token with {sorted(self.released)} released")
            req.output.append(req.rng.randrange(VOCAB))
            self.last_receive_tstamp = time.time()

    def abort_request(self, rid: str = "", abort_all: bool = False):
        if abort_all:
            targets = list(self.rid_to_state.values())
        elif rid and rid in self.rid_to_state:
            targets = [r for key, r in self.rid_to_state.items() if key.startswith(rid)]
        else:
            return
        for req in targets:
            req.aborted = True

    async def pause_generation(self, obj):
        self.calls.append(f"pause:{obj.mode}")
        self.is_pause = True
        self.pause_mode = obj.mode
        self._resumed.clear()
        if obj.mode == "abort":
            self.abort_request(abort_all=True)

    async def continue_generation(self, obj):
        self.calls.append("continue")
        self.is_pause = False
        self._resumed.set()

    async def update_weights_from_disk(self, obj, request=None):
        self.calls.append("update_weights_from_disk")
        if "weights" in self.released:
            _die("loaded weights into released memory")
        if obj.model_path.endswith("missing"):
            return False, f"cannot load {obj.model_path}", 0
        if obj.abort_all_requests:
            self.abort_request(abort_all=True)
        old = self.weight_version
        for req in self.rid_to_state.values():
            if req.output:
                req.events.append((old, len(req.output)))
        self.weight_version = obj.weight_version if obj.weight_version is not None else old
        self.model_path = obj.model_path
        self.updates += 1
        return True, "Succeeded to update model weights.", 0


    def _running(self) -> int:
        """Requests the scheduler holds: every one that started (an aborted one until it is
        answered) and, unless paused, every one queued; a pause holds new ones at the tokenizer."""
        return sum(1 for req in self.rid_to_state.values() if req.started or not self.is_pause)

    async def flush_cache(self, timeout_s: float = 0.0):
        running = self._running()
        self.calls.append(f"flush:{'refused' if running else 'ok'}")
        return types.SimpleNamespace(success=not running, message=f"{running} requests run" if running else "")

    async def release_memory_occupation(self, obj, request=None):
        tags = obj.tags or ["kv_cache", "weights", "cuda_graph"]
        self.calls.append(f"release:{','.join(tags)}")
        if self.refuse_release:
            raise ValueError("release refused (--refuse-release)")
        if self._running():
            _die("release_memory_occupation should be called only when server is idle.")
        self.released.update(tags)
        if self.exit_after_release:
            asyncio.get_running_loop().call_later(0.05, os._exit, 4)

    async def resume_memory_occupation(self, obj, request=None):
        tags = obj.tags or ["kv_cache", "weights", "cuda_graph"]
        self.calls.append(f"resume:{','.join(tags)}")
        if self.exit_after_release:
            await asyncio.Event().wait()    # never answered: the exit scheduled at the release ends the process
        for tag in tags:
            if tag not in self.released:
                _die(f"KeyError: {tag!r} (resumed, never released)")
            self.released.remove(tag)

    async def init_weights_update_group(self, obj, request=None):
        from sglang.srt.utils.common import init_custom_process_group

        try:
            group = await asyncio.to_thread(
                init_custom_process_group, backend=obj.backend, world_size=obj.world_size,
                init_method=f"tcp://{obj.master_address}:{obj.master_port}", rank=obj.rank_offset + 0,
                group_name=obj.group_name)
        except Exception as err:
            return False, f"Failed to initialize custom process group: {err}."
        self.groups[obj.group_name] = group
        return True, "Succeeded to initialize custom process group."

    async def begin_weight_update(self, obj, request=None):
        if self.refuse_sessions:
            return False, "weight-update sessions refused (--refuse-sessions)"
        if self.session_open:
            return False, "a weight-update session is already open; call end_weight_update() first"
        self.session_open = True
        return True, "Success"

    async def end_weight_update(self, obj, request=None):
        if not self.session_open:
            return False, "no weight-update session is open; call begin_weight_update() first"
        self.session_open = False
        return True, "Success"

    async def update_weights_from_distributed(self, obj, request=None):
        if not self.session_open:
            return False, ("update_weights_from_distributed must run between begin_weight_update() and "
                           "end_weight_update()")
        if obj.group_name not in self.groups:
            return False, f"Failed to receive weights: Group {obj.group_name} not in {list(self.groups)}."
        try:
            received = await asyncio.to_thread(self._receive, obj)
        except Exception as err:
            return False, f"Failed to receive weights: {err}"
        self.weight_version = obj.weight_version if obj.weight_version is not None else self.weight_version
        if self.dump_dir is not None:
            from safetensors.torch import save_file

            save_file(received, f"{self.dump_dir}/version-{self.weight_version}.safetensors")
        self.updates += 1
        return True, "Succeeded to update parameter online."

    def _receive(self, obj) -> dict:
        import torch
        import torch.distributed as dist

        tensors = {name: torch.empty(shape, dtype=getattr(torch, dtype))
                   for name, dtype, shape in zip(obj.names, obj.dtypes, obj.shapes)}
        works = [dist.broadcast(t, src=0, group=self.groups[obj.group_name], async_op=True) for t in tensors.values()]
        for work in works:
            work.wait()
        return tensors

    async def destroy_weights_update_group(self, obj, request=None):
        import torch.distributed as dist

        group = self.groups.pop(obj.group_name, None)
        if group is None:
            return False, "The group to be destroyed does not exist."
        dist.destroy_process_group(group)
        return True, "Succeeded to destroy custom process group."


def _die(reason: str) -> None:
    """SGLang's scheduler process dies on this (an assertion or KeyError its loop does not catch),
    and takes the server with it."""
    print(f"stand-in: scheduler died: {reason}", file=sys.stderr, flush=True)
    os._exit(3)


def build_app(*, model_path: str, shape: str, token_delay: float, health_timeout: float, tp_size: int = 1):
    """sglang's FastAPI app with the stand-in installed as its global tokenizer manager."""
    install_torchvision_placeholder()
    from sglang.srt.entrypoints import http_server
    from sglang.srt.runtime_context import publish
    from sglang.srt.server_args import prepare_server_args

    server_args = prepare_server_args(["--model-path", model_path, "--device", "cpu", "--weight-version", "0",
                                       "--tp-size", str(tp_size)])
    publish(server_args, role="tokenizer")
    http_server.HEALTH_CHECK_TIMEOUT = health_timeout
    manager = StandInTokenizerManager(model_path=model_path, shape=shape, token_delay=token_delay)
    manager.server_args = server_args
    http_server.set_global_state(http_server._GlobalState(tokenizer_manager=manager, template_manager=None,
                                                          scheduler_info={}))
    return http_server.app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model-path", required=True, help="an HF model directory (its config is read)")
    parser.add_argument("--shape", default="0.5.23", choices=["0.5.23", "0.5.5", "0.5.3"])
    parser.add_argument("--token-delay", type=float, default=0.01)
    parser.add_argument("--health-timeout", type=float, default=20.0)
    parser.add_argument("--dump-dir", default=None, help="save each version received over the weight group here")
    parser.add_argument("--refuse-sessions", action="store_true", help="refuse every /begin_weight_update")
    parser.add_argument("--tp-size", type=int, default=1, help="the tensor parallelism /server_info reports")
    parser.add_argument("--refuse-release", action="store_true", help="answer every release with a 400")
    parser.add_argument("--exit-after-release", action="store_true", help="exit once a release is answered")
    args = parser.parse_args()
    import uvicorn

    app = build_app(model_path=args.model_path, shape=args.shape, token_delay=args.token_delay,
                    health_timeout=args.health_timeout, tp_size=args.tp_size)
    from sglang.srt.entrypoints import http_server

    http_server._global_state.tokenizer_manager.dump_dir = args.dump_dir
    http_server._global_state.tokenizer_manager.refuse_sessions = args.refuse_sessions
    http_server._global_state.tokenizer_manager.refuse_release = args.refuse_release
    http_server._global_state.tokenizer_manager.exit_after_release = args.exit_after_release
    from sglang.srt.environ import envs

    uvicorn.run(app, host="127.0.0.1", port=args.port, lifespan="off", log_level="warning",
                timeout_keep_alive=envs.SGLANG_TIMEOUT_KEEP_ALIVE.get())


if __name__ == "__main__":
    main()
