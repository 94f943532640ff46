"""The capacity gate as a synchronous state machine: formula, lifecycle, versions, recovery, threads."""

import sys
import threading
import time

import pytest

from rlorch.orchestrator.gate import CapacityGate
from rlorch.types import PolicyVersion


class YieldingPolicy(PolicyVersion):
    """A version handle whose read yields the thread, inside the gate's check-then-admit window."""

    @property
    def value(self):
        time.sleep(0)
        return self._value

    @value.setter
    def value(self, new):
        self._value = new


def make_gate(S=2, B=8, C=10**6, version=0, policy_type=PolicyVersion):
    policy = policy_type(version)
    return CapacityGate(max_staleness=S, batch_size=B, max_concurrent=C, policy=policy), policy


@pytest.mark.parametrize("S", [0, 1, 2, 4, 8])
def test_fresh_capacity_is_the_pending_limit(S):
    gate, _ = make_gate(S=S, B=8)
    assert gate.pending_limit == (S + 1) * 8
    assert gate.capacity() == (S + 1) * 8


def test_concurrency_binds_first():
    gate, _ = make_gate(S=4, B=8, C=12)
    assert gate.pending_limit == 40
    assert gate.capacity() == 12
    assert gate.try_admit(5)
    assert gate.capacity() == 7


def test_staleness_term_counts_accepted_and_running():
    gate, _ = make_gate(S=2, B=8)
    assert gate.try_admit(10)
    gate.on_accepted(4)
    assert gate.capacity() == 24 - (4 + 6)


def test_capacity_goes_negative_when_over_the_bound():
    gate, policy = make_gate(S=2, B=8, version=40)
    gate.on_version_recovered(40)
    gate.on_submitted(30)
    assert gate.capacity() == 24 - 30
    assert not gate.try_admit(1)
    assert gate.counts().capacity == -6
    policy.bump()
    assert gate.capacity() == 2


def test_lifecycle_counters():
    gate, _ = make_gate(S=1, B=4)
    assert gate.try_admit(3)
    gate.on_accepted(2)
    gate.on_rejected(1)
    counts = gate.counts()
    assert (counts.submitted, counts.running, counts.accepted, counts.rejected) == (3, 0, 2, 1)
    assert counts.capacity == 8 - 2


def test_rejected_frees_its_slot():
    gate, _ = make_gate(S=0, B=4)
    assert gate.try_admit(4)
    assert gate.capacity() == 0
    gate.on_rejected(1)
    assert gate.capacity() == 1
    gate.on_accepted(3)
    assert gate.capacity() == 1


def test_discarded_moves_accepted_to_rejected_and_frees_slots():
    gate, _ = make_gate(S=0, B=4)
    assert gate.try_admit(4)
    gate.on_accepted(4)
    assert gate.capacity() == 0
    gate.on_discarded(3)
    counts = gate.counts()
    assert (counts.accepted, counts.rejected, counts.capacity) == (1, 3, 3)
    with pytest.raises(ValueError, match="only 1 accepted"):
        gate.on_discarded(2)


def test_finishing_more_than_running_raises():
    gate, _ = make_gate()
    assert gate.try_admit(2)
    with pytest.raises(ValueError, match="only 2 running"):
        gate.on_accepted(3)
    with pytest.raises(ValueError, match="only 2 running"):
        gate.on_rejected(3)
    assert gate.counts().running == 2


def test_invalid_construction_raises():
    for S, B, C in [(-1, 8, 8), (0, 0, 8), (0, 8, 0)]:
        with pytest.raises(ValueError):
            make_gate(S=S, B=B, C=C)


def test_version_bump_opens_one_batch_of_slots():
    gate, policy = make_gate(S=1, B=8)
    assert gate.try_admit(16)
    gate.on_accepted(16)
    assert gate.capacity() == 0
    policy.bump()
    assert gate.capacity() == 8
    assert gate.counts().version == 1
    policy.bump(to=3)
    assert gate.capacity() == 24
    with pytest.raises(ValueError):
        policy.bump(to=2)


