"""The FSDP2 trainer for real: its ranks on CPU (gloo) with the tiny model, started as a run starts
them, batches written by hand."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlorch.config.compose import compose
from rlorch.rundir import batchfile
from rlorch.rundir.layout import COMPLETE, PUBLISHED, RunDir, save_config, write_atomic


def _make_run(root: Path, *overrides: str) -> tuple[RunDir, object]:
    run = RunDir(root).make()
    # One minibatch unless a test asks for more: the trainer tests pin the shape they check.
    config = compose(["trainer.fsdp.device=cpu", "train.steps=3", "trainer.checkpoint_every=2", "trainer.minibatches=1",
                      "trainer.fsdp.micro_batch_size=2", *overrides])
    save_config(config, run.config)
    return run, config


def _rollout(prompt: str, completion: str, advantage: float, logprob: float = -2.5) -> dict:
    from rlorch.model import build_tokenizer

    tokenizer = build_tokenizer()
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    completion_ids = tokenizer(completion, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    tokens = prompt_ids + completion_ids
    mask = [0] * len(prompt_ids) + [1] * len(completion_ids)
    return {"group_id": 0, "episode_id": "e", "env": "reverse", "tokens": tokens, "loss_mask": mask,
            "logprobs": [logprob * m for m in mask], "versions": [[0, len(completion_ids)]],
            "reward": max(advantage, 0.0), "origin": "live", "finish_reason": "stop", "is_eval": False,
            "prompt_len": len(prompt_ids), "completion": completion, "advantage": advantage}


def _write_batch(run: RunDir, step: int, lines: list[dict] | None = None) -> None:
    lines = lines or [_rollout("123=", "321", 1.0), _rollout("123=", "999", -1.0),
                      _rollout("4567=", "7654", 0.5), _rollout("4567=", "76", -0.5),
                      _rollout("89=", "98", 0.0)]
    write_atomic(run.batch(step, "safetensors"), batchfile.encode(list(batchfile.iter_rows(lines)), "safetensors"))


class _Trainer:
    """A trainer started as a run starts it (the local launcher, through the fork server: warm
    ranks, no torchrun agent for one node), with its log read back as its output."""

    def __init__(self, launched):
        self.launched = launched
        self.handle = launched.handle

    def poll(self):
        return self.handle.poll()

    def kill(self) -> None:
        import asyncio

        from rlorch.launch.local import LocalLauncher

        asyncio.run(LocalLauncher().stop([self.launched], timeout=0))

    def output(self) -> str:
        return self.launched.log.read_text(errors="replace") if self.launched.log.exists() else ""


def _launch(config, run: RunDir, resume: Path | None = None) -> _Trainer:
    from rlorch.launch.local import LocalLauncher
    from rlorch.launch.trainer_command import trainer_command

    run.logs.mkdir(parents=True, exist_ok=True)
    return _Trainer(LocalLauncher().start_trainer(trainer_command(config, run.root, resume), env={},
                                                  log=run.logs / "trainer.log", workers=run.trainer_workers))


def _finish(process: _Trainer, timeout: float = 120) -> tuple[int, str]:
    try:
        code = process.handle.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        raise AssertionError(f"the trainer did not exit within {timeout:g}s:\n{process.output()[-3000:]}")
    output = process.output()
    # A later launch in the same run appends to the log: each launch's output is its own.
    process.launched.log.unlink(missing_ok=True)
    return code, output


def _metrics(run: RunDir) -> list[dict]:
    path = run.trainer / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_trainer_command_standalone_unless_rendezvous(tmp_path):
    from rlorch.launch.trainer_command import trainer_command

    config = compose(["trainer.fsdp.nproc=2"])
    command = trainer_command(config, tmp_path, tmp_path / "checkpoints" / "step_000002")
    assert command[:4] == [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    assert command[command.index("--nproc-per-node") + 1] == "2"
    assert command[-4:] == ["--run-dir", str(tmp_path), "--resume", str(tmp_path / "checkpoints" / "step_000002")]
    cluster = compose(['trainer.fsdp.torchrun_args=["--nnodes=2","--rdzv_endpoint=host:29400"]'])
    assert "--standalone" not in trainer_command(cluster, tmp_path, None)
    single = trainer_command(compose([]), tmp_path, None)
    assert single == [sys.executable, "-m", "rlorch.trainer.fsdp", "--run-dir", str(tmp_path)]


def test_a_one_node_torchrun_of_the_worker_is_started_as_its_ranks_and_nothing_else_is(tmp_path):
    from rlorch.launch.trainer_command import rank_env, standalone_ranks, trainer_command

    command = trainer_command(compose(["trainer.fsdp.nproc=2"]), tmp_path, tmp_path / "ckpt")
    assert standalone_ranks(command) == (2, [sys.executable, "-m", "rlorch.trainer.fsdp", "--run-dir", str(tmp_path),
                                             "--resume", str(tmp_path / "ckpt")])
    extra = compose(['trainer.fsdp.nproc=2', 'trainer.fsdp.torchrun_args=["--max-restarts=1"]'])
    assert standalone_ranks(trainer_command(extra, tmp_path, None)) is None
    assert standalone_ranks(trainer_command(compose(["trainer.fsdp.nnodes=2", "trainer.fsdp.nproc=2",
                                                     "trainer.fsdp.rdzv_endpoint=h:1"]), tmp_path, None)) is None
    assert standalone_ranks(trainer_command(compose([]), tmp_path, None)) is None
    env = rank_env(1, 2, 4321)
    assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"], env["MASTER_PORT"]) == ("1", "1", "2", "4321")


def test_a_rank_group_fails_with_its_first_failed_rank_and_a_stop_ends_the_others():
    import asyncio

    from rlorch.launch.base import Launched
    from rlorch.launch.local import LocalLauncher, RankGroup

    def start(*argv):
        return subprocess.Popen(argv, start_new_session=True)

    clean = RankGroup([start("true"), start("true")])
    assert clean.wait(timeout=10) == 0
    survivor = start("sleep", "60")
    group = RankGroup([survivor, start("sh", "-c", "exit 3")])
    assert group.wait(timeout=10) == 3 and survivor.poll() is None
    asyncio.run(LocalLauncher().stop([Launched("trainer", 0, None, None, handle=group)], timeout=5))
    assert survivor.poll() is not None


def _wait_for(condition, process: _Trainer, timeout: float = 90) -> None:
    deadline = time.time() + timeout
    while not condition():
        if process.poll() is not None or time.time() > deadline:
            process.kill()
            raise AssertionError(process.output())
        time.sleep(0.05)


def _relaunch_from_step_2(run: RunDir, *, nproc: int, steps: int, checkpoint_every: int) -> _Trainer:
    """The trainer again, on ``nproc`` ranks, from the step-2 checkpoint (DCP reshards it)."""
    config = compose(["trainer.fsdp.device=cpu", f"train.steps={steps}", f"trainer.checkpoint_every={checkpoint_every}",
                      "trainer.minibatches=1", "trainer.fsdp.micro_batch_size=2", f"trainer.fsdp.nproc={nproc}"])
    save_config(config, run.config)
    return _launch(config, run, run.checkpoint(2))


def _assert_step_3_reproduced(run: RunDir, first_life: list[dict]) -> None:
    """Same checkpoint, same batch: the resumed step 3 reproduces the first life's."""
    resumed = _metrics(run)[3]
    assert resumed["step"] == 3
    assert resumed["loss"] == pytest.approx(first_life[2]["loss"], rel=1e-4, abs=1e-6)
    assert resumed["grad_norm"] == pytest.approx(first_life[2]["grad_norm"], rel=1e-4)


