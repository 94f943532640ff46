"""The shared asyncio helpers every component stops and fans out with."""

from __future__ import annotations

import asyncio

import pytest

from helpers import hang
from rlorch.lifecycle import gather_all


def test_gather_all_answers_in_order():
    async def value(x: int, delay: float) -> int:
        await asyncio.sleep(delay)
        return x

    assert asyncio.run(gather_all(value(1, 0.02), value(2, 0.0), value(3, 0.01))) == [1, 2, 3]


def test_the_first_failure_cancels_the_siblings_before_it_propagates():
    finished, cancelled = [], []

    async def sibling(name: str) -> None:
        try:
            await hang()
            finished.append(name)
        except asyncio.CancelledError:
            cancelled.append(name)
            raise

    async def failing() -> None:
        await asyncio.sleep(0.01)
        raise ConnectionError("engine gone")

    async def scenario() -> None:
        with pytest.raises(ConnectionError, match="engine gone"):
            await asyncio.wait_for(gather_all(sibling("a"), failing(), sibling("b")), 30)
        # Nothing is left running once the call has failed.
        assert sorted(cancelled) == ["a", "b"]

    asyncio.run(scenario())
    assert finished == []
