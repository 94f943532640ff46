"""Shared data types and the Protocols every backend implements.

Components never import each other; they meet here. Backends (SGLang, the CPU engine, sim) are
implementations of the same Protocols.
"""

from __future__ import annotations

import enum
from array import array
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Optional, Protocol, Sequence, runtime_checkable

import numpy

from rlorch.rundir import batchfile

TOKEN_IDS, LOGPROBS, MASK = "i", "f", "b"
"""``array`` type codes of the per-token fields from the HTTP answer to the batch file: token ids
int32, behaviour logprobs float32 (SGLang's are float32 on the device: exact), loss mask int8.
Four, four and one bytes a token, no Python object per token. ``array`` rather than numpy: it
concatenates with ``+``, compares with ``==`` and is empty-false like the lists it replaced."""


LONG = 256
"""Tokens from which numpy's fixed cost per call (microseconds) is repaid by its speed per token:
shorter arrays are read in Python."""


def token_ids(values: Iterable[int] = ()) -> array:
    """``values`` as a token id array (a copy; an int32 array is copied by memcpy)."""
    return array(TOKEN_IDS, values)


def logprob_array(values: Iterable[float] = ()) -> array:
    """``values`` as a float32 logprob array (a copy)."""
    return array(LOGPROBS, values)


def mask_array(values: Iterable[int] = ()) -> array:
    """``values`` as an int8 loss-mask array (a copy)."""
    return array(MASK, values)


def as_array(typecode: str, values: Iterable) -> array:
    """``values`` itself when it already is an array of ``typecode``, else a copy as one (an
    engine or a test fake may still hand over lists)."""
    if isinstance(values, array) and values.typecode == typecode:
        return values
    return array(typecode, values)


class PolicyVersion:
    """The one shared policy version handle.

    Invariant: ``value`` only increases while a run is live; every component reads it off this
    handle, so a bump propagates without a message.
    """

    __slots__ = ("value",)

    def __init__(self, value: int = 0):
        self.value = value

    def bump(self, to: Optional[int] = None) -> int:
        new = self.value + 1 if to is None else to
        if new < self.value:
            raise ValueError(f"policy version may not go back ({self.value} -> {new})")
        self.value = new
        return new


class Origin(str, enum.Enum):
    """Where a rollout came from; only live-policy rollouts carry a meaningful version."""

    live = "live"
    replay = "replay"
    external = "external"


class VersionStamps:
    """Per-token policy versions over the loss-masked (generated) tokens, run-length encoded.

    ``runs`` is a list of ``[version, count]`` in token order. The head (oldest contributing
    version) is what the staleness bound applies to.
    """

    __slots__ = ("runs",)

    def __init__(self, runs: Optional[list[list[int]]] = None):
        self.runs: list[list[int]] = runs if runs is not None else []

    @classmethod
    def uniform(cls, version: int, count: int) -> "VersionStamps":
        return cls([[version, count]] if count > 0 else [])

    @classmethod
    def from_tokens(cls, versions: list[int]) -> "VersionStamps":
        stamps = cls()
        for version in versions:
            stamps.extend(version, 1)
        return stamps

    def extend(self, version: int, count: int) -> None:
        if count <= 0:
            return
        if self.runs and self.runs[-1][0] == version:
            self.runs[-1][1] += count
        else:
            self.runs.append([version, count])

    def concat(self, other: "VersionStamps") -> None:
        for version, count in other.runs:
            self.extend(version, count)

    @property
    def head(self) -> int:
        """Oldest version that produced a trained token (-1 when there are none)."""
        runs = self.runs
        if len(runs) == 1:
            return runs[0][0]
        return min((v for v, _ in runs), default=-1)

    @property
    def tail(self) -> int:
        """Newest version that produced a trained token (-1 when there are none)."""
        runs = self.runs
        if len(runs) == 1:
            return runs[0][0]
        return max((v for v, _ in runs), default=-1)

    @property
    def count(self) -> int:
        runs = self.runs
        if len(runs) == 1:
            return runs[0][1]
        return sum(c for _, c in runs)

    def expand(self) -> list[int]:
        return [v for v, c in self.runs for _ in range(c)]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, VersionStamps) and self.runs == other.runs

    def __repr__(self) -> str:
        return f"VersionStamps({self.runs})"


