"""What an operator sees and does: progress outside a terminal, the end-of-run report, the run
report's pictures, resume forms, checkpoint pruning, config refusals with suggestions, loggers.
All runs use the sim backends (``conf=sim``)."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

import helpers
from helpers import of_kind, read_metrics
from rlorch.cli import app
from rlorch.config.compose import compose
from rlorch.config.schema import ConfigError
from rlorch.orchestrator.idle import IdleClock, IdleShares
from rlorch.reporting.report import HEIGHT, IMAGES, WIDTH
from rlorch.rundir.targets import locate_checkpoint
from rlorch.runner import resume_training, run_training

FAST = ["inference.sim.latency=[0.005,0.005]", "trainer.sim.step_time=0.01"]


def train(run_dir: Path, *overrides: str) -> tuple[int, dict, list[dict]]:
    """A fast sim run with its progress lines on: exit code, summary and every record."""
    code, summary, _ = helpers.train(run_dir, *FAST, *overrides, progress=True)
    return code, summary, read_metrics(run_dir)


# progress and the end-of-run report --------------------------------------------------------------
def test_outside_a_terminal_phases_plain_lines_and_the_report_are_printed(tmp_path, capsys):
    code, summary, _ = train(tmp_path / "run", "train.steps=12", "run.log_every=5", "run.report=false")
    assert not (tmp_path / "run" / "report").exists()      # run.report=false
    err = capsys.readouterr().err
    assert code == 0
    assert "starting 1 sim engine…" in err and "engines ready in" in err and "trainer ready in" in err
    lines = [line for line in err.splitlines() if line.startswith("step=")]
    assert [line.split()[0] for line in lines] == ["step=5/12", "step=10/12", "step=12/12"]
    for field in ("reward=", "eval_acc=", "age_max=", "age_p99=", "rollouts/s=", "tokens/s=", "in_flight=", "queue="):
        assert all(field in line for line in lines), field
    for heading in ("reward ", "eval acc ", "head age ", "throughput ", "trainer waited for a batch",
                    "engines paused or idle", "lost 0"):
        assert heading in err, heading
    assert "\x1b[" not in err


def test_progress_off_prints_no_step_lines(tmp_path, capsys):
    train(tmp_path / "run", "train.steps=6", "run.log_every=1", "run.progress=false", "run.report=false")
    err = capsys.readouterr().err
    assert not [line for line in err.splitlines() if line.startswith("step=")]
    assert "engines ready in" in err and "head age " in err


def test_summary_holds_the_report_figures_and_every_step_its_idle_shares(tmp_path):
    code, summary, records = train(tmp_path / "run", "train.steps=10", "run.report=false")
    assert code == 0
    steps = of_kind(records, "step")
    assert summary["reward_mean_first"] == steps[0]["reward_mean"]
    assert summary["reward_mean_last"] == steps[-1]["reward_mean"]
    assert summary["age_max"] == max(r["age_max"] for r in steps)
    assert summary["rollouts_per_s"] > 0 and summary["tokens_per_s"] > 0
    assert set(summary["startup_phases"]) == {"engines", "trainer"} and summary["startup_s"] >= 0
    for record in steps:
        assert 0 <= record["trainer_idle"] <= 1 and 0 <= record["engine_idle"] <= 1
        assert sum(record["age_counts"]) == record["rollouts"]
    assert 0 <= summary["trainer_idle"] <= 1 and 0 <= summary["engine_idle"] <= 1


def test_idle_shares_follow_the_bottleneck(tmp_path):
    """A slow trainer leaves the engines waiting on the gate; slow engines leave the trainer waiting."""
    _, slow_trainer, _ = train(tmp_path / "trainer", "train.steps=8", "run.report=false", "eval.enabled=false",
                               "trainer.sim.step_time=0.15", "inference.sim.latency=[0.002,0.002]")
    _, slow_engines, _ = train(tmp_path / "engines", "train.steps=8", "run.report=false", "eval.enabled=false",
                               "trainer.sim.step_time=0.002", "inference.sim.latency=[0.1,0.1]")
    assert slow_trainer["engine_idle"] > 0.5 > slow_trainer["trainer_idle"]
    assert slow_engines["trainer_idle"] > 0.5 > slow_engines["engine_idle"]


def test_idle_clock_counts_overlapping_causes_once():
    now = [0.0]
    clock = IdleClock(now=lambda: now[0])
    shares = IdleShares(trainer=clock, engines=IdleClock(now=lambda: now[0]), now=lambda: now[0])
    clock.set("no_work", True)
    now[0] = 1.0
    clock.set("reload", True)
    now[0] = 2.0
    clock.set("no_work", False)
    now[0] = 3.0
    clock.set("reload", False)
    now[0] = 4.0
    assert clock.total() == 3.0
    assert shares.interval() == {"trainer_idle": 0.75, "engine_idle": 0.0}


# the run report ----------------------------------------------------------------------------------
def test_train_writes_the_report_and_rlorch_report_rewrites_it(tmp_path):
    from PIL import Image

    run_dir = tmp_path / "run"
    code, _, _ = train(run_dir, "train.steps=8")
    assert code == 0
    report = run_dir / "report"
    for name in IMAGES:
        with Image.open(report / name) as image:
            image.load()
            assert image.format == "PNG" and image.size == (WIDTH, HEIGHT), name
        (report / name).unlink()
    text = (report / "report.md").read_text()
    assert all(f"]({name})" in text for name in IMAGES) and "| status | completed |" in text
    result = CliRunner().invoke(app, ["report", str(run_dir)])
    assert result.exit_code == 0, result.output
    assert all((report / name).stat().st_size > 1000 for name in IMAGES)


def test_report_of_a_directory_without_metrics_is_refused(tmp_path):
    result = CliRunner().invoke(app, ["report", str(tmp_path)])
    assert result.exit_code == 2 and "metrics.jsonl" in result.output


# resume forms and pruning ------------------------------------------------------------------------
def checkpoints(run_dir: Path) -> list[str]:
    return sorted(p.name for p in (run_dir / "checkpoints").iterdir())


def test_full_checkpoints_are_pruned_to_the_newest_k_and_every_m(tmp_path):
    keep = ["train.steps=25", "trainer.checkpoint_every=5", "run.report=false", "eval.enabled=false"]
    train(tmp_path / "k", *keep, "trainer.keep_checkpoints=2")
    assert checkpoints(tmp_path / "k") == ["step_000020", "step_000025"]
    train(tmp_path / "m", *keep, "trainer.keep_checkpoints=1", "trainer.keep_checkpoints_every=10")
    assert checkpoints(tmp_path / "m") == ["step_000010", "step_000020", "step_000025"]
    train(tmp_path / "all", *keep, "trainer.keep_checkpoints=0")
    assert len(checkpoints(tmp_path / "all")) == 5


def test_resume_forms_a_run_dir_an_unpadded_step_and_a_finished_run(tmp_path, capsys):
    run_dir = tmp_path / "run"
    train(run_dir, "train.steps=10", "trainer.checkpoint_every=5", "run.report=false", "eval.enabled=false")
    assert locate_checkpoint(run_dir) == run_dir / "checkpoints" / "step_000010"
    assert locate_checkpoint(run_dir / "checkpoints" / "step_5") == run_dir / "checkpoints" / "step_000005"

    capsys.readouterr()
    before = {p: p.stat().st_mtime_ns for p in run_dir.rglob("*")}
    assert resume_training(str(run_dir), []) == 0
    assert "is finished" in capsys.readouterr().err
    assert resume_training(str(run_dir), ["train.stepz=14"]) == 2
    assert "did you mean train.steps?" in " ".join(capsys.readouterr().err.split())
    assert {p: p.stat().st_mtime_ns for p in run_dir.rglob("*")} == before

    assert resume_training(str(run_dir), ["train.steps=14"]) == 0
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 14 and summary["lost"] == 0


def test_resume_of_a_run_without_a_checkpoint_names_the_problem(tmp_path):
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "config.yaml").write_text("{}\n")
    with pytest.raises(ConfigError, match="no complete checkpoint"):
        locate_checkpoint(tmp_path)


def test_a_run_that_ended_before_its_first_checkpoint_is_started_again_in_its_directory(tmp_path, capsys):
    """Killed after some steps but before a checkpoint, a run has nothing to resume: resume says
    so and names the command that starts it again, and that command moves the old files aside
    (kept) rather than answering "continue it with rlorch resume"."""
    import shutil

    run_dir = tmp_path / "run"
    train(run_dir, "train.steps=4", "run.report=false")
    shutil.rmtree(run_dir / "checkpoints" / "step_000004")    # as a kill before the checkpoint leaves it
    capsys.readouterr()
    assert resume_training(str(run_dir), []) == 2
    said = " ".join(capsys.readouterr().err.split())
    assert "nothing to resume" in said and f"rlorch train run.dir={run_dir}" in said, said
    code, summary, _ = train(run_dir, "train.steps=3", "run.report=false")
    assert code == 0 and summary["status"] == "completed" and summary["steps"] == 3
    (aside,) = run_dir.glob("no-checkpoint-*")
    assert (aside / "config.yaml").is_file() and len(list((aside / "rollouts").glob("step_*"))) == 4
    assert list((aside / "checkpoints").iterdir()) == []
    code, _, _ = train(run_dir, "train.steps=3", "run.report=false")
    assert code == 2, "a run with a checkpoint to resume is not set aside"


def test_a_resume_that_shrinks_the_batch_says_what_it_does_to_the_carried_rollouts_age(tmp_path, capsys):
    run_dir = tmp_path / "run"
    train(run_dir, "train.steps=6", "trainer.checkpoint_every=3", "rollout.max_staleness=2", "run.report=false",
          "rollout.max_concurrent=1000", "inference.sim.latency=[0.001,0.001]", "trainer.sim.step_time=0.05")
    checkpoint = str(run_dir / "checkpoints" / "step_000003")
    carried = sum(len(g) for g in json.loads((Path(checkpoint) / "orchestrator.json").read_text())["untrained"])
    assert carried > 2 * 3, "the checkpoint carries more than three batches of 2"
    capsys.readouterr()
    assert resume_training(checkpoint, ["train.steps=9", "rollout.batch_size=2", "run.report=false"]) == 0
    said = " ".join(capsys.readouterr().err.split())
    assert f"warning the checkpoint carries {carried} untrained rollouts" in said, said
    assert "passing rollout.max_staleness=2" in said
    assert resume_training(str(run_dir / "checkpoints" / "step_000006"), ["train.steps=12", "run.report=false"]) == 0
    assert "untrained rollouts" not in capsys.readouterr().err


@pytest.mark.parametrize("override, key", [("model.lora.rank=16", "model.lora.rank"),
                                           ("model.path=/elsewhere", "model.path"),
                                           ("model.lora.target_modules=[q_proj]", "model.lora.target_modules")])
def test_a_resume_refuses_an_override_the_trainer_states_shapes_depend_on(tmp_path, capsys, override, key):
    """The trainer would fail loading the checkpoint after the engines started, and the changed
    config.yaml would fail the next plain resume too: refused first, nothing changed."""
    run_dir = tmp_path / "run"
    train(run_dir, "train.steps=4", "trainer.checkpoint_every=2", "run.report=false")
    config = (run_dir / "config.yaml").read_text()
    capsys.readouterr()
    assert resume_training(str(run_dir), ["train.steps=6", override]) == 2
    said = " ".join(capsys.readouterr().err.split())
    assert f"cannot resume {key}: the checkpoint's trainer state is shaped by {key}=" in said, said
    assert (run_dir / "config.yaml").read_text() == config and not list(run_dir.glob("config.before-resume-*"))
    assert resume_training(str(run_dir), ["train.steps=6", "model.path=tiny"]) == 0, "empty is tiny"


@pytest.mark.parametrize("damage, words", [
    ("", "run.dir: {config} is empty or not a mapping"),
    ("run: [unclosed\n", "run.dir: {config} is not valid YAML"),
    ("rollout:\n  max_stallness: 2", "rollout.max_stallness: {config}: Key 'max_stallness' not in"),
    ("rollout:\n  batch_size: abc", "rollout.batch_size: {config}: Value 'abc'"),
    ("rollout:\n  max_staleness: -3", "rollout.max_staleness: {config}: must be >= 0"),
])
def test_a_resume_refuses_a_damaged_config_yaml_naming_it_and_changes_nothing(tmp_path, capsys, damage, words):
    """An empty config.yaml would otherwise resume on the schema's defaults (not the run's batch,
    group or tokens), and a broken one end in a traceback: each is refused, naming the file."""
    run_dir = tmp_path / "run"
    train(run_dir, "train.steps=6", "trainer.checkpoint_every=3", "run.report=false")
    config = run_dir / "config.yaml"
    if damage.startswith("rollout:"):   # a key of the run's own config: added, or its value replaced
        key, value = damage.split("\n  ")[1].split(": ")
        text = config.read_text()
        damage = (re.sub(rf"(?m)^(  {key}:).*$", rf"\1 {value}", text, count=1) if f"\n  {key}:" in text
                  else text.replace("rollout:\n", f"rollout:\n  {key}: {value}\n", 1))
    config.write_text(damage)
    listing = sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*"))
    capsys.readouterr()
    assert resume_training(str(run_dir), ["train.steps=9"]) == 2
    said = " ".join(capsys.readouterr().err.split())
    assert "cannot resume " + words.format(config=config) in said and "nothing was changed" in said, said
    assert sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*")) == listing
    assert config.read_text() == damage


# config ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("override, key, hint", [
    ("+rollout.max_stalenes=7", "rollout.max_stalenes", "did you mean rollout.max_staleness?"),
    ("rollout.max_stalenes=7", "rollout.max_stalenes", "did you mean rollout.max_staleness?"),
    ("+foo.bar=1", "foo.bar", "unknown key"),
    ("++trainer.fsdp.nprocs=2", "trainer.fsdp.nprocs", "did you mean trainer.fsdp.nproc?"),
    ("staleness=3", "staleness", "did you mean rollout.max_staleness?"),
    ("inference.latency=[1,2]", "inference.latency", "did you mean inference.sim.latency?"),
    ("trainer.nproc=2", "trainer.nproc", "did you mean trainer.fsdp.nproc?"),
    ("trainer.keep=2", "trainer.keep", "did you mean trainer.keep_weight_versions?"),
    ("eval.poll_interval=1", "eval.poll_interval", "did you mean watcher.poll_interval?"),
])
def test_unknown_keys_are_named_with_the_closest_valid_one(override, key, hint):
    with pytest.raises(ConfigError) as caught:
        compose(["conf=sim", override])
    assert caught.value.key == key and hint in str(caught.value)


def test_free_form_task_params_and_config_groups_still_compose():
    config = compose(["task=custom", "task.name=rlorch.tasks.digits:Reverse", "+task.params.turns=2",
                      "inference=sim", "trainer=sim"])
    assert config.task.params == {"turns": 2}


def test_a_typo_in_a_user_preset_names_the_key_and_the_file(tmp_path):
    preset = tmp_path / "mine.yaml"
    preset.write_text("rollout:\n  batch_size: 32\n  max_stalenes: 3\n")
    with pytest.raises(ConfigError) as caught:
        compose([f"conf={preset}"])
    assert caught.value.key == "rollout.max_stalenes"
    assert "mine.yaml" in str(caught.value) and "rollout.max_staleness" in str(caught.value)


def test_validate_config_show_prints_the_whole_resolved_config_as_yaml():
    import yaml

    result = CliRunner().invoke(app, ["validate-config", "--show", "conf=sim", "rollout.max_staleness=3"])
    assert result.exit_code == 0
    shown = yaml.safe_load(result.stdout)
    assert shown["rollout"]["max_staleness"] == 3 and shown["inference"]["backend"] == "sim"
    assert set(shown) == {"run", "rollout", "train", "eval", "inference", "trainer", "model", "task", "data",
                          "watcher", "metrics", "sim"}


def test_version_flag():
    result = CliRunner().invoke(app, ["--version"])
    assert result.exit_code == 0 and result.stdout.startswith("rlorch ")


def test_train_prints_the_warnings_validate_config_gives(tmp_path, capsys):
    train(tmp_path / "run", "train.steps=2", "rollout.max_concurrent=100", "run.report=false", "eval.enabled=false")
    assert "rollout.max_concurrent (100) > (S+1)*B = 24" in capsys.readouterr().err


@pytest.mark.parametrize("override, key", [
    ("rollout.enforce=admission,ship,strict", "rollout.enforce"),
    ("inference=sim", "inference"),
    ("sim.latency=[6,1]", "sim.latency"),
    ("sim.latncy=[1,2]", "sim.latncy"),
])
def test_simulate_refuses_keys_it_ignores_and_checks_its_ranges(override, key):
    result = CliRunner().invoke(app, ["simulate", override])
    assert result.exit_code == 2
    assert f"invalid config {key}:" in " ".join(result.output.split())


# loggers --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("key", ["tensorboard", "wandb"])
def test_a_missing_logger_package_is_a_config_error_naming_key_and_package(monkeypatch, key):
    monkeypatch.setitem(sys.modules, key, None)
    with pytest.raises(ConfigError) as caught:
        compose(["conf=sim", f"metrics.{key}=true"])
    assert caught.value.key == f"metrics.{key}" and f"pip install {key}" in str(caught.value)


@pytest.mark.slow
def test_tensorboard_and_wandb_offline_receive_the_step_records(tmp_path, monkeypatch):
    pytest.importorskip("tensorboard")
    pytest.importorskip("wandb")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    import wandb

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    logged, init = [], wandb.init

    def spying_init(*args, **kwargs):
        run = init(*args, **kwargs)
        log = run.log
        monkeypatch.setattr(run, "log", lambda values, step=None, **kw: (
            logged.append(step) if "reward_mean" in values else None, log(values, step=step, **kw))[1])
        return run

    monkeypatch.setattr(wandb, "init", spying_init)
    run_dir = tmp_path / "run"
    code, _, _ = train(run_dir, "train.steps=6", "run.report=false", "metrics.tensorboard=true",
                       "metrics.wandb=true", "metrics.wandb_project=rlorch-test")
    assert code == 0
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("reward_mean")] == [1, 2, 3, 4, 5, 6]
    assert "eval/accuracy" in events.Tags()["scalars"]
    offline = list((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(offline) == 1 and offline[0].stat().st_size > 0
    assert logged == [1, 2, 3, 4, 5, 6], logged       # each step's figures went to the W&B run


def test_in_a_terminal_the_live_display_leaves_its_last_state_on_screen():
    import io

    from rich.console import Console

    from rlorch.reporting.progress import LiveProgress, progress_logger

    screen = io.StringIO()
    console = Console(file=screen, force_terminal=True, width=160)
    view = progress_logger(compose(["conf=sim", "train.steps=2"]), console)
    assert isinstance(view, LiveProgress)
    view.log({"kind": "start", "time": 0.0, "version": 0})
    view.log({"kind": "eval", "time": 0.5, "step": 0, "accuracy": 0.25})
    for step in (1, 2):
        view.log({"kind": "step", "time": float(step), "step": step, "reward_mean": 0.5 * step, "age_max": 1,
                  "age_p99": 1.0, "rollouts": 8, "tokens": 24, "in_flight": 4, "out_queue": 3})
    view.close()
    last = screen.getvalue().rsplit("step", 1)[-1]
    for text in ("2/2", "1.000", "25.0%@0", "8.0", "24.0"):
        assert text in last, text


@pytest.mark.parametrize("width", [80, 40])
def test_a_narrow_terminal_gets_the_live_display_in_rows_that_fit_with_no_name_or_value_cut(width):
    import io

    from rich.console import Console

    from rlorch.reporting.progress import RunView, live_tables

    view = RunView(300)
    view.log({"kind": "start", "time": 0.0, "version": 0})
    view.log({"kind": "eval", "time": 0.5, "step": 0, "accuracy": 0.25})
    view.log({"kind": "step", "time": 1.0, "step": 120, "reward_mean": 0.5, "age_max": 2, "age_p99": 2.0,
              "rollouts": 2747, "tokens": 8149, "in_flight": 130, "out_queue": 3, "truncated_share": 0.5})
    fields = view.fields()
    screen = io.StringIO()
    Console(file=screen, width=width).print(live_tables(fields, width))
    lines = screen.getvalue().splitlines()
    assert all(len(text) <= width for text in lines) and "…" not in screen.getvalue()
    words = screen.getvalue().split()
    assert all(key in words for key in fields) and all(value in words for value in fields.values())


def test_versions_that_went_by_disk_under_distributed_show_in_the_live_line_and_the_end_report():
    from rlorch.reporting.progress import RunView, report_lines

    view = RunView(10)
    view.log({"kind": "start", "time": 0.0, "version": 0})
    view.log({"kind": "step", "step": 1, "time": 1.0, "transfer_fallbacks": 0})
    assert "by_disk" not in view.fields()
    view.log({"kind": "step", "step": 2, "time": 2.0, "transfer_fallbacks": 2})
    assert view.fields()["by_disk"] == "2"
    summary = {"admitted": 8, "trained": 8, "filtered": 0, "dropped_stale": 0, "persisted_untrained": 0, "lost": 0}
    assert not any("went by disk" in text for text in report_lines({**summary, "transfer_fallbacks": 0}))
    assert any("2 of 3 loaded version(s) went by disk" in text and "inference.weight_transfer=distributed" in text
               for text in report_lines({**summary, "transfer_fallbacks": 2, "reloads": 3}))



def test_the_end_report_of_a_converged_run_says_what_ended_it():
    from rlorch.reporting.progress import report_lines

    summary = {"admitted": 8, "trained": 8, "filtered": 0, "dropped_stale": 0, "persisted_untrained": 0, "lost": 0}
    why = "held-out accuracy 100.0% at step 250, 100.0% at step 275, 98.0% at step 300: ..."
    assert [text for text in report_lines({**summary, "status": "converged", "reason": why})
            if text.startswith("converged")] == [f"converged   {why}"]
    assert not any(text.startswith("converged") for text in report_lines({**summary, "status": "completed"}))


def test_a_pending_scale_request_shows_in_the_live_line_between_steps_and_a_dropped_one_in_the_end_report():
    from rlorch.reporting.progress import RunView, report_lines

    view = RunView(10)
    view.log({"kind": "start", "time": 0.0, "version": 0})
    view.log({"kind": "step", "step": 1, "time": 1.0, "scale_pending": None})
    assert "scale_pending" not in view.fields()
    pending = {"requested": 3, "servers": 1, "waiting_s": 4.0, "waiting_for": "placement group server-1"}
    view.log({"kind": "periodic", "engines_scale_pending": pending})
    assert view.fields()["scale_pending"] == "1/3@4s"
    view.log({"kind": "step", "step": 2, "time": 2.0, "scale_pending": {**pending, "waiting_s": 12.4}})
    assert view.fields()["scale_pending"] == "1/3@12s"
    view.log({"kind": "step", "step": 3, "time": 3.0, "scale_pending": None})
    assert "scale_pending" not in view.fields()
    summary = {"admitted": 8, "trained": 8, "filtered": 0, "dropped_stale": 0, "persisted_untrained": 0, "lost": 0}
    assert not any(text.startswith("scale") for text in report_lines({**summary, "scale_dropped": 0}))
    [line] = [text for text in report_lines({**summary, "scale_dropped": 1, "scale_pending": pending})
              if text.startswith("scale")]
    assert "1 request(s) dropped" in line and "run.placement_timeout" in line
    assert "inference.num_servers=3 still pending" in line and "placement group server-1" in line


# the run directory: what is a run, who holds it ------------------------------------------------------
def test_resume_takes_the_lock_before_it_reads_anything(tmp_path, capsys):
    """A run still going prunes its checkpoints: a resume beside it is refused on the lock,
    naming the holder, before it reads a checkpoint the holder may be deleting."""
    from rlorch.launch.runlock import RunLock

    run_dir = tmp_path / "run"
    train(run_dir, "train.steps=10", "trainer.checkpoint_every=5", "run.report=false", "eval.enabled=false")
    for state in (run_dir / "checkpoints").glob("step_*/orchestrator.json"):
        state.unlink()    # what pruning by the holder looks like mid-read
    capsys.readouterr()
    with RunLock(run_dir).acquire():
        assert resume_training(str(run_dir), ["train.steps=14"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"in use by process {os.getpid()}" in err, err


def test_a_directory_without_rlorchs_files_is_not_a_run(tmp_path, capsys):
    notes = tmp_path / "ne"
    notes.mkdir()
    (notes / "notes.txt").write_text("mine\n")
    config = compose(["conf=sim", f"run.dir={notes}", *FAST, "train.steps=2"])
    assert run_training(config, []) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "not an rlorch run" in err and "already holds a run" not in err and "resume" not in err, err
    assert resume_training(str(notes), []) == 2
    assert "not an rlorch run directory" in " ".join(capsys.readouterr().err.split())
    assert sorted(p.name for p in notes.iterdir()) == ["notes.txt"]


def test_resume_takes_a_bare_run_dir_and_names_a_path_that_does_not_exist(tmp_path):
    run_dir = tmp_path / "run"
    train(run_dir, "train.steps=5", "trainer.checkpoint_every=5", "run.report=false", "eval.enabled=false")
    runner = CliRunner()
    done = runner.invoke(app, ["resume", str(run_dir)], env={"COLUMNS": "200"})
    assert done.exit_code == 0 and "is finished" in done.output, done.output
    done = runner.invoke(app, ["resume", f"checkpoint={tmp_path / 'nonexistent'}"], env={"COLUMNS": "200"})
    assert done.exit_code == 2 and "does not exist" in done.output, done.output


# the report --------------------------------------------------------------------------------------------
def test_the_report_writes_accuracy_in_percent_and_covers_every_life_of_a_resumed_run(tmp_path):
    run_dir = tmp_path / "run"
    train(run_dir, "train.steps=10", "trainer.checkpoint_every=5", "run.report=false", "eval.every=5")
    assert resume_training(str(run_dir), ["train.steps=14", "run.report=true"]) == 0
    text = (run_dir / "report" / "report.md").read_text()
    steps = of_kind(read_metrics(run_dir), "step")
    assert "| steps | 14 |" in text, text
    assert f"| reward first -> last | {steps[0]['reward_mean']:.4g} -> {steps[-1]['reward_mean']:.4g} |" in text, text
    assert "| eval accuracy first -> last | 0.0% -> 0.0% |" in text, text
    assert "(last of 2 lives)" in text


def test_a_resume_moves_the_abandoned_steps_metrics_lines_aside_so_each_step_has_one(tmp_path):
    """A resume at checkpoint 5 of a run that went on to step 12 (as a kill at step 12 leaves it,
    with a torn last line): metrics.jsonl and trainer/metrics.jsonl keep one line a step, the
    trajectory's, and the abandoned lines move beside them, none lost."""
    run_dir = tmp_path / "run"
    train(run_dir, "train.steps=12", "trainer.checkpoint_every=5", "run.report=false", "eval.every=5")
    logs = (run_dir / "metrics.jsonl", run_dir / "trainer" / "metrics.jsonl")
    before = {log: log.read_text() for log in logs}
    with logs[0].open("a") as torn:
        torn.write('{"kind": "step", "step": 13, "rew')
    assert resume_training(str(run_dir / "checkpoints" / "step_000005"), ["train.steps=12", "run.report=true"]) == 0
    for log in logs:
        records = [json.loads(line) for line in log.read_text().splitlines()]
        steps = [r["step"] for r in records if r.get("kind", "step") == "step"]
        assert steps == list(range(1, 13)), (log, steps)
        (aside,) = log.parent.glob(f"{log.stem}.superseded-*.jsonl")
        moved = aside.read_text().splitlines()
        assert [json.loads(line).get("step") for line in moved if line.endswith("}")][0] == 6
        assert all(line in moved for line in before[log].splitlines() if line not in log.read_text().splitlines())
        if log == logs[0]:
            assert moved[-1] == '{"kind": "step", "step": 13, "rew', "the torn line is moved, not fused"
    evals = [r["step"] for r in of_kind(read_metrics(run_dir), "eval")]
    assert evals == sorted(evals) and evals.count(10) == 1, evals   # the resume evaluates its start again
    assert "not read" not in (run_dir / "report" / "report.md").read_text()


