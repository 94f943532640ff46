"""The Ray launcher (``run.launcher=ray``): every process of a run in a placement group of a Ray
cluster, owned by an actor there.

- A launched server gets a placement group of its own: ``inference.tp_size`` bundles of one GPU
  (one CPU for a CPU server), STRICT_PACK. The actor in bundle 0 starts the server with the
  usual command builder on a free port of its node and returns ``node_ip:port``; the actors in
  the other bundles only hold their GPU and say which it is. The server's
  ``CUDA_VISIBLE_DEVICES`` is the GPUs Ray gave the group's actors.
- The trainer gets one placement group of ``trainer.fsdp.nnodes`` bundles of ``nproc`` GPUs (CPUs
  for a CPU trainer), STRICT_SPREAD: one actor per node runs the torchrun command with its
  ``--node-rank`` and a static rendezvous at node 0's IP.
- A placement group never waits silently: while pending, what it asks for and what the cluster
  has free are printed every :data:`PENDING_REPORT_S` seconds and held in
  :attr:`RayLauncher.waiting` (what a scale request shows in the step records); past
  ``run.placement_timeout`` the start fails naming the request, and the group is forgotten, so a
  later start of the same server asks anew.
- Nothing outlives the run. Without ``run.ray_address`` the cluster is the run's own
  (:mod:`rlorch.launch.private_cluster`): all of it ends with the run, a kill -9 of the
  orchestrator too. On a joined cluster actors are not detached, so Ray kills a dead driver's
  actors; every process an actor starts watches the actor's pid (``--parent-pid`` /
  ``RLORCH_ORCHESTRATOR_PID``) and exits with it. :meth:`RayLauncher.close` removes every
  placement group (which kills the actors in it).
"""

from __future__ import annotations

import asyncio
import functools
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional

from rlorch.config.schema import InferenceBackend, TrainerBackend
from rlorch.launch.base import LOG_TAIL_LINES, LaunchError, Launched
from rlorch.launch.private_cluster import PrivateCluster, private_cpus
from rlorch.launch.server_command import API_KEY_ENV, server_command
from rlorch.lifecycle import ORCHESTRATOR_PID_ENV

TRANSFER_ADDRESS_ENV = "RLORCH_TRANSFER_ADDRESS"
"""The trainer's weight-group address (read by :mod:`rlorch.trainer.broadcast`; not imported
from there: launch does not import the trainer)."""

PENDING_REPORT_S = 10.0
"""Seconds between reports of a placement group still pending."""
PROBE_NAME = "probe-node-{rank}"
"""The file each trainer node writes into the run directory at start (a node that cannot see
the shared run directory fails the start, naming itself and the path)."""


# ---- what is asked for (also what --dry-run prints) ----------------------------------------

def server_bundles(config) -> list[dict[str, float]]:
    """One launched server's bundles: a GPU per tensor-parallel rank (an SGLang server), else
    one CPU (``rlorch serve``)."""
    if config.inference.backend is InferenceBackend.sglang:
        return [{"GPU": 1.0} for _ in range(config.inference.tp_size)]
    return [{"CPU": 1.0}]


def trainer_bundles(config) -> list[dict[str, float]]:
    """The trainer's bundles, one per node: ``nproc`` GPUs, or ``nproc`` CPUs on a CPU trainer
    (``trainer.fsdp.device=auto`` trains on GPUs when ``run.gpus`` is set or the connected
    cluster has GPUs)."""
    from rlorch.launch.placement import fill_counts

    fsdp = fill_counts(config, config.run.gpus or 0).trainer.fsdp
    kind = "GPU" if fsdp.device == "cuda" or (fsdp.device == "auto" and _cluster_gpus(config)) else "CPU"
    return [{kind: float(fsdp.nproc)} for _ in range(fsdp.nnodes)]


def _cluster_gpus(config) -> bool:
    if config.run.gpus is not None:
        return config.run.gpus > 0
    ray = sys.modules.get("ray")  # not imported: not connected (a dry run)
    return ray is not None and ray.is_initialized() and ray.cluster_resources().get("GPU", 0) > 0


