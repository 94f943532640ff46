"""`rlorch simulate` drives the real gate: the design figures reproduce exactly, sweeps and plots work."""

import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from rlorch.cli import app
from rlorch.config.compose import compose
from rlorch.simulate import SimParams, run_gate, simulate_command
from rlorch.simulate import simulate as sweep

runner = CliRunner()
SIM = ["conf=sim"]  # B=8, group size 1, latency [3, 3], 60 ticks


def simulate(*overrides):
    result = runner.invoke(app, ["simulate", *SIM, *overrides, "--json"])
    assert result.exit_code == 0, result.output
    return [json.loads(line) for line in result.output.splitlines() if line.strip()]


def by(runs, key):
    return {run["params"][key]: run for run in runs}


def test_uniform_latency_reaches_exactly_s():
    runs = by(simulate("rollout.max_staleness=0,1,2,4", "rollout.max_concurrent=64"),
              "rollout.max_staleness")
    assert sorted(runs) == [0, 1, 2, 4]
    for S, run in runs.items():
        assert run["trained"] > 0
        assert run["max_age"] == S
        assert run["params"]["rollout.batch_size"] == 8
        assert run["params"]["sim.latency"] == [3, 3]
        assert run["trained"] % 8 == 0
        assert len(run["admissions"]) == 60
    assert runs[0]["mean_age"] == 0


def test_latency_spread_overshoots_the_bound():
    runs = by(simulate("rollout.max_staleness=1,2,4", "rollout.max_concurrent=64", "sim.latency=[1,6]"),
              "rollout.max_staleness")
    assert [runs[S]["max_age"] for S in (1, 2, 4)] == [2, 4, 7]
    for S, run in runs.items():
        assert abs(run["mean_age"] - S) < 1.0
        assert run["p99_age"] <= run["max_age"]


def test_overshoot_grows_with_latency_spread():
    narrow, wide = simulate("rollout.max_staleness=2", "rollout.max_concurrent=64", "sim.latency=[1,3],[1,12]")
    assert (narrow["params"]["sim.latency"], wide["params"]["sim.latency"]) == ([1, 3], [1, 12])
    assert narrow["max_age"] < wide["max_age"]


def test_without_staleness_term_concurrency_sets_the_age():
    runs = by(simulate(f"rollout.max_staleness={10**9}", "sim.ticks=80",
                       "rollout.max_concurrent=16,32,64,128,256"), "rollout.max_concurrent")
    assert {C: run["max_age"] for C, run in runs.items()} == {16: 1, 32: 3, 64: 7, 128: 15, 256: 31}
    assert all(run["admissions"][0] == C for C, run in runs.items())


def test_smaller_of_the_two_knobs_binds():
    runs = by(simulate("rollout.max_staleness=2", "sim.ticks=80", "rollout.max_concurrent=16,64,256"),
              "rollout.max_concurrent")
    assert {C: run["max_age"] for C, run in runs.items()} == {16: 1, 64: 2, 256: 2}


def test_resume_without_recovery_loses_the_bound():
    runs = simulate("rollout.max_staleness=2", "sim.recover_at=40", "sim.fix_recovery=false,true",
                    f"rollout.max_concurrent={10**6}")
    bad, good = (by(runs, "sim.fix_recovery")[fix] for fix in (False, True))
    assert (bad["admissions"][0], good["admissions"][0]) == (344, 24)
    assert (bad["max_age"], good["max_age"]) == (42, 2)


def test_concurrency_cap_hides_the_burst_but_not_the_age():
    (clipped,) = simulate("rollout.max_staleness=2", "sim.recover_at=40", "sim.fix_recovery=false",
                          "rollout.max_concurrent=64")
    assert clipped["admissions"][0] == 64
    assert clipped["max_age"] == 7


def test_run_gate_is_deterministic_per_seed():
    params = SimParams.from_config(compose(["conf=sim", "sim.latency=[1,6]", "rollout.max_concurrent=64"]))
    first, again = run_gate(params), run_gate(params)
    assert first == again
    other = run_gate(SimParams(**{**params.__dict__, "seed": 1}))
    assert other != first


def test_any_batch_size_composes_regardless_of_group_size():
    result = runner.invoke(app, ["simulate", "rollout.batch_size=12", "rollout.max_concurrent=36", "--json"])
    assert result.exit_code == 0, result.output
    (run,) = [json.loads(line) for line in result.output.splitlines()]
    assert run["params"]["rollout.batch_size"] == 12
    assert run["trained"] % 12 == 0
    assert run["max_age"] == 2


def test_sweep_prints_one_table_row_per_combination():
    result = runner.invoke(app, ["simulate", *SIM, "rollout.max_staleness=0,2",
                                 "rollout.max_concurrent=16,64"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    rows = [line.strip("│ ").split() for line in result.output.splitlines()
            if line.startswith("│") and line.strip("│ ")[:1].isdigit()]
    rows = [[cell for cell in row if cell != "│"] for row in rows]
    assert len(rows) == 4
    assert sorted((int(r[0]), int(r[2])) for r in rows) == [(S, C) for S in (0, 2) for C in (16, 64)]
    ages = {(int(r[0]), int(r[2])): int(r[5]) for r in rows}
    assert ages[(2, 64)] == 2 and ages[(2, 16)] == 1


def test_plot_writes_a_png(tmp_path):
    target = tmp_path / "ages.png"
    result = runner.invoke(app, ["simulate", *SIM, "rollout.max_staleness=1,4", "sim.latency=[1,6]",
                                 "--json", "--plot", str(target)])
    assert result.exit_code == 0, result.output
    data = target.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 10_000


@pytest.mark.parametrize("override,key", [
    ("rollout.bogus=1", "rollout.bogus"),
    ("rollout.max_staleness=1,-1", "rollout.max_staleness"),
    ("sim.latency=[0,3]", "sim.latency"),
    ("sim.ticks=0", "sim.ticks"),
])
def test_bad_setting_exits_naming_the_key(override, key):
    result = runner.invoke(app, ["simulate", *SIM, override, "--json"])
    assert result.exit_code == 2
    assert f"invalid config {key}:" in " ".join(result.output.split())


def _readme_simulate_example() -> list[str]:
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    command = re.search(r"`rlorch simulate (rollout\.[^`]+)`", readme).group(1).split()
    return [item for item in command if "=" in item and not item.startswith("--")]


def test_the_readme_example_shows_the_overshoot_grow_with_s():
    """The README's example sweeps S: each S must give its own row (with C = B they are all one)."""
    results = sweep(_readme_simulate_example())
    ages = [r.max_age for r in results]
    assert len(ages) == 4 and len(set(ages)) == 4, ages
    assert ages == sorted(ages)


def test_the_simulate_help_example_is_accepted():
    from typer.testing import CliRunner

    from rlorch.cli import app

    help_text = " ".join(CliRunner().invoke(app, ["simulate", "--help"], env={"COLUMNS": "300"}).output.split())
    example = re.search(r"\(e\.g\. ([^)]+\]?)\)", help_text).group(1).split()
    assert example and simulate_command(example, json_lines=True, plot=None) == 0, example