@dataclass(slots=True)
class Prompt:
    """One task instance handed to inference; ``group_id`` ties the samples of one prompt.
    ``text`` is the prompt as the environment made it: text, or a list of chat messages."""

    group_id: int
    input_ids: list[int]
    env: str
    text: Any = ""
    answer: Any = None
    is_eval: bool = False
    attempt: int = 0


@dataclass(slots=True)
class Rollout:
    """A whole trajectory, stamped with the policy version of every generated token.

    ``tokens`` holds prompt, model turns, tool calls and environment replies; ``loss_mask`` marks
    model tokens (the only ones trained); ``logprobs`` are the behaviour logprobs aligned with
    ``tokens`` (0 where the mask is 0); ``versions`` covers the masked tokens in order. The three
    per-token fields are compact arrays (int32, int8, float32: see ``TOKEN_IDS``); JSON gets
    lists (:meth:`to_json`) and the batch file is written from the arrays (:meth:`Batch.to_jsonl`).
    Its arrays and stamps are never changed once it is built (rollouts of one engine call may
    share them).
    """

    group_id: int
    episode_id: str
    env: str
    tokens: array
    loss_mask: array
    logprobs: array
    versions: VersionStamps
    reward: float = 0.0
    origin: Origin = Origin.live
    finish_reason: str = "stop"
    is_eval: bool = False
    prompt_len: int = 0
    completion: str = ""
    correct: Optional[bool] = None
    """Exact match of the answer (set on eval rollouts; None where not judged)."""
    attempt: int = 0
    """Which generation of its prompt this is (strict mode regenerates too-stale groups)."""
    segments: Optional[list[int]] = None
    """The lengths of independent sequences ``tokens`` holds back to back (an agent episode
    whose calls forked: each starts with its own prompt, and the trainer runs each as a
    sequence of its own under the rollout's advantage); None: one sequence."""

    def __post_init__(self) -> None:
        # Whoever builds it (an engine, a test, a state file) hands over arrays or lists; it
        # holds arrays either way (an array of the right type is kept as it is).
        self.tokens = as_array(TOKEN_IDS, self.tokens)
        self.loss_mask = as_array(MASK, self.loss_mask)
        self.logprobs = as_array(LOGPROBS, self.logprobs)

    @property
    def generated_tokens(self) -> int:
        return self.versions.count

    def to_json(self) -> dict:
        """Plain JSON values (lists for the arrays), for state files."""
        line = self.fields()
        line["tokens"], line["loss_mask"], line["logprobs"] = (
            list_of(self.tokens), list_of(self.loss_mask), list_of(self.logprobs))
        return line

    @classmethod
    def from_json(cls, data: dict) -> "Rollout":
        fields = dict(data)
        fields["versions"] = VersionStamps([list(run) for run in fields["versions"]])
        fields["origin"] = Origin(fields.get("origin", "live"))
        return cls(**fields)

    def fields(self) -> dict:
        """Every field but the three arrays, as JSON values (the batch file's record)."""
        return {"group_id": self.group_id, "episode_id": self.episode_id, "env": self.env,
                "versions": self.versions.runs, "reward": self.reward, "origin": self.origin.value,
                "finish_reason": self.finish_reason, "is_eval": self.is_eval, "prompt_len": self.prompt_len,
                "completion": self.completion, "correct": self.correct, "attempt": self.attempt,
                **({"segments": self.segments} if self.segments else {})}


def list_of(values: Any) -> list:
    """An array (or any sequence) as a list of Python numbers."""
    return values.tolist() if isinstance(values, array) else list(values)


def numpy_view(values: Any):
    """An array as a numpy array over the same memory (a list is converted)."""
    if isinstance(values, array):
        return numpy.frombuffer(values, dtype=values.typecode)
    return numpy.asarray(values)


def head_ages(rollouts: Iterable[Rollout], train_version: int) -> list[int]:
    """Head off-policy age of each live rollout trained at ``train_version``.

    Replayed or external rollouts carry no meaningful version and are excluded.
    """
    live = Origin.live
    return [train_version - r.versions.head for r in rollouts if r.origin is live and r.versions.runs]


