"""Replay of stuck prompts (``rollout.replay_share``): prompts whose group came back flat below
the maximum reward are drawn again sooner.

A prompt the policy answers one wrong way every time has a group whose samples all score the same:
GRPO gives it advantage 0, and a fresh prompt stream brings it back once every pass over the
prompt set, if ever. The replay queue takes such prompts (by their index in the environment) as
their groups finish and hands them back ahead of new prompts, one replay per ``1 / share`` draws,
so they are trained again within a batch or two, until a group of theirs has spread or is
solved. A replay takes its own group id (from ``REPLAY_IDS`` on), never a data position: the
data stream and its position are exactly those of a run without replay.

Invariants: the queue holds each index at most once and at most ``REPLAY_CAPACITY``; a replay id
resolves to its source index for as long as ``ALIAS_MEMORY`` later replays have not been drawn
(longer than any replay can be in flight, queued or regenerated); the whole state is a small dict
saved with the data position at checkpoints (:meth:`ReplayQueue.state_dict`).
"""

from __future__ import annotations

from collections import deque
from typing import Optional, Sequence

REPLAY_CAPACITY = 256
"""Most stuck prompts waiting for a replay; a flat wrong group beyond it is not queued."""
REPLAY_IDS = 1 << 40
"""Replays' group ids start here, far above any data position."""
ALIAS_MEMORY = 16_384
"""Replay ids remembered (their source index), newest first."""


class ReplayQueue:
    def __init__(self, share: float = 0.0, *, max_reward: float = 1.0):
        self.share = share
        self.max_reward = max_reward
        self.queue: deque[int] = deque()
        self.aliases: dict[int, int] = {}
        """Replay group id -> the source index it replays."""
        self.next_id = REPLAY_IDS
        self.credit = 0.0
        self.replayed = 0

    def source(self, group_id: int) -> int:
        """The environment index group ``group_id`` asks for."""
        return self.aliases.get(group_id, group_id)

    def observe(self, group_id: int, rewards: Sequence[float]) -> None:
        """A training group finished: queue its prompt when its samples all scored the same below
        the maximum reward."""
        if not self.share or len(rewards) < 2 or rewards[0] >= self.max_reward:
            return
        if any(r != rewards[0] for r in rewards):
            return
        index = self.source(group_id)
        if index not in self.queue and len(self.queue) < REPLAY_CAPACITY:
            self.queue.append(index)

    def draw(self) -> Optional[int]:
        """The group id of a replay to run now, or None for the next data prompt. Credit accrues
        ``share`` a draw while something waits (at most one replay's worth), so replays are at
        most ``share`` of the draws and never come in a burst."""
        if not self.share or not self.queue:
            self.credit = 0.0
            return None
        self.credit = min(1.0, self.credit + self.share)
        if self.credit < 1.0:
            return None
        self.credit -= 1.0
        group_id, self.next_id = self.next_id, self.next_id + 1
        self.aliases[group_id] = self.queue.popleft()
        if len(self.aliases) > ALIAS_MEMORY:
            del self.aliases[next(iter(self.aliases))]
        self.replayed += 1
        return group_id

    def state_dict(self) -> dict:
        return {"queue": list(self.queue), "aliases": [[k, v] for k, v in self.aliases.items()],
                "next_id": self.next_id, "credit": self.credit, "replayed": self.replayed}

    def load_state_dict(self, state: dict) -> None:
        """Restore a checkpoint's state (an empty dict: a checkpoint written without replay)."""
        self.queue = deque(state.get("queue", []))
        self.aliases = {int(k): int(v) for k, v in state.get("aliases", [])}
        self.next_id = state.get("next_id", REPLAY_IDS)
        self.credit = state.get("credit", 0.0)
        self.replayed = state.get("replayed", 0)
