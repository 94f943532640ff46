"""Episodes: prompts from the environment, and the work that turns a prompt into a rollout group.

The orchestrator owns the engine pool and the environment and hands the dispatcher the work
function built here, so the dispatcher knows neither.
"""

from __future__ import annotations

import random
from array import array
from dataclasses import replace
from typing import Any, Callable, Iterator, Optional, Sequence

from rlorch.config.schema import Config, InferenceBackend, SimReward
from rlorch.lifecycle import gather_all
from rlorch.tasks.base import is_single_turn
from rlorch.tasks.prompts import chat_suffix, encode_prompt, encode_text
from rlorch.tasks.replay import ReplayQueue
from rlorch.types import (LOGPROBS, LONG, TOKEN_IDS, AgentRunner, Engine, Environment, Generation, GroupRequest,
                          Origin, Prompt, Rollout, SamplingParams, VersionStamps, as_array, is_correct, list_of,
                          logprob_array, mask_array, numpy_view, token_ids)

EVAL_SEED_OFFSET = 1_000_003


class PromptSource:
    """Deterministic prompts by index; ``position`` is the data position saved at checkpoints.
    ``replay`` (``rollout.replay_share``) draws stuck prompts again between data prompts: see
    :mod:`rlorch.tasks.replay`; its state is saved beside the position."""

    def __init__(self, env: Environment, *, tokenizer: Any, seed: int, position: int = 0,
                 replay: Optional[ReplayQueue] = None):
        self.env = env
        self.tokenizer = tokenizer
        self.seed = seed
        self.position = position
        self.replay = replay or ReplayQueue()

    def make(self, index: int, *, is_eval: bool = False) -> Prompt:
        seed = self.seed + (EVAL_SEED_OFFSET if is_eval else 0)
        text, answer = self.env.make_prompt(index if is_eval else self.replay.source(index), seed)
        return self._prompt(index, text, answer, is_eval)

    def _prompt(self, index: int, text: str, answer: Any, is_eval: bool) -> Prompt:
        return Prompt(index, encode_prompt(self.tokenizer, text), self.env.name, text, answer, is_eval)

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
        replay = self.replay.draw()
        if replay is not None:
            return self.make(replay)
        prompt = self.make(self.position)
        self.position += 1
        return prompt

    def observe(self, group: Sequence[Rollout]) -> None:
        """A training group finished (trained or filtered): the replay queue sees its rewards."""
        if group:
            self.replay.observe(group[0].group_id, [r.reward for r in group])


def sampling_params(config: Config, tokenizer: Any, *, greedy: bool = False) -> SamplingParams:
    r = config.rollout
    stop = [tokenizer.eos_token_id] if tokenizer is not None and tokenizer.eos_token_id is not None else []
    return SamplingParams(max_new_tokens=r.max_new_tokens, temperature=0.0 if greedy else r.temperature,
                          top_p=r.top_p, top_k=r.top_k, stop_token_ids=stop)


Reward = Callable[[str, Any], float]


def reward_override(config: Config, seed: int) -> Optional[Reward]:
    """The sim engine's stand-in reward (random, constant 0.5, solved), replacing the
    environment's; None when the environment's own reward counts."""
    if config.inference.backend is not InferenceBackend.sim or config.inference.sim.reward is SimReward.task:
        return None
    if config.inference.sim.reward is SimReward.constant:
        return lambda completion, answer: 0.5
    if config.inference.sim.reward is SimReward.solved:
        return lambda completion, answer: 1.0
    rng = random.Random(seed)
    return lambda completion, answer: rng.random()