@dataclass(slots=True)
class Batch:
    """One training step's rollouts with their group-normalised advantages."""

    step: int
    rollouts: list[Rollout]
    advantages: list[float]
    filtered: int = 0
    unlikelihood: list[bool] = field(default_factory=list)
    """Per rollout, whether the trainer scales its advantage per token by ``p / (1 - p)``
    (``trainer.flat_advantage=unlikelihood``); empty: none is."""

    @property
    def trainable(self) -> bool:
        """Whether any rollout carries a learning signal (a nonzero advantage)."""
        return any(abs(a) > 1e-8 for a in self.advantages)

    def file(self, fmt: str = "safetensors") -> Iterator[Any]:
        """The batch file's bytes in pieces (:mod:`rlorch.rundir.batchfile`, format ``fmt``): each
        rollout's fields plus ``"advantage"`` (and ``"unlikelihood": true`` on a marked one),
        its arrays written as they are held."""
        marks = self.unlikelihood or [False] * len(self.rollouts)
        rows = []
        for rollout, advantage, marked in zip(self.rollouts, self.advantages, marks):
            fields = rollout.fields()
            fields["advantage"] = advantage
            if marked:
                fields["unlikelihood"] = True
            rows.append(batchfile.Row(fields, rollout.tokens, rollout.loss_mask, rollout.logprobs))
        return batchfile.encode(rows, fmt)

    @property
    def size(self) -> int:
        return len(self.rollouts)

    def load(self) -> list[Rollout]:
        return self.rollouts

    def filed(self, path: Any) -> "FiledBatch":
        """This batch once its file at ``path`` is written: its rollouts' arrays can go."""
        return FiledBatch(self.step, path, len(self.rollouts))


@dataclass(frozen=True, slots=True)
class FiledBatch:
    """A shipped batch whose file is written. Its rollouts live only in the file (nothing in
    memory holds their arrays any more: memory holds what is in flight, not what is trained);
    :meth:`load` reads them back, as they were, when a checkpoint lists them untrained."""

    step: int
    path: Any
    size: int

    def load(self) -> list[Rollout]:
        rollouts = []
        for fields in batchfile.read_records(self.path):
            del fields["advantage"]
            fields.pop("unlikelihood", None)
            rollouts.append(Rollout.from_json(fields))
        return rollouts


@dataclass(slots=True)
class SamplingParams:
    max_new_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        params = {"max_new_tokens": self.max_new_tokens, "temperature": self.temperature,
                  "top_p": self.top_p, "top_k": self.top_k}
        if self.stop_token_ids:
            params["stop_token_ids"] = self.stop_token_ids
        if self.stop:
            params["stop"] = self.stop
        return params


@dataclass(slots=True)
class Generation:
    """An engine's answer to one request: generated ids, behaviour logprobs, per-token versions
    (int32 and float32 arrays, see ``TOKEN_IDS``)."""

    output_ids: array
    logprobs: array
    versions: VersionStamps
    finish_reason: str
    text: str = ""


@dataclass(slots=True)
class GroupRequest:
    """One prompt's ``n`` samples inside a batched engine call (request ids ``f"{rid}-{i}"``)."""

    input_ids: list[int]
    params: SamplingParams
    n: int
    rid: str


class Admission(Protocol):
    """What the dispatcher needs of the capacity gate."""

    def try_admit(self, count: int = 1) -> bool:
        """Admit ``count`` rollouts together if they all fit."""
        ...

    def admit_groups(self, size: int, most: int) -> int:
        """Admit up to ``most`` whole groups of ``size``; returns how many fit."""
        ...

    def on_accepted(self, count: int = 1) -> None: ...

    def on_rejected(self, count: int = 1) -> None: ...


@runtime_checkable
class Engine(Protocol):
    """An inference engine (one server, a pool, or the simulator)."""

    name: str

    async def generate(self, input_ids: list[int], params: SamplingParams, rid: str) -> Generation: ...

    async def generate_group(self, input_ids: list[int], params: SamplingParams, n: int,
                             rid: str) -> list[Generation]:
        """``n`` independent samples of one prompt (request ids ``f"{rid}-{i}"``)."""
        ...

    async def generate_batch(self, requests: Sequence[GroupRequest]) -> list[list[Generation]]:
        """Several prompts' samples as one call (SGLang's batch /generate where it can be
        sent), answered in request order; each sample is interruptible on its own."""
        ...

    async def pause(self) -> None: ...

    async def resume(self) -> None: ...

    async def reload(self, path: str, version: int) -> None: ...

    async def healthy(self, timeout: Optional[float] = None) -> bool:
        """Whether it generates (``/health_generate``) within ``timeout`` seconds (default: its own)."""
        ...

    def gauges(self) -> dict:
        """Numbers for the metrics loop (servers up, in flight, ...)."""
        ...

    def health(self) -> dict:
        """What each step record carries of the engines: servers up, suspect and dead, restarts,
        per-server throughput ({} for an engine with no servers of its own)."""
        ...

    async def close(self) -> None: ...


