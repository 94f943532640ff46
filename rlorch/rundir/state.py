"""What a checkpoint carries for the orchestrator (its ``orchestrator.json``): the data position,
the finished rollouts not yet trained, the prompts not yet finished and the ledger's totals."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable

from rlorch.types import Prompt, Rollout


@dataclass
class ResumeState:
    """What a checkpoint carries for the orchestrator (its ``orchestrator.json``)."""

    step: int
    prompt_position: int
    untrained: list[list[Rollout]]
    pending_prompts: list[Prompt]
    totals: dict = field(default_factory=dict)
    replay: dict = field(default_factory=dict)
    """The replay queue of stuck prompts (:mod:`rlorch.tasks.replay`), restored before the pending
    prompts are made (see :func:`rlorch.rundir.resume.read_state`)."""

    def to_json(self) -> dict:
        return {"step": self.step, "prompt_position": self.prompt_position, "totals": self.totals,
                "replay": self.replay,
                "untrained": [[r.to_json() for r in group] for group in self.untrained],
                "pending_prompts": [{"group_id": p.group_id, "attempt": p.attempt} for p in self.pending_prompts]}

    @classmethod
    def from_json(cls, data: dict, make_prompt: Callable[[int], Prompt]) -> "ResumeState":
        prompts = []
        for item in data["pending_prompts"]:
            prompt = make_prompt(item["group_id"])
            prompt.attempt = item.get("attempt", 0)
            prompts.append(prompt)
        return cls(step=data["step"], prompt_position=data["prompt_position"], totals=data.get("totals", {}),
                   replay=data.get("replay", {}),
                   untrained=[[Rollout.from_json(r) for r in group] for group in data["untrained"]],
                   pending_prompts=prompts)


def regroup(rollouts: Iterable[Rollout]) -> list[list[Rollout]]:
    """Rollouts back into their groups (a group is one prompt's samples of one attempt)."""
    groups: dict[tuple, list[Rollout]] = {}
    for rollout in rollouts:
        groups.setdefault((rollout.group_id, rollout.attempt), []).append(rollout)
    return list(groups.values())