class EngineConversation:
    """One sample's trajectory, built by the environment's episode (see
    :class:`rlorch.types.Conversation`). Every model turn's tokens carry the versions the engine
    reported for them; environment text is trained with loss mask 0."""

    def __init__(self, prompt: Prompt, *, engine: Engine, tokenizer: Any, params: SamplingParams, rid: str):
        self.prompt = prompt.text
        self.chat = not isinstance(prompt.text, str)
        self.messages: Optional[list] = [dict(m) for m in prompt.text] if self.chat else None
        self.last_turn = ""
        self.engine = engine
        self.tokenizer = tokenizer
        self.params = params
        self.rid = rid
        self.turns = 0
        # Arrays, grown in place turn by turn (an array made of bytes takes them as its memory:
        # zero bytes are zeros).
        self.tokens = token_ids(prompt.input_ids)
        self.loss_mask = mask_array(bytes(len(prompt.input_ids)))
        self.logprobs = logprob_array(bytes(4 * len(prompt.input_ids)))
        self.versions = VersionStamps()
        self.completion = ""
        self.finish_reason = "stop"

    async def generate(self, *, max_new_tokens: Optional[int] = None, stop: Sequence[str] = ()) -> str:
        params = self.params
        if max_new_tokens is not None or stop:
            params = replace(params, max_new_tokens=max_new_tokens or params.max_new_tokens,
                             stop=[*params.stop, *stop])
        self.turns += 1
        rid = self.rid if self.turns == 1 else f"{self.rid}-t{self.turns}"
        generation = await self.engine.generate(self.tokens, params, rid)
        text = self.take(generation)
        if (self.finish_reason == "length" and max_new_tokens and max_new_tokens < self.params.max_new_tokens
                and len(generation.output_ids) >= max_new_tokens):
            # A turn the environment cut shorter than rollout.max_new_tokens ended where it asked,
            # not truncated by the run's limit (which truncated_share counts and warns to raise).
            self.finish_reason = "stop"
        return text

    def take(self, generation: Generation) -> str:
        """Append a model turn the engine produced; returns its text."""
        self.tokens += as_array(TOKEN_IDS, generation.output_ids)
        self.loss_mask.frombytes(b"\x01" * len(generation.output_ids))
        self.logprobs += as_array(LOGPROBS, generation.logprobs)
        self.versions.concat(generation.versions)
        self.completion = decode(self.tokenizer, generation)
        self.finish_reason = generation.finish_reason
        if self.chat:
            self.messages.append({"role": "assistant", "content": self.completion})
            self.last_turn = decode(self.tokenizer, generation, special=True)
        return self.completion

    def add(self, text: str, role: str = "user") -> None:
        """Text form: ``text`` appended as it is. Chat form: a ``role`` message; only the text the
        chat template adds for it (the last model turn's closer where the model did not write it,
        the message, the next generation prompt) is tokenized, every earlier id is kept."""
        if self.chat:
            message = {"role": role, "content": text}
            text = chat_suffix(self.tokenizer, self.messages, [message], last_turn=self.last_turn)
            self.messages.append(message)
            self.last_turn = ""
        ids = encode_text(self.tokenizer, text)
        self.tokens.extend(ids)
        self.loss_mask.frombytes(bytes(len(ids)))
        self.logprobs.frombytes(bytes(4 * len(ids)))


def decode(tokenizer: Any, generation: Generation, *, special: bool = False) -> str:
    """A generation's text (``special``: with its special tokens, as the chat template sees a turn):
    its ids decoded (an engine's own text can differ: a server's stand-ins and SGLang's
    incremental detokenizer are not what training decodes)."""
    if tokenizer is None:
        return generation.text
    # A long turn goes as a numpy view: transformers checks every element of a list before
    # decoding it and takes a numpy array's tolist() at once, after a fixed cost (tens of
    # microseconds) a short turn's list does not repay.
    ids = generation.output_ids
    ids = numpy_view(ids) if len(ids) >= LONG else list_of(ids)
    return tokenizer.decode(ids, skip_special_tokens=not special)


