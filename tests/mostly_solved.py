"""An environment of the user's own (``task=custom task.name=tests.mostly_solved:MostlySolved``)
that is nearly solved: most prompts score the maximum on every sample, one in ``every`` scores at
random, so the empty-batch guard finds the task solved while some groups still train. With
``hard_score`` set, a hard prompt scores that on every sample instead: under the sim engine, which
samples one completion, its groups are collapsed short of the maximum."""

from __future__ import annotations

import random

from rlorch.tasks.base import SingleTurn


class MostlySolved(SingleTurn):
    name = "mostly_solved"

    def __init__(self, every: int = 6, held_out_correct: bool = True, warm: int = 0, hard_score: float | None = None):
        """``warm``: the first prompts of the stream are all hard, so the run trains a while first."""
        self.every, self.held_out_correct, self.warm, self.hard_score = every, held_out_correct, warm, hard_score
        self.random = random.Random(0)

    def make_prompt(self, index: int, seed: int) -> tuple[str, str]:
        return f"p{index}=", "hard" if index % self.every == 0 or index < self.warm else "easy"

    def score(self, completion: str, answer: str) -> float:
        if answer == "hard":
            return self.random.random() if self.hard_score is None else self.hard_score
        return 1.0

    def is_correct(self, completion: str, answer: str) -> bool:
        return self.held_out_correct
