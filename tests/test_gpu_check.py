"""scripts/check_gpu_colocated.py, the colocated part of the one-GPU check: rehearsed here on
the CPU, so that what it reads from a run (records, logs, the server's device) is the run's own
before a GPU's minutes are spent on it."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import check_gpu_colocated  # noqa: E402


@pytest.mark.slow
def test_the_colocated_check_rehearsed_on_the_cpu_passes_both_modes_with_their_figures(tmp_path, capsys):
    code = check_gpu_colocated.main(["--rehearse", "--timeout", "240", "--root", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0, out
    resident, swap = json.loads(out.splitlines()[-1])["colocated"]
    for result in (resident, swap):
        assert result["pass"] and result["status"] == "completed" and result["steps"] == 2 and result["lost"] == 0
        assert result["trainer_device"] == "cpu" and result["server_device"] == "cpu"
        assert result["server_dtype"] == "float32"
        for figure in ("reload_s_median", "trainer_step_s_median", "publish_s_median", "trainer_positions_per_s",
                       "trained_tokens_per_s", "startup_s"):
            assert result[figure] > 0, (result["mode"], figure)
    assert resident["release_s_median"] is None and resident["offload_s_median"] is None
    for figure in ("release_s_median", "onload_s_median", "offload_s_median"):
        assert swap[figure] is not None, figure


@pytest.mark.slow
def test_a_mode_past_its_time_limit_is_interrupted_and_still_reports_its_steps(tmp_path):
    run_dir = tmp_path / "run"
    # 20 s: past start-up on a loaded machine, far short of 5000 steps, and a solved task does not
    # end the run (the empty-batch guard waits for a million empty batches).
    code, tail = check_gpu_colocated.train_within([f"run.dir={run_dir}", "train.steps=5000", "run.progress=false",
                                                   "train.max_empty_batches=1000000", "train.stop_on_converged=false"],
                                                  timeout=20)
    assert code == 124 and "interrupted" in tail
    figures = check_gpu_colocated.figures(run_dir)
    assert figures["status"] == "interrupted" and figures["steps"] > 0 and figures["lost"] == 0
    assert figures["server_device"] == "cpu" and figures["trainer_step_s_median"] > 0