def test_trains_publishes_checkpoints_resumes_and_stops(tmp_path):
    """Two ranks train 3 steps; one rank resumes from step 2 (DCP reshards), re-trains step 3
    identically, then checkpoints step 3 on STOP while waiting for batch 4."""
    from transformers import AutoModelForCausalLM

    run, config = _make_run(tmp_path / "run", "trainer.fsdp.nproc=2", "trainer.keep_weight_versions=2")
    for step in (1, 2, 3):
        _write_batch(run, step)
    code, output = _finish(_launch(config, run))
    assert code == 0, output
    assert json.loads((run.trainer / "ready").read_text())["world_size"] == 2
    first_life = _metrics(run)
    assert [m["step"] for m in first_life] == [1, 2, 3]
    assert first_life[0]["tokens"] == 19 and first_life[0]["sequences"] == 5
    assert first_life[0]["grad_norm"] > 0
    assert set(first_life[0]) >= {"loss", "kl", "ratio_mean", "ratio_max", "clip_frac", "step_s"}
    assert "ref_kl" not in first_life[0]  # trainer.kl_coef=0: no reference policy at all
    assert [step for step, _ in run.published_weights()] == [2, 3]  # keep=2 pruned version 1
    model = AutoModelForCausalLM.from_pretrained(run.weights_for(3))
    assert model.config.vocab_size > 0 and (run.weights_for(3) / "tokenizer.json").exists()
    assert json.loads((run.weights_for(3) / "config.json").read_text())["architectures"] == ["Qwen2ForCausalLM"]
    assert [step for step, _ in run.complete_checkpoints()] == [2, 3]
    assert AutoModelForCausalLM.from_pretrained(run.checkpoint(2) / "weights").config.vocab_size > 0

    # Step 3's weights and checkpoint now belong to an abandoned trajectory: both get replaced.
    (run.weights_for(3) / "abandoned").write_text("")
    (run.checkpoint(3) / "trainer" / "abandoned").write_text("")
    process = _relaunch_from_step_2(run, nproc=1, steps=5, checkpoint_every=10)
    _wait_for(lambda: len(_metrics(run)) == 4 and (run.weights_for(3) / PUBLISHED).exists(), process)
    write_atomic(run.stop_file, b"")
    code, output = _finish(process)
    assert code == 0, output
    _assert_step_3_reproduced(run, first_life)
    assert (run.checkpoint(3) / "trainer" / COMPLETE).exists()
    assert not (run.checkpoint(3) / "trainer" / "abandoned").exists()
    assert not (run.weights_for(3) / "abandoned").exists()
    assert json.loads((run.checkpoint(3) / "trainer" / "trainer_state.json").read_text())["step"] == 3
    assert not run.weights_for(4).exists()


def test_asked_while_waiting_the_trainer_writes_its_current_weights_to_disk(tmp_path):
    """``broadcast/publish.request`` (a restarted server's only way to a version that went over the
    weight group): two ranks waiting for batch 2 write version 1, which ``publish_every=2`` kept
    off the disk, and clear the request; asked again with it there, they write nothing more."""
    from transformers import AutoModelForCausalLM

    from rlorch.rundir.layout import write_json_atomic

    run, config = _make_run(tmp_path / "run", "trainer.fsdp.nproc=2", "trainer.publish_every=2", "train.steps=2",
                            "trainer.checkpoint_every=10")
    run.offers.mkdir(parents=True, exist_ok=True)
    _write_batch(run, 1)
    process = _launch(config, run)
    _wait_for(lambda: len(_metrics(run)) == 1, process)
    assert not run.weights_for(1).exists()
    write_json_atomic(run.publish_request, {"version": 1})
    _wait_for(lambda: (run.weights_for(1) / PUBLISHED).exists() and not run.publish_request.exists(), process)
    written = (run.weights_for(1) / PUBLISHED).stat().st_mtime_ns
    write_json_atomic(run.publish_request, {"version": 1})
    _wait_for(lambda: not run.publish_request.exists(), process)
    assert (run.weights_for(1) / PUBLISHED).stat().st_mtime_ns == written
    assert AutoModelForCausalLM.from_pretrained(run.weights_for(1)).config.vocab_size > 0
    _write_batch(run, 2)
    code, output = _finish(process)
    assert code == 0, output
    assert output.count("version 1 published to disk on the orchestrator's request") == 1, output


