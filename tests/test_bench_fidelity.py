"""scripts/bench_fidelity.py's grid: every configuration it runs is one `rlorch train` accepts."""

from __future__ import annotations

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
