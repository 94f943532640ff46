"""The batch file in both formats: the same records back, any safetensors reader opens it, the
trainer refuses a damaged one naming the file and the rollout."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy
import pytest

from rlorch.rundir import batchfile
from rlorch.trainer.batch import BatchError, read_batch
from rlorch.types import Batch, Rollout, VersionStamps


def _batch() -> Batch:
    first = Rollout(1, "g1-0", "reverse", [5, 6, 7, 8], [0, 0, 1, 1], [0.0, 0.0, -0.5, -0.123456789],
                    VersionStamps([[3, 2]]), reward=1.0, completion="héllo\nwörld")
    forked = Rollout(1, "g1-1", "calculator", [5, 6, 9, 2], [0, 1, 0, 1], [0.0, -1.5, 0.0, -2.0],
                     VersionStamps([[3, 1], [4, 1]]), reward=0.0, segments=[2, 2])
    return Batch(7, [first, forked], [0.5, -0.5], unlikelihood=[False, True])


@pytest.mark.parametrize("fmt", batchfile.FORMATS)
def test_both_formats_give_back_every_field_and_the_same_sequences(tmp_path, fmt):
    batch = _batch()
    path = tmp_path / f"step{batchfile.SUFFIXES[fmt]}"
    path.write_bytes(b"".join(batch.file(fmt)))
    assert batchfile.is_safetensors(path) == (fmt == "safetensors")
    expected = [{**rollout.to_json(), "advantage": advantage}
                for rollout, advantage in zip(batch.rollouts, batch.advantages)]
    expected[1]["unlikelihood"] = True
    records = batchfile.read_records(path)
    assert [{**r, "logprobs": numpy.float32(r["logprobs"]).tolist()} for r in records] == [
        {**e, "logprobs": numpy.float32(e["logprobs"]).tolist()} for e in expected]
    assert [r.to_json() for r in batch.filed(path).load()] == [r.to_json() for r in batch.rollouts]
    sequences = read_batch(path, vocab_size=10)
    assert [s.tokens for s in sequences] == [[5, 6, 7, 8], [5, 6], [9, 2]]
    assert [s.versions for s in sequences] == [[-1, -1, 3, 3], [-1, 3], [-1, 4]]
    assert [(s.advantage, s.unlikelihood) for s in sequences] == [(0.5, False), (-0.5, True), (-0.5, True)]
    assert numpy.float32(sequences[0].logprobs[3]) == numpy.float32(-0.123456789)


def test_the_safetensors_file_is_what_its_docstring_says_and_any_reader_opens_it(tmp_path):
    from safetensors import safe_open
    from safetensors.numpy import load_file

    path = tmp_path / "step.safetensors"
    path.write_bytes(b"".join(_batch().file()))
    tensors = load_file(str(path))
    assert {name: (t.dtype.str, t.shape) for name, t in tensors.items()} == {
        "lengths": ("<i8", (2,)), "tokens": ("<i4", (8,)), "logprobs": ("<f4", (8,)), "loss_mask": ("|i1", (8,)),
        "records": ("|u1", (len(tensors["records"]),))}
    assert tensors["tokens"].tolist() == [5, 6, 7, 8, 5, 6, 9, 2] and tensors["lengths"].tolist() == [4, 4]
    assert [json.loads(line)["episode_id"] for line in tensors["records"].tobytes().splitlines()] == ["g1-0", "g1-1"]
    with safe_open(str(path), framework="numpy") as handle:
        assert handle.metadata() == {"format": batchfile.FORMAT_TAG}
    header = struct.unpack("<Q", path.read_bytes()[:8])[0]
    assert (8 + header) % 8 == 0    # the data section starts 8-aligned
    # 4 + 4 + 1 bytes a token, the records beside them
    assert path.stat().st_size == 8 + header + 8 * 2 + 9 * 8 + len(tensors["records"])


def test_a_rollout_whose_arrays_disagree_is_refused_before_anything_is_written():
    rollout = _batch().rollouts[0]
    rows = [batchfile.Row(rollout.fields(), rollout.tokens, rollout.loss_mask, rollout.logprobs[:3])]
    with pytest.raises(ValueError, match="rollout 0 has 4 tokens, 4 mask entries and 3 logprobs"):
        b"".join(batchfile.encode(rows, "safetensors"))
    with pytest.raises(ValueError, match="run.batch_format: unknown batch format 'npz'"):
        batchfile.encode(rows, "npz")


def _rewritten(tmp_path: Path, change) -> Path:
    """The batch written with ``change(record)`` applied to its second rollout; the path."""
    records = batchfile.read_records(_write(tmp_path))
    change(records[1])
    path = tmp_path / "changed.safetensors"
    path.write_bytes(b"".join(batchfile.encode(list(batchfile.iter_rows(records)), "safetensors")))
    return path


def _write(tmp_path: Path) -> Path:
    path = tmp_path / "step.safetensors"
    path.write_bytes(b"".join(_batch().file()))
    return path


@pytest.mark.parametrize("change, message", [
    (lambda r: r.update(tokens=[5, 6, 10, 2]), "token id outside the vocabulary (size 10)"),
    (lambda r: r.update(loss_mask=[1, 1, 0, 1]), "loss_mask[0] is set"),
    (lambda r: r.update(logprobs=[0.0, float("nan"), 0.0, -1.0]), "must be finite"),
    (lambda r: r.update(advantage=None), "non-numeric value"),
    (lambda r: r.pop("advantage"), "missing key(s) 'advantage'"),
    (lambda r: r.update(unlikelihood="yes"), "unlikelihood must be true or false"),
    (lambda r: r.update(versions=[[3, 5]]), "versions cover 5 tokens but loss_mask marks 2"),
    (lambda r: r.update(segments=[1, 3]), "starts with a trained token"),
    (lambda r: r.update(tokens=[], loss_mask=[], logprobs=[], versions=[], segments=None), "no tokens"),
])
def test_read_batch_names_the_file_and_rollout_of_a_bad_record(tmp_path, change, message):
    path = _rewritten(tmp_path, change)
    with pytest.raises(BatchError) as caught:
        read_batch(path, vocab_size=10)
    assert str(caught.value).startswith(f"{path}: rollout 1: ") and message in str(caught.value), caught.value


def test_a_damaged_or_foreign_file_is_refused_naming_it(tmp_path):
    from safetensors.numpy import save_file

    path = _write(tmp_path)
    whole = path.read_bytes()
    (tmp_path / "truncated").write_bytes(whole[:-5])
    (tmp_path / "header_cut").write_bytes(whole[:20])
    (tmp_path / "text").write_bytes(b"not a batch\n")
    save_file({"tokens": numpy.zeros(3, numpy.int32)}, str(tmp_path / "foreign"))
    messages = {"truncated": "not a readable safetensors file", "header_cut": "not a readable safetensors file",
                "text": ":1: not valid JSON",
                "foreign": "a safetensors file, but not a batch file"}
    for name, message in messages.items():
        with pytest.raises(BatchError) as caught:
            read_batch(tmp_path / name, vocab_size=10)
        assert str(caught.value).startswith(str(tmp_path / name)) and message in str(caught.value), caught.value


def test_a_run_writes_the_format_it_is_told_a_resume_may_change_it_and_a_bad_one_is_named(tmp_path):
    from helpers import read_run, train, trained
    from rlorch.config.compose import compose
    from rlorch.config.schema import ConfigError
    from rlorch.runner import resume_training

    for fmt in batchfile.FORMATS:
        code, summary, _ = train(tmp_path / fmt, "train.steps=4", f"run.batch_format={fmt}", "run.report=false",
                                 "trainer.checkpoint_every=2")
        assert code == 0 and summary["lost"] == 0, summary
        files = sorted(p.name for p in (tmp_path / fmt / "rollouts").iterdir())
        assert files == [f"step_00000{s}{batchfile.SUFFIXES[fmt]}" for s in (1, 2, 3, 4)]
    # Resumed at step 2 as JSON lines: steps 3 and 4 of the first life move aside, whatever their format.
    run_dir = tmp_path / "safetensors"
    assert resume_training(str(run_dir / "checkpoints" / "step_000002"), ["run.batch_format=jsonl"]) == 0
    summary, _ = read_run(run_dir)
    assert summary["lost"] == 0 and summary["trained"] == 4 * 8, summary
    assert sorted(p.name for p in (run_dir / "rollouts").glob("step_*")) == [
        "step_000001.safetensors", "step_000002.safetensors", "step_000003.jsonl", "step_000004.jsonl"]
    (aside,) = (run_dir / "rollouts").glob("superseded-*")
    assert sorted(p.name for p in aside.iterdir()) == ["step_000003.safetensors", "step_000004.safetensors"]
    groups = [record["group_id"] for step in (1, 2, 3, 4) for record in trained(run_dir, step)]
    assert len(groups) == len(set(groups)) == 4 * 8
    with pytest.raises(ConfigError, match="run.batch_format"):
        compose(["run.batch_format=npz"])
