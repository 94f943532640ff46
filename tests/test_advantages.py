"""Advantage estimators as pure functions, checked against values worked out by hand."""

from __future__ import annotations

import math

import pytest

from rlorch.config.compose import compose
from rlorch.config.schema import ConfigError
from rlorch.trainer.advantages import EPS, advantages

GROUPS = [[1.0, 0.0, 0.0, 1.0], [2.0, 0.0, 1.0, 1.0]]
"""Group 1: mean 0.5, std 0.5. Group 2: mean 1, std sqrt(0.5). Batch: mean 0.75, std sqrt(0.4375)."""


def _close(got, expected):
    assert len(got) == len(expected)
    for row, want in zip(got, expected):
        assert row == pytest.approx(want, abs=1e-9)


def test_grpo_divides_the_group_centred_rewards_by_the_group_std():
    a, b = 0.5 / (0.5 + EPS), 1 / (math.sqrt(0.5) + EPS)
    _close(advantages(GROUPS, "grpo"), [[a, -a, -a, a], [b, -b, 0.0, 0.0]])
    assert advantages(GROUPS, "grpo")[0][0] == pytest.approx(1.0, abs=1e-5)


def test_dr_grpo_keeps_the_group_mean_and_drops_the_std():
    _close(advantages(GROUPS, "dr_grpo"), [[0.5, -0.5, -0.5, 0.5], [1.0, -1.0, 0.0, 0.0]])


def test_rloo_subtracts_the_mean_of_the_other_samples():
    # 1 - (0 + 0 + 1) / 3 = 2/3; 0 - 2/3; group 2: 2 - 2/3 = 4/3, 0 - 4/3, 1 - 1 = 0.
    _close(advantages(GROUPS, "rloo"), [[2 / 3, -2 / 3, -2 / 3, 2 / 3], [4 / 3, -4 / 3, 0.0, 0.0]])
    # verl's and the RLOO paper's form: G / (G - 1) times the group-centred reward.
    rewards = [[0.2, 0.47, 1.0, 0.73, 0.2]]
    _close(advantages(rewards, "rloo"), [[5 / 4 * a for a in advantages(rewards, "dr_grpo")[0]]])


def test_reinforce_subtracts_the_batch_mean():
    _close(advantages(GROUPS, "reinforce"), [[0.25, -0.75, -0.75, 0.25], [1.25, -0.75, 0.25, 0.25]])


def test_scale_rewards_batch_and_none_override_the_estimators_own():
    batch_std = math.sqrt(0.4375) + EPS
    _close(advantages(GROUPS, "grpo", "batch"), [[0.5 / batch_std, -0.5 / batch_std, -0.5 / batch_std, 0.5 / batch_std],
                                                 [1 / batch_std, -1 / batch_std, 0.0, 0.0]])
    _close(advantages(GROUPS, "grpo", "none"), advantages(GROUPS, "dr_grpo"))
    _close(advantages(GROUPS, "reinforce", "group"),
           [[0.25 / (0.5 + EPS), -0.75 / (0.5 + EPS), -0.75 / (0.5 + EPS), 0.25 / (0.5 + EPS)],
            [1.25 / (math.sqrt(0.5) + EPS), -0.75 / (math.sqrt(0.5) + EPS), 0.25 / (math.sqrt(0.5) + EPS),
             0.25 / (math.sqrt(0.5) + EPS)]])


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo"])
def test_a_zero_variance_group_gets_zero_advantages_from_group_baselines(estimator):
    got = advantages([[1.0, 1.0, 1.0], [0.0, 1.0, 1.0]], estimator)
    assert got[0] == [0.0, 0.0, 0.0]
    assert got[1][0] < 0 < got[1][1] == got[1][2]


def test_reinforce_gives_a_zero_variance_group_the_batch_mean_difference():
    _close(advantages([[1.0, 1.0], [0.0, 0.0]], "reinforce"), [[0.5, 0.5], [-0.5, -0.5]])
    _close(advantages([[1.0, 1.0], [1.0, 1.0]], "reinforce", "batch"), [[0.0, 0.0], [0.0, 0.0]])


@pytest.mark.parametrize("estimator, expected", [
    ("grpo", [1 / (1 + EPS), -1 / (1 + EPS), 1 / (1 + EPS), -1 / (1 + EPS)]),  # batch mean 1, std 1
    ("dr_grpo", [1.0, -1.0, 1.0, -1.0]),
    ("rloo", [2 - 2 / 3, 0 - 4 / 3, 2 - 2 / 3, 0 - 4 / 3]),  # others' mean: (0 + 2 + 0) / 3, (2 + 2 + 0) / 3
    ("reinforce", [1.0, -1.0, 1.0, -1.0]),
])
def test_groups_of_one_are_normalised_as_one_group_across_the_batch(estimator, expected):
    got = advantages([[2.0], [0.0], [2.0], [0.0]], estimator)
    _close(got, [[a] for a in expected])


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo", "reinforce"])
def test_a_lone_sample_has_no_baseline_but_itself(estimator):
    assert advantages([[3.0]], estimator) == [[0.0]]