def requests(config) -> list[dict]:
    """Every placement group the run asks for: ``name``, ``bundles``, ``strategy``."""
    groups = []
    if config.inference.backend in (InferenceBackend.cpu, InferenceBackend.sglang) and not config.inference.addresses:
        groups += [{"name": f"server-{i}", "bundles": server_bundles(config), "strategy": "STRICT_PACK"}
                   for i in range(config.inference.num_servers or 1)]
    if config.trainer.backend is TrainerBackend.fsdp:
        groups.append({"name": "trainer", "bundles": trainer_bundles(config), "strategy": "STRICT_SPREAD"})
    return groups


def cpus_asked(config) -> int:
    """The CPUs the run's placement groups ask for at start."""
    return int(sum(b.get("CPU", 0.0) for g in requests(config) for b in g["bundles"]))


# ---- what runs on the nodes --------------------------------------------------------------

def fixed_command(command: list[str], *, host: str, port: int) -> list[str]:
    """``command`` with ``{host}`` and ``{port}`` filled in (a command that needs neither)."""
    return [arg.replace("{host}", host).replace("{port}", str(port)) for arg in command]


def _server_build(config, *, model_path: Path, api_key: str, host: str, port: int) -> list[str]:
    """A launched server's command, built on its node (``--parent-pid`` is its actor's pid);
    SGLang runs under the guard, which takes it down with the actor."""
    command = server_command(config, model_path=model_path, port=port, host=host)
    if config.inference.backend is InferenceBackend.sglang:
        command = [sys.executable, "-m", "rlorch.launch.guard", *command, "--api-key", api_key]
    return command


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


