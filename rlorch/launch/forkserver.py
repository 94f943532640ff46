"""Start rlorch's own subprocesses (``rlorch serve``, the trainer worker) as forks of one warm
process that has already imported torch (and transformers and FSDP2, when the run's config says
its children will need them: :func:`preload_for`).

Each of those processes otherwise spends seconds of CPU importing the same modules at every run
start; on a small machine they compete for the same cores, so starting them concurrently does
not help unless that work is done once. The fork server is started on the first spawn (with
``OMP_NUM_THREADS`` as the children get it, since the OpenMP runtime reads it when torch is
imported), imports the heavy modules before it forks anything, and starts no threads, so a
fork is safe. Each child gets its own session, environment, working directory and log, and runs
its module as ``python -m`` would. What the server imported stays shared with every child
(copy-on-write pages, frozen out of the garbage collector: :func:`preload`), so a child starts
in a fraction of a second. ``rlorch train`` starts the server before it composes its config
when the default backends will launch through it (:func:`warm_up_early`); one
that has forked nothing is stopped once the run turns out not to need it, and at exit
(:func:`discard`).

:func:`spawn` hands back a :class:`Forked` with the part of ``subprocess.Popen``'s interface the
launcher and the trainer use (``pid``, ``poll``, ``wait``, ``returncode``, ``send_signal``);
commands that are not an rlorch module of this interpreter get a plain ``Popen``. Set
``RLORCH_FORKSERVER=0`` to launch every process the ordinary way.

One fork server can also serve many runs: ``python -m rlorch.launch.forkserver --listen PATH``
listens on a Unix socket (it answers as soon as it is bound; requests wait for its imports), and
a run started with ``RLORCH_FORKSERVER=PATH`` forks its processes there instead of warming a
server of its own, so only the first run pays for the imports. Each connection is told about
the exits of the processes it asked for, and closing it stops nothing: what was forked watches
its own orchestrator. The server's imports are those of the code it started with, so one
started before an upgrade keeps running the old code until it is restarted.
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import subprocess
import sys
import threading
import time
from typing import Optional

TRAINER_MODULE = "rlorch.trainer.fsdp"
TRAINER_PRELOAD = ("torch", "torch.distributed", "safetensors.torch", "omegaconf", TRAINER_MODULE,
                   "rlorch.trainer.optimizer")
"""The trainer's own imports: a per-run server imports them first and forks a trainer already
asked for before it imports the rest (:func:`_serve`)."""
ENGINE_MODULE = "rlorch.serve.server"
ENGINE_PRELOAD = ("tokenizers", "jinja2.sandbox", "aiohttp.web", "rlorch.model", "rlorch.qwen2", "rlorch.tokenizer",
                  ENGINE_MODULE, "rlorch.serve.batcher", "rlorch.serve.weight_sync")
"""A launched engine's own imports beyond the trainer's (its launched form composes no config):
imported next, before the rest of :data:`PRELOAD`."""
PRELOAD = (*TRAINER_PRELOAD, *ENGINE_PRELOAD,
           "hydra.compose", "hydra.initialize", "hydra._internal.hydra",
           "hydra._internal.config_loader_impl", "hydra.core.override_parser.overrides_parser",
           "hydra._internal.core_plugins.importlib_resources_config_source",
           "hydra._internal.core_plugins.file_config_source", "hydra._internal.core_plugins.structured_config_source",
           "hydra._internal.core_plugins.basic_launcher", "hydra._internal.core_plugins.basic_sweeper",
           "rich.console", "rich.markup", "rlorch.cli", "rlorch.config.compose", "rlorch.config.schema",
           "rlorch.config.keys")
"""Every module a child imports before it serves or trains with rlorch's own Qwen2 and a
tokenizer its files define (the CPU default), and what composing their config takes (Hydra,
OmegaConf, the CLI's error display). A module this environment lacks is skipped."""
TRANSFORMERS_PRELOAD = ("transformers", "transformers.modeling_utils", "transformers.models.auto.modeling_auto",
                        "transformers.models.auto.tokenization_auto", "transformers.models.qwen2.modeling_qwen2",
                        "transformers.models.qwen2.tokenization_qwen2")
"""What a child running transformers' model or tokenizer imports (``model.implementation``
resolving to ``hf``, LoRA, another architecture): asked for by :func:`preload_for` once the
config says so, before the first fork, so that those children share it too."""
SHARDING_PRELOAD = ("torch.distributed.fsdp", "torch.distributed.device_mesh", "torch.distributed.checkpoint",
                    "torch.distributed.checkpoint.state_dict")
"""What an FSDP2 trainer imports before its first step (several ranks, or mixed precision)."""
STAGES = ((TRAINER_PRELOAD, (TRAINER_MODULE,)), (ENGINE_PRELOAD, (TRAINER_MODULE, ENGINE_MODULE)))
"""What a per-run server imports before :data:`PRELOAD`, and which children it forks after each."""
FORKABLE = ("rlorch.cli", TRAINER_MODULE, ENGINE_MODULE)


class Forked:
    """A process forked by the fork server (a ``Popen`` look-alike)."""

    def __init__(self, pid: int, server: "ForkServer"):
        self.pid = pid
        self._server = server

    @property
    def returncode(self) -> Optional[int]:
        return self._server.exits.get(self.pid)

    def poll(self) -> Optional[int]:
        """The exit status once the fork server has reaped the process. One that has already
        died (a zombie awaiting the server's next reap, at most one 50 ms tick away) is waited
        for, so a caller that just saw it fail also sees why, as with ``Popen.poll``."""
        if self.returncode is None and _defunct(self.pid):
            try:
                self.wait(timeout=1.0)
            except subprocess.TimeoutExpired:
                pass
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(str(self.pid), timeout)
            time.sleep(0.01)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, sig)