def test_malformed_batch_names_file_and_line(tmp_path):
    run, config = _make_run(tmp_path / "run", "train.steps=1", "run.batch_format=jsonl")
    good = json.dumps(_rollout("12=", "21", 1.0))
    write_atomic(run.batch(1, "jsonl"), f"{good}\n{{\"tokens\": [1, 2]}}\n".encode())
    code, output = _finish(_launch(config, run))
    assert code != 0
    assert f"{run.batch(1, 'jsonl')}:2: missing key(s)" in output


@pytest.mark.parametrize("change, message", [
    ({"logprobs": [0.0]}, "must be non-empty and of equal length"),
    ({"advantage": float("nan")}, "must be finite"),
    ({"tokens": [1, 10_000, 3, 4, 5]}, "outside the vocabulary"),
    ({"loss_mask": [1, 0, 0, 0, 0]}, "loss_mask[0] is set"),
    ({"tokens": "12"}, "must be lists"),
    ({"unlikelihood": "yes"}, "unlikelihood must be true or false"),
])
def test_read_batch_rejects_malformed_lines(tmp_path, change, message):
    from rlorch.trainer.batch import BatchError, read_batch

    good = _rollout("12=", "2", 1.0)
    path = tmp_path / "step_000001.jsonl"
    path.write_text(json.dumps(good) + "\n\n" + json.dumps({**good, **change}) + "\n")
    with pytest.raises(BatchError) as caught:
        read_batch(path, vocab_size=64)
    assert str(caught.value).startswith(f"{path}:3: ") and message in str(caught.value)


def test_micro_batches_pad_and_fill_to_the_same_count():
    from rlorch.trainer.batch import Sequence, rank_share

    sequences = [Sequence([5, 6, 7], [0, 1, 1], [0.0, -1.0, -2.0], 1.0, 1.0),
                 Sequence([5, 6], [0, 1], [0.0, -1.0], -1.0, 0.0)]
    micros = rank_share(sequences * 2, 1, 2, max_tokens=None, size=1, pad_id=0)
    assert [m.tokens.tolist() for m in micros] == [[[5, 6]], [[5, 6]]]
    alone = rank_share(sequences, 0, 1, max_tokens=None, size=1, pad_id=0)
    assert [m.tokens.tolist() for m in alone] == [[[5, 6, 7]], [[5, 6]]]
    short = rank_share(sequences[:1], 1, 2, max_tokens=None, size=1, pad_id=0)
    assert short[0].mask.sum() == 0 and short[0].sequences == 0  # filler for a rank short of data
    both = rank_share(sequences, 0, 1, max_tokens=None, size=2, pad_id=0)[0]
    assert both.tokens.tolist() == [[5, 6, 7], [5, 6, 0]] and both.mask.tolist() == [[0, 1, 1], [0, 1, 0]]
    assert both.advantages.tolist() == [[1.0, 1.0, 1.0], [-1.0, -1.0, 0.0]]


def test_a_line_marked_unlikelihood_marks_its_tokens_padded_packed_and_split(tmp_path):
    from rlorch.trainer.batch import packed, padded, read_batch

    good = _rollout("12=", "21", 1.0)
    path = tmp_path / "step_000001.jsonl"
    path.write_text(json.dumps(good) + "\n" + json.dumps({**good, "unlikelihood": True}) + "\n")
    sequences = read_batch(path, vocab_size=64)
    assert [s.unlikelihood for s in sequences] == [False, True]
    n = len(sequences[0].tokens)
    assert padded(sequences, 0).unlikelihood.tolist() == [[False] * n, [True] * n]
    assert packed(sequences, 0).unlikelihood.tolist() == [[False] * n + [True] * n]


def _one_step_weights(root: Path, *overrides: str, lines: list[dict] | None = None) -> tuple[dict, dict]:
    from safetensors.torch import load_file

    run, config = _make_run(root, "train.steps=1", "rollout.max_staleness=0", "trainer.lr=0.05",
                            "trainer.fsdp.micro_batch_size=8", *overrides)
    _write_batch(run, 1, lines)
    code, output = _finish(_launch(config, run))
    assert code == 0, output
    return _metrics(run)[0], load_file(str(run.weights_for(1) / "model.safetensors"))


@pytest.mark.slow
def test_a_batch_line_marked_unlikelihood_reaches_the_trainers_loss(tmp_path):
    import torch
    from safetensors.torch import load_file

    def stepped(root: Path, marked: bool, *overrides: str) -> dict:
        run, config = _make_run(root, "train.steps=1", "rollout.max_staleness=0", "trainer.lr=0.05", *overrides)
        lines = [_rollout("123=", "999", -1.0), _rollout("4567=", "76", -1.0), _rollout("89=", "98", 1.0)]
        _write_batch(run, 1, [{**line, "unlikelihood": marked and line["advantage"] < 0} for line in lines])
        code, output = _finish(_launch(config, run))
        assert code == 0, output
        return load_file(str(run.weights_for(1) / "model.safetensors"))

    plain, marked = stepped(tmp_path / "plain", False), stepped(tmp_path / "marked", True)
    assert any(not torch.equal(plain[k], marked[k]) for k in plain)
    # The answer's unlikelihood (trainer.unlikelihood_level) weighs the same marks otherwise.
    answer = stepped(tmp_path / "answer", True, "trainer.unlikelihood_level=sequence")
    assert any(not torch.equal(answer[k], marked[k]) for k in marked)