class ProcessOwner:
    """The actor that owns one process on its node (a server, or the trainer's agent there)."""

    def __init__(self) -> None:
        self.process: Optional[subprocess.Popen] = None
        self.log: Optional[str] = None

    def node(self) -> dict:
        """This node's IP, a free port on it, and the GPUs Ray gave this actor."""
        import ray

        host = ray.util.get_node_ip_address()
        return {"ip": host, "port": _free_port(host), "gpus": [str(g) for g in ray.get_gpu_ids()],
                "node_id": ray.get_runtime_context().get_node_id()}

    def start(self, build: Callable[..., list[str]], env: dict[str, str], log: str, *, port: Optional[int] = None,
              gpus: Optional[list[str]] = None) -> dict:
        """Start ``build(host=, port=)`` (the node's IP, ``port`` or a free one) with ``env``, its
        output appended to ``log``; ``gpus`` (default this actor's) become its
        ``CUDA_VISIBLE_DEVICES``. Returns the address, the pid and the GPUs."""
        node = self.node()
        port = node["port"] if port is None else port
        gpus = node["gpus"] if gpus is None else gpus
        command = build(host=node["ip"], port=port)
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
                    **env, ORCHESTRATOR_PID_ENV: str(os.getpid())}
        full_env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
        shown = ["***" if i and command[i - 1] == "--api-key" else a for i, a in enumerate(command)]
        self.log = log
        Path(log).parent.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as handle:
            handle.write(f"$ {' '.join(shown)}\n".encode())
            self.process = subprocess.Popen(command, stdout=handle, stderr=subprocess.STDOUT, env=full_env,
                                            start_new_session=True, stdin=subprocess.DEVNULL)
        return {"address": f"{node['ip']}:{port}", "ip": node["ip"], "pid": self.process.pid, "gpus": gpus}

    def wait(self) -> dict:
        """Block until the process exits: its status and the tail of its log."""
        code = self.process.wait()
        try:
            tail = "\n".join(Path(self.log).read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:])
        except OSError:
            tail = "(no log)"
        return {"code": code, "tail": tail}

    def stop(self, timeout: float, workers: Optional[str] = None) -> None:
        """SIGTERM the process's group, SIGKILL it after ``timeout`` s; then the trainer ranks
        recorded in ``workers`` that run on this node."""
        if self.process is not None and self.process.poll() is None:
            _signal_group(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                _signal_group(self.process.pid, signal.SIGKILL)
                self.process.wait()
        if workers is not None:
            from rlorch.launch.local import _kill_workers

            asyncio.run(_kill_workers(Path(workers)))

    def probe(self, path: str, rank: int) -> Optional[str]:
        """Write the run directory probe for node ``rank``; None, or why it could not."""
        try:
            Path(path).write_text(f"{rank} {socket.gethostname()}\n")
        except OSError as err:
            return str(err)
        return None


# ---- the launcher -------------------------------------------------------------------------

class RayLauncher:
    name = "ray"
    server_build: Callable[..., list[str]] = staticmethod(_server_build)
    """``(config, *, model_path, api_key, host, port) -> command`` of a launched server, called on
    its node (module-level, so Ray pickles it by reference)."""

    def __init__(self, config=None) -> None:
        import ray

        self.config = config
        run = config.run if config is not None else None
        self.placement_timeout = run.placement_timeout if run is not None else 300.0
        self.namespace = f"rlorch-{os.getpid()}-{secrets.token_hex(4)}"
        self.groups: dict[str, Any] = {}
        self.actors: list[Any] = []
        self._server_actors: dict[int, list[Any]] = {}
        self._generation = 0
        self.waiting: Optional[str] = None
        """What a start in progress waits for (a placement group not yet placed, and the cluster's
        free resources as of the last report); None when nothing waits. Written by the thread
        that starts, read by the event loop."""
        self.started_ray = False
        self.cluster: Optional[PrivateCluster] = None
        if not ray.is_initialized():
            address = run.ray_address if run is not None else None
            # ray.init replaces the driver's SIGTERM handler: the run's own is put back.
            handler = signal.getsignal(signal.SIGTERM)
            options = {"log_to_driver": False, "namespace": self.namespace}
            if address is None:
                cpus = private_cpus(config, cpus_asked(config) if config is not None else 1)
                log_dir = Path(run.dir) / "logs" if run is not None and run.dir else Path(tempfile.gettempdir())
                self.cluster = PrivateCluster(num_cpus=cpus, log=log_dir / "ray.log")
                try:
                    self.cluster.connect(**options)
                except BaseException:
                    self.cluster.stop()
                    raise
            else:
                ray.init(address=address, include_dashboard=False, **options)
            signal.signal(signal.SIGTERM, handler)
            self.started_ray = True
        self._actor_class = ray.remote(ProcessOwner)

    # -- placement groups

    def _group(self, name: str, bundles: list[dict], strategy: str):
        """The placement group ``name`` (created once, reused by restarts), once it is placed."""
        from ray.util.placement_group import placement_group, remove_placement_group

        if name in self.groups:
            return self.groups[name]
        request = f"placement group {name} ({strategy}, bundles {bundles})"
        group = placement_group(bundles, strategy=strategy, name=f"{self.namespace}-{name}")
        self.groups[name] = group
        self.waiting = request
        try:
            wait_placed(group, request, self.placement_timeout, on_report=self._report_waiting)
        except BaseException:
            self.groups.pop(name, None)
            try:
                remove_placement_group(group)  # a timeout removed it already; an interruption did not
            except Exception:
                pass
            raise
        finally:
            self.waiting = None
        return group

    def _report_waiting(self, line: str) -> None:
        self.waiting = line

    def _actor(self, group, bundle: int, role: str, gpus: float, cpus: float = 0.0):
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self._generation += 1
        actor = self._actor_class.options(
            name=f"{role}-{self._generation}", namespace=self.namespace, num_cpus=cpus, num_gpus=gpus,
            max_concurrency=4, lifetime=None,
            scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=bundle)).remote()
        self.actors.append(actor)
        return actor

    # -- the Launcher protocol

    def start_server(self, config, index: int, *, model_path: Path, api_key: str, log_dir: Path,
                     env: dict[str, str], port: Optional[int] = None) -> Launched:
        import ray

        bundles = server_bundles(config)
        group = self._group(f"server-{index}", bundles, "STRICT_PACK")
        for stale in self._server_actors.pop(index, []):  # a restart: the bundles must be free
            _kill(stale)
        gpu = bundles[0].get("GPU", 0.0)
        owner = self._actor(group, 0, f"server-{index}", gpu, bundles[0].get("CPU", 0.0))
        holders = [self._actor(group, b, f"server-{index}-gpu{b}", gpu) for b in range(1, len(bundles))]
        self._server_actors[index] = [owner, *holders]
        gpus = None
        if gpu:
            nodes = ray.get([a.node.remote() for a in [owner, *holders]])
            gpus = [g for node in nodes for g in node["gpus"]]
        log = log_dir / f"server-{index}.log"
        build = functools.partial(self.server_build, config, model_path=model_path, api_key=api_key)
        env = {k: v for k, v in env.items() if k != "CUDA_VISIBLE_DEVICES"}
        started = ray.get(owner.start.remote(build, {**env, API_KEY_ENV: api_key}, str(log), port=port, gpus=gpus))
        return Launched("server", index, started["address"], log, handle=owner,
                        extra={"wait": owner.wait.remote(), "holders": holders, "pid": started["pid"],
                               "gpus": started["gpus"]})

    def start_trainer(self, command: list[str], *, env: dict[str, str], log: Path, workers: Path) -> Launched:
        """One actor per bundle of the trainer's group; with several nodes each runs ``command``
        with its ``--node-rank`` and node 0's IP and a free port there as the rendezvous."""
        import ray

        config = self.config
        bundles = trainer_bundles(config) if config is not None else [{"CPU": 1.0}]
        group = self._group("trainer", bundles, "STRICT_SPREAD")
        actors = [self._actor(group, b, f"trainer-{b}", bundles[b].get("GPU", 0.0), bundles[b].get("CPU", 0.0))
                  for b in range(len(bundles))]
        nodes = ray.get([a.node.remote() for a in actors])
        run_dir = workers.parent.parent
        failed = [(rank, error) for rank, error in enumerate(
            ray.get([a.probe.remote(str(run_dir / PROBE_NAME.format(rank=rank)), rank) for rank, a in enumerate(actors)]))
            if error is not None or not (run_dir / PROBE_NAME.format(rank=rank)).exists()]
        if failed:
            rank, error = failed[0]
            raise LaunchError(f"trainer node {rank} ({nodes[rank]['ip']}) cannot write the run directory {run_dir}: "
                              f"{error or 'its probe file is not visible here'}; the run directory must be on storage "
                              "every node sees")
        env = trainer_env(env, nodes)
        handles = []
        for rank, actor in enumerate(actors):
            node_command = node_trainer_command(command, rank, nodes[0]["ip"], nodes[0]["port"]) \
                if len(actors) > 1 else command
            node_log = log if rank == 0 else log.with_name(f"{log.stem}-node{rank}{log.suffix}")
            ray.get(actor.start.remote(functools.partial(fixed_command, node_command), env, str(node_log)))
            handles.append(actor)
        waits = [a.wait.remote() for a in handles]
        return Launched("trainer", 0, None, log, handle=handles[0],
                        extra={"wait": waits[0], "waits": waits, "actors": handles, "workers": workers,
                               "node_ip": nodes[0]["ip"]})

    def returncode(self, process: Launched) -> Optional[int]:
        """The first exit among the process's actors (a dead actor is status -9)."""
        import ray
        from ray.exceptions import RayActorError

        if process.handle is None:
            return None
        if "code" in process.extra:
            return process.extra["code"]
        waits = process.extra.get("waits") or [process.extra["wait"]]
        done, _ = ray.wait(waits, num_returns=1, timeout=0)
        if not done:
            return None
        try:
            code = ray.get(done[0])["code"]
        except RayActorError:
            code = -9
        process.extra["code"] = code
        return code

    async def stop(self, processes: list[Launched], *, timeout: float) -> None:
        import ray

        def stop_all() -> None:
            refs = []
            for process in processes:
                workers = process.extra.get("workers")
                for actor in process.extra.get("actors") or ([process.handle] if process.handle is not None else []):
                    refs.append(actor.stop.remote(timeout, str(workers) if workers is not None else None))
            try:
                ray.get(refs, timeout=timeout + 10.0)
            except Exception:  # a dead actor's processes died with it (they watch its pid)
                pass
            for process in processes:
                for actor in (process.extra.get("actors") or [process.handle]) + process.extra.get("holders", []):
                    if actor is not None:
                        _kill(actor)

        await asyncio.to_thread(stop_all)

    def release(self, process: Launched) -> None:
        """Remove the placement group of a server taken out of the run (its GPUs are free again)."""
        from ray.util.placement_group import remove_placement_group

        group = self.groups.pop(f"server-{process.index}", None)
        if group is not None:
            remove_placement_group(group)

    def close(self) -> None:
        """Remove every placement group of the run (killing what is left in them); shut down a
        cluster this launcher started."""
        import ray
        from ray.util.placement_group import remove_placement_group

        if not ray.is_initialized():
            if self.cluster is not None:
                self.cluster.stop()
                self.cluster = None
            return
        # Taken whole first: a start still waiting on a thread (a scale-up not yet placed) adds
        # or drops its group while this runs.
        actors, self.actors = list(self.actors), []
        groups, self.groups = list(self.groups.values()), {}
        for actor in actors:
            _kill(actor)
        for group in groups:
            try:
                remove_placement_group(group)
            except Exception:
                pass
        if self.started_ray:
            ray.shutdown()
        if self.cluster is not None:
            self.cluster.stop()
            self.cluster = None


