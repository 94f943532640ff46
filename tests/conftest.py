"""Shared fixtures: one temporary RLORCH_HOME for the session, so the tiny default model is
created once (a few seconds) and every subprocess a test starts finds it there; and one shared
fork server for the session (``RLORCH_FORKSERVER``), so the runs the tests start, in this process
or as ``rlorch`` subprocesses, fork their engines and trainers warm instead of each importing
torch and transformers again."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

import pytest


@pytest.fixture(scope="session", autouse=True)
def rlorch_home(tmp_path_factory):
    home = tmp_path_factory.getbasetemp() / "rlorch-home"
    previous = os.environ.get("RLORCH_HOME")
    os.environ["RLORCH_HOME"] = str(home)
    yield home
    if previous is None:
        os.environ.pop("RLORCH_HOME", None)
    else:
        os.environ["RLORCH_HOME"] = previous


@pytest.fixture(scope="session", autouse=True)
def shared_forkserver(rlorch_home):
    if os.environ.get("RLORCH_FORKSERVER", "1") != "1":
        yield None  # set by whoever runs the tests: off, or a server of their own
        return
    # A short path: a Unix socket's path is limited to about 100 bytes.
    path = os.path.join(tempfile.mkdtemp(prefix="rlorch-fs-"), "socket")
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "PYTHONUNBUFFERED": "1"}
    server = subprocess.Popen([sys.executable, "-m", "rlorch.launch.forkserver", "--listen", path,
                               "--parent-pid", str(os.getpid())], env=env, start_new_session=True,
                              stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while not os.path.exists(path):  # bound before its imports: a client may then connect at once
        assert server.poll() is None and time.monotonic() < deadline, "the shared fork server did not start"
        time.sleep(0.02)
    os.environ["RLORCH_FORKSERVER"] = path
    try:
        yield path
    finally:
        os.environ.pop("RLORCH_FORKSERVER", None)
        server.terminate()
        server.wait(30)


@pytest.fixture(scope="session")
def model_dir(rlorch_home):
    from rlorch.model import ensure_default_model

    return ensure_default_model()


@pytest.fixture(scope="session")
def perturbed_dir(model_dir, tmp_path_factory):
    """A second checkpoint of the same architecture with different weights."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    torch.manual_seed(1)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.5)
    target = tmp_path_factory.mktemp("perturbed")
    model.save_pretrained(target)
    return target


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which reads the groups off the marks
def pytest_collection_modifyitems(config, items):
    """Under xdist (``--dist loadgroup``) tests spread one by one over the workers, except that
    the cluster tests (each a Ray cluster or a fleet of its own, minutes on 2 cores) run one after
    another on one worker, and a module's tests sharing a module-scoped fixture (a served model,
    a Ray cluster, an SGLang app) stay on one worker, so it is built once."""
    for item in items:
        if item.get_closest_marker("cluster") is not None:
            item.add_marker(pytest.mark.xdist_group("cluster"))
            continue
        info = getattr(item, "_fixtureinfo", None)
        definitions = info.name2fixturedefs.values() if info is not None else ()
        if any(defs and defs[-1].scope == "module" for defs in definitions):
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))


@pytest.fixture
def one_rank():
    """A process group of one rank (gloo) for the test's duration: FSDP2 and the trainer's
    collectives run in the test's own process."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