@pytest.mark.slow
def test_minibatches_make_the_corrections_differ_engage_the_clip_and_measure_mismatch_before_any_update(tmp_path):
    import torch

    lines, weights = {}, {}
    for correction in ("decoupled", "tis", "none", "recompute"):
        # `none` past the first minibatch is off-policy: allowed here to compare them all.
        lines[correction], weights[correction] = _one_step_weights(
            tmp_path / correction, f"trainer.correction={correction}", "trainer.minibatches=2",
            "trainer.proximal=recompute", "trainer.allow_uncorrected=true")
    assert all(line["minibatches"] == 2 for line in lines.values())
    assert lines["decoupled"]["clip_frac"] > 0
    # recompute ignores the hand-written behaviour logprobs that weigh decoupled's tokens.
    for a, b in (("decoupled", "tis"), ("decoupled", "none"), ("tis", "none"), ("decoupled", "recompute")):
        assert any(not torch.equal(weights[a][k], weights[b][k]) for k in weights[a]), (a, b)
    # One minibatch: the proximal policy is the current one and decoupled == tis exactly.
    one, decoupled = _one_step_weights(tmp_path / "d1", "trainer.correction=decoupled")
    _, tis = _one_step_weights(tmp_path / "t1", "trainer.correction=tis")
    assert all(torch.allclose(decoupled[k], tis[k], atol=1e-6) for k in decoupled)
    # The hand-written behaviour logprobs (-2.5 everywhere) are not the model's: the mismatch
    # over the tokens stamped with the trainer's version says so.
    # tis and none read no proximal logprobs and run no pass for them: their mismatch is the first
    # minibatch's (its 2 sequences' 8 tokens), measured by its training forward.
    assert [lines[c]["proximal_pass"] for c in ("decoupled", "tis", "none", "recompute")] == [True, False, False, True]
    assert lines["tis"]["mismatch_tokens"] == 8 and lines["tis"]["mismatch_kl"] > 0.1
    # Mismatch and entropy are measured on the weights before the first update: with two
    # minibatches the first one's figures come from its training forward and the second one's
    # from a forward before the first update, and together they equal one minibatch's.
    two = lines["decoupled"]
    assert one["mismatch_tokens"] == two["mismatch_tokens"] == 19
    assert two["mismatch_kl"] == pytest.approx(one["mismatch_kl"], rel=1e-5)
    assert two["mismatch_max"] == pytest.approx(one["mismatch_max"], rel=1e-5)
    assert two["entropy"] == pytest.approx(one["entropy"], rel=1e-5)


def _own_logprob_lines(temperature: float) -> list[dict]:
    """The default batch with the base model's own logprobs as behaviour, stamped version 0: as
    if the proximal weights of step 1 had sampled every token."""
    import torch

    from rlorch.model import ensure_default_model
    from rlorch.qwen2 import Qwen2ForCausalLM
    from rlorch.trainer.loss import token_logprobs

    model = Qwen2ForCausalLM.from_pretrained(ensure_default_model()).eval()
    lines = [_rollout("123=", "321", 1.0), _rollout("123=", "999", -1.0), _rollout("4567=", "7654", 0.5),
             _rollout("4567=", "76", -0.5), _rollout("89=", "98", 0.0)]
    for line in lines:
        tokens = torch.tensor([line["tokens"]])
        with torch.no_grad():
            own = token_logprobs(model(input_ids=tokens).logits, tokens, temperature)[0].tolist()
        line["logprobs"] = [value * mask for value, mask in zip(own, line["loss_mask"])]
    return lines


@pytest.mark.slow
def test_loglinear_skips_the_proximal_pass_and_is_exact_where_the_proximal_weights_sampled(tmp_path):
    import torch

    # Each sequence runs in a row of its own, as its behaviour logprobs were computed: the
    # recomputed ones are then the file's bit for bit. (A shared row attends in one masked call,
    # which rounds differently, and AdamW's first step turns a rounding-sized difference in a
    # near-zero gradient into a whole step of the learning rate.)
    two = ("trainer.minibatches=2", "rollout.temperature=1.0", "trainer.fsdp.share_prompts=false")
    own = _own_logprob_lines(1.0)
    recomputed, recomputed_weights = _one_step_weights(tmp_path / "recompute", *two, "trainer.proximal=recompute",
                                                       lines=own)
    estimated, estimated_weights = _one_step_weights(tmp_path / "loglinear", *two, "trainer.proximal=loglinear", lines=own)
    assert recomputed["proximal_pass"] and not estimated["proximal_pass"]
    # Every token sampled by the proximal weights: the estimate is their behaviour logprob, which
    # is what the pass recomputes (up to the mismatch), so both train the same weights.
    assert all(torch.allclose(recomputed_weights[k], estimated_weights[k], atol=1e-6) for k in recomputed_weights)
    assert estimated["mismatch_tokens"] == 8 and estimated["mismatch_kl"] < 1e-9
    # Behaviour logprobs that are not the model's are taken at their word...
    _, differs = _one_step_weights(tmp_path / "hand", *two, "trainer.proximal=loglinear")
    _, hand_recomputed = _one_step_weights(tmp_path / "hand-recompute", *two, "trainer.proximal=recompute")
    assert any(not torch.equal(differs[k], hand_recomputed[k]) for k in differs)
    # ...and a batch with a trained token of unknown version is recomputed.
    unknown = [{key: value for key, value in line.items() if key != "versions"} for line in own]
    fallback, fallback_weights = _one_step_weights(tmp_path / "unknown", *two, "trainer.proximal=loglinear", lines=unknown)
    assert fallback["proximal_pass"]
    assert all(torch.equal(fallback_weights[k], recomputed_weights[k]) for k in recomputed_weights)
    # On two FSDP ranks the same holds; and one line of unknown version, held by one rank, makes
    # both run the pass (the model's forward is collective: a rank alone in it would hang).
    ranks = ("trainer.fsdp.nproc=2",)
    _, sharded = _one_step_weights(tmp_path / "two-ranks", *two, *ranks, "trainer.proximal=loglinear", lines=own)
    _, sharded_recomputed = _one_step_weights(tmp_path / "two-ranks-recompute", *two, *ranks,
                                              "trainer.proximal=recompute", lines=own)
    assert all(torch.allclose(sharded[k], sharded_recomputed[k], atol=1e-6) for k in sharded)
    one_unknown = own[:-1] + unknown[-1:]
    mixed, _ = _one_step_weights(tmp_path / "two-ranks-unknown", *two, *ranks, "trainer.proximal=loglinear",
                                 lines=one_unknown)
    assert mixed["proximal_pass"]


