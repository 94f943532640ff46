"""Replay of stuck prompts (rollout.replay_share): what is queued, how often it comes back, and
that a checkpoint carries the queue so a resume makes the same prompts."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from rlorch.config.compose import compose
from rlorch.config.schema import ConfigError
from rlorch.rundir.layout import CheckpointDir
from rlorch.rundir.resume import read_state
from rlorch.rundir.state import ResumeState
from rlorch.tasks.episode import PromptSource
from rlorch.tasks.registry import make_environment
from rlorch.tasks.replay import REPLAY_CAPACITY, REPLAY_IDS, ReplayQueue


def _source(share: float, **kwargs) -> PromptSource:
    env = make_environment(compose([]))
    return PromptSource(env, tokenizer=None, seed=0, replay=ReplayQueue(share), **kwargs)


def _group(group_id: int, rewards):
    return [SimpleNamespace(group_id=group_id, reward=r) for r in rewards]


def test_only_flat_groups_below_the_maximum_are_queued():
    replay = ReplayQueue(0.25)
    replay.observe(3, [0.6, 0.6, 0.6])
    replay.observe(4, [0.6, 1.0, 0.6])
    replay.observe(5, [1.0, 1.0, 1.0])
    replay.observe(6, [0.2])
    replay.observe(3, [0.6, 0.6, 0.6])
    assert list(replay.queue) == [3]
    off = ReplayQueue(0.0)
    off.observe(3, [0.6, 0.6])
    assert not off.queue and off.draw() is None


def test_the_queue_is_bounded():
    replay = ReplayQueue(0.5)
    for index in range(REPLAY_CAPACITY + 10):
        replay.observe(index, [0.0, 0.0])
    assert len(replay.queue) == REPLAY_CAPACITY


def test_replays_are_a_bounded_share_of_draws_and_keep_the_data_position():
    source = _source(0.25)
    plain = _source(0.0)
    stuck = next(source)
    next(plain)
    for index in range(5):
        source.observe(_group(index, [0.4, 0.4]))
    drawn = [next(source) for _ in range(40)]
    replays = [p for p in drawn if p.group_id >= REPLAY_IDS]
    assert len(replays) == 5 and [p.group_id for p in replays] == list(range(REPLAY_IDS, REPLAY_IDS + 5))
    # One replay every 1 / share draws while something waits, never two in a row.
    assert [i for i, p in enumerate(drawn) if p.group_id >= REPLAY_IDS] == [3, 7, 11, 15, 19]
    # A replay is the same prompt as the one it replays; data prompts are those of a run without replay.
    assert replays[0].text == stuck.text and replays[0].answer == stuck.answer
    data = [p for p in drawn if p.group_id < REPLAY_IDS]
    assert [p.text for p in data] == [next(plain).text for _ in range(len(data))]
    assert source.position == 1 + len(data)
    # A replay that comes back flat and wrong again is queued under its source index.
    source.observe(_group(replays[0].group_id, [0.4, 0.4]))
    assert list(source.replay.queue) == [0]


def test_a_checkpoint_carries_the_queue_and_a_resume_makes_the_same_prompts(tmp_path):
    source = _source(0.5)
    for prompt in [next(source) for _ in range(3)]:
        source.observe(_group(prompt.group_id, [0.0, 0.0, 0.0]))
    assert next(source).group_id == 3
    replay = next(source)
    assert replay.group_id == REPLAY_IDS and replay.text == source.make(0).text
    state = ResumeState(step=7, prompt_position=source.position, untrained=[], pending_prompts=[replay],
                        replay=source.replay.state_dict())
    checkpoint = tmp_path / "step_000007"
    checkpoint.mkdir()
    CheckpointDir(checkpoint).state.write_text(json.dumps(state.to_json()))

    resumed = _source(0.5)
    restored = read_state(checkpoint, resumed.make, resumed.replay.load_state_dict)
    resumed.position = restored.prompt_position
    assert [(p.group_id, p.text) for p in restored.pending_prompts] == [(replay.group_id, replay.text)]
    assert list(resumed.replay.queue) == [1, 2]
    assert [(p.group_id, p.text) for p in (next(resumed) for _ in range(6))] == \
        [(p.group_id, p.text) for p in (next(source) for _ in range(6))]
    # A checkpoint written before replay existed resumes with an empty queue.
    old = state.to_json()
    del old["replay"]
    CheckpointDir(checkpoint).state.write_text(json.dumps(old))
    empty = _source(0.5)
    read_state(checkpoint, empty.make, empty.replay.load_state_dict)
    assert not empty.replay.queue


def test_replay_share_is_checked_by_key():
    with pytest.raises(ConfigError, match="rollout.replay_share"):
        compose(["rollout.replay_share=0.9"])
    with pytest.raises(ConfigError, match="trainer.clip_high"):
        compose(["trainer.clip_high=0"])