def test_group_admission_is_all_or_nothing():
    gate, _ = make_gate(S=1, B=8, C=10)
    assert gate.try_admit(4)
    assert gate.try_admit(4)
    assert gate.capacity() == 2
    assert not gate.try_admit(4)
    assert gate.counts().submitted == 8
    assert gate.try_admit(2)
    assert gate.capacity() == 0
    assert gate.counts().submitted == 10


@pytest.mark.parametrize("version", [1, 5, 40, 1000])
def test_recovery_closes_the_resume_burst(version):
    gate, _ = make_gate(S=2, B=8, version=version)
    assert gate.capacity() == (2 + version + 1) * 8
    gate.on_version_recovered(version)
    assert gate.counts().accepted == version * 8
    assert gate.capacity() == gate.pending_limit == 24


def test_recovery_counts_buffered_rollouts():
    gate, _ = make_gate(S=2, B=8, version=40)
    gate.on_version_recovered(40, buffered=5)
    assert gate.counts().accepted == 325
    assert gate.capacity() == 24 - 5


def test_recovery_with_running_rollouts_raises():
    gate, _ = make_gate(S=2, B=8, version=40)
    assert gate.try_admit(1)
    with pytest.raises(ValueError, match="1 running"):
        gate.on_version_recovered(40)


def _run_threads(worker, count):
    """Run ``worker(i)`` on ``count`` threads, switching often so unlocked updates would race."""
    errors = []
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)

    def guarded(*args):
        try:
            worker(*args)
        except BaseException as err:  # surfaced in the test thread below
            errors.append(err)

    threads = [threading.Thread(target=guarded, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    try:
        for thread in threads:
            thread.join(timeout=30)
    finally:
        sys.setswitchinterval(interval)
    assert not any(thread.is_alive() for thread in threads)
    if errors:
        raise errors[0]


@pytest.mark.parametrize("S,B,C", [(10**6, 8, 20), (0, 20, 10**6), (1, 8, 12)])
def test_concurrent_admission_fills_exactly_to_the_bound(S, B, C):
    gate, policy = make_gate(S=S, B=B, C=C, policy_type=YieldingPolicy)
    limit = min(C, (S + 1) * B)

    def worker(_):
        while gate.try_admit(1):
            pass

    for _ in range(10):
        _run_threads(worker, 16)
        counts = gate.counts()
        assert counts.running == limit
        assert counts.capacity == 0
        gate.on_accepted(limit)
        policy.bump(to=gate.counts().accepted // B)
    assert gate.counts().submitted == 10 * limit


def test_concurrent_counter_updates_are_consistent():
    gate, _ = make_gate(S=0, B=10**6, C=10**6)
    per_thread = 2000

    def worker(_):
        for i in range(per_thread):
            assert gate.try_admit(2)
            if i % 2:
                gate.on_accepted(2)
            else:
                gate.on_rejected(2)

    _run_threads(worker, 8)
    counts = gate.counts()
    assert counts.submitted == 8 * per_thread * 2
    assert counts.accepted == counts.rejected == 8 * per_thread
    assert counts.running == 0


def test_a_short_batch_counts_its_shortfall_as_accepted():
    """A batch shipped short (filter budget) must still account for B accepted rollouts, or each
    short batch would open slots beyond (S + v + 1) * B."""
    policy = PolicyVersion(0)
    gate = CapacityGate(max_staleness=1, batch_size=8, max_concurrent=100, policy=policy)
    assert gate.try_admit(8)
    gate.on_accepted(8)
    gate.on_discarded(5)       # 5 of them filtered: the batch ships with 3
    gate.on_short_batch(5)
    policy.bump()
    assert gate.capacity() == (1 + 1 + 1) * 8 - 8