@runtime_checkable
class Server(Engine, Protocol):
    """One inference server as the engine pool drives it: an Engine that can continue a
    generation a pause cut short and says which weight version it holds."""

    async def generate(self, input_ids: list[int], params: SamplingParams, rid: str, *,
                       prefix: Optional[Generation] = None) -> Generation:
        """``prefix``: what an earlier, aborted segment of this request already generated."""
        ...

    async def weight_version(self) -> int: ...


@runtime_checkable
class Trainer(Protocol):
    """The trainer as the orchestrator sees it: it takes shipped batches and publishes
    checkpoints into the run directory, where the weight watcher finds them."""

    async def start(self) -> None: ...

    async def submit(self, batch: Batch) -> None: ...

    def error(self) -> Optional[str]: ...

    async def stop(self, timeout: float) -> None: ...


class AgentEpisodeResult(Protocol):
    """An agent episode as the work turns it into a rollout (:class:`rlorch.agents.episodes.AgentEpisode`)."""

    trajectory: Any
    reward: float
    completion: str
    finish_reason: str


class AgentRunner(Protocol):
    """Runs a sample's episode as the user's agent (``task.agent``)."""

    async def run(self, prompt: Prompt, params: SamplingParams, rid: str) -> AgentEpisodeResult: ...

    def gauges(self) -> dict: ...


class Conversation(Protocol):
    """One sample's trajectory, as the environment running its episode sees it.

    The environment adds its own text (tool results, feedback: trained with loss mask 0) and asks
    the model for turns (loss mask 1). Token ids, behaviour logprobs and per-token version stamps
    are kept by the engine call behind :meth:`generate`, never by the environment.
    """

    prompt: Any
    """The prompt the episode started from: text, or a list of chat messages (the chat form)."""
    messages: Optional[list]
    """In the chat form, the conversation so far as messages (model turns as ``assistant``
    messages of their text); None in text form."""

    async def generate(self, *, max_new_tokens: Optional[int] = None, stop: Sequence[str] = ()) -> str:
        """One model turn on the whole trajectory so far; returns its text (up to end of sequence)."""
        ...

    def add(self, text: str, role: str = "user") -> None:
        """Append environment text (a tool result, a reply) to the trajectory, untrained. In the
        chat form it is a message of ``role`` (``user``, ``tool``, ...), rendered by the chat
        template together with the generation prompt of the next model turn."""
        ...


@runtime_checkable
class Environment(Protocol):
    """A task: makes prompts and runs episodes.

    ``episode`` drives the model through a :class:`Conversation` as often as it needs (one turn,
    several, tool calls) and returns the reward (0-1 for the built-in tasks). Optional members
    the orchestrator reads: ``max_reward`` (default 1; a group all at it counts as solved),
    ``is_correct(completion, answer)`` (exact match for eval accuracy; default: reward at the
    maximum) and ``eval_prompts(count)`` (a held-out set never trained on).
    """

    name: str

    def make_prompt(self, index: int, seed: int) -> tuple[str, Any]: ...

    async def episode(self, conversation: Conversation, answer: Any) -> float: ...


def is_correct(env: Environment, completion: str, answer: Any, reward: float) -> bool:
    """Exact-match correctness: the environment's own ``is_correct`` when it has one, else a
    reward at the environment's maximum."""
    check = getattr(env, "is_correct", None)
    if check is not None:
        return bool(check(completion, answer))
    return reward >= max_reward(env)


def max_reward(env: Environment) -> float:
    """The best score an episode can earn (``max_reward`` attribute, default 1)."""
    return float(getattr(env, "max_reward", 1.0))


@dataclass
class DispatcherState:
    """The dispatcher's unfinished work at one moment, as a checkpoint saves it."""

    finished: list[list[Rollout]]
    """Finished groups not yet taken, oldest first."""
    in_flight: list[Prompt]
    failed: list[Prompt]
    """Prompts whose group failed every retry."""
    queued: list[Prompt]


class Fate(str, enum.Enum):
    """What became of admitted rollouts, as the loop reports it."""

    filtered = "filtered"
    dropped_stale = "dropped_stale"
    requeued = "requeued"