def _defunct(pid: int) -> bool:
    try:
        stat = open(f"/proc/{pid}/stat", "rb").read()
    except OSError:
        return True
    return stat[stat.rindex(b")") + 2:stat.rindex(b")") + 3] in (b"Z", b"X")


class ForkServer:
    """The client side: a warm process asked to fork, over a pipe to this process's own
    (``address`` None) or over a connection to a shared one listening at ``address``."""

    def __init__(self, address: Optional[str] = None):
        self.process: Optional[subprocess.Popen] = None
        self._connection: Optional[socket.socket] = None
        if address is None:
            env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "PYTHONUNBUFFERED": "1"}
            self.process = subprocess.Popen([sys.executable, "-m", "rlorch.launch.forkserver"], stdin=subprocess.PIPE,
                                            stdout=subprocess.PIPE, env=env, text=True, bufsize=1,
                                            start_new_session=True)
            self._input, self._output = self.process.stdout, self.process.stdin
        else:
            self._connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                self._connection.connect(address)
            except OSError as err:
                self._connection.close()
                raise RuntimeError(f"RLORCH_FORKSERVER={address}: no fork server answers there ({err}); start one "
                                   f"with `python -m rlorch.launch.forkserver --listen {address}`, or unset "
                                   f"RLORCH_FORKSERVER") from None
            self._input = self._connection.makefile("r", encoding="utf-8")
            self._output = self._connection.makefile("w", encoding="utf-8", buffering=1)
        self._closed = False
        self.exits: dict[int, int] = {}
        self.spawned = 0
        """How many processes it was asked to fork."""
        self.forked = 0
        """How many it has forked (answered with a pid)."""
        self._pids: dict[int, int] = {}
        self._arrived = threading.Condition()
        self._next = 0
        self._lock = threading.Lock()
        threading.Thread(target=self._read, name="rlorch-forkserver", daemon=True).start()

    def alive(self) -> bool:
        """Whether the server still answers (its process runs, or the connection is open)."""
        if self.process is not None:
            return self.process.poll() is None
        return not self._closed

    def close(self) -> None:
        """Stop a private server (killed: it may still be importing); leave a shared one."""
        if self.process is not None:
            if self.process.poll() is None:
                self.process.kill()
                self.process.wait()
            self.process.stdin.close()
        elif self._connection is not None:
            try:  # the reading thread's file holds the socket open: shut it down for both sides
                self._connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._connection.close()

    def _read(self) -> None:
        try:
            for line in self._input:
                message = json.loads(line)
                with self._arrived:
                    if "exit" in message:
                        self.exits[message["exit"]] = message["status"]
                    else:
                        self._pids[message["id"]] = message["pid"]
                        self.forked += 1
                    self._arrived.notify_all()
        except (OSError, ValueError):
            pass
        with self._arrived:
            self._closed = True
            self._arrived.notify_all()

    def preload(self, modules: list[str]) -> None:
        """Have the server import ``modules`` before it forks anything asked for after this."""
        with self._lock:
            self._output.write(json.dumps({"preload": list(modules)}) + "\n")
            self._output.flush()

    def spawn(self, command: list[str], *, log: str, env: dict, cwd: str) -> Forked:
        with self._lock:
            self._next += 1
            self.spawned += 1
            ident = self._next
            self._output.write(json.dumps({"id": ident, "argv": command[2:], "module": command[2],
                                           "env": env, "cwd": cwd, "log": log}) + "\n")
            self._output.flush()
        with self._arrived:
            if not self._arrived.wait_for(lambda: ident in self._pids or not self.alive(), 120):
                raise RuntimeError("the fork server did not answer in 120 s")
            if ident not in self._pids:
                status = "closed" if self.process is None else f"exited with status {self.process.returncode}"
                raise RuntimeError(f"the fork server {status}")
            return Forked(self._pids.pop(ident), self)


