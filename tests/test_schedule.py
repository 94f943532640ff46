"""The learning-rate schedule as a pure function, checked against values worked out by hand."""

from __future__ import annotations

import math

import pytest

from rlorch.config.compose import compose
from rlorch.config.schema import ConfigError
from rlorch.trainer.schedule import lr_factor


def _curve(total: int, **kwargs) -> list[float]:
    return [lr_factor(p, total_steps=total, **kwargs) for p in range(total)]


def test_constant_without_warmup_is_exactly_one():
    assert _curve(5) == [1.0] * 5
    assert _curve(5, min_lr_ratio=0.3) == [1.0] * 5


def test_warmup_ramps_from_lr_over_n_to_lr_then_holds():
    assert _curve(6, warmup_steps=4) == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


def test_linear_decays_from_the_end_of_warmup_to_the_floor():
    # total 6, warm-up 2: progress (p - 2) / 4 -> 0, 0.25, 0.5, 0.75 for p = 2..5.
    assert _curve(6, schedule="linear", warmup_steps=2) == pytest.approx([0.5, 1.0, 1.0, 0.75, 0.5, 0.25])
    assert _curve(6, schedule="linear", warmup_steps=2, min_lr_ratio=0.2) == pytest.approx(
        [0.5, 1.0, 1.0, 0.8, 0.6, 0.4])
    assert lr_factor(99, schedule="linear", total_steps=6, min_lr_ratio=0.2) == pytest.approx(0.2)


def test_cosine_follows_half_a_cosine_to_the_floor():
    got = _curve(5, schedule="cosine", warmup_steps=1, min_lr_ratio=0.1)
    # progress (p - 1) / 4: 0, 0.25, 0.5, 0.75.
    shape = [0.5 * (1 + math.cos(math.pi * x)) for x in (0.0, 0.25, 0.5, 0.75)]
    assert got == pytest.approx([1.0] + [0.1 + 0.9 * s for s in shape])
    assert got[3] == pytest.approx(0.55)
    assert lr_factor(5, schedule="cosine", total_steps=5, min_lr_ratio=0.1) == pytest.approx(0.1)


def test_config_checks_name_the_key():
    config = compose(["trainer.lr_schedule=cosine", "trainer.warmup_steps=3", "trainer.min_lr_ratio=0.1"])
    assert config.trainer.lr_schedule.value == "cosine"
    for override, key in (("trainer.warmup_steps=-1", "trainer.warmup_steps"),
                          ("trainer.min_lr_ratio=1.5", "trainer.min_lr_ratio")):
        with pytest.raises(ConfigError) as caught:
            compose([override])
        assert caught.value.key == key
    with pytest.raises(Exception, match="trainer.lr_schedule"):
        compose(["trainer.lr_schedule=step"])


def test_a_warmup_longer_than_the_run_is_warned_about():
    from rlorch.config.schema import warnings_for

    assert not warnings_for(compose(["train.steps=10", "trainer.warmup_steps=9"]))
    found = warnings_for(compose(["train.steps=10", "trainer.minibatches=2", "trainer.warmup_steps=20"]))
    assert len(found) == 1 and found[0].startswith("trainer.warmup_steps (20) >= train.steps * trainer.minibatches (20)")
