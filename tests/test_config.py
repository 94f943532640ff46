"""Every shipped preset composes; every invalid setting fails naming its key; the CLI entry point works."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from rlorch.cli import app
from rlorch.config.compose import compose, presets
from rlorch.config.schema import Config, ConfigError, Correction

runner = CliRunner()


def validate(*overrides):
    result = runner.invoke(app, ["validate-config", *overrides], env={"COLUMNS": "200"})
    return result.exit_code, " ".join(result.output.split())


def test_presets_are_shipped():
    assert {"config", "sim", "sync"} <= set(presets())


@pytest.mark.parametrize("name", presets())
def test_preset_composes(name):
    config = compose([f"conf={name}"])
    assert isinstance(config, Config)
    assert config.rollout.batch_size % config.rollout.group_size == 0


@pytest.mark.parametrize("name", presets())
def test_preset_validates_on_the_cli(name):
    code, output = validate(f"conf={name}")
    assert code == 0, output
    assert "pending limit" in output
    assert "invalid config" not in output


def test_sim_preset_is_the_simulator_baseline():
    config = compose(["conf=sim"])
    assert (config.rollout.batch_size, config.rollout.group_size) == (8, 1)
    assert (config.sim.ticks, config.sim.latency) == (60, [3, 3])


def test_overrides_reach_the_typed_config():
    config = compose(["rollout.max_staleness=4", "rollout.max_concurrent=160", "inference=sim", "trainer=sim"])
    assert config.rollout.max_staleness == 4
    assert config.rollout.max_concurrent == 160
    assert config.inference.backend.value == "sim"


def test_the_fsdp_trainer_refuses_simulated_tokens():
    result = runner.invoke(app, ["validate-config", "inference=sim"])
    assert result.exit_code != 0 and "trainer" in result.output and "inference=cpu" in result.output


@pytest.mark.parametrize("override,key,fragment", [
    ("rollout.max_staleness=-1", "rollout.max_staleness", ">= 0"),
    ("rollout.batch_size=0", "rollout.batch_size", ">= 1"),
    ("rollout.max_concurrent=0", "rollout.max_concurrent", ">= 1"),
    ("rollout.queue_size=4", "rollout.queue_size", "rollout.batch_size"),
    ("rollout.enforce=eager", "rollout.enforce", "[admission, ship, strict]"),
    ("rollout.staleness=2", "rollout.staleness", "unknown key (did you mean rollout.max_staleness?)"),
    ("rollout.batch_size=many", "rollout.batch_size", "many"),
    ("trainer.correction=none", "trainer.correction", "trainer.allow_uncorrected=true"),
    ("trainer.correction=recompute", "trainer.correction", "'recompute' trains off-policy data"),
    ("conf=sync trainer.minibatches=2", "trainer.correction", "trainer.minibatches=1"),
    ("inference.parse_workers=-1", "inference.parse_workers", ">= 0"),
])
def test_invalid_setting_names_its_key(override, key, fragment):
    code, output = validate(*override.split())
    assert code != 0
    assert f"invalid config {key}:" in output
    assert fragment in output


@pytest.mark.parametrize("override,key,fragment", [
    ("inference=sglang run.gpus=1 inference.weight_transfer=distributed", "inference.weight_transfer", "NCCL"),
    ("inference=sglang run.gpus=1 run.colocate=swap", "run.colocate", "rollout.max_staleness=0"),
])
def test_a_placement_refusal_names_its_key_without_a_traceback(override, key, fragment):
    """Placement is checked after the keys compose (it needs the GPU count): its refusal reads as
    any other invalid setting's, an exit status of 2 and the key, not a Python traceback."""
    result = runner.invoke(app, ["validate-config", *override.split()], env={"COLUMNS": "200"})
    output = " ".join(result.output.split())
    assert result.exit_code == 2, (result.exception, output)
    assert f"invalid config {key}:" in output and fragment in output


@pytest.mark.parametrize("override,key", [
    ("rollout.max_staleness=-1", "rollout.max_staleness"),
    ("rollout.staleness=2", "rollout.staleness"),
    ("rollout.enforce=eager", "rollout.enforce"),
])
def test_config_error_carries_the_key(override, key):
    with pytest.raises(ConfigError) as raised:
        compose([override])
    assert raised.value.key == key


def test_invalid_yaml_names_the_file(tmp_path):
    bad = tmp_path / "broken.yaml"
    bad.write_text("rollout:\n  max_staleness: [1,\n  batch_size: 8\n")
    code, output = validate(f"conf={bad}")
    assert code != 0
    assert "invalid config conf:" in output
    assert "not valid YAML" in output


def test_missing_yaml_names_the_file(tmp_path):
    missing = tmp_path / "absent.yaml"
    code, output = validate(f"conf={missing}")
    assert code != 0
    assert "invalid config conf:" in output
    assert "file not found" in output


