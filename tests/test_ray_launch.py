"""run.launcher=ray: placement groups with logical GPUs, pending reports and timeouts, clean-up.

One private Ray instance (2 CPUs, 8 logical GPUs) is shared by the module: a start costs seconds.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.slow

from helpers import start_local_ray  # noqa: E402
from rlorch.config.compose import compose  # noqa: E402
from rlorch.launch.base import LaunchError  # noqa: E402
from rlorch.launch import ray as ray_launch  # noqa: E402

DUMP = "import os; print('GPUS=' + os.environ.get('CUDA_VISIBLE_DEVICES', ''), flush=True)"


def stand_in(config, *, model_path, api_key, host, port):
    """A server that prints the GPUs it sees and exits."""
    return [sys.executable, "-c", DUMP]


@pytest.fixture(scope="module")
def cluster():
    start_local_ray(num_cpus=2, num_gpus=8, include_dashboard=False, log_to_driver=False)
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    yield
    ray.shutdown()


def _gpus(log: Path) -> list[str]:
    for _ in range(200):
        lines = [l for l in log.read_text().splitlines() if l.startswith("GPUS=")] if log.exists() else []
        if lines:
            return lines[-1].removeprefix("GPUS=").split(",")
        time.sleep(0.05)
    raise AssertionError(f"{log} never said which GPUs it sees:\n{log.read_text() if log.exists() else ''}")


def _config(*overrides):
    return compose(["inference=sglang", "inference.tp_size=2", "inference.num_servers=2", "trainer=fsdp",
                    "trainer.fsdp.nproc=4", "trainer.fsdp.device=cuda", "run.gpus=8", "run.launcher=ray",
                    *overrides])


def test_servers_and_trainer_get_disjoint_gpus_from_ray(cluster, tmp_path):
    config = _config()
    launcher = ray_launch.RayLauncher(config)
    launcher.server_build = stand_in
    try:
        servers = [launcher.start_server(config, i, model_path=tmp_path, api_key="k", log_dir=tmp_path, env={})
                   for i in range(2)]
        (tmp_path / "trainer" / "workers").mkdir(parents=True)
        trainer = launcher.start_trainer([sys.executable, "-c", DUMP], env={"CUDA_VISIBLE_DEVICES": "0"},
                                         log=tmp_path / "trainer.log", workers=tmp_path / "trainer" / "workers")
        seen = [_gpus(s.log) for s in servers] + [_gpus(trainer.log)]
        assert [len(ids) for ids in seen] == [2, 2, 4]
        flat = [g for ids in seen for g in ids]
        assert len(set(flat)) == 8, seen
        for process in [*servers, trainer]:
            deadline = time.monotonic() + 30
            while launcher.returncode(process) is None and time.monotonic() < deadline:
                time.sleep(0.05)
            assert launcher.returncode(process) == 0
        assert all(s.address.rsplit(":", 1)[1].isdigit() for s in servers)
        assert (tmp_path / "probe-node-0").exists()
    finally:
        launcher.close()
    assert not [g for g in ray.util.placement_group_table().values() if g["state"] != "REMOVED"]


def test_an_impossible_request_fails_naming_it(cluster, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(ray_launch, "PENDING_REPORT_S", 0.2)
    config = _config("inference.tp_size=16", "inference.num_servers=1", "run.gpus=16", "run.placement_timeout=1")
    launcher = ray_launch.RayLauncher(config)
    try:
        with pytest.raises(LaunchError) as err:
            launcher.start_server(config, 0, model_path=tmp_path, api_key="k", log_dir=tmp_path, env={})
    finally:
        launcher.close()
    assert "placement group server-0" in str(err.value) and "run.placement_timeout=1s" in str(err.value)
    assert "{'GPU': 1.0}" in str(err.value) and "'GPU': 8.0" in str(err.value)
    pending = capsys.readouterr().err
    assert "server-0" in pending and "pending for" in pending and "GPU" in pending
    assert not [g for g in ray.util.placement_group_table().values() if g["state"] != "REMOVED"]


def test_a_trainer_node_that_cannot_see_the_run_directory_fails_the_start_naming_it(cluster, tmp_path):
    config = _config()
    launcher = ray_launch.RayLauncher(config)
    not_a_dir = tmp_path / "run"
    not_a_dir.write_text("a file where the run directory should be")
    try:
        with pytest.raises(LaunchError) as err:
            launcher.start_trainer([sys.executable, "-c", "pass"], env={}, log=tmp_path / "trainer.log",
                                   workers=not_a_dir / "trainer" / "workers")
    finally:
        launcher.close()
    assert "trainer node 0" in str(err.value) and str(not_a_dir) in str(err.value)
    assert "every node sees" in str(err.value)