def test_a_handed_off_state_dict_does_not_follow_the_next_optimizer_step():
    import torch

    from rlorch.trainer.handoff import own_copy

    model = torch.nn.Linear(3, 2)
    detached = {"other": torch.ones(2)}
    state = own_copy(model, {**model.state_dict(), **detached})
    before = {name: tensor.clone() for name, tensor in state.items()}
    with torch.no_grad():
        model.weight.add_(1.0)
        model.bias.add_(1.0)
    assert all(torch.equal(state[name], before[name]) for name in before)
    assert state["other"] is detached["other"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_weight_check_finds_any_non_finite_value_and_passes_empty_shards(dtype):
    import torch

    from rlorch.trainer.fsdp import all_finite

    dtype = getattr(torch, dtype)
    weights = [torch.randn(64, 3).to(dtype), torch.empty(0, dtype=dtype), torch.full((5,), 3e38).to(dtype)]
    assert all_finite(weights) and all_finite([]) and all_finite([torch.empty(0)])
    for bad in (float("nan"), float("inf"), -float("inf")):
        spoiled = [w.clone() for w in weights]
        spoiled[0][17, 1] = bad
        assert not all_finite(spoiled), bad
    assert not all_finite([torch.randn(4), torch.tensor([1.0, float("nan")], dtype=dtype)])


@pytest.mark.slow
def test_a_single_rank_checkpoint_resumes_on_two_ranks(tmp_path):
    """One rank trains the plain module; its DCP checkpoint reshards onto two FSDP ranks, which
    re-train step 3 as the single rank did."""
    run, config = _make_run(tmp_path / "run", "trainer.fsdp.nproc=1")
    for step in (1, 2, 3):
        _write_batch(run, step)
    code, output = _finish(_launch(config, run))
    assert code == 0, output
    single = _metrics(run)
    assert [m["step"] for m in single] == [1, 2, 3]

    code, output = _finish(_relaunch_from_step_2(run, nproc=2, steps=3, checkpoint_every=2))
    assert code == 0, output
    assert json.loads((run.trainer / "ready").read_text())["world_size"] == 2
    _assert_step_3_reproduced(run, single)


@pytest.mark.parametrize("tied", [True, False])
def test_later_versions_are_written_as_save_pretrained_writes_them(tmp_path, tied, monkeypatch):
    """After the first full save, a version gets the same files byte for byte as a full save of
    its weights would write, the weights' new values included (tied embeddings or not), its
    weights file written raw (header and data) without safetensors' save_file."""
    import safetensors.torch
    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from rlorch.model import ensure_default_model
    from rlorch.trainer.publish import HFWriter, write_hf

    path = ensure_default_model()
    config = AutoConfig.from_pretrained(path)
    config.tie_word_embeddings = tied
    model, tokenizer = AutoModelForCausalLM.from_config(config), AutoTokenizer.from_pretrained(path)
    full_saves = []
    save_pretrained = model.save_pretrained
    model.save_pretrained = lambda *args, **kwargs: full_saves.append(1) or save_pretrained(*args, **kwargs)
    writer = HFWriter(model, tokenizer)
    writer.write(tmp_path / "v1", {name: tensor.clone() for name, tensor in model.state_dict().items()})
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter))
    state = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    saved_by_save_file = []
    save_file = safetensors.torch.save_file
    monkeypatch.setattr(safetensors.torch, "save_file",
                        lambda *args, **kwargs: saved_by_save_file.append(1) or save_file(*args, **kwargs))
    writer.write(tmp_path / "v2", state)
    assert len(full_saves) == 1 and not saved_by_save_file
    monkeypatch.undo()
    write_hf(tmp_path / "full", model, dict(state), tokenizer)
    written, full = sorted(tmp_path.joinpath("v2").iterdir()), sorted(tmp_path.joinpath("full").iterdir())
    assert [entry.name for entry in written] == [entry.name for entry in full]
    for mine, theirs in zip(written, full):
        assert mine.read_bytes() == theirs.read_bytes(), mine.name
        if mine.suffix == ".safetensors":
            ours, first = load_file(mine), load_file(tmp_path / "v1" / mine.name)
            assert not any(torch.equal(ours[name], first[name]) for name in ours)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "v2")
    assert all(torch.equal(a, b) for a, b in zip(reloaded.state_dict().values(), model.state_dict().values()))


