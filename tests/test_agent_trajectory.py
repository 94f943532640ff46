"""An agent episode's tokens: calls that extend the held messages continue one sequence whose
trained tokens are exactly the engine's; anything else forks, and says why."""

from __future__ import annotations

import json

import pytest

from rlorch.agents.trajectory import CallKind, ForkReason, Trajectory, message_key
from rlorch.model import build_tokenizer
from rlorch.tasks.prompts import encode_prompt, encode_text
from rlorch.types import Generation, VersionStamps

CALL = {"id": "call_1", "type": "function", "function": {"name": "calculate", "arguments": '{"expression": "3+4"}'}}
# Drops what an earlier assistant turn wrote up to its last "z" (as Qwen3 drops past reasoning).
REWRITING = ("{{ bos_token }}{% for m in messages %}{{ m['role'] }}:{% if m['role'] == 'assistant' and not loop.last %}"
             "{{ m['content'].split('z')[-1] }}{% else %}{{ m['content'] }}{% endif %}{{ eos_token }}{% endfor %}"
             "{% if add_generation_prompt %}assistant:{% endif %}")


def generation(ids: list[int], version: int, logprob: float = -0.25) -> Generation:
    return Generation(ids, [logprob] * len(ids), VersionStamps.uniform(version, len(ids)), "stop")


def call(trajectory, tokenizer, messages, text, version, reply=None, tools=None):
    plan = trajectory.plan(messages, tools)
    ids = encode_text(tokenizer, text)
    reply = reply or {"role": "assistant", "content": tokenizer.decode(ids, skip_special_tokens=True)}
    return plan, trajectory.record(plan, generation(ids, version), reply, text), ids


def test_a_tool_round_trip_is_one_sequence_of_the_engine_ids():
    tokenizer = build_tokenizer()
    trajectory = Trajectory(tokenizer)
    user = {"role": "user", "content": "3+4="}
    first_plan, first, call_ids = call(trajectory, tokenizer, [user], "3+4|<eos>", 1,
                                       reply={"role": "assistant", "content": None, "tool_calls": [CALL]})
    assert first_plan.kind is CallKind.first
    assert first.prompt_ids.tolist() == encode_prompt(tokenizer, [user])
    # The agent echoes the assistant message as the openai client dumps it (other spacing in the
    # arguments, an empty content) and adds the tool's answer.
    echoed = {"role": "assistant", "content": "", "tool_calls": [
        {**CALL, "function": {"name": "calculate", "arguments": json.dumps({"expression": "3+4"}, indent=1)}}]}
    tool = {"role": "tool", "tool_call_id": "call_1", "content": "7"}
    second_plan, second, answer_ids = call(trajectory, tokenizer, [user, echoed, tool], "7<eos>", 2)
    assert second_plan.kind is CallKind.extended
    bridge = encode_text(tokenizer, "tool:7<eos>assistant:")
    assert second.prompt_ids.tolist() == first.prompt_ids.tolist() + call_ids + bridge
    tokens, mask, logprobs, versions, segments = trajectory.sequence()
    assert segments is None and trajectory.forks == 0
    assert tokens.tolist() == second.prompt_ids.tolist() + answer_ids
    prompt_len = len(first.prompt_ids)
    assert mask.tolist() == [0] * prompt_len + [1] * len(call_ids) + [0] * len(bridge) + [1] * len(answer_ids)
    assert [t for t, m in zip(tokens, mask) if m] == call_ids + answer_ids
    assert [p for p, m in zip(logprobs, mask) if m] == [-0.25] * (len(call_ids) + len(answer_ids))
    assert not any(p for p, m in zip(logprobs, mask) if not m)
    assert versions.expand() == [1] * len(call_ids) + [2] * len(answer_ids)


def test_a_turn_cut_by_the_length_limit_gets_the_closer_untrained():
    tokenizer = build_tokenizer()
    trajectory = Trajectory(tokenizer)
    user = {"role": "user", "content": "1+1="}
    _, first, ids = call(trajectory, tokenizer, [user], "22", 0)
    _, second, _ = call(trajectory, tokenizer, [user, {"role": "assistant", "content": "22"},
                                                {"role": "user", "content": "no"}], "2<eos>", 0)
    assert second.prompt_ids.tolist() == (first.prompt_ids.tolist() + ids
                                          + encode_text(tokenizer, "<eos>user:no<eos>assistant:"))


def test_messages_that_do_not_extend_the_held_ones_fork():
    tokenizer = build_tokenizer()
    trajectory = Trajectory(tokenizer)
    user = {"role": "user", "content": "3+4="}
    call(trajectory, tokenizer, [user], "7<eos>", 0)
    # History edited: the assistant turn the agent sends is not the one it was given.
    plan, record, _ = call(trajectory, tokenizer, [user, {"role": "assistant", "content": "8"},
                                                   {"role": "user", "content": "no"}], "7<eos>", 1)
    assert plan.kind is CallKind.forked and plan.fork_reason is ForkReason.diverged
    assert record.segment == 1 and trajectory.forks == 1
    tokens, mask, _, _, segments = trajectory.sequence()
    assert segments == [len(s.tokens) for s in trajectory.segments] and sum(segments) == len(tokens)
    assert mask[segments[0]] == 0  # the second segment starts with its own (untrained) prompt
    # The same messages again (a second sample of the same turn, not a retry) fork too.
    plan, _, _ = call(trajectory, tokenizer, [user], "7<eos>", 1)
    assert plan.fork_reason is ForkReason.diverged and trajectory.forks == 2