def test_a_lone_sample_among_larger_groups_gets_zero_under_group_baselines():
    for estimator in ("grpo", "dr_grpo", "rloo"):
        assert advantages([[1.0, 0.0], [1.0]], estimator)[1] == [0.0]
    assert advantages([[1.0, 0.0], [1.0]], "reinforce")[1] == [pytest.approx(1 / 3)]


def test_the_default_is_todays_grpo_bit_for_bit():
    rewards = [0.3, 0.7, 0.1, 0.9, 0.9]
    mean = sum(rewards) / len(rewards)
    std = math.sqrt(sum([(r - mean) ** 2 for r in rewards]) / len(rewards))
    assert advantages([rewards]) == [[(r - mean) / (std + 1e-6) for r in rewards]]


def test_config_refuses_dr_grpo_with_a_std_divisor_and_unknown_names():
    assert compose(["trainer.advantage=dr_grpo"]).trainer.scale_rewards is None
    assert compose(["trainer.advantage=rloo", "trainer.scale_rewards=batch"]).trainer.scale_rewards.value == "batch"
    with pytest.raises(ConfigError) as caught:
        compose(["trainer.advantage=dr_grpo", "trainer.scale_rewards=group"])
    assert caught.value.key == "trainer.scale_rewards"
    with pytest.raises(Exception, match="trainer.advantage"):
        compose(["trainer.advantage=ppo"])
    with pytest.raises(ValueError, match="trainer.advantage"):
        advantages(GROUPS, "ppo")


def test_the_train_sink_emits_the_configured_estimators_advantages():
    from rlorch.orchestrator.sinks import TrainSink
    from test_components import rollout

    def emitted(**kwargs):
        sink = TrainSink(batch_size=4, max_staleness=2, strict=False, **kwargs)
        for group, rewards in enumerate(([1.0, 0.0], [2.0, 1.0])):
            sink.add([rollout(group, r, [[0, 1]], token=i) for i, r in enumerate(rewards)], step=1)
        return sink.emit(1).advantages

    assert emitted() == pytest.approx([1.0, -1.0, 1.0, -1.0], abs=1e-5)
    assert emitted(advantage="rloo") == pytest.approx([1.0, -1.0, 1.0, -1.0])
    assert emitted(advantage="reinforce") == pytest.approx([0.0, -1.0, 1.0, 0.0])


CRAFTED = [[1.0, 0.6, 0.6, 1.0], [0.6, 0.6, 0.6, 0.6], [1.0, 1.0, 1.0, 1.0]]
"""Mixed (mean 0.8, std 0.2), flat below the maximum (0.6), flat at the maximum. Batch: 12 rewards,
mean (2.4 + 2.4 + 4) / 12 = 0.7333..., std sqrt(mean of squares - mean^2)."""


def test_flat_advantage_batch_pushes_a_flat_wrong_group_and_nothing_else():
    rewards = [r for group in CRAFTED for r in group]
    mean = sum(rewards) / 12
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / 12)
    mixed = 0.2 / (0.2 + EPS)
    flat = (0.6 - mean) / (std + EPS)
    assert flat < -0.5
    _close(advantages(CRAFTED, "grpo", flat="batch"), [[mixed, -mixed, -mixed, mixed], [flat] * 4, [0.0] * 4])
    # The maximum is the environment's: below a higher one the third group is stuck too.
    top = (1.0 - mean) / (std + EPS)
    assert advantages(CRAFTED, "grpo", flat="batch", max_reward=2.0)[2] == pytest.approx([top] * 4)


def test_flat_advantage_zero_is_the_estimators_own():
    for estimator in ("grpo", "dr_grpo", "rloo", "reinforce"):
        assert advantages(CRAFTED, estimator, flat="zero") == advantages(CRAFTED, estimator)
    a = 0.2 / (0.2 + EPS)
    _close(advantages(CRAFTED, "grpo"), [[a, -a, -a, a], [0.0] * 4, [0.0] * 4])


def test_flat_advantage_unknown_choice_names_the_key():
    with pytest.raises(ValueError, match="trainer.flat_advantage"):
        advantages(CRAFTED, "grpo", flat="entropy")


