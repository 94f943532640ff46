"""The ledger's accounting: every admitted rollout has exactly one fate, so ``lost`` is 0; a group
that reaches no fate shows as ``lost`` = its size, one counted twice as a negative ``lost``, and a
run whose ledger does not balance fails saying which."""

from __future__ import annotations

import pytest

from helpers import train
from rlorch.orchestrator.ledger import Ledger, unaccounted
from rlorch.types import Batch, Fate, FiledBatch, Rollout
from test_components import rollout

GROUP = 4


def group(group_id: int) -> list:
    return [rollout(group_id, float(i), [[0, 2]]) for i in range(GROUP)]


def batch(step: int, *group_ids: int) -> Batch:
    rollouts = [r for g in group_ids for r in group(g)]
    return Batch(step=step, rollouts=rollouts, advantages=[1.0] * len(rollouts))


def ledger_of(groups: int, restored: dict | None = None) -> Ledger:
    return Ledger(group_size=GROUP, admissions=lambda: groups * GROUP, restored=restored)


def accounting(ledger: Ledger, *, step: int, untrained: int = 0, saved: bool = True) -> dict:
    return ledger.account(step=step, untrained=untrained, failed_prompts=0, empty_batches=0, saved=saved)


def every_fate(ledger: Ledger) -> None:
    """Six groups admitted: two trained (steps 1, 2), one filtered, one dropped stale, one
    requeued; the sixth is the caller's to account for."""
    ledger.ship(batch(1, 0))
    ledger.ship(batch(2, 1))
    ledger.record(Fate.filtered, GROUP)
    ledger.record(Fate.dropped_stale, GROUP)
    ledger.record(Fate.requeued, GROUP)


def test_every_fate_counted_once_balances():
    ledger = ledger_of(6)
    every_fate(ledger)
    result = accounting(ledger, step=2, untrained=GROUP)
    assert result["lost"] == 0 and unaccounted(result["lost"]) is None
    assert (result["trained"], result["filtered"], result["dropped_stale"], result["requeued"],
            result["persisted_untrained"]) == (2 * GROUP, GROUP, GROUP, GROUP, GROUP)


def test_a_group_with_no_fate_is_lost_by_its_size():
    ledger = ledger_of(6)
    every_fate(ledger)
    result = accounting(ledger, step=2)       # the sixth group: neither untrained nor anything else
    assert result["lost"] == GROUP
    assert f"lost = {GROUP}" in unaccounted(result["lost"]) and "neither trained" in unaccounted(result["lost"])


def test_a_group_counted_twice_makes_lost_negative_and_is_named():
    ledger = ledger_of(6)
    every_fate(ledger)
    ledger.record(Fate.filtered, GROUP)       # the sixth group, filtered ...
    result = accounting(ledger, step=2, untrained=GROUP)    # ... and also persisted untrained
    assert result["lost"] == -GROUP
    assert unaccounted(result["lost"]) == (f"ledger: lost = {-GROUP}: {GROUP} rollout fate(s) were counted twice "
                                           "(more trained, filtered, dropped, persisted or requeued than admitted)")


def test_a_batch_counts_as_trained_only_through_the_checkpoint_step():
    ledger = ledger_of(3)
    for step in (1, 2, 3):
        ledger.ship(batch(step, step - 1))
    assert accounting(ledger, step=2, untrained=GROUP)["lost"] == 0      # batch 3 untrained at checkpoint 2
    assert accounting(ledger, step=2)["lost"] == GROUP                   # ... and lost if nobody persists it
    ledger.snapshotted(3)
    assert not ledger.shipped and accounting(ledger, step=3)["lost"] == 0
    assert accounting(ledger, step=3, untrained=GROUP)["lost"] == -GROUP  # persisted and trained: twice


def test_counts_restored_from_a_checkpoint_are_the_starting_point():
    earlier = {"admitted": 8, "trained": 8, "filtered": 0}
    ledger = ledger_of(1, restored=earlier)
    ledger.ship(batch(3, 2))
    result = accounting(ledger, step=3)
    assert (result["admitted"], result["trained"], result["lost"]) == (3 * GROUP, 3 * GROUP, 0)


def test_without_a_checkpoint_untrained_and_requeued_count_as_unsaved():
    ledger = ledger_of(2)
    ledger.record(Fate.requeued, GROUP)
    result = accounting(ledger, step=0, untrained=GROUP, saved=False)
    assert (result["unsaved"], result["persisted_untrained"], result["requeued"], result["lost"]) == (2 * GROUP, 0, 0, 0)


@pytest.mark.parametrize("fault,expected", [("twice", "counted twice"), ("dropped", "neither trained")])
def test_a_run_whose_ledger_does_not_balance_fails_naming_it(tmp_path, monkeypatch, fault, expected):
    """A sim run with a bookkeeping fault: batch 2 counted as shipped twice, or never."""
    original = Ledger.ship

    def faulty(self, shipped):
        for _ in range({"twice": 2, "dropped": 0}[fault] if shipped.step == 2 else 1):
            original(self, shipped)

    monkeypatch.setattr(Ledger, "ship", faulty)
    code, summary, _ = train(tmp_path / fault, "train.steps=6", "inference.sim.latency=[0.002,0.002]",
                             "trainer.sim.step_time=0.01", "run.report=false")
    assert code == 1 and summary["status"] == "failed" and summary["stop"] == "bookkeeping", summary
    assert summary["lost"] == (-8 if fault == "twice" else 8), summary
    assert expected in summary["error"] and f"lost = {summary['lost']}" in summary["error"]


def test_a_filed_batch_holds_no_rollout_and_a_checkpoint_reads_its_groups_back_from_its_file(tmp_path):
    shipped = batch(2, 0, 1)
    path = tmp_path / "step_2.safetensors"
    path.write_bytes(b"".join(shipped.file()))
    ledger = ledger_of(2)
    ledger.ship(shipped.filed(path))
    (held,) = ledger.shipped
    assert isinstance(held, FiledBatch) and not any(isinstance(v, (list, Rollout)) for v in (held.step, held.path, held.size))
    assert ledger.shipped_count_after(1) == 2 * GROUP and ledger.trained_through(2) == 2 * GROUP
    assert ledger.shipped_after(1) == [group(0), group(1)]
    assert accounting(ledger, step=1, untrained=2 * GROUP)["lost"] == 0
    ledger.snapshotted(2)
    assert not ledger.shipped and accounting(ledger, step=2)["lost"] == 0