def _kill(actor) -> None:
    """``ray.kill``, for an actor that may be gone already."""
    import ray

    try:
        ray.kill(actor)
    except Exception:  # already dead, or its cluster is
        pass


def trainer_env(env: dict[str, str], nodes: list[dict]) -> dict[str, str]:
    """What every trainer node's torchrun runs under: Ray sets ``CUDA_VISIBLE_DEVICES`` (the
    orchestrator's own is dropped), and the weight group's address is node 0's IP (``nodes`` in
    rank order, as the actors report them): its store is on global rank 0, there, and the
    engines on other nodes reach it at that IP, not at ``inference.transfer_address``."""
    return {**{k: v for k, v in env.items() if k != "CUDA_VISIBLE_DEVICES"}, TRANSFER_ADDRESS_ENV: nodes[0]["ip"]}


def node_trainer_command(command: list[str], rank: int, master: str, port: int) -> list[str]:
    """``command`` (a multi-node torchrun line) for node ``rank``, its rendezvous at ``master:port``."""
    values = {"--node-rank": str(rank), "--master-addr": master, "--master-port": str(port)}
    out = list(command)
    for i, arg in enumerate(out[:-1]):
        if arg in values:
            out[i + 1] = values[arg]
    return out


def wait_placed(group, request: str, timeout: float, report: Optional[float] = None, out=None,
                on_report: Optional[Callable[[str], None]] = None) -> None:
    """Wait until ``group`` is placed; every ``report`` s say what it asks for against the
    cluster's free resources (printed to ``out``, and handed to ``on_report``); past ``timeout``
    remove it and raise :class:`LaunchError`."""
    import ray
    from ray.exceptions import GetTimeoutError
    from ray.util.placement_group import remove_placement_group

    out = sys.stderr if out is None else out
    report = PENDING_REPORT_S if report is None else report
    started = time.monotonic()
    ready = group.ready()
    while True:
        left = timeout - (time.monotonic() - started)
        try:
            ray.get(ready, timeout=max(0.0, min(report, left)))
            return
        except GetTimeoutError:
            pass
        free = {k: v for k, v in sorted(ray.available_resources().items()) if k in ("CPU", "GPU") or k.startswith("accelerator")}
        waited = time.monotonic() - started
        if waited >= timeout:
            remove_placement_group(group)
            raise LaunchError(f"{request} not placed after run.placement_timeout={timeout:g}s; the cluster has free "
                              f"{free or 'nothing'} (total {_totals()})")
        line = f"{request} pending for {waited:.0f}s; the cluster has free {free or 'nothing'} (total {_totals()})"
        print(f"rlorch: {line}", file=out, flush=True)
        if on_report is not None:
            on_report(line)


def _totals() -> dict:
    import ray

    return {k: v for k, v in sorted(ray.cluster_resources().items()) if k in ("CPU", "GPU")}
