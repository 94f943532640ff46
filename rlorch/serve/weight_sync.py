"""Weights over a process group for ``rlorch serve``: SGLang's ``/init_weights_update_group``,
``/update_weights_from_distributed`` and ``/destroy_weights_update_group``, same fields and
answers.

The engine joins the trainer's group (see :mod:`rlorch.launch.weight_group`) with gloo, since it runs
on CPU. An update checks ``names``/``dtypes``/``shapes`` against the served model, receives every
tensor in ``names`` order into fresh buffers, and only then copies them into the model (under
the model lock, like a load from disk), so a failed transfer leaves the live weights as they
were. Failures answer HTTP 400 ``{"success": false, "message": ...}``.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Optional

from aiohttp import web

from rlorch.serve.batcher import load_tensors
from rlorch.serve.http import json_body
from rlorch.serve.sampling import RequestError
from rlorch.launch.weight_group import DEFAULT_GROUP_NAME, GroupSpec, broadcast, close_group, open_group, parse_dtype

log = logging.getLogger("rlorch.serve")

GROUP_TIMEOUT_S = 300.0
"""How long joining the group, or one transfer, may wait for the trainer."""
ENGINE_BACKENDS = ("gloo",)


def _failed(message: str) -> web.Response:
    log.warning("weight transfer failed: %s", message)
    return web.json_response({"success": False, "message": message}, status=400)


def _ok(message: str) -> web.Response:
    return web.json_response({"success": True, "message": message})


def parse_group_spec(body: dict) -> GroupSpec:
    for key in ("master_address", "master_port", "rank_offset", "world_size"):
        if key not in body:
            raise RequestError(f"{key} is required")
    if not isinstance(body["master_address"], str) or not body["master_address"]:
        raise RequestError("master_address must be a non-empty string")
    for key in ("master_port", "rank_offset", "world_size"):
        if not isinstance(body[key], int) or isinstance(body[key], bool) or body[key] < 0:
            raise RequestError(f"{key} must be a non-negative integer")
    spec = GroupSpec(master_address=body["master_address"], master_port=body["master_port"],
                     rank_offset=body["rank_offset"], world_size=body["world_size"],
                     group_name=str(body.get("group_name", DEFAULT_GROUP_NAME)),
                     backend=str(body.get("backend", "nccl")))
    if spec.backend not in ENGINE_BACKENDS:
        raise RequestError(f"backend {spec.backend!r} is not supported by rlorch serve (a CPU engine): use gloo")
    if not 0 < spec.rank_offset < spec.world_size:
        raise RequestError(f"rank_offset must lie in [1, world_size={spec.world_size}) (rank 0 is the trainer)")
    return spec


def parse_manifest(body: dict, model) -> list[tuple[str, Any, tuple[int, ...]]]:
    """(name, dtype, shape) per tensor, checked against ``model`` before anything is received."""
    names, dtypes, shapes = body.get("names"), body.get("dtypes"), body.get("shapes")
    if not (isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)):
        raise RequestError("names, dtypes and shapes must be lists")
    if not len(names) == len(dtypes) == len(shapes):
        raise RequestError(f"names, dtypes and shapes must have one entry per tensor "
                           f"(got {len(names)}, {len(dtypes)}, {len(shapes)})")
    state = model.state_dict()
    entries = []
    for name, dtype, shape in zip(names, dtypes, shapes):
        if name not in state:
            raise RequestError(f"{name!r} is not a tensor of the served model")
        try:
            parsed = parse_dtype(dtype)
        except ValueError as err:
            raise RequestError(f"dtypes: {err}") from None
        if not isinstance(shape, list) or tuple(shape) != tuple(state[name].shape):
            raise RequestError(f"shape of {name!r} is {shape}, the served model has {list(state[name].shape)}")
        entries.append((name, parsed, tuple(shape)))
    return entries


class WeightSync:
    """The weight-transfer endpoints of one :class:`~rlorch.serve.server.CpuServer`."""

    def __init__(self, server, timeout: Optional[float] = None):
        self.server = server
        self.timeout = GROUP_TIMEOUT_S if timeout is None else timeout
        """Seconds joining a group, or one transfer over it, may wait (``inference.transfer_timeout``
        when launched by a run)."""
        self.groups: dict[str, Any] = {}
        self.session_open = False
        """SGLang's weight-update session: ``/update_weights_from_distributed`` is refused outside
        ``/begin_weight_update`` ... ``/end_weight_update``, and a second begin is refused."""

    def routes(self) -> list:
        return [web.post("/init_weights_update_group", self.init_group),
                web.post("/begin_weight_update", self.begin),
                web.post("/update_weights_from_distributed", self.update),
                web.post("/end_weight_update", self.end),
                web.post("/destroy_weights_update_group", self.destroy_group)]

    async def begin(self, request: web.Request) -> web.Response:
        if self.session_open:
            return _failed("a weight-update session is already open; call end_weight_update() first")
        self.session_open = True
        return _ok("Success")

    async def end(self, request: web.Request) -> web.Response:
        if not self.session_open:
            return _failed("no weight-update session is open; call begin_weight_update() first")
        self.session_open = False
        return _ok("Success")

    async def _body(self, request: web.Request, *, empty_ok: bool = False) -> dict:
        return await json_body(request, empty_ok=empty_ok)

    async def init_group(self, request: web.Request) -> web.Response:
        try:
            spec = parse_group_spec(await self._body(request))
        except RequestError as err:
            return _failed(str(err))
        if spec.group_name in self.groups:
            return _failed(f"Failed to initialize custom process group: the group name {spec.group_name!r} "
                           "has already been created")
        try:
            group = await asyncio.to_thread(open_group, spec, rank=spec.rank_offset, timeout=self.timeout)
        except Exception as err:  # torch raises RuntimeError/DistStoreError and friends
            return _failed(f"cannot join group {spec.group_name!r} at {spec.master_address}:"
                           f"{spec.master_port}: {err}")
        self.groups[spec.group_name] = group
        log.info("joined weight group %s as rank %d of %d", spec.group_name, spec.rank_offset, spec.world_size)
        return _ok("Succeeded to initialize custom process group.")

    async def update(self, request: web.Request) -> web.Response:
        server = self.server
        if not self.session_open:
            return _failed("update_weights_from_distributed must run between begin_weight_update() and "
                           "end_weight_update()")
        try:
            body = await self._body(request)
            entries = parse_manifest(body, server.model)
            group = self.groups.get(str(body.get("group_name", DEFAULT_GROUP_NAME)))
            if group is None:
                raise RequestError(f"no weight group {body.get('group_name', DEFAULT_GROUP_NAME)!r}: "
                                   "call /init_weights_update_group first")
            version = body.get("weight_version")
            if version is not None and (not isinstance(version, (str, int)) or isinstance(version, bool)):
                raise RequestError("weight_version must be a string")
        except RequestError as err:
            return _failed(str(err))

        def receive_and_load() -> None:
            import torch

            tensors = {name: torch.empty(shape, dtype=dtype) for name, dtype, shape in entries}
            broadcast(group, list(tensors.values()))
            load_tensors(server.model, tensors, server.dtype)

        try:
            await server.batcher.update_weights(receive_and_load, version=None if version is None else str(version),
                                                abort_all=bool(body.get("abort_all_requests", False)))
        except RuntimeError as err:  # LoadError, or the group's transport error
            return _failed(f"transfer failed: {err}")
        log.info("received %d tensors over %s (weight_version %s)", len(entries),
                 body.get("group_name", DEFAULT_GROUP_NAME), server.batcher.weight_version)
        return _ok("Succeeded to update parameter online.")

    async def destroy_group(self, request: web.Request) -> web.Response:
        try:
            body = await self._body(request, empty_ok=True)
        except RequestError as err:
            return _failed(str(err))
        name = str(body.get("group_name", DEFAULT_GROUP_NAME))
        group = self.groups.pop(name, None)
        if group is None:
            return _failed("The group to be destroyed does not exist.")
        await asyncio.to_thread(close_group, group)
        return _ok("Succeeded to destroy custom process group.")
