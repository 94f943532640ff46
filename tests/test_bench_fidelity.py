"""scripts/bench_fidelity.py's grid: every configuration it runs is one `rlorch train` accepts."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import bench_fidelity  # noqa: E402

from rlorch.config.compose import compose  # noqa: E402
from rlorch.config.schema import ConfigError  # noqa: E402


def test_every_configuration_of_the_full_grid_composes():
    grid = bench_fidelity.configurations([1, 2, 4], ["decoupled", "tis", "none", "recompute"],
                                         list(bench_fidelity.FAMILIES))
    assert {"sync S=0", "default", "S=4 recompute", "family lora"} <= set(grid)
    for name, overrides in grid.items():
        config = compose(overrides)
        if name.startswith("S="):
            assert config.rollout.max_staleness == int(name.split()[0][2:])
            assert config.trainer.correction.value == name.split()[1]


def test_the_staleness_blind_corrections_run_off_policy_only_by_permit():
    grid = bench_fidelity.configurations([4], ["none", "recompute"], sync=False)
    for overrides in grid.values():
        assert "trainer.allow_uncorrected=true" in overrides
        with pytest.raises(ConfigError, match="trains off-policy data"):
            compose([o for o in overrides if not o.startswith("trainer.allow_uncorrected")])


def _kept_run(root: Path, name: str, seed: int, evals: list[tuple[int, float]], status: str = "converged") -> None:
    run_dir = root / bench_fidelity.run_dir_name(name, seed)
    run_dir.mkdir(parents=True)
    (run_dir / "summary.json").write_text(json.dumps({"status": status, "loop_s": 10.0}))
    (run_dir / "config.yaml").write_text("rollout:\n  batch_size: 100\n")
    (run_dir / "metrics.jsonl").write_text("".join(
        json.dumps({"kind": "eval", "step": step, "accuracy": accuracy, "time": step / 10}) + "\n"
        for step, accuracy in evals))


def test_tabulate_reads_kept_runs_back_under_their_names_sync_first(tmp_path):
    _kept_run(tmp_path, "S=4 recompute", 0, [(0, 0.0), (100, 0.2), (300, 0.9)], status="completed")
    _kept_run(tmp_path, "sync S=0", 0, [(0, 0.0), (100, 0.5), (200, 0.85)])
    _kept_run(tmp_path, "sync S=0", 1, [(0, 0.0), (100, 0.9)])
    (tmp_path / "S4_decoupled-seed0").mkdir()    # no summary: a run still going, left out
    results = bench_fidelity.tabulated(tmp_path)
    assert list(results) == ["sync S=0", "S=4 recompute"]
    assert [run.seed for run in results["sync S=0"]] == [0, 1]
    # Equal samples: sync's mean samples to 80% (20,000 and 10,000 samples).
    at = bench_fidelity.equal_samples_point(results["sync S=0"])
    assert at == 15_000
    # The recompute run's last evaluation by then is step 100's; a converged sync run that
    # stopped before it keeps its last.
    assert results["S=4 recompute"][0].accuracy_at(at) == 0.2
    assert results["sync S=0"][1].accuracy_at(at) == 0.9


def test_tabulate_of_a_folder_without_finished_runs_says_which(tmp_path):
    with pytest.raises(SystemExit, match=str(tmp_path)):
        bench_fidelity.tabulated(tmp_path)