def test_user_yaml_extends_the_default_preset(tmp_path):
    mine = tmp_path / "mine.yaml"
    mine.write_text("rollout:\n  max_staleness: 5\n")
    config = compose([f"conf={mine}"])
    assert config.rollout.max_staleness == 5
    assert config.rollout.batch_size == compose([]).rollout.batch_size


def test_uncorrected_is_allowed_when_asked_or_synchronous():
    code, output = validate("trainer.correction=none", "trainer.allow_uncorrected=true")
    assert code == 0, output
    code, output = validate("conf=sync")
    assert code == 0, output
    sync = compose(["conf=sync"])
    assert (sync.rollout.max_staleness, sync.trainer.correction) == (0, Correction.none)
    # recompute clips against the weights each batch starts from, so minibatches need no permit.
    code, output = validate("conf=sync", "trainer.correction=recompute", "trainer.minibatches=2")
    assert code == 0, output


def test_concurrency_below_batch_warns():
    code, output = validate("rollout.max_concurrent=16")
    assert code == 0, output
    assert "warning rollout.max_concurrent (16) < rollout.batch_size (128)" in output


def test_concurrency_above_pending_limit_warns():
    code, output = validate("rollout.max_concurrent=500")
    assert code == 0, output
    assert "warning rollout.max_concurrent (500) > (S+1)*B = 384" in output
    assert "116 slots can never be used" in output


def test_default_config_has_no_warnings():
    code, output = validate()
    assert code == 0, output
    assert "warning" not in output


def test_help_lists_the_commands():
    result = runner.invoke(app, ["--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    for command in ("train", "resume", "simulate", "validate-config"):
        assert command in result.output


def _console_script(*args):
    script = Path(sys.executable).with_name("rlorch")
    command = [str(script)] if script.exists() else ["rlorch"]
    return subprocess.run([*command, *args], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "COLUMNS": "200"})


def test_console_script_entry_point():
    done = _console_script("--help")
    assert done.returncode == 0, done.stderr
    for command in ("train", "resume", "simulate", "validate-config"):
        assert command in done.stdout
    done = _console_script("validate-config", "rollout.batch_size=0")
    assert done.returncode == 2
    assert "rollout.batch_size" in done.stderr


def test_an_error_is_one_line_when_piped():
    """Piped (no terminal, 80 columns) an error still comes as one line, however long."""
    done = subprocess.run([sys.executable, "-m", "rlorch.cli", "validate-config", "rollout.batch_size=lots"],
                          capture_output=True, text=True, timeout=60, env={**os.environ, "COLUMNS": "80"})
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "rollout.batch_size" in lines[0] and "lots" in lines[0], done.stderr


def test_a_wrong_type_in_your_own_yaml_names_the_file_the_key_and_the_value(tmp_path):
    mine = tmp_path / "my.yaml"
    mine.write_text('rollout: {batch_size: "lots"}\n')
    with pytest.raises(ConfigError) as raised:
        compose([f"conf={mine}"])
    assert raised.value.key == "rollout.batch_size"
    assert str(mine) in str(raised.value) and "lots" in str(raised.value)


def test_a_task_param_typo_suggests_the_tasks_own_param():
    with pytest.raises(ConfigError) as raised:
        compose(["task.params.min_digit=2"])
    assert raised.value.key == "task.params.min_digit"
    assert "did you mean task.params.min_digits?" in str(raised.value)
    with pytest.raises(ConfigError) as raised:
        compose(["task=calculator", "task.params.max_operan=9"])
    assert "did you mean task.params.max_operand?" in str(raised.value)


def test_a_built_in_param_the_preset_does_not_list_gets_the_plus_hint():
    with pytest.raises(ConfigError) as raised:
        compose(["task=agent", "task.params.call_tokens=3"])
    assert raised.value.key == "task.params.call_tokens"
    assert "+task.params.call_tokens=VALUE" in str(raised.value) and "did you mean" not in str(raised.value)
    assert compose(["task=agent", "+task.params.call_tokens=3"]).task.params["call_tokens"] == 3


def test_a_new_param_of_your_own_task_without_plus_gets_the_plus_hint():
    with pytest.raises(ConfigError) as raised:
        compose(["task=custom", "task.name=mytasks.guess:Guess", "task.params.turns=2"])
    assert raised.value.key == "task.params.turns"
    assert "+task.params.turns=" in str(raised.value)
    assert compose(["task=custom", "task.name=mytasks.guess:Guess", "+task.params.turns=2"]).task.params == {"turns": 2}


def test_the_summary_says_how_batches_are_trained():
    _, default = validate()
    assert "fsdp / decoupled / 2" in default and "0; wrong ones unlikelihood x0.1" in default
    _, sync = validate("conf=sync")
    assert "fsdp / none / 1" in sync
    assert "trained with advantage 0" in validate("trainer.flat_advantage=zero")[1]
    _, filtered = validate("rollout.filter_groups=true", "trainer.flat_advantage=zero")
    assert "zero-variance groups │ filtered" in filtered