def test_a_template_that_rewrites_earlier_turns_forks_without_the_bridge_and_bridges_with_it():
    tokenizer = build_tokenizer()
    tokenizer.chat_template = REWRITING
    user, more = {"role": "user", "content": "3+4="}, {"role": "user", "content": "no"}
    for bridge in (False, True):
        trajectory = Trajectory(tokenizer, bridge=bridge)
        _, first, ids = call(trajectory, tokenizer, [user], "abz7<eos>", 0)
        plan, second, _ = call(trajectory, tokenizer, [user, {"role": "assistant", "content": "abz7"}, more],
                               "8<eos>", 1)
        if not bridge:
            assert plan.kind is CallKind.forked and plan.fork_reason is ForkReason.template
            assert trajectory.forks == 1
            # A fresh rendering, as the template writes it (the earlier turn rewritten).
            assert tokenizer.decode(second.prompt_ids.tolist()) == "<bos>user:3+4=<eos>assistant:7<eos>user:no<eos>assistant:"
        else:
            assert plan.kind is CallKind.bridged and trajectory.forks == 0
            # The sampled "abz7" is kept as sampled.
            assert second.prompt_ids.tolist() == (first.prompt_ids.tolist() + ids
                                                  + encode_text(tokenizer, "user:no<eos>assistant:"))


def test_two_calls_extending_the_same_turn_at_once_fork_the_later():
    tokenizer = build_tokenizer()
    trajectory = Trajectory(tokenizer)
    user = {"role": "user", "content": "3+4="}
    call(trajectory, tokenizer, [user], "7<eos>", 0)
    history = [user, {"role": "assistant", "content": "7"}]
    a = trajectory.plan([*history, {"role": "user", "content": "a"}])
    b = trajectory.plan([*history, {"role": "user", "content": "b"}])
    ids = encode_text(tokenizer, "1<eos>")
    trajectory.record(a, generation(ids, 1), {"role": "assistant", "content": "1"}, "1<eos>")
    late = trajectory.record(b, generation(ids, 1), {"role": "assistant", "content": "1"}, "1<eos>")
    assert late.kind is CallKind.forked and trajectory.fork_reasons == [ForkReason.concurrent]
    assert trajectory.segments[1].tokens.tolist() == b.prompt_ids.tolist() + ids


def test_message_keys_ignore_what_does_not_render():
    a = {"role": "assistant", "content": None, "tool_calls": [CALL]}
    b = {"role": "assistant", "content": "", "refusal": None,
         "tool_calls": [{**CALL, "id": "other", "function": {"name": "calculate", "arguments": '{"expression":"3+4"}'}}]}
    assert message_key(a) == message_key(b)
    assert message_key({"role": "user", "content": [{"type": "text", "text": "hi"}]}) == message_key(
        {"role": "user", "content": "hi"})
    assert message_key({"role": "user", "content": "hi"}) != message_key({"role": "user", "content": "ho"})


@pytest.mark.parametrize("fmt", ["safetensors", "jsonl"])
def test_a_forked_episode_trains_as_one_sequence_per_segment_under_its_advantage(tmp_path, fmt):
    from rlorch.rundir import batchfile
    from rlorch.trainer.batch import BatchError, read_batch
    from rlorch.types import Batch, Rollout

    tokenizer = build_tokenizer()
    trajectory = Trajectory(tokenizer)
    user = {"role": "user", "content": "3+4="}
    call(trajectory, tokenizer, [user], "7<eos>", 3)
    call(trajectory, tokenizer, [{"role": "user", "content": "5+5="}], "10<eos>", 4)
    tokens, mask, logprobs, versions, segments = trajectory.sequence()
    rollout = Rollout(0, "g0-0-0", "calculator", tokens, mask, logprobs, versions, 1.0, segments=segments)
    assert Rollout.from_json(rollout.to_json()).segments == segments
    path = tmp_path / f"batch{batchfile.SUFFIXES[fmt]}"
    path.write_bytes(b"".join(Batch(1, [rollout], [0.5]).file(fmt)))
    sequences = read_batch(path, len(tokenizer))
    assert [len(s.tokens) for s in sequences] == segments
    assert [s.tokens for s in sequences] == [seg.tokens.tolist() for seg in trajectory.segments]
    assert all(s.advantage == 0.5 for s in sequences)
    assert [sorted({v for v, m in zip(s.versions, s.loss_mask) if m}) for s in sequences] == [[3], [4]]
    (record,) = batchfile.read_records(path)
    record["segments"] = [segments[0] - 1, segments[1] + 1]  # the second would start with a trained token
    path.write_bytes(b"".join(batchfile.encode(list(batchfile.iter_rows([record])), fmt)))
    with pytest.raises(BatchError, match="starts with a trained token"):
        read_batch(path, len(tokenizer))