def test_the_train_sink_trains_a_kept_flat_wrong_group_under_flat_advantage_batch():
    from rlorch.orchestrator.sinks import TrainSink
    from test_components import rollout

    def emitted(**kwargs):
        sink = TrainSink(batch_size=6, max_staleness=2, strict=False, keep_flat=True, **kwargs)
        for group, rewards in enumerate(([1.0, 0.0], [0.5, 0.5], [1.0, 1.0])):
            sink.add([rollout(group, r, [[0, 1]], token=i) for i, r in enumerate(rewards)], step=1)
        return sink.emit(1).advantages

    assert emitted()[2:] == [0.0] * 4
    mean, std = 4 / 6, math.sqrt((3 * (1 / 3) ** 2 + (2 / 3) ** 2 + 2 * (1 / 6) ** 2) / 6)
    assert emitted(flat_advantage="batch")[2:] == pytest.approx([(0.5 - mean) / (std + EPS)] * 2 + [0.0] * 2)


def test_flat_advantage_negative_never_reinforces_a_flat_wrong_group():
    groups = [[0.2, 0.2], [0.9, 0.9], [0.0, 1.0]]
    batch = advantages(groups, "grpo", flat="batch")
    assert batch[1][0] > 0 > batch[0][0]
    negative = advantages(groups, "grpo", flat="negative")
    assert negative == [batch[0], [0.0, 0.0], batch[2]]


def test_flat_advantage_bounded_is_negative_floored_at_minus_one():
    # Nearly all solved: the batch's std is small and a flat wrong group's z-score far below -1.
    groups = [[1.0, 1.0]] * 14 + [[0.2, 0.2], [0.9, 0.9]]
    negative = advantages(groups, "grpo", flat="negative")
    assert negative[14][0] < -3 and -1 < negative[15][0] < 0
    bounded = advantages(groups, "grpo", flat="bounded")
    assert bounded[14] == [-1.0, -1.0] and bounded[15] == negative[15] and bounded[:14] == negative[:14]
    mild = [[0.2, 0.2], [0.9, 0.9], [0.0, 1.0]]
    assert advantages(mild, "grpo", flat="bounded") == advantages(mild, "grpo", flat="negative")


def test_flat_advantage_unlikelihood_gives_flat_wrong_groups_minus_one_and_marks_only_them():
    from rlorch.trainer.advantages import unlikelihood_marks

    groups = [[1.0, 1.0]] * 14 + [[0.2, 0.2], [0.0, 1.0]]
    unlikely = advantages(groups, "grpo", flat="unlikelihood")
    assert unlikely[14] == [-1.0, -1.0]
    assert unlikely[:14] == [[0.0, 0.0]] * 14 and unlikely[15] == advantages(groups, "grpo")[15]
    assert unlikelihood_marks(groups, "unlikelihood") == [False] * 28 + [True, True, False, False]
    assert unlikelihood_marks(groups, "bounded") == [False] * 32


def test_the_train_sink_marks_a_kept_flat_wrong_group_for_the_trainer_and_its_file_says_so(tmp_path):
    from rlorch.rundir import batchfile
    from rlorch.orchestrator.sinks import TrainSink
    from test_components import rollout

    def emitted(**kwargs):
        sink = TrainSink(batch_size=6, max_staleness=2, strict=False, keep_flat=True, **kwargs)
        for group, rewards in enumerate(([1.0, 0.0], [0.5, 0.5], [1.0, 1.0])):
            sink.add([rollout(group, r, [[0, 1]], token=i) for i, r in enumerate(rewards)], step=1)
        return sink.emit(1)

    batch = emitted(flat_advantage="unlikelihood")
    assert batch.advantages[2:] == [-1.0, -1.0, 0.0, 0.0]
    assert batch.unlikelihood == [False, False, True, True, False, False]
    for fmt in batchfile.FORMATS:
        path = tmp_path / f"batch{batchfile.SUFFIXES[fmt]}"
        path.write_bytes(b"".join(batch.file(fmt)))
        records = batchfile.read_records(path)
        assert [record.get("unlikelihood", False) for record in records] == batch.unlikelihood
        assert [r.reward for r in batch.filed(path).load()] == [1.0, 0.0, 0.5, 0.5, 1.0, 1.0]
        path.write_bytes(b"".join(emitted(flat_advantage="bounded").file(fmt)))
        assert not any("unlikelihood" in record for record in batchfile.read_records(path))


def test_config_refuses_a_flat_advantage_whose_flat_groups_are_filtered_away():
    assert compose(["trainer.flat_advantage=unlikelihood"]).trainer.flat_advantage.value == "unlikelihood"
    with pytest.raises(ConfigError) as caught:
        compose(["trainer.flat_advantage=unlikelihood", "rollout.filter_groups=true"])
    assert caught.value.key == "trainer.flat_advantage" and "rollout.filter_groups=false" in str(caught.value)
    compose(["trainer.flat_advantage=zero", "rollout.filter_groups=true"])
