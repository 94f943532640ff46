"""Agent episodes: whatever the agent does, one rollout per episode and the run goes on; a failing
agent is reported with its error; a subprocess agent finds its session in its environment."""

from __future__ import annotations

import asyncio
import sys

import pytest

from rlorch.agents.episodes import AgentEpisodes, openai_environment
from rlorch.agents.gateway import AgentGateway
from rlorch.model import build_tokenizer
from rlorch.types import Generation, Prompt, SamplingParams, VersionStamps

openai = pytest.importorskip("openai")


class Echo:
    """An engine answering ``7<eos>`` to every call."""

    def __init__(self, tokenizer):
        self.ids = tokenizer("7<eos>", add_special_tokens=False)["input_ids"]

    async def generate(self, input_ids, params, rid):
        return Generation(self.ids, [-0.1] * len(self.ids), VersionStamps.uniform(1, len(self.ids)), "stop")


class Scored:
    """The task's own score, asked when the agent returns None."""

    def score(self, completion, answer):
        return float(completion == answer)


async def ask(base_url, api_key, times=1):
    async with openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
        for _ in range(times):
            reply = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "3+4="}])
    return reply.choices[0].message.content


async def answers(sample, *, base_url, api_key):
    return 1.0 if await ask(base_url, api_key) == sample["answer"] else 0.0


async def leaves_it_to_the_task(sample, *, base_url, api_key):
    await ask(base_url, api_key)


async def raises(sample, *, base_url, api_key):
    await ask(base_url, api_key)
    raise KeyError("no such tool")


async def hangs(sample, *, base_url, api_key):
    await ask(base_url, api_key)
    await asyncio.sleep(60)


async def never_calls(sample, *, base_url, api_key):
    return 1.0


async def calls_too_often(sample, *, base_url, api_key):
    await ask(base_url, api_key, times=3)
    return 1.0


async def returns_text(sample, *, base_url, api_key):
    await ask(base_url, api_key)
    return "good"


async def in_a_subprocess(sample, *, base_url, api_key):
    from rlorch.agents.episodes import openai_environment

    script = ("import openai; c = openai.OpenAI(max_retries=0); "
              "print(c.chat.completions.create(model='m', messages=[{'role': 'user', 'content': '3+4='}])"
              ".choices[0].message.content)")
    process = await asyncio.create_subprocess_exec(sys.executable, "-c", script, stdout=asyncio.subprocess.PIPE,
                                                   env=openai_environment(base_url, api_key))
    out, _ = await process.communicate()
    return 1.0 if out.decode().strip() == sample["answer"] else 0.0


def run_episode(agent, *, timeout=60.0, max_calls=2):
    tokenizer = build_tokenizer()

    async def scenario():
        gateway = AgentGateway(engine=Echo(tokenizer), tokenizer=tokenizer, model_name="m", tool_parser=None,
                               max_calls=max_calls)
        await gateway.start()
        try:
            episodes = AgentEpisodes(gateway=gateway, agent=agent, env=Scored(), timeout=timeout)
            episode = await episodes.run(Prompt(3, [1, 2], "calculator", "3+4=", "7"), SamplingParams(), "g3-0-0")
            return episode, episodes.gauges()
        finally:
            await gateway.stop()

    return asyncio.run(scenario())


@pytest.mark.parametrize("agent", [answers, leaves_it_to_the_task, in_a_subprocess])
def test_an_agent_episode_is_scored_by_the_agent_or_the_task(agent):
    episode, gauges = run_episode(agent)
    assert episode.error is None and episode.reward == 1.0 and episode.completion == "7"
    assert len(episode.trajectory.calls) == 1
    assert gauges == {"agent_episodes": 1, "agent_calls": 1, "agent_failures": 0, "agent_forks_total": 0}


@pytest.mark.parametrize("agent, error", [
    (raises, "the agent raised KeyError: 'no such tool'"),
    (hangs, "the agent ran past task.agent_timeout=0.5s"),
    (never_calls, "the agent made no call"),
    (calls_too_often, "task.max_calls"),
    (returns_text, "not a reward"),
])
def test_a_failing_agent_fails_its_episode_only_and_is_reported(agent, error):
    episode, gauges = run_episode(agent, timeout=0.5)
    assert episode.error is not None and error in episode.error
    assert episode.reward == 0.0 and episode.finish_reason == "error"
    assert gauges["agent_failures"] == 1 and error in gauges["agent_errors"][0]
    # What it sampled before failing is kept.
    assert len(episode.trajectory.calls) == (0 if agent is never_calls else 2 if agent is calls_too_often else 1)


def test_the_subprocess_environment_names_the_session():
    environment = openai_environment("http://h:1/s/abc/v1", "sk-1")
    assert environment["OPENAI_BASE_URL"] == "http://h:1/s/abc/v1" and environment["OPENAI_API_KEY"] == "sk-1"
