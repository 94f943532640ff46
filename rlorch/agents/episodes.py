"""Agent episodes: the user's agent function run once per sample against a gateway session.

``task.agent`` names ``async def agent(sample, *, base_url, api_key) -> float | None``. The agent
calls the model with any OpenAI client at ``base_url`` (for an agent in a subprocess, hand it
:func:`openai_environment`). An agent that also takes ``http_client`` gets an HTTP client to
build its ``openai`` client on, far cheaper than its own (:func:`episode_http_client`). Its return value is the episode's reward; None asks the task to
score the last answer (``task.reward``'s functions for a data task, the task's own score else).

Every episode ends as one rollout whatever the agent does: an agent that raises, outlives
``task.agent_timeout``, exceeds ``task.max_calls`` or never calls fails its episode, which keeps
what was sampled, scores 0 and is reported (``agent_failures``, ``agent_errors``); the run goes on.
"""

from __future__ import annotations

import asyncio
import inspect
import os
from collections import Counter, deque
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Optional

from rlorch.agents.gateway import AgentGateway
from rlorch.agents.trajectory import Trajectory
from rlorch.types import Prompt, SamplingParams

AgentFunction = Callable[..., Awaitable[Optional[float]]]
RECENT_ERRORS = 3
"""Distinct recent agent errors the step records show."""
FAILED = "error"
"""The finish reason of a failed episode."""


def openai_environment(base_url: str, api_key: str) -> dict[str, str]:
    """The process environment a subprocess agent needs: this one plus ``OPENAI_BASE_URL`` and
    ``OPENAI_API_KEY`` (the ``openai`` client reads both)."""
    return {**os.environ, "OPENAI_BASE_URL": base_url, "OPENAI_API_KEY": api_key}


def episode_http_client() -> Any:
    """An HTTP client for one episode's ``openai`` client (``http_client=``: the installed
    client's own default, ``openai.DefaultAsyncHttpxClient``), built on
    one SSL context for the whole run: a client left to build its own loads the CA store (34 ms
    of CPU, most of the orchestrator's at tens of episodes a second), and one client shared by
    every episode scans its whole pool of connections on every request. rlorch closes it when
    the episode ends."""
    import ssl

    from openai import DefaultAsyncHttpxClient

    global _SSL_CONTEXT
    if _SSL_CONTEXT is None:
        _SSL_CONTEXT = ssl.create_default_context()
    return DefaultAsyncHttpxClient(verify=_SSL_CONTEXT)


_SSL_CONTEXT = None


def takes_http_client(function: Any) -> bool:
    """Whether an agent takes ``http_client`` (rlorch then hands it :func:`episode_http_client`)."""
    parameters = inspect.signature(function).parameters
    return "http_client" in parameters or any(p.kind is p.VAR_KEYWORD for p in parameters.values())


def check_agent(function: Any, spec: str) -> Optional[str]:
    """Why ``function`` cannot be an agent (None: it can)."""
    if not inspect.iscoroutinefunction(function):
        return f"{spec} is not an async function: an agent is async def agent(sample, *, base_url, api_key)"
    parameters = inspect.signature(function).parameters
    missing = [name for name in ("base_url", "api_key") if name not in parameters
               and not any(p.kind is p.VAR_KEYWORD for p in parameters.values())]
    if missing:
        return f"{spec} takes no {', '.join(missing)}: an agent is async def agent(sample, *, base_url, api_key)"
    return None


def sample_of(prompt: Prompt) -> dict:
    """What the agent receives: the prompt (text or messages), the answer and, for a data task,
    every other column of the row."""
    answer = prompt.answer
    columns = getattr(answer, "columns", None)
    sample = {"prompt": prompt.text, "answer": getattr(answer, "answer", answer), "index": prompt.group_id,
              "is_eval": prompt.is_eval}
    if isinstance(columns, dict):
        sample.update({key: value for key, value in columns.items() if key not in sample})
    return sample


@dataclass
class AgentEpisode:
    """One episode's outcome: its trajectory, reward and last answer, and its error if it failed."""

    trajectory: Trajectory
    reward: float
    completion: str
    finish_reason: str
    error: Optional[str] = None


class AgentEpisodes:
    """Runs episodes (see the module's docstring); counts them for the step records."""

    def __init__(self, *, gateway: AgentGateway, agent: AgentFunction, env: Any, timeout: float):
        self.gateway, self.agent, self.env, self.timeout = gateway, agent, env, timeout
        self.counts = Counter()
        self.fork_reasons = Counter()
        self.recent_errors: deque[str] = deque(maxlen=RECENT_ERRORS)
        self.pass_http_client = takes_http_client(agent)

    async def run(self, prompt: Prompt, params: SamplingParams, rid: str) -> AgentEpisode:
        session = self.gateway.open(params=params, rid=rid)
        error, reward = None, None
        http_client = episode_http_client() if self.pass_http_client else None
        extra = {"http_client": http_client} if http_client is not None else {}
        try:
            reward = await asyncio.wait_for(self.agent(sample_of(prompt), base_url=session.base_url,
                                                       api_key=session.key, **extra), self.timeout)
        except asyncio.TimeoutError:
            error = f"the agent ran past task.agent_timeout={self.timeout:g}s"
        except asyncio.CancelledError:
            await self.gateway.close(session)
            raise
        except Exception as err:  # the agent is the user's code: its failure is its episode's
            error = f"the agent raised {type(err).__name__}: {err}"
        finally:
            if http_client is not None:
                await http_client.aclose()
        trajectory = await self.gateway.close(session)
        calls = trajectory.calls
        if error is None and not calls:
            error = "the agent made no call"
        if error is None and reward is not None and not _is_number(reward):
            error = f"the agent returned {type(reward).__name__} {reward!r}, not a reward (a number or None)"
        if error is not None and session.errors:
            error = f"{error} ({session.errors[-1]})"
        self.counts["agent_episodes"] += 1
        self.counts["agent_calls"] += len(calls)
        self.counts["agent_forks"] += trajectory.forks
        self.fork_reasons.update(reason.value for reason in trajectory.fork_reasons)
        completion = self._last_answer(trajectory)
        if error is not None:
            self.counts["agent_failures"] += 1
            self.recent_errors.append(error)
            return AgentEpisode(trajectory, 0.0, completion, FAILED, error)
        if reward is None:
            reward = await self._score(prompt, completion)
        return AgentEpisode(trajectory, float(reward), completion, calls[-1].finish_reason)

    def _last_answer(self, trajectory: Trajectory) -> str:
        if not trajectory.calls:
            return ""
        ids = trajectory.calls[-1].output_ids
        tokenizer = self.gateway.tokenizer
        return tokenizer.decode(ids.tolist(), skip_special_tokens=True) if tokenizer is not None else ""

    async def _score(self, prompt: Prompt, completion: str) -> float:
        score_groups = getattr(self.env, "score_groups", None)
        if score_groups is not None:
            return float((await score_groups([prompt], [[completion]]))[0][0])
        return float(self.env.score(completion, prompt.answer))

    def gauges(self) -> dict:
        """Counts since the run started (a step's own forks are its record's ``agent_forks``),
        why episodes forked (``agent_fork_reasons``: diverged, template, concurrent), and the
        latest distinct errors."""
        fields = {key: self.counts[key] for key in ("agent_episodes", "agent_calls", "agent_failures")}
        fields["agent_forks_total"] = self.counts["agent_forks"]
        if self.fork_reasons:
            fields["agent_fork_reasons"] = dict(self.fork_reasons)
        if self.recent_errors:
            fields["agent_errors"] = list(dict.fromkeys(self.recent_errors))
        return fields


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value
