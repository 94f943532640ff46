"""Episodes: prompts from the environment, and the work that turns a prompt into a rollout group.

The orchestrator owns the engine pool and the environment and hands the dispatcher the work
function built here, so the dispatcher knows neither.
"""

from __future__ import annotations

import asyncio
import random
from typing import Any, Callable, Iterator, Optional

from rlorch.config import Config, InferenceBackend, SimReward
from rlorch.types import (Engine, Environment, Generation, MultiTurnEnvironment, Prompt, Rollout,
                          SamplingParams, is_correct)

EVAL_SEED_OFFSET = 1_000_003


class PromptSource:
    """Deterministic prompts by index; ``position`` is the data position saved at checkpoints."""

    def __init__(self, env: Environment, *, tokenizer: Any, seed: int, position: int = 0):
        self.env = env
        self.tokenizer = tokenizer
        self.seed = seed
        self.position = position

    def make(self, index: int, *, is_eval: bool = False) -> Prompt:
        seed = self.seed + (EVAL_SEED_OFFSET if is_eval else 0)
        text, answer = self.env.make_prompt(index, seed)
        return self._prompt(index, text, answer, is_eval)

    def _prompt(self, index: int, text: str, answer: Any, is_eval: bool) -> Prompt:
        return Prompt(group_id=index, input_ids=encode_prompt(self.tokenizer, text), env=self.env.name,
                      text=text, answer=answer, is_eval=is_eval)

    def eval_set(self, count: int) -> list[Prompt]:
        """The fixed evaluation prompts: the environment's held-out set when it has one (never
        trained on), else ``count`` prompts drawn with a separate seed."""
        held_out = getattr(self.env, "eval_prompts", None)
        if held_out is None:
            return [self.make(i, is_eval=True) for i in range(count)]
        return [self._prompt(i, text, answer, True) for i, (text, answer) in enumerate(held_out(count))]

    def __iter__(self) -> Iterator[Prompt]:
        return self

    def __next__(self) -> Prompt:
        prompt = self.make(self.position)
        self.position += 1
        return prompt


def encode_text(tokenizer: Any, text: str) -> list[int]:
    """Token ids of ``text`` (the sim backends have no tokenizer: one id per character)."""
    if tokenizer is None:
        return [1 + (ord(c) % 60) for c in text]
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def encode_prompt(tokenizer: Any, text: str) -> list[int]:
    ids = encode_text(tokenizer, text)
    if tokenizer is not None and tokenizer.bos_token_id is not None:
        return [tokenizer.bos_token_id] + ids
    return ids or [1]


def sampling_params(config: Config, tokenizer: Any, *, greedy: bool = False) -> SamplingParams:
    r = config.rollout
    stop = [tokenizer.eos_token_id] if tokenizer is not None and tokenizer.eos_token_id is not None else []
    return SamplingParams(max_new_tokens=r.max_new_tokens, temperature=0.0 if greedy else r.temperature,
                          top_p=r.top_p, top_k=r.top_k, stop_token_ids=stop)


def make_reward(config: Config, env: Environment, seed: int) -> Callable[[str, Any], float]:
    """The reward: the environment's own, or the sim engine's random/constant stand-in."""
    if config.inference.backend is InferenceBackend.sim and config.inference.reward is not SimReward.task:
        if config.inference.reward is SimReward.constant:
            return lambda completion, answer: 0.5
        if config.inference.reward is SimReward.solved:
            return lambda completion, answer: 1.0
        rng = random.Random(seed)
        return lambda completion, answer: rng.random()
    return env.score


def make_work(config: Config, *, engine: Engine, tokenizer: Any, reward: Callable[[str, Any], float],
              env: Optional[Environment] = None) -> Callable[[Prompt], Any]:
    """The dispatcher's work: one prompt to a group of scored, version-stamped rollouts.

    With an environment that replies and task.max_turns > 1, each sample continues as a
    conversation: the reply's tokens join the trajectory unmasked, the next model turn is
    generated on the whole trajectory, and its tokens' versions extend the same stamps.
    """
    multi_turn = config.task.max_turns > 1 and isinstance(env, MultiTurnEnvironment)
    train_params = sampling_params(config, tokenizer)
    eval_params = sampling_params(config, tokenizer, greedy=True)
    group_size = config.rollout.group_size
    decode: Optional[Callable[[list[int]], str]] = (
        (lambda ids: tokenizer.decode(ids, skip_special_tokens=True)) if tokenizer is not None else None)

    def to_rollout(prompt: Prompt, rid: str, generation: Generation, prompt_mask: list[int],
                   prompt_logprobs: list[float]) -> Rollout:
        completion = decode(generation.output_ids) if decode else generation.text
        n_prompt = len(prompt_mask)
        return Rollout(group_id=prompt.group_id, episode_id=rid, env=prompt.env,
                       tokens=prompt.input_ids + generation.output_ids,
                       loss_mask=prompt_mask + [1] * len(generation.output_ids),
                       logprobs=prompt_logprobs + generation.logprobs,
                       versions=generation.versions, reward=reward(completion, prompt.answer),
                       finish_reason=generation.finish_reason, is_eval=prompt.is_eval,
                       prompt_len=n_prompt, completion=completion, correct=judge(prompt, completion))

    def judge(prompt: Prompt, completion: str) -> Optional[bool]:
        return is_correct(env, completion, prompt.answer) if prompt.is_eval and env is not None else None

    async def converse(prompt: Prompt, rollout: Rollout, params: SamplingParams) -> Rollout:
        for turn in range(1, config.task.max_turns):
            message = env.reply(rollout.completion, prompt.answer, turn)
            if message is None:
                break
            reply_ids = encode_text(tokenizer, message)
            rollout.tokens += reply_ids
            rollout.loss_mask += [0] * len(reply_ids)
            rollout.logprobs += [0.0] * len(reply_ids)
            generation = await engine.generate(rollout.tokens, params, f"{rollout.episode_id}-t{turn + 1}")
            rollout.tokens += generation.output_ids
            rollout.loss_mask += [1] * len(generation.output_ids)
            rollout.logprobs += generation.logprobs
            rollout.versions.concat(generation.versions)
            rollout.completion = decode(generation.output_ids) if decode else generation.text
            rollout.finish_reason = generation.finish_reason
        rollout.reward = reward(rollout.completion, prompt.answer)
        rollout.correct = judge(prompt, rollout.completion)
        return rollout

    async def work(prompt: Prompt) -> list[Rollout]:
        rid = f"{'e' if prompt.is_eval else 'g'}{prompt.group_id}-{prompt.attempt}"
        n, params = (1, eval_params) if prompt.is_eval else (group_size, train_params)
        generations = await engine.generate_group(prompt.input_ids, params, n, rid)
        prompt_mask, prompt_logprobs = [0] * len(prompt.input_ids), [0.0] * len(prompt.input_ids)
        rollouts = [to_rollout(prompt, f"{rid}-{i}", g, prompt_mask, prompt_logprobs)
                    for i, g in enumerate(generations)]
        if multi_turn:
            rollouts = list(await asyncio.gather(*(converse(prompt, r, params) for r in rollouts)))
        return rollouts

    return work