def test_the_cut_keeps_a_late_evaluation_of_a_kept_step_and_moves_the_rest_in_order(tmp_path):
    from rlorch.rundir.resume import cut_log

    records = [{"kind": "start"}, {"kind": "eval", "step": 0}, {"kind": "step", "step": 1}, {"kind": "periodic"},
               {"kind": "step", "step": 2}, {"kind": "step", "step": 3}, {"kind": "eval", "step": 2},
               {"kind": "periodic"}, {"kind": "step", "step": 4}]
    log = tmp_path / "metrics.jsonl"
    log.write_text("".join(json.dumps(r) + "\n" for r in records) + '{"kind": "st')
    cut_log(log, 2, tmp_path / "aside.jsonl")
    assert [json.loads(line) for line in log.read_text().splitlines()] == records[:5] + [records[6]]
    assert (tmp_path / "aside.jsonl").read_text().splitlines() == [
        json.dumps(records[5]), json.dumps(records[7]), json.dumps(records[8]), '{"kind": "st']
    cut_log(log, 2, tmp_path / "again.jsonl")
    assert not (tmp_path / "again.jsonl").exists(), "nothing past step 2 is left to move"


def test_step_costs_leaves_out_the_interval_across_a_resume(tmp_path):
    """Each life's clock starts at 0: the interval from the last step before a resume to the
    first after it would be negative and pull the mean down."""
    import subprocess

    run_dir = tmp_path / "run"
    train(run_dir, "train.steps=12", "trainer.checkpoint_every=6", "run.report=false")
    assert resume_training(str(run_dir / "checkpoints" / "step_000006"), ["train.steps=14", "run.report=false"]) == 0
    script = Path(__file__).resolve().parents[1] / "scripts" / "step_costs.py"
    done = subprocess.run([sys.executable, str(script), str(run_dir), "--skip", "0"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert "12 step intervals (steps 2-14)" in done.stdout, done.stdout    # 13 steps, one life boundary
    mean = float(done.stdout.split("mean", 1)[1].split("ms")[0])
    assert mean > 0, done.stdout


def test_the_report_names_a_line_of_metrics_jsonl_it_cannot_read_and_draws_the_rest(tmp_path):
    run_dir = tmp_path / "run"
    train(run_dir, "train.steps=6", "run.report=false")
    lines = (run_dir / "metrics.jsonl").read_text().splitlines(keepends=True)
    lines.insert(3, '{"kind": "step", "st\n')
    (run_dir / "metrics.jsonl").write_text("".join(lines))
    result = CliRunner().invoke(app, ["report", str(run_dir)])
    assert result.exit_code == 0, result.output
    assert "metrics.jsonl: 1 (line 4: not JSON objects, skipped)" in " ".join(result.output.split())
    text = (run_dir / "report" / "report.md").read_text()
    assert "| lines of metrics.jsonl not read | 1 (line 4" in text and "| steps | 6 |" in text


def test_the_flow_legend_covers_none_of_its_data(tmp_path):
    from rlorch.reporting.report import flow_figure, read_records
    from rlorch.rundir.layout import RunDir

    run_dir = tmp_path / "run"
    train(run_dir, "train.steps=30", "run.report=false", "metrics.interval=0.05")
    fig = flow_figure(read_records(RunDir(run_dir)))
    fig.canvas.draw()
    ax = fig.axes[1]
    box = ax.get_legend().get_window_extent()
    points = [xy for line in ax.get_lines() for xy in ax.transData.transform(line.get_xydata())]
    assert points and not [p for p in points if box.contains(*p)]


def test_the_simulated_age_plot_has_a_tick_at_every_age():
    from rlorch.simulate import ages_figure, simulate

    fig = ages_figure(simulate(["rollout.max_staleness=0,1", "rollout.max_concurrent=640", "sim.latency=[1,6]"]))
    ticks = [round(t) for t in fig.axes[0].get_xticks() if 0 <= t <= 2]
    assert ticks == [0, 1, 2], ticks


def test_a_smaller_held_out_set_than_eval_prompts_is_said(tmp_path, capsys):
    train(tmp_path / "run", "train.steps=2", "run.report=false")
    assert "evaluation: 97 held-out prompts (eval.prompts=100; the task holds out 97)" in capsys.readouterr().err
    data = tmp_path / "sums.jsonl"    # no held-out split: evaluation draws training rows, and says so
    data.write_text("".join(json.dumps({"prompt": f"{a}+1=", "answer": str(a + 1)}) + "\n" for a in range(8)))
    train(tmp_path / "data", f"data.path={data}", "train.steps=2", "run.report=false")
    said = capsys.readouterr().err
    assert "evaluation: 8 training rows, none held out (eval.prompts=100)" in said and "held-out prompts" not in said


def test_report_figures_of_a_thousand_and_over_read_as_numbers_not_exponents():
    from rlorch.reporting.report import _format

    assert [_format(v) for v in (10050.3, 999.94, 0.0001234, 19200, 0.5)] == [
        "10,050", "999.9", "0.0001234", "19,200", "0.5"]


def test_completions_cut_by_the_length_limit_are_counted_and_above_a_fifth_named(tmp_path):
    """sim.tokens=8 under rollout.max_new_tokens=3: every completion ends by length, which cuts
    any answer of a data task short (its answers have no known length) and is exactly a 3-digit
    one (the default task: no truncation)."""
    from rlorch.reporting.progress import RunView, report_lines

    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{n}=", "answer": str(n)[::-1]}) + "\n" for n in range(100, 164)))
    _, cut, records = train(tmp_path / "cut", "train.steps=3", "run.report=false", "eval.enabled=false",
                            "rollout.max_new_tokens=3", "inference.sim.tokens=8", f"data.path={data}")
    assert [r["truncated_share"] for r in of_kind(records, "step")] == [1.0, 1.0, 1.0] and cut["truncated_share"] == 1.0
    _, fits, records = train(tmp_path / "fits", "train.steps=3", "run.report=false", "eval.enabled=false",
                             "rollout.max_new_tokens=3", "inference.sim.tokens=8")
    assert [r["truncated_share"] for r in of_kind(records, "step")] == [0.0, 0.0, 0.0] and fits["truncated_share"] == 0.0
    _, whole, records = train(tmp_path / "whole", "train.steps=3", "run.report=false", "eval.enabled=false",
                              "rollout.max_new_tokens=8", "inference.sim.tokens=8")
    assert [r["truncated_share"] for r in of_kind(records, "step")] == [0.0, 0.0, 0.0] and whole["truncated_share"] == 0.0

    view = RunView(10)
    view.log({"kind": "start", "time": 0.0, "version": 0})
    view.log({"kind": "step", "step": 1, "time": 1.0, "truncated_share": 0.2})
    assert "truncated" not in view.fields()
    view.log({"kind": "step", "step": 2, "time": 2.0, "truncated_share": 0.85})
    assert "85%" in view.fields()["truncated"] and "rollout.max_new_tokens" in view.fields()["truncated"]
    summary = {"admitted": 8, "trained": 8, "filtered": 0, "dropped_stale": 0, "persisted_untrained": 0, "lost": 0}
    assert not any("truncated" in text for text in report_lines({**summary, "truncated_share": 0.1}))
    assert any("85%" in text and "rollout.max_new_tokens" in text
               for text in report_lines({**summary, "truncated_share": 0.85}))


@pytest.mark.parametrize("admitted, expected", [
    (0, "interrupted in start-up: nothing was admitted or trained"),
    (128, "interrupted before the first step: nothing was trained (128 rollouts admitted)"),
])
def test_a_run_stopped_before_its_first_step_says_so_instead_of_a_report_of_dashes(tmp_path, admitted, expected):
    from io import StringIO

    from rich.console import Console

    from rlorch.reporting.progress import print_report

    out = StringIO()
    summary = {"status": "interrupted", "steps": 0, "wall_s": 0.6, "admitted": admitted, "trained": 0}
    print_report(Console(file=out, width=200), summary, summary_path=tmp_path / "summary.json")
    text = out.getvalue()
    assert expected in text and "- -> -" not in text, text
    assert f"start again with: rlorch train run.dir={tmp_path}" in text, text
