"""`rlorch train task=agent` end to end on CPU: the calculator agent through the gateway, and an
agent that fails some episodes, reported in the step records while the run goes on. These check
the plumbing, on the random tiny model (``model.path=tiny``, created at once) rather than the
preset's copy-pretrained one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import of_kind, read_metrics, trained

pytest.importorskip("openai")

SMALL = ["model.path=tiny", "rollout.batch_size=16", "rollout.group_size=4", "rollout.max_concurrent=32", "run.progress=false",
         "inference.num_servers=1", "train.steps=3", "eval.prompts=8", "train.max_empty_batches=20"]
FLAKY = '''
from rlorch.tasks.calculator_agent import solve


async def run(sample, *, base_url, api_key, http_client=None):
    if sample["index"] % 2:
        raise RuntimeError("the tool server is down")
    return await solve(sample, base_url=base_url, api_key=api_key, http_client=http_client)
'''


def train(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rlorch.cli", "train", "task=agent", *SMALL, *args],
                          cwd=tmp_path, env={**os.environ, "PYTHONUNBUFFERED": "1"}, capture_output=True, text=True,
                          timeout=300)


@pytest.mark.slow
def test_the_calculator_agent_trains_through_the_gateway(tmp_path):
    run_dir = tmp_path / "run"
    done = train(tmp_path, f"run.dir={run_dir}")
    assert done.returncode == 0, done.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["lost"] == 0 and summary["steps"] == 3
    steps = of_kind(read_metrics(run_dir), "step")
    assert steps[-1]["agent_episodes"] >= 3 * 16 and steps[-1]["agent_failures"] == 0
    assert (summary["agent_episodes"], summary["agent_failures"]) == (steps[-1]["agent_episodes"], 0)
    # The agent sets max_tokens on every call: turns that reach it are not truncations.
    assert summary["truncated_share"] == 0 and "truncated" not in done.stderr
    # Every trained rollout is one episode: a prompt, then model turns (mask 1) with the tool's
    # answer between them (mask 0).
    rollout = trained(run_dir, 1)[0]
    assert rollout["loss_mask"][0] == 0 and 1 in rollout["loss_mask"]
    assert sum(count for _, count in rollout["versions"]) == sum(rollout["loss_mask"])


@pytest.mark.slow
def test_an_agent_failing_episodes_is_reported_and_the_run_goes_on(tmp_path):
    (tmp_path / "flaky_agent.py").write_text(FLAKY)
    run_dir = tmp_path / "run"
    done = train(tmp_path, f"run.dir={run_dir}", "task.agent=flaky_agent:run")
    assert done.returncode == 0, done.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["lost"] == 0 and summary["steps"] == 3
    last = of_kind(read_metrics(run_dir), "step")[-1]
    assert 0 < last["agent_failures"] < last["agent_episodes"]
    assert any("the tool server is down" in error for error in last["agent_errors"])
    assert summary["agent_failures"] == last["agent_failures"]
    agents_line = next(line for line in done.stderr.splitlines() if line.strip().startswith("agents"))
    assert f"{last['agent_failures']} failed" in agents_line and "the tool server is down" in agents_line
    assert "| agent episodes / calls / failed / forked |" in (run_dir / "report" / "report.md").read_text()


def test_an_agent_that_cannot_be_loaded_is_refused_naming_the_key(tmp_path):
    (tmp_path / "not_agents.py").write_text("def run(sample):\n    return 1.0\n")
    for spec, message in [("not_agents:run", "not an async function"), ("missing_module:run", "cannot load"),
                          ("not_agents", "package.module:function")]:
        done = subprocess.run([sys.executable, "-m", "rlorch.cli", "validate-config", "task=agent", f"task.agent={spec}"],
                              cwd=tmp_path, capture_output=True, text=True, timeout=120)
        assert done.returncode != 0 and "task.agent" in done.stdout + done.stderr, spec
        assert message in done.stdout + done.stderr, spec