_server: Optional[ForkServer] = None
_server_lock = threading.Lock()


def enabled() -> bool:
    return os.environ.get("RLORCH_FORKSERVER", "1") != "0"


def shared_address() -> Optional[str]:
    """The socket of a shared fork server to use (``RLORCH_FORKSERVER=PATH``), if one is named."""
    value = os.environ.get("RLORCH_FORKSERVER", "1")
    return None if value in ("0", "1", "") else value


def warm_up() -> None:
    """Start the fork server now (it takes seconds to import), if it will be used."""
    global _server
    if enabled():
        with _server_lock:
            if _server is None or not _server.alive():
                if _server is None:
                    atexit.register(discard)
                _server = ForkServer(shared_address())


OTHER_LAUNCH = ("conf=", "inference=", "trainer=", "inference.backend=", "trainer.backend=", "run.launcher=")
"""Overrides that may choose backends launched otherwise: :func:`warm_up_early` leaves them to
the composed config."""


def warm_up_early(overrides: list[str]) -> None:
    """Start the fork server before the config is composed, or even the runner imported, when the
    overrides keep the default preset's backends (CPU engines, FSDP trainer), which launch
    through it: its imports take the longest of the start, so every fraction of a second they
    start sooner is one off the time to the first step. Any other choice waits for the composed
    config (``rlorch.runner``)."""
    if os.environ.get("RLORCH_CONF_DIR") or any(o.lstrip("+~").startswith(OTHER_LAUNCH) for o in overrides):
        return
    warm_up()


def preload_for(modules: list[str]) -> None:
    """Ask the fork server (when one is started) to import ``modules`` too, before its next fork."""
    with _server_lock:
        server = _server
    if modules and server is not None and server.alive():
        server.preload(modules)


def running() -> bool:
    """Whether this process has a fork server started (warm or still importing)."""
    with _server_lock:
        return _server is not None and _server.alive()


def discard() -> None:
    """Stop the fork server (a shared one: close this process's connection to it) if it has
    forked nothing: when the run turns out to launch nothing
    through it, and at exit (requests still unanswered included: a run interrupted while the
    server imports), so that a server still importing does not go on for nobody. One that has
    forked processes is left to exit when this process's end closes its pipe: it reports their
    exits, and a trainer it forked watches it."""
    global _server
    with _server_lock:
        server = _server
        if server is None or server.forked:
            return
        _server = None
    server.close()


def spawn(command: list[str], *, log_path: str, env: dict) -> "Forked | subprocess.Popen":
    """Start ``command`` in its own session with stdout and stderr appended to ``log_path``."""
    forkable = (enabled() and len(command) > 2 and command[0] == sys.executable and command[1] == "-m"
                and command[2] in FORKABLE)
    if forkable:
        warm_up()
        return _server.spawn(command, log=log_path, env=env, cwd=os.getcwd())
    with open(log_path, "ab") as handle:
        return subprocess.Popen(command, stdout=handle, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=env, start_new_session=True)


# ---- the server side -------------------------------------------------------------------------