def test_a_version_in_another_dtype_is_written_in_full(tmp_path):
    """The learned header holds for one dtype and shape per tensor: a state dict in another dtype
    (or shape) is written by save_pretrained, and reads back as given."""
    import torch
    from safetensors.torch import load_file

    from rlorch.model import build_model, build_tokenizer
    from rlorch.trainer.publish import HFWriter

    model = build_model(build_tokenizer())
    writer = HFWriter(model, None)
    writer.write(tmp_path / "v1", {name: tensor.clone() for name, tensor in model.state_dict().items()})
    halved = {name: tensor.to(torch.bfloat16) for name, tensor in model.state_dict().items()}
    writer.write(tmp_path / "v2", halved)
    written = load_file(tmp_path / "v2" / "model.safetensors")
    assert {tensor.dtype for tensor in written.values()} == {torch.bfloat16}
    assert all(torch.equal(written[name], halved[name]) for name in written)


@pytest.mark.slow
@pytest.mark.parametrize("agg", ["seq_mean_token_sum", "seq_mean_token_mean"])
def test_loss_aggregation_is_the_same_on_two_ranks_as_on_one(tmp_path, agg):
    """Five sequences of different lengths in micro-batches of one: rank 0 trains three, rank 1
    two. With the minibatch's counts as normalisers the loss and the gradient norm (before
    clipping) equal one rank's; a per-rank normaliser would scale the ranks' shares unequally.
    (The weights after one AdamW step are not compared: its first update is about lr * sign(g),
    which rounding flips where a gradient is near 0.)"""
    overrides = (f"trainer.loss_agg={agg}", "trainer.fsdp.micro_batch_size=1")
    one, _ = _one_step_weights(tmp_path / "one", "trainer.fsdp.nproc=1", *overrides)
    two, _ = _one_step_weights(tmp_path / "two", "trainer.fsdp.nproc=2", *overrides)
    assert two["loss"] == pytest.approx(one["loss"], rel=1e-5)
    assert two["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-5)
    token_mean, _ = _one_step_weights(tmp_path / "token", "trainer.fsdp.nproc=1", "trainer.fsdp.micro_batch_size=1")
    assert token_mean["loss"] != pytest.approx(one["loss"], rel=1e-3)


@pytest.mark.slow
@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean"])
def test_token_budgets_on_two_ranks_give_one_ranks_padded_step(tmp_path, agg):
    """The five sequences packed into passes of at most 12 tokens, balanced over two ranks, give
    the loss and gradient norm of one rank's padded micro-batches, and the step records count
    the positions run: the real tokens only, where padding made one rank's passes longer. With
    shared prompts (the default; two prompts here are sampled twice) the same step runs over
    fewer positions still."""
    agg_key, unshared = f"trainer.loss_agg={agg}", "trainer.fsdp.share_prompts=false"
    padded, _ = _one_step_weights(tmp_path / "padded", "trainer.fsdp.nproc=1", agg_key, unshared)
    one, _ = _one_step_weights(tmp_path / "one", "trainer.fsdp.nproc=1", agg_key,
                               "trainer.fsdp.max_tokens_per_micro_batch=12", unshared)
    two, _ = _one_step_weights(tmp_path / "two", "trainer.fsdp.nproc=2", agg_key,
                               "trainer.fsdp.max_tokens_per_micro_batch=12", unshared)
    shared, _ = _one_step_weights(tmp_path / "shared", "trainer.fsdp.nproc=2", agg_key)
    for other in (one, two, shared):
        assert other["loss"] == pytest.approx(padded["loss"], rel=1e-5)
        assert other["grad_norm"] == pytest.approx(padded["grad_norm"], rel=1e-5)
        assert other["entropy"] == pytest.approx(padded["entropy"], rel=1e-5)
    lines = batchfile.read_records(RunDir(tmp_path / "one").batch(1, "safetensors"))
    real = sum(len(line["tokens"]) for line in lines)
    assert one["positions"] == real < padded["positions"]
    assert two["positions"] <= real + 2  # at most one 2-token filler pass
    # Each rank lays out its own sequences: no rank's last token, and a prompt once a rank.
    assert shared["positions"] <= real - len(lines)


@pytest.mark.slow
def test_a_resumed_run_continues_the_learning_rate_curve_exactly(tmp_path):
    """Cosine with warm-up over 3 batches of 2 minibatches (horizon 6 updates); batch 1 holds
    one sequence, so it takes one update. The step records carry the lr of each batch's last
    update, and a run resumed from step 2 trains step 3 at the uninterrupted run's lr: the
    schedule's position (3 updates) comes from the checkpoint, not from 0 nor from
    steps * minibatches (4)."""
    from rlorch.trainer.schedule import lr_factor

    schedule = ("trainer.lr_schedule=cosine", "trainer.warmup_steps=2", "trainer.min_lr_ratio=0.1",
                "trainer.minibatches=2", "trainer.lr=0.01", "trainer.fsdp.nproc=1")
    run, config = _make_run(tmp_path / "run", *schedule)
    _write_batch(run, 1, [_rollout("123=", "321", 1.0)])
    for step in (2, 3):
        _write_batch(run, step)
    code, output = _finish(_launch(config, run))
    assert code == 0, output
    first = _metrics(run)
    assert [m["minibatches"] for m in first] == [1, 2, 2]
    expected = [0.01 * lr_factor(position, schedule="cosine", warmup_steps=2, total_steps=6,
                                 min_lr_ratio=0.1) for position in (0, 2, 4)]
    assert [m["lr"] for m in first] == pytest.approx(expected)
    assert len(set(m["lr"] for m in first)) == 3
    state = json.loads((run.checkpoint(2) / "trainer" / "trainer_state.json").read_text())
    assert state["optimizer_steps"] == 3

    code, output = _finish(_launch(config, run, run.checkpoint(2)))
    assert code == 0, output
    resumed = _metrics(run)[3]
    assert resumed["step"] == 3 and resumed["lr"] == first[2]["lr"]
    assert resumed["loss"] == pytest.approx(first[2]["loss"], rel=1e-4, abs=1e-6)
    assert resumed["grad_norm"] == pytest.approx(first[2]["grad_norm"], rel=1e-4)


@pytest.mark.slow
def test_kl_to_the_reference_is_zero_before_the_first_update_and_resumes_exactly(tmp_path):
    """Two ranks hold the reference sharded like the policy: at step 1 both are the initial
    weights (ref_kl 0), later the policy moved (ref_kl > 0). One rank resumed from step 2
    reloads the same reference and re-trains step 3 with the same ref_kl and loss."""
    run, config = _make_run(tmp_path / "run", "trainer.fsdp.nproc=2", "trainer.kl_coef=0.5", "trainer.lr=0.01")
    for step in (1, 2, 3):
        _write_batch(run, step)
    code, output = _finish(_launch(config, run))
    assert code == 0, output
    first = _metrics(run)
    assert first[0]["ref_kl"] == pytest.approx(0.0, abs=1e-6)
    assert first[1]["ref_kl"] > 1e-6 and first[2]["ref_kl"] > 1e-6

    # One minibatch unless a test asks for more: the trainer tests pin the shape they check.
    config = compose(["trainer.fsdp.device=cpu", "train.steps=3", "trainer.checkpoint_every=2", "trainer.minibatches=1",
                      "trainer.fsdp.micro_batch_size=2", "trainer.fsdp.nproc=1", "trainer.kl_coef=0.5",
                      "trainer.lr=0.01"])
    save_config(config, run.config)
    code, output = _finish(_launch(config, run, run.checkpoint(2)))
    assert code == 0, output
    resumed = _metrics(run)[3]
    assert resumed["step"] == 3
    assert resumed["ref_kl"] == pytest.approx(first[2]["ref_kl"], rel=1e-4)
    assert resumed["loss"] == pytest.approx(first[2]["loss"], rel=1e-4, abs=1e-6)


@pytest.mark.slow
def test_activation_checkpointing_under_fsdp_gives_the_same_step(tmp_path):
    """Two ranks, each decoder layer an FSDP unit whose forward is recomputed in the backward:
    the step's loss and gradient norm equal those without checkpointing."""
    plain, _ = _one_step_weights(tmp_path / "plain", "trainer.fsdp.nproc=2")
    checkpointed, _ = _one_step_weights(tmp_path / "ac", "trainer.fsdp.nproc=2", "trainer.activation_checkpointing=true")
    assert checkpointed["loss"] == pytest.approx(plain["loss"], rel=1e-5, abs=1e-7)
    assert checkpointed["grad_norm"] == pytest.approx(plain["grad_norm"], rel=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [2, 1])
def test_lora_trains_adapters_publishes_merged_weights_and_resumes_exactly(tmp_path, nproc):
    """Two ranks shard decoder layers holding frozen base weights and trainable adapters, or one
    rank holds them all and writes its checkpoints beside training, without DCP. The checkpoint
    holds the adapters (and the trained norms) alone; every published version is full weights under the base
    model's names that an engine loads as it is; a run resumed from step 2 re-trains step 3 to
    the very weights of the uninterrupted run."""
    import torch
    import torch.distributed.checkpoint as dcp
    from safetensors import safe_open
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from rlorch.model import ensure_default_model

    lora = ("model.lora.rank=4", "model.lora.alpha=8", "model.lora.modules_to_save=[norm]", "trainer.lr=0.05",
            f"trainer.fsdp.nproc={nproc}")
    run, config = _make_run(tmp_path / "run", *lora)
    for step in (1, 2, 3):
        _write_batch(run, step)
    code, output = _finish(_launch(config, run), timeout=300)
    assert code == 0, output
    first = _metrics(run)
    uninterrupted = load_file(str(run.weights_for(3) / "model.safetensors"))
    base = AutoModelForCausalLM.from_pretrained(ensure_default_model()).state_dict()
    assert sorted(uninterrupted) == sorted(base)
    assert not torch.equal(uninterrupted["model.layers.0.self_attn.q_proj.weight"],
                           base["model.layers.0.self_attn.q_proj.weight"])
    assert torch.equal(uninterrupted["model.embed_tokens.weight"], base["model.embed_tokens.weight"])
    served = AutoModelForCausalLM.from_pretrained(run.weights_for(3))
    assert torch.equal(served.state_dict()["model.layers.1.mlp.down_proj.weight"],
                       uninterrupted["model.layers.1.mlp.down_proj.weight"])
    trainer_dir = run.checkpoint(2) / "trainer"
    if nproc == 1:
        with safe_open(str(trainer_dir / "state.safetensors"), framework="pt") as handle:
            model_keys = [key for key in handle.keys() if key.startswith("model/")]
    else:
        saved = dcp.FileSystemReader(str(trainer_dir / "dcp")).read_metadata()
        model_keys = [key for key in saved.state_dict_metadata if key.startswith("model.")]
    assert model_keys and all("lora_" in key or "modules_to_save" in key for key in model_keys)

    code, output = _finish(_launch(config, run, run.checkpoint(2)), timeout=300)
    assert code == 0, output
    resumed = _metrics(run)[3]
    assert resumed["step"] == 3
    assert resumed["loss"] == pytest.approx(first[2]["loss"], rel=1e-6, abs=1e-7)
    assert resumed["grad_norm"] == pytest.approx(first[2]["grad_norm"], rel=1e-6)
    again = load_file(str(run.weights_for(3) / "model.safetensors"))
    assert all(torch.equal(again[name], uninterrupted[name]) for name in uninterrupted)


@pytest.mark.slow
def test_bf16_publishes_bf16_weights(tmp_path):
    """model.dtype=bfloat16 trains fp32 master weights and publishes the served dtype."""
    import torch

    record, weights = _one_step_weights(tmp_path, "model.dtype=bfloat16")
    assert {tensor.dtype for tensor in weights.values()} == {torch.bfloat16}
    assert json.loads((tmp_path / "weights" / "step_000001" / "config.json").read_text())["dtype"] == "bfloat16"
    assert record["skipped_updates"] == 0 and record["grad_norm"] > 0


def test_a_single_rank_checkpoint_written_beside_training_holds_the_state_of_its_step(tmp_path):
    """The write of a single rank's checkpoint runs while the next step trains: what it writes
    is the state when it was begun (the optimizer step in between changes nothing in it), and
    until it ends the checkpoint is not complete, so nothing resumes from it."""
    import torch

    from rlorch.rundir.layout import mark
    from rlorch.trainer import checkpoint

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)

    def train_a_step():
        model(torch.randn(2, 4)).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()

    train_a_step()
    run = RunDir(tmp_path / "run").make()
    run.weights_for(1).mkdir(parents=True)
    (run.weights_for(1) / "model.safetensors").write_bytes(b"weights")
    mark(run.weights_for(1), PUBLISHED)
    at_step_1 = {name: p.detach().clone() for name, p in model.named_parameters()}
    moments = optimizer.state[model.weight]["exp_avg"].clone()
    write = checkpoint.begin_single_rank_save(run, 1, model, optimizer, optimizer_steps=1)
    assert not checkpoint.is_complete(run.checkpoint(1))
    train_a_step()   # the next step, before the write
    assert checkpoint.is_complete(write())
    assert (run.checkpoint(1) / "weights" / "model.safetensors").read_bytes() == b"weights"
    assert sorted(p.name for p in (run.checkpoint(1) / "trainer").iterdir()) == [
        "COMPLETE", checkpoint.FLAT_STATE_FILE, checkpoint.STATE_FILE]

    fresh = torch.nn.Linear(4, 3)
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    fresh(torch.randn(2, 4)).sum().backward()
    fresh_optimizer.step()   # the optimizer's state exists to load into
    assert checkpoint.load(run.checkpoint(1), fresh, fresh_optimizer) == (1, 1)
    for name, parameter in fresh.named_parameters():
        assert torch.equal(parameter, at_step_1[name]), name
    assert torch.equal(fresh_optimizer.state[fresh.weight]["exp_avg"], moments)
    assert not torch.equal(model.weight, at_step_1["weight"])


