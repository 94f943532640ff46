"""The simulated engine (``inference=sim``): no model, a latency per request, random tokens.

Like SGLang's update_weights_from_disk without abort, a reload lets running requests finish on
the weights they started with, so every token of a request carries the version current when the
request started.
"""

from __future__ import annotations

import asyncio
import random
from typing import Optional, Sequence

from rlorch.backends import inference_backend
from rlorch.config.schema import Config, InferenceBackend, SimEngineConfig
from rlorch.rundir.layout import RunDir
from rlorch.types import (Generation, GroupRequest, PolicyVersion, SamplingParams, VersionStamps, logprob_array,
                          token_ids)


class SimEngine:
    name = "sim"

    def __init__(self, config: SimEngineConfig, *, policy: PolicyVersion, seed: int = 0):
        self.lo, self.hi = config.latency
        self.tokens = config.tokens
        self.policy = policy
        self.rng = random.Random(seed)
        self.loaded_version = policy.value
        self.loaded_path = ""
        self.requests = 0
        self.calls = 0
        """Engine calls answered (a group or batch call counts once)."""
        self._pattern = token_ids([4 + (i * 7) % 60 for i in range(max(config.tokens, 1))])

    def _finish(self, count: int) -> str:
        """``length`` when the length limit cut the simulated completion short, else ``stop``."""
        return "length" if count < self.tokens else "stop"

    async def generate(self, input_ids: list[int], params: SamplingParams, rid: str) -> Generation:
        version = self.loaded_version
        self.requests += 1
        self.calls += 1
        delay = self.lo if self.hi <= self.lo else self.rng.uniform(self.lo, self.hi)
        if delay > 0:
            await asyncio.sleep(delay)
        count = min(self.tokens, params.max_new_tokens)
        ids = self._pattern[:count]
        return Generation(output_ids=ids, logprobs=logprob_array([-1.0]) * count,
                          versions=VersionStamps([[version, count]]), finish_reason=self._finish(count))

    async def generate_group(self, input_ids: list[int], params: SamplingParams, n: int,
                             rid: str) -> list[Generation]:
        """One latency draw for the whole group: its samples run side by side."""
        version = self.loaded_version
        self.requests += n
        self.calls += 1
        delay = self.lo if self.hi <= self.lo else self.rng.uniform(self.lo, self.hi)
        if delay > 0:
            await asyncio.sleep(delay)
        count = min(self.tokens, params.max_new_tokens)
        return [Generation(output_ids=self._pattern[:count], logprobs=logprob_array([-1.0]) * count,
                           versions=VersionStamps([[version, count]]), finish_reason=self._finish(count))
                for _ in range(n)]

    async def generate_batch(self, requests: Sequence[GroupRequest]) -> list[list[Generation]]:
        """One latency draw per group, the batch answered when its slowest group is done (a
        batch /generate returns once every sample has finished). Samples of the same length
        are one Generation, its lists and version stamps included (consumers copy or read it,
        never change it)."""
        version = self.loaded_version
        self.requests += sum(request.n for request in requests)
        self.calls += 1
        delay = self.lo if self.hi <= self.lo else max(self.rng.uniform(self.lo, self.hi) for _ in requests)
        if delay > 0:
            await asyncio.sleep(delay)
        answers, shared, tokens = [], {}, self.tokens
        for request in requests:
            count = min(tokens, request.params.max_new_tokens)
            generation = shared.get(count)
            if generation is None:
                generation = shared[count] = Generation(self._pattern[:count], logprob_array([-1.0]) * count,
                                                        VersionStamps([[version, count]]), self._finish(count))
            answers.append([generation] * request.n)
        return answers

    async def pause(self) -> None:
        pass

    async def resume(self) -> None:
        pass

    async def reload(self, path: str, version: int) -> None:
        self.loaded_path, self.loaded_version = path, version

    async def healthy(self, timeout: Optional[float] = None) -> bool:
        return True

    async def close(self) -> None:
        pass

    def gauges(self) -> dict:
        return {"servers_up": 1, "calls": self.calls}

    def health(self) -> dict:
        """An in-process engine neither hangs nor dies apart from the run."""
        return {}


@inference_backend(InferenceBackend.sim)
async def start_sim(config: Config, run_dir: RunDir, policy: PolicyVersion, launcher: object) -> tuple[SimEngine, None]:
    """An in-process engine: nothing for the launcher to start."""
    return SimEngine(config.inference.sim, policy=policy, seed=config.run.seed), None