def _child(request: dict, ready: int) -> None:
    """In the forked child: become the requested ``python -m`` process, then exit. The fork
    server answers with the pid only once the child leads its own session (``ready`` closed),
    so signalling its process group right away reaches it, as with ``Popen``."""
    import faulthandler
    import runpy
    import signal

    os.setsid()
    os.close(ready)
    _set_name(request["module"])
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    fd = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    sys.stdin = open(0, closefd=False)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    # A crash in native code (a segfault in a collective, say) leaves every thread's Python stack
    # in the log rather than a bare signal number in the parent's exit status.
    faulthandler.enable(sys.stderr)
    sys.argv = [request["module"], *request["argv"][1:]]
    code = 0
    try:
        _run_module(request["module"], runpy)
    except SystemExit as done:
        code = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _run_module(name: str, runpy) -> None:
    """Run ``python -m name``. A module the fork server preloaded is already in ``sys.modules``:
    running it again through runpy would execute a second copy of it beside the first (and
    warn that it was found there); its ``main()`` entry runs the loaded one instead."""
    loaded = sys.modules.get(name)
    entry = getattr(loaded, "main", None)
    if entry is None:
        runpy.run_module(name, run_name="__main__", alter_sys=True)
        return
    sys.exit(entry())


def _set_name(module: str) -> None:
    """Name the child after its role (``top`` and ``ps -o comm`` show it): its command line is
    still the fork server's."""
    import ctypes

    name = b"rlorch-trainer" if module == "rlorch.trainer.fsdp" else b"rlorch-serve"
    try:
        ctypes.CDLL(None).prctl(15, ctypes.c_char_p(name), 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass


def preload(modules: tuple[str, ...] = PRELOAD) -> None:
    """Import ``modules`` (default :data:`PRELOAD`) and take what the imports built out of the
    garbage collector's sight (``gc.freeze``): it lives as long as every child, and a child's
    collections then neither walk it (each would take a tenth of a second) nor write to its pages
    (which the child would then copy rather than share). The collector is off while importing: what
    imports build is kept (and the little garbage they leave is frozen with it), so the
    collections they would trigger, a sixth of the import time, would find next to nothing."""
    import gc
    import importlib

    enabled = gc.isenabled()
    gc.disable()
    try:
        for module in modules:
            try:
                importlib.import_module(module)
            except ImportError:
                pass
        if "transformers" in modules:
            _build_shared_tables()
        gc.freeze()
    finally:
        if enabled:
            gc.enable()


def _build_shared_tables() -> None:
    """Build what every child's first model load would otherwise build for itself: transformers'
    table of checkpoint renamings for every architecture (about a thousand compiled patterns,
    nearly all of a small model's load), made on first use and kept for the process."""
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    except ImportError:
        return
    get_checkpoint_conversion_mapping("qwen2")


def _fork(request: dict, inherited: tuple[int, ...] = ()) -> int:
    """Fork the requested child (it closes ``inherited``: the server's own sockets) and return
    its pid once it leads its own session."""
    started, ready = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(started)
        for fd in inherited:
            os.close(fd)
        _child(request, ready)
    os.close(ready)
    os.read(started, 1)
    os.close(started)
    return pid


def _reap() -> list[tuple[int, int]]:
    """``(pid, status)`` of every child that has exited since the last call."""
    exits = []
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return exits
        if pid == 0:
            return exits
        exits.append((pid, os.waitstatus_to_exitcode(status)))


def _serve() -> None:
    """Serve this process's parent over stdin/stdout until it closes the pipe.

    The imports come in :data:`STAGES`: the trainer's first, then a launched engine's. A trainer
    or engine asked for by the end of a stage is forked then, so it loads its model on another
    core while this server goes on importing. The rest of :data:`PRELOAD` (Hydra, the CLI) waits
    for a child that needs it: in a run of the default backends none does, and importing it
    anyway would take a core from the run's first steps. Requests keep their order otherwise:
    one that asks for more imports holds back every fork asked for after it."""
    import select

    out = sys.stdout
    pending = b""

    staged = {module for _, forkable in STAGES for module in forkable}
    complete = False    # whether PRELOAD is in: only a child of another module needs all of it

    def handle(request: dict) -> bool:
        """Serve one request; False once the client is gone."""
        nonlocal complete
        if "preload" in request:
            preload(tuple(request["preload"]))
            return True
        if not complete and request["module"] not in staged:
            preload()
            complete = True
        pid = _fork(request)
        try:
            out.write(json.dumps({"id": request["id"], "pid": pid}) + "\n")
            out.flush()
        except BrokenPipeError:
            return False    # the client is gone; what was forked watches its orchestrator
        return True

    def arrived(timeout: float) -> Optional[list[dict]]:
        """The requests whose lines have arrived (None once the client closed the pipe)."""
        nonlocal pending
        ready, _, _ = select.select([0], [], [], timeout)
        if ready:
            chunk = os.read(0, 1 << 16)
            if not chunk:
                return None
            pending += chunk
        lines = pending.split(b"\n")
        pending = lines.pop()
        return [json.loads(line) for line in lines if line]

    waiting: list[dict] = []
    for modules, forkable_now in STAGES:
        preload(modules)
        requests = arrived(0)
        if requests is None:
            return
        held = False    # a request for more imports came: every fork asked for after it waits for them
        still: list[dict] = []
        for request in [*waiting, *requests]:
            held = held or "preload" in request
            if not held and request.get("module") in forkable_now:
                if not handle(request):
                    return
            else:
                still.append(request)
        waiting = still
    for request in waiting:
        if not handle(request):
            return
    while True:
        requests = arrived(0.05)
        for pid, status in _reap():
            out.write(json.dumps({"exit": pid, "status": status}) + "\n")
            out.flush()
        if requests is None:
            return
        for request in requests:
            if not handle(request):
                return


def _serve_shared(path: str, parent_pid: Optional[int]) -> None:
    """Serve every connection to the Unix socket ``path`` until SIGTERM, or until the process
    ``parent_pid`` is gone. The socket is bound before the imports, so a client may connect and
    ask at once: its requests wait in the connection until the server is warm."""
    import select
    import signal

    from rlorch.lifecycle import process_alive

    if os.path.exists(path):
        os.unlink(path)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    os.chmod(path, 0o600)
    listener.listen(64)

    def stop(*_) -> None:
        # Exits at once, imports under way or not: a SystemExit raised inside an import can be
        # swallowed by a library's broad except, leaving the server importing for a minute.
        if os.path.exists(path):
            os.unlink(path)
        os._exit(0)

    signal.signal(signal.SIGTERM, stop)
    preload()
    clients: dict[socket.socket, bytes] = {}
    owners: dict[int, socket.socket] = {}

    def send(client: socket.socket, message: dict) -> bool:
        try:
            client.sendall((json.dumps(message) + "\n").encode())
            return True
        except OSError:
            return False

    try:
        while parent_pid is None or process_alive(parent_pid):
            ready, _, _ = select.select([listener, *clients], [], [], 0.05)
            for pid, status in _reap():
                owner = owners.pop(pid, None)
                if owner in clients:
                    send(owner, {"exit": pid, "status": status})
            for sock in ready:
                if sock is listener:
                    client, _ = listener.accept()
                    clients[client] = b""
                    continue
                try:
                    chunk = sock.recv(1 << 16)
                except OSError:
                    chunk = b""
                if not chunk:
                    del clients[sock]
                    sock.close()
                    continue
                clients[sock] += chunk
                while b"\n" in clients[sock]:
                    line, clients[sock] = clients[sock].split(b"\n", 1)
                    request = json.loads(line)
                    if "preload" in request:
                        preload(tuple(request["preload"]))
                        continue
                    pid = _fork(request, (listener.fileno(), *(c.fileno() for c in clients)))
                    owners[pid] = sock
                    send(sock, {"id": request["id"], "pid": pid})
    finally:
        listener.close()
        if os.path.exists(path):
            os.unlink(path)


def main(argv: Optional[list[str]] = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m rlorch.launch.forkserver",
                                     description="A warm fork server for rlorch's processes.")
    parser.add_argument("--listen", metavar="PATH", help="serve every run started with RLORCH_FORKSERVER=PATH "
                                                         "(a Unix socket); without it, serve the parent over a pipe")
    parser.add_argument("--parent-pid", type=int, default=None, help="with --listen: exit when this process is gone")
    args = parser.parse_args(argv)
    if args.listen is None:
        _serve()
    else:
        _serve_shared(args.listen, args.parent_pid)


if __name__ == "__main__":
    main()