def test_a_single_ranks_checkpoint_is_written_without_importing_dcp(tmp_path):
    """Importing torch.distributed.checkpoint costs about a second of CPU, taken from the first
    steps of a run on a small machine: a single rank's trainer writes its checkpoints without it."""
    script = f"""
import sys, torch
from pathlib import Path
from rlorch.rundir.layout import PUBLISHED, RunDir, mark
from rlorch.trainer import checkpoint, fsdp  # the trainer's module too, as its process imports it
model = torch.nn.Linear(4, 3)
optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
model(torch.randn(2, 4)).sum().backward()
optimizer.step()
run = RunDir(Path({str(tmp_path / "run")!r})).make()
run.weights_for(1).mkdir(parents=True)
mark(run.weights_for(1), PUBLISHED)
checkpoint.begin_single_rank_save(run, 1, model, optimizer)()
assert checkpoint.is_complete(run.checkpoint(1))
print("torch.distributed.checkpoint" in sys.modules)
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "False"


def test_a_version_is_published_without_fsync_and_made_durable_by_the_checkpoint_that_links_it(tmp_path, monkeypatch):
    """The engines read a version through the page cache; what must outlive the machine is a
    checkpoint, whose COMPLETE comes only after every file it holds (the version's files,
    hard-linked: the same inodes) is fsynced."""
    from rlorch.rundir.layout import CheckpointDir
    from rlorch.trainer.checkpoint import _complete, link_or_copy_tree
    from rlorch.trainer.publish import publish

    run = RunDir(tmp_path / "run").make()
    synced: list[tuple[int, bool]] = []   # (inode, whether COMPLETE existed at the time)
    real_fsync = os.fsync
    checkpoint = run.checkpoint(1)

    def recording_fsync(fd):
        synced.append((os.fstat(fd).st_ino, (CheckpointDir(checkpoint).trainer / COMPLETE).exists()))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)

    def write(directory: Path) -> None:
        directory.mkdir(parents=True)
        (directory / "model.safetensors").write_bytes(b"weights")
        (directory / "config.json").write_text("{}")

    final = publish(run, 1, write)
    assert (final / PUBLISHED).exists() and synced == []
    CheckpointDir(checkpoint).trainer.mkdir(parents=True)
    link_or_copy_tree(final, CheckpointDir(checkpoint).weights)
    _complete(checkpoint)
    weights = {(final / name).stat().st_ino for name in ("model.safetensors", "config.json")}
    assert weights <= {inode for inode, complete in synced if not complete}
    assert (CheckpointDir(checkpoint).trainer / COMPLETE).exists()