class EpisodeWork:
    """The dispatcher's work: prompts to groups of scored, version-stamped rollouts.

    The environment runs each sample's episode. A single-turn environment's first turns are
    sampled by one engine call per pack (every prompt of the pack with its n samples: SGLang's
    batch /generate), and each sample becomes a rollout directly; any other environment gets
    one conversation per sample, all run concurrently. Calling it with one prompt is a pack of
    one, so evaluation and training build rollouts with the same code.
    """

    def __init__(self, config: Config, *, engine: Engine, tokenizer: Any, env: Environment,
                 override: Optional[Reward] = None, agents: Optional[AgentRunner] = None):
        self.engine, self.tokenizer, self.env, self.override = engine, tokenizer, env, override
        self.agents = agents
        self.answer_tokens: Optional[int] = getattr(env, "answer_tokens", None)
        self.train_params = sampling_params(config, tokenizer)
        self.eval_params = sampling_params(config, tokenizer, greedy=True)
        self.group_size = config.rollout.group_size
        self.batched = is_single_turn(env) and agents is None

    def gauges(self) -> dict:
        """The agents' counts (``task.agent``); {} otherwise."""
        return self.agents.gauges() if self.agents is not None else {}

    async def __call__(self, prompt: Prompt) -> list[Rollout]:
        return (await self.pack([prompt]))[0]

    async def pack(self, prompts: list[Prompt]) -> list[list[Rollout]]:
        requests = self._requests(prompts)
        if not self.batched:
            episodes = self._episodes if self.agents is None else self._agent_episodes
            return await gather_all(*(episodes(p, r) for p, r in zip(prompts, requests)))
        answers = await self.engine.generate_batch(requests)
        score_groups = getattr(self.env, "score_groups", None)
        if score_groups is None or self.override is not None:
            return self._single_turn(prompts, requests, answers)
        texts = [[self._text(generation) for generation in generations] for generations in answers]
        return self._single_turn(prompts, requests, answers, texts, await score_groups(prompts, texts))

    def _text(self, generation: Generation) -> str:
        return generation.text if self.tokenizer is None else decode(self.tokenizer, generation)

    def _requests(self, prompts: list[Prompt]) -> list[GroupRequest]:
        """One request per prompt: an eval prompt's one greedy sample (id ``e<group>-<attempt>``),
        else the group's samples (``g<group>-<attempt>``)."""
        train, greedy, n = self.train_params, self.eval_params, self.group_size
        return [GroupRequest(p.input_ids, greedy, 1, f"e{p.group_id}-{p.attempt}") if p.is_eval
                else GroupRequest(p.input_ids, train, n, f"g{p.group_id}-{p.attempt}") for p in prompts]

    def _single_turn(self, prompts: list[Prompt], requests: list[GroupRequest], answers: list[list[Generation]],
                     texts: Optional[list[list[str]]] = None,
                     scores: Optional[list[list[float]]] = None) -> list[list[Rollout]]:
        """The rollouts single-turn groups' generations make: prompt tokens untrained (mask 0,
        logprob 0), then the generated ones with their behaviour logprobs and version stamps
        (each rollout takes over its generation's stamps: the engine made them for this call).
        The fields :meth:`_rollout` sets, built inline: this runs once per sample. Rollouts of
        the same prompt and generated lengths share one loss mask (a rollout's arrays are never
        changed once built). ``texts`` and ``scores``: each sample's completion and reward where
        the environment scored the groups itself (``score_groups``)."""
        score, override, tokenizer, env, live = self.env.score, self.override, self.tokenizer, self.env, Origin.live
        untrained: dict[int, array] = {}
        masks: dict[tuple[int, int], array] = {}
        groups = []
        for number, (prompt, request, generations) in enumerate(zip(prompts, requests, answers)):
            answer, env_name, is_eval = prompt.answer, prompt.env, prompt.is_eval
            prompt_ids = token_ids(prompt.input_ids)
            prompt_len, group_id, attempt, base = len(prompt_ids), prompt.group_id, prompt.attempt, request.rid
            nothing = untrained.get(prompt_len)
            if nothing is None:
                nothing = untrained[prompt_len] = logprob_array(bytes(4 * prompt_len))
            rollouts = []
            for i, generation in enumerate(generations):
                if scores is not None:
                    completion, reward = texts[number][i], float(scores[number][i])
                else:
                    completion = generation.text if tokenizer is None else decode(tokenizer, generation)
                    reward = float(score(completion, answer)) if override is None else override(completion, answer)
                correct = is_correct(env, completion, answer, reward) if is_eval else None
                output_ids = as_array(TOKEN_IDS, generation.output_ids)
                shape = (prompt_len, len(output_ids))
                mask = masks.get(shape)
                if mask is None:
                    mask = masks[shape] = mask_array(bytes(prompt_len) + b"\x01" * len(output_ids))
                rollouts.append(Rollout(group_id, f"{base}-{i}", env_name, prompt_ids + output_ids, mask,
                                        nothing + as_array(LOGPROBS, generation.logprobs), generation.versions,
                                        reward, live,
                                        finish_reason(generation.finish_reason, len(output_ids), self.answer_tokens),
                                        is_eval, prompt_len, completion, correct,
                                        attempt))
            groups.append(rollouts)
        return groups

    async def _episodes(self, prompt: Prompt, request: GroupRequest) -> list[Rollout]:
        conversations = [EngineConversation(prompt, engine=self.engine, tokenizer=self.tokenizer,
                                            params=request.params, rid=f"{request.rid}-{i}")
                         for i in range(request.n)]
        rewards = await gather_all(*(self.env.episode(c, prompt.answer) for c in conversations))
        return [self._rollout(prompt, c.rid, c.tokens, c.loss_mask, c.logprobs, c.versions, float(r),
                              finish_reason(c.finish_reason, len(c.tokens) - len(prompt.input_ids), self.answer_tokens),
                              c.completion) for c, r in zip(conversations, rewards)]

    async def _agent_episodes(self, prompt: Prompt, request: GroupRequest) -> list[Rollout]:
        """The group's samples as agent episodes (``task.agent``): one rollout each, its
        segments back to back; an episode with no call keeps the prompt, nothing trained."""
        rids = [f"{request.rid}-{i}" for i in range(request.n)]
        episodes = await gather_all(*(self.agents.run(prompt, request.params, rid) for rid in rids))
        rollouts = []
        for rid, episode in zip(rids, episodes):
            tokens, mask, logprobs, versions, segments = episode.trajectory.sequence()
            held = episode.trajectory.segments
            prompt_len = held[0].prompt_len if held else 0
            if not len(tokens):
                tokens = token_ids(prompt.input_ids)
                mask, logprobs, prompt_len = mask_array(bytes(len(tokens))), logprob_array(bytes(4 * len(tokens))), len(tokens)
            rollout = self._rollout(prompt, rid, tokens, mask, logprobs, versions, episode.reward,
                                    episode.finish_reason, episode.completion)
            rollout.prompt_len, rollout.segments = prompt_len, segments
            rollouts.append(rollout)
        return rollouts

    def _rollout(self, prompt: Prompt, rid: str, tokens: array, loss_mask: array, logprobs: array,
                 versions: VersionStamps, reward: float, finish_reason: str, completion: str) -> Rollout:
        if self.override is not None:
            reward = self.override(completion, prompt.answer)
        correct = is_correct(self.env, completion, prompt.answer, reward) if prompt.is_eval else None
        return Rollout(prompt.group_id, rid, prompt.env, tokens, loss_mask, logprobs, versions, reward,
                       Origin.live, finish_reason, prompt.is_eval, len(prompt.input_ids), completion,
                       correct, prompt.attempt)


def finish_reason(reason: str, generated: int, answer_tokens: Optional[int]) -> str:
    """How a rollout ended, as its records count it: an environment whose answers take at most
    ``answer_tokens`` tokens (the digit tasks: one a digit) ends a turn that reached them as it
    expects, ``stop``, even where the length limit was what stopped the engine; a turn cut
    shorter stays ``length`` (truncated: ``truncated_share``)."""
    if reason == "length" and answer_tokens is not None and generated >= answer_tokens:
        return "stop"
    return reason


def make_work(config: Config, *, engine: Engine, tokenizer: Any, env: Environment,
              override: Optional[Reward] = None, agents: Optional[AgentRunner] = None) -> EpisodeWork:
    """The dispatcher's work (see :class:`EpisodeWork`): callable on one prompt, ``pack`` for
    several; ``agents`` runs each sample's episode as an agent of the user's (``task.agent``)."""
    return EpisodeWork(config, engine=engine, tokenizer=tokenizer, env=env, override=override, agents=agents)
