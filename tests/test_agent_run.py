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


@pytest.mark.slow
def test_an_agent_failing_every_episode_fails_the_run_saying_so_whatever_the_flat_advantage(tmp_path):
    """Its groups hold no token to train: no push can move them, and batches of them would be
    steps that train nothing. They are filtered, and the guard ends the run naming the cause."""
    (tmp_path / "broken_agent.py").write_text(
        "async def run(sample, *, base_url, api_key, http_client=None):\n"
        "    raise RuntimeError('the tool server is down')\n")
    run_dir = tmp_path / "run"
    done = train(tmp_path, f"run.dir={run_dir}", "task.agent=broken_agent:run", "train.steps=50",
                 "train.max_empty_batches=2")
    said = " ".join((done.stdout + done.stderr).split())
    assert done.returncode != 0 and "most episodes ended without a model turn" in said, said[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["lost"] == 0 and summary["steps"] == 0, summary
    assert summary["agent_failures"] == summary["agent_episodes"] > 0
    assert any("the tool server is down" in error for error in summary["agent_errors"])
    assert "last error: the agent raised RuntimeError: the tool server is down" in said, said[-3000:]


def test_an_agent_that_cannot_be_loaded_is_refused_naming_the_key(tmp_path):
    (tmp_path / "not_agents.py").write_text("def run(sample):\n    return 1.0\n")
    for spec, message in [("not_agents:run", "not an async function"), ("missing_module:run", "cannot load"),
                          ("not_agents", "package.module:function")]:
        done = subprocess.run([sys.executable, "-m", "rlorch.cli", "validate-config", "task=agent", f"task.agent={spec}"],
                              cwd=tmp_path, capture_output=True, text=True, timeout=120)
        assert done.returncode != 0 and "task.agent" in done.stdout + done.stderr, spec
        assert message in done.stdout + done.stderr, spec
