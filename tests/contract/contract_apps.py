"""Starting the stand-in SGLang app (``sglang_stand_in.py``) for the contract tests."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from rlorch.launch.local import free_port

STAND_IN = Path(__file__).with_name("sglang_stand_in.py")
SGLANG_PIN = "0.5.23"


def require_sglang() -> None:
    if importlib.util.find_spec("sglang") is None:
        message = (f"sglang is not installed: pip install --no-deps sglang=={SGLANG_PIN} plus the light "
                   "packages in .ci/sglang-contract.txt (--no-deps)")
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(message + " (CI=true: contract tests must run)")
        pytest.skip(message)


class StandIn:
    """One running stand-in app (``sglang_stand_in.py``) on a free port."""

    def __init__(self, model_dir: Path, *args: str):
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.log = Path(os.environ.get("TMPDIR", "/tmp")) / f"sglang-stand-in-{self.port}.log"
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(Path.cwd()),
                                                                          os.environ.get("PYTHONPATH")]))}
        with open(self.log, "wb") as handle:
            self.process = subprocess.Popen([sys.executable, str(STAND_IN), "--port", str(self.port),
                                             "--model-path", str(model_dir), *args],
                                            stdout=handle, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 120
        while True:
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()     # a start that timed out must not leave the app running
                raise AssertionError("stand-in app did not start:\n" + self.log.read_text()[-3000:])
            try:
                urllib.request.urlopen(f"http://{self.address}/model_info", timeout=2).read()
                return
            except OSError:
                time.sleep(0.2)

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


async def wait_for_requests(addresses: list[str], rids: list[str], *, tokens: int = 0, timeout: float = 30) -> None:
    """Return once every rid is held by one of the stand-in apps at ``addresses`` with at least
    ``tokens`` generated (its ``/server_info``); fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        held: dict[str, int] = {}
        for address in addresses:
            url = address if "://" in address else f"http://{address}"
            info = await asyncio.to_thread(lambda: json.load(urllib.request.urlopen(f"{url}/server_info", timeout=5)))
            held.update(info["internal_states"][0]["requests"])
        if all(held.get(rid, -1) >= tokens for rid in rids):
            return
        assert time.monotonic() < deadline, f"requests {rids} not at the app with {tokens} tokens: {held}"
        await asyncio.sleep(0.01)
